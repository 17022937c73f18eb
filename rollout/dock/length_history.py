"""Per-prompt history of response lengths, kept by the transfer dock across epochs and in its snapshot.

A prompt's key is a 64-bit digest of its token ids, so the same prompt in a later epoch (a new group id) finds the
lengths its earlier groups reached, with no data set index to plumb through; a caller may pass its own keys. When a
group is trained its mean response length goes into the history (an exponential average over epochs, HISTORY_WEIGHT
on the newest), and rollout.start_order = predicted_longest reads it to start the groups predicted longest first.

    keys = prompt_keys(flat_tokens, lengths)      # -> int64[k]
    history.record(keys, mean_lengths); history.predict(keys)   # -> float64[k], NaN: never trained
    prediction_metrics(predicted[B], true[B])     # -> the metrics.jsonl keys of how well the history predicted
"""
from __future__ import annotations

import hashlib

import numpy as np

HISTORY_WEIGHT = 0.5  # weight of the newest epoch's mean length in a prompt's average
PREDICTION_KEYS = ("predicted_group_len", "true_group_len", "predicted_groups", "predictor_r")  # in metrics.jsonl
MIN_CORRELATED = 3  # groups with a prediction needed for predictor_r (the bench's rule, bench/mode_run.py)


def prompt_keys(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Prompts concatenated in flat (lengths[k] tokens each) -> int64[k] digests of their token ids."""
    values = np.asarray(flat, dtype=np.int64)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    out = np.empty(len(ends), dtype=np.int64)
    for i, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist())):
        digest = hashlib.blake2b(values[start:end].tobytes(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little", signed=True)
    return out


def prediction_metrics(predicted: np.ndarray, true: np.ndarray) -> dict:
    """The trained groups' predicted[B] (the history's value when each started, NaN: none) and true[B] (their mean
    response length) -> JSON-safe metrics: predicted_group_len (None: no prediction) and true_group_len per group,
    predicted_groups (how many had one), predictor_r (Pearson correlation over those; None with fewer than
    MIN_CORRELATED or a constant side)."""
    predicted, true = np.asarray(predicted, dtype=np.float64), np.asarray(true, dtype=np.float64)
    known = ~np.isnan(predicted)
    r = None
    if known.sum() >= MIN_CORRELATED and np.std(predicted[known]) > 0 and np.std(true[known]) > 0:
        r = round(float(np.corrcoef(predicted[known], true[known])[0, 1]), 4)
    return {"predicted_group_len": [round(p, 3) if k else None for p, k in zip(predicted.tolist(), known.tolist())],
            "true_group_len": [round(t, 3) for t in true.tolist()], "predicted_groups": int(known.sum()),
            "predictor_r": r}


class LengthHistory:
    def __init__(self):
        self.lengths: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def record(self, keys: np.ndarray, mean_lengths: np.ndarray) -> None:
        for key, value in zip(np.asarray(keys, dtype=np.int64).tolist(), np.asarray(mean_lengths, float).tolist()):
            old = self.lengths.get(key)
            self.lengths[key] = value if old is None else HISTORY_WEIGHT * value + (1 - HISTORY_WEIGHT) * old

    def predict(self, keys: np.ndarray) -> np.ndarray:
        """-> float64[k]: each prompt's average group length, NaN where it was never trained."""
        return np.asarray([self.lengths.get(key, np.nan) for key in np.asarray(keys, dtype=np.int64).tolist()],
                          dtype=np.float64)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """-> (keys int64[h], lengths float64[h]) for a snapshot."""
        return (np.fromiter(self.lengths.keys(), dtype=np.int64, count=len(self.lengths)),
                np.fromiter(self.lengths.values(), dtype=np.float64, count=len(self.lengths)))

    @classmethod
    def load(cls, keys: np.ndarray, lengths: np.ndarray) -> "LengthHistory":
        keys, lengths = np.asarray(keys, dtype=np.int64), np.asarray(lengths, dtype=np.float64)
        if keys.shape != lengths.shape or keys.ndim != 1:
            raise ValueError(f"length history: {keys.shape} keys for {lengths.shape} lengths")
        history = cls()
        history.lengths = dict(zip(keys.tolist(), lengths.tolist()))
        return history
