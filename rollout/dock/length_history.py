"""Per-prompt history of response lengths, kept by the transfer dock across epochs and in its snapshot.

A prompt's key is a 64-bit digest of its token ids, so the same prompt in a later epoch (a new group id) finds the
lengths its earlier groups reached, with no data set index to plumb through; a caller may pass its own keys. When a
group is trained its mean response length goes into the history (an exponential average over epochs, HISTORY_WEIGHT
on the newest), and rollout.start_order = predicted_longest reads it to start the groups predicted longest first.

    keys = prompt_keys(flat_tokens, lengths)      # -> int64[k]
    history.record(keys, mean_lengths); history.predict(keys)   # -> float64[k], NaN: never trained
"""
from __future__ import annotations

import hashlib

import numpy as np

HISTORY_WEIGHT = 0.5  # weight of the newest epoch's mean length in a prompt's average


def prompt_keys(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Prompts concatenated in flat (lengths[k] tokens each) -> int64[k] digests of their token ids."""
    values = np.asarray(flat, dtype=np.int64)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    out = np.empty(len(ends), dtype=np.int64)
    for i, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist())):
        digest = hashlib.blake2b(values[start:end].tobytes(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little", signed=True)
    return out


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
