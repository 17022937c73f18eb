"""spillover: rollout package."""
