"""Views of rollout data that only tests take: a RolloutBatch restricted to some of its groups, and Samples as the
seed's train-data columns (a run trains on RolloutBatch.from_samples instead)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from spillover.rollout.batch import RolloutBatch, offsets
from spillover.rollout.sample import AlignmentError, Sample, Status


def select_groups(batch: RolloutBatch, groups) -> RolloutBatch:
    """The batch restricted to some of its groups (in the given order)."""
    groups = np.asarray(groups, dtype=np.int64)
    rows = (groups[:, None] * batch.n + np.arange(batch.n)).reshape(-1)

    def take(flat, lengths):
        starts = offsets(lengths)
        index = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows.tolist()]) if len(rows) else []
        return flat[np.asarray(index, dtype=np.int64)]

    r_cols = {c: take(getattr(batch, c), batch.response_lengths)
              for c in ("response_tokens", "rollout_logprobs", "weight_versions", "loss_mask")}
    return replace(batch, group_ids=batch.group_ids[groups], prompt_tokens=take(batch.prompt_tokens, batch.prompt_lengths),
                   prompt_lengths=batch.prompt_lengths[rows], response_lengths=batch.response_lengths[rows],
                   truncated=batch.truncated[rows], ages=batch.ages[rows], labels=tuple(batch.labels[g] for g in groups),
                   metadata=tuple(batch.metadata[g] for g in groups) if batch.metadata else (),
                   advantages=None if batch.advantages is None else batch.advantages[rows],
                   samples=None if batch.samples is None else tuple(batch.samples[g] for g in groups),
                   turns=None if batch.turns is None else batch.turns[rows],
                   env_rewards=None if batch.env_rewards is None else batch.env_rewards[rows], **r_cols)


def flatten_samples(samples: list) -> list[Sample]:
    """Flatten list[list[Sample]] (groups) or list[Sample] into one list."""
    out: list[Sample] = []
    for item in samples:
        if isinstance(item, Sample):
            out.append(item)
        else:
            out.extend(flatten_samples(item))
    return out


def convert_samples_to_train_data(samples: list) -> dict[str, list]:
    """Samples (flat or grouped) -> the seed's train-data columns.

    tokens, response_lengths, rewards, truncated, sample_indices, loss_masks (default all ones),
    plus raw_reward and round_number when the first sample's metadata has them.
    """
    flat = flatten_samples(samples)
    loss_masks = []
    for s in flat:
        mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise AlignmentError(f"sample {s.group_index}/{s.index}: loss mask length {len(mask)} != "
                                 f"response length {s.response_length}")
        loss_masks.append(list(mask))
    data: dict[str, list] = {
        "tokens": [s.tokens for s in flat],
        "response_lengths": [s.response_length for s in flat],
        "rewards": [s.get_reward_value() for s in flat],
        "truncated": [1 if s.status == Status.TRUNCATED else 0 for s in flat],
        "sample_indices": [s.index for s in flat],
        "loss_masks": loss_masks,
    }
    for key in ("raw_reward", "round_number"):
        if flat and key in flat[0].metadata:
            data[key] = [s.metadata[key] for s in flat]
    return data
