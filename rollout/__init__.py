"""spillover: rollout package."""
from infra.ray_env import set_loopback_env as _set_loopback_env

_set_loopback_env()  # before any module of ours imports ray
