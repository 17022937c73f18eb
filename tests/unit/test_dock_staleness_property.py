"""The staleness guarantee over random long-tailed workloads, both drivers simulated at dock level: with the
bound on, every trained token is at most max_age - 1 weight versions older than the update that trains it;
bound on or off, every loaded group is trained exactly once and generation never stalls.

The drivers here are the two real ones reduced to their dock calls (rollout/drivers/default_rollout.py, partial_async.py):
sync = rounds of take_rows((gbs + K) * n) with max_tokens // max_split new tokens each; async = take every
row with its whole budget, rows advance at their own speeds, abort the moment update_ready() holds (rows
keep their tokens so far; some come back empty, some are released). Each row has a natural length with EOS
at its end (lognormal: a long tail past max_tokens, where it is truncated). Weight version = iteration.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulated_dock import token_staleness_max
from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.tasks.prompts import groups_for_iteration

EOS = 0
MAX_ROUNDS = 10_000


class Workload:
    """Natural response length per (group id, sample): EOS is its last token."""

    def __init__(self, rng: np.random.Generator, n: int, max_tokens: int, sigma: float):
        self.rng, self.n, self.median, self.sigma = rng, n, max(1.0, max_tokens / 3), sigma
        self.lengths: dict[int, np.ndarray] = {}

    def natural(self, dock: TransferDock, rows: np.ndarray) -> np.ndarray:
        out = []
        for row in rows.tolist():
            g = int(dock.group_ids[row // dock.n])
            if g not in self.lengths:
                self.lengths[g] = np.maximum(1, np.ceil(self.rng.lognormal(np.log(self.median), self.sigma, self.n)))
            out.append(int(self.lengths[g][row % dock.n]))
        return np.asarray(out, dtype=np.int64)


def answer(dock: TransferDock, work: Workload, rows: np.ndarray, produced: np.ndarray, version: int) -> None:
    """put_generation of `produced` new tokens per row; the last is EOS where the natural length is reached."""
    have = dock.responses.length[rows]
    ends = have + produced >= work.natural(dock, rows)
    tokens = [[5] * m for m in produced.tolist()]
    for t, end in zip(tokens, ends.tolist()):
        if t and end:
            t[-1] = EOS
    dock.put_generation(rows, tokens, [[-0.5] * len(t) for t in tokens], version, [False] * len(rows))


def sync_generate(dock: TransferDock, work: Workload, rows_per_round: int, version: int) -> None:
    for _ in range(MAX_ROUNDS):
        if dock.update_ready():
            return
        rows = dock.take_rows(limit=rows_per_round)
        assert len(rows), f"sync generation stalled: {dock.stats()}"
        _, max_new = dock.generation_inputs(rows, dock.max_tokens // dock.max_split)
        remaining = work.natural(dock, rows) - dock.responses.length[rows]
        answer(dock, work, rows, np.minimum(remaining, max_new), version)
    raise AssertionError("sync generation never became ready")


def async_generate(dock: TransferDock, work: Workload, rng: np.random.Generator, version: int) -> None:
    for _ in range(MAX_ROUNDS):
        if dock.update_ready():
            return
        rows = dock.take_rows()
        assert len(rows), f"async generation stalled: {dock.stats()}"
        _, max_new = dock.generation_inputs(rows, None)
        full = np.minimum(work.natural(dock, rows) - dock.responses.length[rows], max_new)
        step_s = rng.uniform(0.5, 2.0, len(rows))  # per-row speed
        done_at = full * step_s
        order = np.argsort(done_at, kind="stable")
        for k, i in enumerate(order.tolist()):
            answer(dock, work, rows[i:i + 1], full[i:i + 1], version)
            if dock.update_ready():  # abort: the others answer with what they have by now
                left = order[k + 1:]
                so_far = np.minimum(np.floor(done_at[i] / step_s[left]).astype(np.int64), full[left])
                dropped = rng.random(len(left)) < 0.2  # request lost: released with nothing written
                dock.release(rows[left[dropped]])
                answer(dock, work, rows[left[~dropped]], so_far[~dropped], version)
                return
    raise AssertionError("async generation never became ready")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gbs=st.integers(1, 3), n=st.integers(2, 3), max_split=st.integers(1, 4), round_tokens=st.integers(1, 4),
       extra=st.integers(0, 3), max_age=st.one_of(st.none(), st.integers(1, 4)), mode=st.sampled_from(["sync", "async"]),
       bounded=st.booleans(), sigma=st.floats(0.3, 1.5), iterations=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_trained_tokens_are_at_most_max_age_minus_one_versions_old(gbs, n, max_split, round_tokens, extra, max_age,
                                                                    mode, bounded, sigma, iterations, seed):
    max_tokens = max_split * round_tokens
    cfg = RolloutConfig(global_batch_size=gbs, n_samples_per_prompt=n, max_split=max_split, max_tokens=max_tokens,
                        max_model_len=max_tokens + 4, max_age=max_age, mode=mode, over_sampling_groups=extra,
                        require_max_age_all_finished=bounded)
    dock = TransferDock.from_config(cfg, [EOS])
    assert dock.require_max_age_all_finished == cfg.require_max_age_all_finished == bounded
    rng = np.random.default_rng(seed)
    work = Workload(rng, n, max_tokens, sigma)
    next_id, loaded, trained = 0, [], []
    for it in range(iterations):
        count = groups_for_iteration(dock, iterations)
        ids = list(range(next_id, next_id + count))
        dock.load_groups(ids, [[1, 2, 3]] * count, ids)
        next_id += count
        loaded += ids
        dock.set_drain(it == iterations - 1)
        if mode == "sync":
            sync_generate(dock, work, (gbs + extra) * n, version=it)
        else:
            async_generate(dock, work, rng, version=it)
        batch = dock.select_batch()
        assert len(batch) == gbs
        staleness = token_staleness_max(dock.batch_arrays()["weight_versions"], update_version=it)
        assert staleness <= dock.batch_arrays()["ages"].max()  # a group's age counts from its first token
        if bounded:
            assert staleness <= dock.max_age - 1, (it, staleness, dock.max_age, dock.stats())
        trained += dock.group_ids[batch].tolist()
        dock.clear()
    assert dock.stats()["loaded_groups"] == 0
    assert sorted(trained) == sorted(loaded) == list(range(iterations * gbs))  # each group trained exactly once
