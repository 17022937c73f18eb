"""grpo.kl_ctrl: the pure controller (verl's AdaptiveKLController), its config checks, and the policy learner
using, advancing and checkpointing the coefficient."""
from __future__ import annotations

import numpy as np
import pytest

from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import build_config
from spillover.infra.config.training import GRPOConfig, OptimizerConfig
from spillover.tasks.learner.kl_control import next_kl_coef


@pytest.mark.parametrize("kl, n, expected", [
    (0.2, 100, 0.1 * (1 + 0.2 * 100 / 1000)),   # twice the target: +20% error (clipped), scaled by n / horizon
    (0.11, 100, 0.1 * (1 + 0.1 * 100 / 1000)),  # 10% over
    (0.05, 100, 0.1 * (1 - 0.2 * 100 / 1000)),  # half the target: -20% (clipped at -0.2 from -0.5)
    (0.1, 100, 0.1),                             # on target
    (float("nan"), 100, 0.1),                    # nothing measured: unchanged
])
def test_adaptive_matches_verl(kl, n, expected):
    assert next_kl_coef(0.1, kl, n, "adaptive", target=0.1, horizon=1000) == pytest.approx(expected)


def test_fixed_never_moves_and_unknown_modes_fail():
    assert next_kl_coef(0.3, 5.0, 512, "fixed", 0.1, 10) == 0.3
    with pytest.raises(ValueError, match="grpo.kl_ctrl must be fixed or adaptive"):
        next_kl_coef(0.3, 5.0, 512, "pid", 0.1, 10)


def test_config_checks():
    base = ["rollout.global_batch_size=4", "rollout.n_samples_per_prompt=2", "grpo.micro_batch_size=8"]
    cfg = build_config(overrides=base + ["grpo.kl_ctrl=adaptive", "grpo.kl_coef=0.05", "grpo.kl_horizon=100"])
    assert cfg.grpo.kl_ctrl == "adaptive" and cfg.grpo.kl_target == 0.1
    with pytest.raises(ConfigError, match="grpo.kl_ctrl=adaptive needs grpo.kl_coef > 0"):
        build_config(overrides=base + ["grpo.kl_ctrl=adaptive"])
    with pytest.raises(ConfigError, match="grpo.kl_horizon above 1/5 of the samples of one update"):
        build_config(overrides=base + ["grpo.kl_ctrl=adaptive", "grpo.kl_coef=0.05", "grpo.kl_horizon=1"])


def test_the_learner_uses_advances_and_checkpoints_the_coefficient(tiny_model_dir):
    from spillover.bench.batches import from_sequences
    from spillover.tasks.learner.actor import LearnerActor

    grpo = GRPOConfig(kl_coef=0.5, kl_ctrl="adaptive", kl_target=1e-9, kl_horizon=8, micro_batch_size=4)
    learner = LearnerActor(str(tiny_model_dir), grpo, OptimizerConfig(lr=1e-3), temperature=1.0, seed=0,
                           trainable=True)
    seqs = [[3, 4, 5, 6, 7], [3, 4, 5, 8, 9], [3, 5, 6, 7, 8], [3, 5, 9, 9, 4]]
    batch = from_sequences(seqs, [3] * 4, [[-2.0] * 3] * 4, [[0] * 3] * 4, advantages=[1, -1, 1, -1], n=2)
    ref = np.full(12, -6.0, dtype=np.float32)  # far from the policy: KL well above the tiny target
    first = learner.update(batch, None, ref)
    assert first["kl_coef"] == 0.5 and first["kl"] > 0
    assert learner.kl_coef == pytest.approx(0.5 * (1 + 0.2 * 4 / 8))  # +20% error x 4 samples / horizon 8
    second = learner.update(batch, None, ref)
    assert second["kl_coef"] == pytest.approx(0.55)
    tensors, meta = learner.get_state()
    assert meta["kl_coef"] == pytest.approx(0.605)
    resumed = LearnerActor(str(tiny_model_dir), grpo, OptimizerConfig(lr=1e-3), temperature=1.0, seed=0,
                           trainable=True)
    resumed.set_state(tensors, meta)
    assert resumed.kl_coef == pytest.approx(0.605)
    resumed.set_state(tensors, {k: v for k, v in meta.items() if k != "kl_coef"})  # an older checkpoint
    assert resumed.kl_coef == 0.5
