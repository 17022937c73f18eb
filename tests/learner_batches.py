"""Random learner batches for the learner tests: n samples of 3-6 prompt tokens and 1..max_response-1
response tokens (ids in the tiny model's vocabulary), rollout logprobs near -3, every token of one version."""
from __future__ import annotations

import numpy as np

from spillover.bench.batches import from_sequences
from spillover.rollout.batch import RolloutBatch


def random_batch(seed: int, n: int = 8, version: int = 0, advantages=None, max_response: int = 12) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    tokens, lengths = [], []
    for _ in range(n):
        prompt, resp = int(rng.integers(3, 7)), int(rng.integers(1, max_response))
        tokens.append(rng.integers(2, 40, prompt + resp).tolist())
        lengths.append(resp)
    adv = rng.normal(size=n).tolist() if advantages is None else advantages
    return from_sequences(tokens, lengths, [(-3.0 + 0.1 * rng.normal(size=r)).tolist() for r in lengths],
                          [[version] * r for r in lengths], advantages=adv)
