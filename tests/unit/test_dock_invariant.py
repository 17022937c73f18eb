"""The dock's invariant, over random runs: every prompt group enters once and is trained exactly once,
and no token (nor its logprob or weight version) is lost or duplicated -- checked against a plain
reference model (a list of tokens per sample). Runs mix: take limits, aborted requests (release),
several put calls per round in random order, stop flags and EOS, max_tokens / max_model_len limits,
the max-age rule, crashes (snapshot with requests in flight, results lost, restore), and a drain at
the end that empties the dock."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spillover.rollout.batch import to_samples
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.sample import Status

EOS = 0


class Reference:
    """What the dock should hold: per sample index, the prompt and every token written so far."""

    def __init__(self):
        self.prompt: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.versions: dict[int, list[int]] = {}
        self.stopped: dict[int, bool] = {}
        self.loaded: list[int] = []
        self.trained: Counter = Counter()
        self.tokens_written = 0
        self.tokens_trained = 0


def sample_index(dock: TransferDock, row: int) -> int:
    return int(dock.group_ids[row // dock.n]) * dock.n + row % dock.n


def restart(dock: TransferDock) -> TransferDock:
    """A crash: the state goes through a JSON/array snapshot; whatever was in flight is lost."""
    arrays, meta = dock.snapshot()
    return TransferDock.restore({k: v.copy() for k, v in arrays.items()}, json.loads(json.dumps(meta)), "a snapshot in memory")


def generation_round(dock: TransferDock, ref: Reference, rng: np.random.Generator, version: int,
                     pending: dict[int, int], resolve_all: bool = False) -> TransferDock:
    """Hand out rows (they join `pending`: row -> max_new_tokens), then answer some or all pending rows,
    as an async driver does; sometimes crash with requests still in flight."""
    if not resolve_all:
        limit = None if rng.random() < 0.5 else int(rng.integers(1, dock.capacity_rows + 1))
        rows = dock.take_rows(limit)
        assert not set(rows.tolist()) & set(pending), "a row was handed out twice"
        round_tokens = dock.max_tokens // dock.max_split if rng.random() < 0.7 else None
        inputs, max_new = dock.generation_inputs(rows, round_tokens)
        for i, row in enumerate(rows.tolist()):
            s = sample_index(dock, row)
            assert inputs[i] == ref.prompt[s] + ref.tokens[s]
            pending[row] = int(max_new[i])
    rows = np.array(sorted(pending), dtype=np.int64)
    rng.shuffle(rows)
    if not resolve_all and len(rows) and rng.random() < 0.5:
        rows = rows[: int(rng.integers(1, len(rows) + 1))]
    released = rows[rng.random(len(rows)) < 0.1]
    dock.release(released)
    to_put = np.setdiff1d(rows, released)
    rng.shuffle(to_put)
    crash = not resolve_all and rng.random() < 0.1
    if crash:
        to_put = to_put[: int(rng.integers(0, len(to_put) + 1))]
    for part in np.array_split(to_put, int(rng.integers(1, 4))) if len(to_put) else []:
        write(dock, ref, rng, part, np.array([pending[r] for r in part.tolist()]), version)
    for row in rows.tolist():
        pending.pop(row)
    if crash:
        pending.clear()  # their requests die with the process
        return restart(dock)
    return dock


def write(dock: TransferDock, ref: Reference, rng: np.random.Generator, rows: np.ndarray, max_new: np.ndarray,
          version: int) -> None:
    lengths = np.where(rng.random(len(rows)) < 0.85, rng.integers(1, max_new + 1), 0)
    tokens = [rng.integers(1, 50, m).tolist() for m in lengths.tolist()]
    for t in tokens:
        if t and rng.random() < 0.3:
            t[-1] = EOS
    logprobs = [(-rng.random(len(t))).astype(np.float32).tolist() for t in tokens]
    stop = rng.random(len(rows)) < 0.1
    dock.put_generation(rows, tokens, logprobs, version, stop)
    for row, t, lp, st_ in zip(rows.tolist(), tokens, logprobs, stop.tolist()):
        s = sample_index(dock, row)
        ref.tokens[s] += t
        ref.logprobs[s] += lp
        ref.versions[s] += [version] * len(t)
        ref.stopped[s] = st_ or (bool(t) and t[-1] == EOS)
        ref.tokens_written += len(t)
        done = (ref.stopped[s] or len(ref.tokens[s]) >= dock.max_tokens
                or len(ref.prompt[s]) + len(ref.tokens[s]) >= dock.max_model_len)
        assert dock.complete[row] == done and not dock.in_flight[row]


def train(dock: TransferDock, ref: Reference) -> None:
    batch = dock.select_batch()
    assert (dock.select_batch() == batch).all()
    arrays = dock.batch_arrays()
    offset = 0
    for group in to_samples(dock.rollout_batch()):
        for sample in group:
            s = sample.index
            assert sample.prompt_tokens == ref.prompt[s] and sample.response_tokens == ref.tokens[s]
            assert sample.rollout_logprobs == ref.logprobs[s] and sample.weight_versions == ref.versions[s]
            assert sample.status == (Status.COMPLETED if ref.stopped[s] else Status.TRUNCATED)
            end = offset + len(ref.tokens[s])
            assert arrays["response_tokens"][offset:end].tolist() == ref.tokens[s]
            offset = end
            ref.tokens_trained += len(sample.response_tokens)
        ref.trained[group[0].group_index] += 1
    assert offset == len(arrays["response_tokens"])
    dock.clear()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gbs=st.integers(1, 3), n=st.integers(1, 3), max_split=st.integers(1, 4), extra_tokens=st.integers(0, 5),
       model_slack=st.integers(-4, 3), iterations=st.integers(1, 5), require=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_every_group_trained_once_and_no_token_lost(gbs, n, max_split, extra_tokens, model_slack, iterations, require,
                                                    seed):
    rng = np.random.default_rng(seed)
    max_tokens = max_split + extra_tokens
    max_model_len = max(6, 4 + max_tokens + model_slack)  # prompts are 1..4 tokens: the limit sometimes binds
    dock = TransferDock(gbs, n, max_split, max_tokens, max_model_len, [EOS],
                        require_max_age_all_finished=require)
    ref = Reference()
    next_group, version = 0, 0
    for it in range(iterations + 100):
        draining = it >= iterations
        if draining:
            dock.set_drain(True)
            if dock.stats()["loaded_groups"] == 0:
                break
        else:
            k = dock.free_group_slots()
            ids = 3 * np.arange(next_group, next_group + k) + 1  # ids need not be consecutive
            next_group += k
            prompts = [rng.integers(1, 50, int(rng.integers(1, 5))).tolist() for _ in range(k)]
            dock.load_groups(ids, prompts, [{"answer": int(g)} for g in ids])
            for g, p in zip(ids.tolist(), prompts):
                ref.loaded.append(g)
                for i in range(n):
                    s = g * n + i
                    ref.prompt[s], ref.tokens[s], ref.logprobs[s], ref.versions[s] = list(p), [], [], []
                    ref.stopped[s] = False
        pending: dict[int, int] = {}
        for _ in range(1000):
            if dock.update_ready():
                break
            dock = generation_round(dock, ref, rng, version, pending)
        else:
            raise AssertionError(f"generation never became ready: {dock.stats()}")
        dock = generation_round(dock, ref, rng, version, pending, resolve_all=True)  # the stop: abort the rest
        batch = dock.select_batch()
        if rng.random() < 0.2:
            dock = restart(dock)  # a crash between generation and training: the chosen batch survives
            assert (dock.select_batch() == batch).all()
        train(dock, ref)
        version += 1
    assert dock.stats()["loaded_groups"] == 0
    assert sorted(ref.trained) == sorted(ref.loaded) and set(ref.trained.values()) == {1}
    assert len(ref.loaded) == len(set(ref.loaded))
    assert ref.tokens_written == ref.tokens_trained
