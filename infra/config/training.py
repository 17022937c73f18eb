"""The training sections: `grpo` (loss, KL, off-policy correction, rewards) and `optimizer` (AdamW and its
learning-rate schedule). Imported by infra/config/run_config.py, which builds the run's config from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import Section
from .scoring import RewardModelConfig

__all__ = ["DecaySpan", "GRPOConfig", "OFF_POLICY_NEEDS_OLD_LOGPROBS", "OptimizerConfig"]


OFF_POLICY_NEEDS_OLD_LOGPROBS = ("masked_is", "decoupled")


class GRPOConfig(Section):
    micro_batch_size: int = Field(32, ge=1, description="Samples per forward/backward pass (padded rows), unless "
                                  "learner.max_tokens_per_micro_batch sizes micro-batches by tokens.")
    num_steps_per_rollout: int = Field(
        1, ge=1, description="Optimizer steps per iteration: the batch is cut into this many mini-batches in "
        "group order, one AdamW step each; old logprobs are taken once, before the first (PPO-style).")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (low).")
    clip_eps_high: float | None = Field(None, gt=0, description="PPO clip range (high); empty = clip_eps.")
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
        "(off for masked_is and decoupled: they compare the learner's own old logprobs with the rollout's). With tis "
        "and seq_reject such a batch then gets weight 1 and no rejection: set false to correct the engine/learner "
        "numerics gap there too, at the cost of the old-logprob pass.")
    reward_function_path: str = Field("spillover.rollout.builtin.toy_task.reward", description="Import path of the rule reward.")
    rule_reward_weight: float = Field(1.0, description="Weight of the rule reward in the total.")
    reward_models: list[RewardModelConfig] = Field(
        default_factory=list, description="Reward models run as Ray actors; total reward = rule_reward_weight x "
        "rule reward + the sum of weight x score (e.g. [{path: /models/rm, weight: 0.5}]).")
    reward_timeout_s: float | None = Field(
        None, gt=0, description="The most one reward function call may take (an `async def` one's await, or a plain "
        "one's call); one that takes longer fails the iteration naming the sample, and `spillover resume` goes on "
        "from the last checkpoint. Empty = no limit.")
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


@dataclass(frozen=True)
class DecaySpan:
    """Where a run's learning-rate decay stands: `start_progress` of it (0: lr, 1: the end value) done at update
    `start_step`, all of it at update `end_step`, evenly in between. A fresh run's is (0, 0.0, horizon). The learner
    records it in its state (the checkpoint), so that a run resumed with a longer horizon continues the curve
    (OptimizerConfig.resumed_decay) instead of starting it over."""
    start_step: int
    start_progress: float
    end_step: int

    def progress(self, step: int) -> float:
        """The share of the decay done at update `step` (0-based), in [start_progress, 1]."""
        if step >= self.end_step:
            return 1.0
        if step <= self.start_step:
            return self.start_progress
        return self.start_progress + (1.0 - self.start_progress) * (step - self.start_step) / (
            self.end_step - self.start_step)


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate schedule over decay_steps updates (then held at its end value).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Decayed learning rate as a share of lr.")
    decay_steps: int | None = Field(None, ge=1, description="Optimizer steps to decay over; empty = "
                                       "schedule.num_iterations x grpo.num_steps_per_rollout.")
    lr_extension: Literal["stretch", "keep"] = Field(
        "stretch", description="A run resumed with another decay horizon (`spillover resume RUN "
        "schedule.num_iterations=N` without decay_steps): stretch = the rest of the decay, from the lr of the last "
        "update taken, spread over the new horizon; keep = the horizon recorded in the checkpoint stays (after it "
        "the lr holds its end value). Either way the lr goes on from where it was.")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each of the AdamW betas must lie in [0, 1); got {list(betas)}")
        return betas

    def fresh_decay(self, default_steps: int) -> DecaySpan:
        """The decay of a new run: over decay_steps, else default_steps (num_iterations x num_steps_per_rollout)."""
        return DecaySpan(0, 0.0, self.decay_steps or default_steps)

    def resumed_decay(self, recorded: DecaySpan, next_step: int, default_steps: int) -> DecaySpan:
        """The decay a resumed run follows from update `next_step` on, given the one its checkpoint recorded: the
        recorded one when the horizon is the same (a crash resume trains exactly as the run would have) or
        lr_extension=keep; else (stretch) the recorded curve from the last update taken, stretched to the new
        horizon. A horizon already passed leaves the end value."""
        horizon = self.decay_steps or default_steps
        if self.lr_extension == "keep" or horizon == recorded.end_step:
            return recorded
        last = max(next_step - 1, 0)  # its lr is the current value, where the stretched rest starts
        return DecaySpan(last, recorded.progress(last), horizon)

    def lr_at(self, step: int, decay: DecaySpan) -> float:
        """Learning rate of update `step` (0-based) on the run's decay span: a pure function of the two."""
        import math

        done = decay.progress(step)
        if self.lr_decay == "linear":
            factor = 1.0 - done
        elif self.lr_decay == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * done))
        else:
            return self.lr
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)
