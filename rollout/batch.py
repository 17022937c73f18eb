"""RolloutBatch: the one shape a training batch has from the dock to the learner.

G groups of n samples, R = G*n rows in group order, as flat columns with per-row lengths (no per-sample
Python objects on the way): prompt tokens per row, response tokens with their rollout logprobs, weight
versions and loss mask per token. `Sample` lists appear only at the boundaries where users write code:
custom or SFT rollout functions (`from_samples`) and reward functions that ask for a sample (`to_samples`).
The reward step adds advantages (`with_advantages`); the learner cuts the batch into padded micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .sample import Sample, Status

SFT_KEY = "sft"  # a sample's metadata mark: a supervised target (rollout/builtin/sft.py makes them)

UNTRAINED = (Status.FAILED, Status.ABORTED)


def offsets(lengths: np.ndarray) -> np.ndarray:
    """lengths[k] -> int64[k + 1] start offsets of each span in the flat column (last = total)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """flat[T], lengths[k] -> k views."""
    return np.split(flat, offsets(lengths)[1:-1]) if len(lengths) else []


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """Columns (R = G*n rows group by group; Tp prompt tokens and Tr response tokens, row by row).

    group_ids[G] (the groups' stream ids), n, prompt_tokens[Tp] / prompt_lengths[R], response_tokens[Tr] /
    response_lengths[R], rollout_logprobs[Tr], weight_versions[Tr] (-1: no policy made the token, e.g.
    SFT), loss_mask[Tr] (0/1), truncated[R] (complete without a stop), ages[R] (iterations carried over),
    labels[G], metadata[G] (data.additional_keys per group: a dict, or () when the run has none); advantages[R]
    once the reward step has set them; multi-turn rollouts (rollout/drivers/tool_turns.py) add turns[R] (tool calls per
    trajectory) and env_rewards[R] (the env's reward, NaN: none), else both are None. `sft` marks a supervised
    batch (advantage 1, no behaviour policy).
    """

    group_ids: np.ndarray
    n: int
    prompt_tokens: np.ndarray
    prompt_lengths: np.ndarray
    response_tokens: np.ndarray
    response_lengths: np.ndarray
    rollout_logprobs: np.ndarray
    weight_versions: np.ndarray
    loss_mask: np.ndarray
    truncated: np.ndarray
    ages: np.ndarray
    labels: tuple = ()
    metadata: tuple = ()
    advantages: np.ndarray | None = None
    sft: bool = False
    samples: tuple | None = field(default=None, repr=False)  # the Sample groups it was built from, if any
    turns: np.ndarray | None = None
    env_rewards: np.ndarray | None = None

    def __post_init__(self) -> None:
        rows = len(self.group_ids) * self.n
        for name in ("prompt_lengths", "response_lengths", "truncated", "ages"):
            if len(getattr(self, name)) != rows:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries for {rows} rows "
                                 f"({len(self.group_ids)} groups of {self.n})")
        if int(self.prompt_lengths.sum()) != len(self.prompt_tokens):
            raise ValueError("RolloutBatch.prompt_lengths do not add up to the prompt tokens")
        tokens = int(self.response_lengths.sum())
        for name in ("response_tokens", "rollout_logprobs", "weight_versions", "loss_mask"):
            if len(getattr(self, name)) != tokens:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries but the responses "
                                 f"have {tokens} tokens")
        if (self.prompt_lengths[self.response_lengths > 0] < 1).any():
            raise ValueError("RolloutBatch: a response needs at least one prompt token before it")
        for name in ("turns", "env_rewards"):
            if getattr(self, name) is not None and len(getattr(self, name)) != rows:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries for {rows} rows")
        if self.metadata and len(self.metadata) != len(self.group_ids):
            raise ValueError(f"RolloutBatch.metadata has {len(self.metadata)} entries for {len(self.group_ids)} groups")
        if self.advantages is not None and (len(self.advantages) != rows or not np.isfinite(self.advantages).all()):
            raise ValueError(f"RolloutBatch.advantages must be {rows} finite numbers (check the rewards for NaN)")

    def __len__(self) -> int:
        return len(self.response_lengths)

    # ---- derived columns --------------------------------------------------------------------------
    @property
    def seq_lengths(self) -> np.ndarray:
        """int64[R]: prompt + response tokens per row."""
        return self.prompt_lengths + self.response_lengths

    @property
    def response_offsets(self) -> np.ndarray:
        return offsets(self.response_lengths)

    @property
    def loss_tokens(self) -> np.ndarray:
        """int64[R]: tokens per row that count in the loss."""
        running = offsets(self.loss_mask.astype(np.int64))
        ends = self.response_offsets
        return running[ends[1:]] - running[ends[:-1]]

    def response_lists(self) -> list[list[int]]:
        """Response ids per row as Python lists (what a tokenizer's batch decode takes)."""
        return [part.tolist() for part in split(self.response_tokens, self.response_lengths)]

    def with_advantages(self, advantages: np.ndarray) -> "RolloutBatch":
        return replace(self, advantages=np.asarray(advantages, dtype=np.float32).reshape(-1))

    def sample_groups(self) -> list[list[Sample]]:
        """The rows as Sample groups: the ones it was built from, else new ones (costs per token)."""
        return [list(g) for g in self.samples] if self.samples is not None else to_samples(self)

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_dock_arrays(cls, arrays: dict[str, np.ndarray], n: int, labels, metadata=None) -> "RolloutBatch":
        """From `TransferDock.batch_arrays()` (one prompt per group), the batch groups' labels and metadata."""
        group_prompts = arrays["prompt_lengths"]
        starts = offsets(group_prompts)
        row_groups = np.repeat(np.arange(len(group_prompts)), n)
        prompt_lengths = group_prompts[row_groups]
        index = np.repeat(starts[row_groups] - offsets(prompt_lengths)[:-1], prompt_lengths) + np.arange(
            int(prompt_lengths.sum()))
        tokens = arrays["response_tokens"]
        return cls(group_ids=np.asarray(arrays["group_ids"], dtype=np.int64), n=n,
                   prompt_tokens=arrays["prompt_tokens"][index], prompt_lengths=prompt_lengths.astype(np.int64),
                   response_tokens=tokens, response_lengths=arrays["response_lengths"].astype(np.int64),
                   rollout_logprobs=arrays["rollout_logprobs"], weight_versions=arrays["weight_versions"],
                   loss_mask=np.asarray(arrays["loss_mask"], dtype=np.uint8) if "loss_mask" in arrays
                   else np.ones(len(tokens), dtype=np.uint8), truncated=np.asarray(arrays["truncated"], bool),
                   ages=arrays["ages"].astype(np.int32), labels=tuple(labels),
                   metadata=_group_metadata(metadata), **_multi_turn_columns(arrays))

    @classmethod
    def from_samples(cls, groups: list[list[Sample]], sft: bool = False) -> "RolloutBatch":
        """From groups of Samples (custom, SFT or replayed rollouts); every group must have the same size."""
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"a training batch needs groups of one size; got group sizes {sorted(sizes)} "
                             "(rollout.n_samples_per_prompt samples per prompt)")
        flat = [s for g in groups for s in g]

        def column(get, dtype) -> np.ndarray:
            parts = [np.asarray(get(s), dtype=dtype) for s in flat]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        # A sample its rollout function marked FAILED or ABORTED keeps its place in the group (its reward
        # still shapes the group baseline) but none of its tokens is trained.
        masks = [[0] * s.response_length if s.status in UNTRAINED else
                 s.loss_mask if s.loss_mask is not None else [1] * s.response_length for s in flat]
        return cls(group_ids=np.array([g[0].group_index for g in groups], dtype=np.int64), n=sizes.pop(),
                   prompt_tokens=column(lambda s: s.prompt_tokens, np.int32),
                   prompt_lengths=np.array([len(s.prompt_tokens) for s in flat], dtype=np.int64),
                   response_tokens=column(lambda s: s.response_tokens, np.int32),
                   response_lengths=np.array([s.response_length for s in flat], dtype=np.int64),
                   rollout_logprobs=column(lambda s: s.rollout_logprobs, np.float32),
                   weight_versions=column(lambda s: s.weight_versions, np.int32),
                   loss_mask=np.concatenate([np.asarray(m, np.uint8) for m in masks]) if flat else np.zeros(0, np.uint8),
                   truncated=np.array([s.status == Status.TRUNCATED for s in flat], dtype=bool),
                   ages=np.array([int(s.metadata.get("age", 0)) for s in flat], dtype=np.int32),
                   labels=tuple(g[0].label for g in groups), sft=sft, samples=tuple(tuple(g) for g in groups),
                   metadata=_group_metadata([g[0].metadata.get("data") for g in groups]))


def to_samples(batch: RolloutBatch) -> list[list[Sample]]:
    """One list of n new Samples per group (status COMPLETED or TRUNCATED, metadata {"age"}, plus "data": the
    group's data.additional_keys when it has them)."""
    prompts = split(batch.prompt_tokens, batch.prompt_lengths)
    columns = [split(getattr(batch, c), batch.response_lengths)
               for c in ("response_tokens", "rollout_logprobs", "weight_versions", "loss_mask")]
    groups: list[list[Sample]] = []
    for g, group_id in enumerate(batch.group_ids.tolist()):
        group = []
        for i in range(batch.n):
            r = g * batch.n + i
            tokens, logprobs, versions, mask = (c[r] for c in columns)
            group.append(Sample(group_index=group_id, index=group_id * batch.n + i, prompt_tokens=prompts[r].tolist(),
                                response_tokens=tokens.tolist(), rollout_logprobs=logprobs.tolist(),
                                weight_versions=versions.tolist(),
                                loss_mask=None if mask.all() else mask.tolist(), label=batch.labels[g],
                                status=Status.TRUNCATED if batch.truncated[r] else Status.COMPLETED,
                                metadata={"age": int(batch.ages[r]),
                                          **({"data": batch.metadata[g]} if batch.metadata else {}),
                                          **_turn_metadata(batch, r, mask)}))
        groups.append(group)
    return groups


def label_of_rows(batch: RolloutBatch) -> list[Any]:
    """labels[R]: each row's group label."""
    return [label for label in batch.labels for _ in range(batch.n)]


def metadata_of_rows(batch: RolloutBatch) -> list[dict | None]:
    """metadata[R]: each row's group metadata (None for every row when the batch has none)."""
    groups = batch.metadata or (None,) * len(batch.group_ids)
    return [meta for meta in groups for _ in range(batch.n)]


def _multi_turn_columns(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """turns[R] and env_rewards[R] from the dock's batch arrays when the batch holds any multi-turn state, else {}."""
    turns, rewards, mask = arrays.get("turns"), arrays.get("env_rewards"), arrays.get("loss_mask")
    if turns is None or rewards is None:
        return {}
    used = (turns > 0).any() or np.isfinite(rewards).any() or (mask is not None and not mask.all())
    return {"turns": turns.astype(np.int32), "env_rewards": rewards.astype(np.float32)} if used else {}


def _turn_metadata(batch: RolloutBatch, row: int, mask: np.ndarray) -> dict:
    """A multi-turn row's Sample metadata: turns (tool calls), tool_spans ([start, end) of each run of tool tokens in
    the response: what debug rollout data shows of the turns) and env_reward (when the env gave one)."""
    if batch.turns is None:
        return {}
    edges = np.flatnonzero(np.diff(np.concatenate([[1], mask.astype(np.int8), [1]])))
    reward = float(batch.env_rewards[row]) if batch.env_rewards is not None else float("nan")
    return {"turns": int(batch.turns[row]), "tool_spans": edges.reshape(-1, 2).tolist(),
            **({"env_reward": reward} if np.isfinite(reward) else {})}


def _group_metadata(metadata) -> tuple:
    """Per-group metadata -> a tuple, or () when there is none at all."""
    metadata = tuple(metadata) if metadata is not None else ()
    return metadata if any(m is not None for m in metadata) else ()


def is_sft_batch(groups: list[list[Sample]]) -> bool:
    """True when every sample is an SFT sample, False when none is; a mix is refused."""
    marks = {bool(s.metadata.get(SFT_KEY)) for g in groups for s in g}
    if len(marks) > 1:
        raise ValueError("the batch mixes SFT samples (metadata 'sft') with generated ones; the flow trains "
                         "either with advantage 1 (SFT) or with group advantages (RL), not both")
    return marks == {True}
