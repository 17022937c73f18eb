"""Sample: one response to one prompt, the data contract between rollout and training.

Per-token arrays (response tokens, rollout logprobs, weight versions, loss mask) only change through
`append_segment`, which keeps them aligned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class AlignmentError(ValueError):
    """Per-token arrays of a Sample would no longer have the same length."""


@dataclass
class Sample:
    group_index: int
    index: int
    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] | None = None
    reward: float | None = None
    label: Any = None
    prompt: str = ""
    response: str = ""
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        self._check_aligned()

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt_tokens) + list(self.response_tokens)

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def _check_aligned(self) -> None:
        n = len(self.response_tokens)
        lengths = {"rollout_logprobs": len(self.rollout_logprobs), "weight_versions": len(self.weight_versions)}
        if self.loss_mask is not None:
            lengths["loss_mask"] = len(self.loss_mask)
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise AlignmentError(f"sample {self.group_index}/{self.index}: response has {n} tokens but {bad}")

    def append_segment(self, tokens: list[int], logprobs: list[float], weight_version: int | list[int],
                       loss_mask: list[int] | None = None) -> None:
        """Append generated tokens with their logprobs and weight version(s); all or nothing."""
        versions = [weight_version] * len(tokens) if isinstance(weight_version, int) else list(weight_version)
        if len(logprobs) != len(tokens) or len(versions) != len(tokens):
            raise AlignmentError(f"sample {self.group_index}/{self.index}: segment has {len(tokens)} tokens, "
                                 f"{len(logprobs)} logprobs, {len(versions)} weight versions")
        if loss_mask is not None and len(loss_mask) != len(tokens):
            raise AlignmentError(f"sample {self.group_index}/{self.index}: segment has {len(tokens)} tokens "
                                 f"but {len(loss_mask)} loss-mask entries")
        if loss_mask is None and self.loss_mask is not None:
            loss_mask = [1] * len(tokens)
        if loss_mask is not None and self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_tokens)  # earlier tokens had the default mask (all ones)
        self.response_tokens = list(self.response_tokens) + list(tokens)
        self.rollout_logprobs = list(self.rollout_logprobs) + [float(x) for x in logprobs]
        self.weight_versions = list(self.weight_versions) + versions
        if loss_mask is not None:
            self.loss_mask = list(self.loss_mask or []) + list(loss_mask)

    def get_reward_value(self) -> float:
        if self.reward is None or (isinstance(self.reward, float) and math.isnan(self.reward)):
            raise ValueError(f"sample {self.group_index}/{self.index} has no reward yet")
        return float(self.reward)

    # --- safe serialisation (JSON; never pickle) ---
    def to_dict(self) -> dict[str, Any]:
        return {
            "group_index": self.group_index, "index": self.index,
            "prompt_tokens": list(map(int, self.prompt_tokens)),
            "response_tokens": list(map(int, self.response_tokens)),
            "rollout_logprobs": list(map(float, self.rollout_logprobs)),
            "weight_versions": list(map(int, self.weight_versions)),
            "loss_mask": None if self.loss_mask is None else list(map(int, self.loss_mask)),
            "reward": self.reward, "label": self.label, "prompt": self.prompt, "response": self.response,
            "status": self.status.value, "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        return cls(**d)
