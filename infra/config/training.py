"""The training sections: `grpo` (loss, KL, off-policy correction, rewards) and `optimizer` (AdamW and its
learning-rate schedule). Imported by infra/config/run_config.py, which builds the run's config from them."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from spillover.infra.config.base import Section
from spillover.infra.config.scoring import RewardModelConfig

__all__ = ["GRPOConfig", "OFF_POLICY_NEEDS_OLD_LOGPROBS", "OptimizerConfig"]


OFF_POLICY_NEEDS_OLD_LOGPROBS = ("masked_is", "decoupled")


class GRPOConfig(Section):
    micro_batch_size: int = Field(32, ge=1, description="Samples per forward/backward pass (padded rows), unless "
                                  "learner.max_tokens_per_micro_batch sizes micro-batches by tokens.")
    num_steps_per_rollout: int = Field(
        1, ge=1, description="Optimizer steps per iteration: the batch is cut into this many mini-batches in "
        "group order, one AdamW step each; old logprobs are taken once, before the first (PPO-style).")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (low).")
    clip_eps_high: float | None = Field(None, description="PPO clip range (high); empty = clip_eps.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference model.")
    kl_estimator: Literal["k3", "low_var_kl", "k1"] = Field("low_var_kl", description="KL estimator.")
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed", description="KL coefficient control: fixed = kl_coef throughout; adaptive = starts at kl_coef and "
        "steers the measured KL towards kl_target (coef *= 1 + clip(kl / kl_target - 1, +-0.2) x samples / "
        "kl_horizon after each update; tasks/learner/kl_control.py).")
    kl_target: float = Field(0.1, gt=0, description="Adaptive KL control: the KL per token to steer towards.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL control: samples over which a 20% KL error moves "
                            "the coefficient by 20%.")
    loss_agg: Literal["token_mean", "seq_mean"] = Field("token_mean", description="Loss aggregation.")
    off_policy: Literal["none", "tis", "masked_is", "seq_reject", "decoupled"] = Field(
        "tis", description="Correction for tokens the engine sampled from other weights than the learner's old "
        "policy, by w = exp(old - rollout) per token: tis = loss x min(w, tis_cap); masked_is = tokens with "
        "w > tis_cap leave the loss and its denominator, the rest weigh w; seq_reject = samples whose geometric "
        "mean w lies outside [seq_reject_low, seq_reject_high] leave the loss; decoupled = PPO clipped against "
        "the recomputed old (proximal) policy, times w (0 where w > tis_cap; AReaL); none.")
    tis_cap: float = Field(2.0, gt=0, description="Bound C on w: truncate (tis), drop (masked_is), zero (decoupled).")
    seq_reject_low: float = Field(0.8, gt=0, le=1, description="seq_reject: lowest accepted geometric-mean w.")
    seq_reject_high: float = Field(1.25, ge=1, description="seq_reject: highest accepted geometric-mean w.")
    skip_old_logprob: bool = Field(
        True, description="Take old logprobs from rollout logprobs when all tokens came from current weights "
        "(off for masked_is and decoupled: they compare the learner's own old logprobs with the rollout's).")
    reward_function_path: str = Field("spillover.rollout.builtin.toy_task.reward", description="Import path of the rule reward.")
    rule_reward_weight: float = Field(1.0, description="Weight of the rule reward in the total.")
    reward_models: list[RewardModelConfig] = Field(
        default_factory=list, description="Reward models run as Ray actors; total reward = rule_reward_weight x "
        "rule reward + the sum of weight x score (e.g. [{path: /models/rm, weight: 0.5}]).")
    reward_concurrency: int = Field(
        32, ge=1, description="An `async def` reward function is awaited concurrently, at most this many calls "
        "at once (a remote verifier or sandbox).")

    @model_validator(mode="before")
    @classmethod
    def _old_logprobs_for_correction(cls, data):
        """masked_is and decoupled turn skip_old_logprob off unless it was set (then it must be false)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("off_policy") in OFF_POLICY_NEEDS_OLD_LOGPROBS:
            if data.get("skip_old_logprob") is not None and _truthy(data["skip_old_logprob"]):
                raise ValueError(f"grpo.off_policy={data['off_policy']} needs old logprobs recomputed by the learner "
                                 "(it compares them with the rollout logprobs); set grpo.skip_old_logprob=false")
            data["skip_old_logprob"] = False
        return data


def _truthy(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() not in ("false", "0", "no", "off")


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate schedule over decay_steps updates (then held at its end value).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Decayed learning rate as a share of lr.")
    decay_steps: int | None = Field(None, ge=1, description="Optimizer steps to decay over; empty = "
                                       "schedule.num_iterations x grpo.num_steps_per_rollout.")

    def lr_at(self, step: int, default_steps: int) -> float:
        """Learning rate of update `step` (0-based): a pure function of the step, so resume needs no state."""
        import math

        total = self.decay_steps or default_steps
        done = min(max(step, 0), total) / max(total, 1)
        if self.lr_decay == "linear":
            factor = 1.0 - done
        elif self.lr_decay == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * done))
        else:
            return self.lr
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)
