"""Config sections for scoring beyond the rule reward: reward models (grpo.reward_models) and `spillover eval`
(the `eval` section). Kept apart from infra/config/run_config.py, which imports them."""
from __future__ import annotations

from pydantic import Field

from .base import Section

__all__ = ["EvalConfig", "RewardModelConfig"]


class RewardModelConfig(Section):
    path: str = Field(..., description="HF sequence-classification folder (num_labels=1, a pad token), or a Hugging "
                      "Face Hub id (org/name, resolved as model.path is): scores prompt text + response text with its "
                      "own tokenizer.")
    revision: str | None = Field(None, description="A Hub id's branch, tag or commit; empty = main. A run records "
                                 "the commit it resolved to here, so a resume loads the same weights.")
    weight: float = Field(1.0, description="Weight of its score in the total reward.")
    name: str | None = Field(None, description="Name in metrics (reward_model_<name>_mean); empty = its index.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs its Ray actor reserves (0: CPU).")
    batch_size: int = Field(16, ge=1, description="Texts per forward pass.")
    max_length: int = Field(4096, ge=8, description="Most tokens scored per text (longer ones keep their end).")


class EvalConfig(Section):
    k: int = Field(4, ge=1, description="`spillover eval`: sampled responses per prompt for pass@k (pass@1 is greedy).")
    temperature: float = Field(1.0, gt=0, description="`spillover eval`: sampling temperature of the pass@k samples.")
    top_p: float = Field(1.0, gt=0, le=1, description="`spillover eval`: nucleus mass of the pass@k samples.")
    pass_threshold: float = Field(1.0, description="`spillover eval`: a response with reward >= this counts as "
                                  "solved (the math reward gives 1.0 for a correct answer).")
