"""The simulated-engine runs of tests/unit (test_scheduling_invariant.py, test_overlap.py, test_simulated_engine.py):
loading an iteration's groups as a run does, checking a trained group against the lengths the simulated engine drew,
and the staleness of a batch's tokens."""
from __future__ import annotations

import numpy as np

from spillover.bench.simulator.workload import DEFAULT_EOS, FILL_TOKEN, SAMPLE_KEY_BASE, simulated_prompt
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.prompt_data import groups_for_iteration


def load_iteration(dock: TransferDock, iterations: int, next_id: int, prompt_tokens: int) -> list[int]:
    """Load the groups a run of `iterations` loads now (ids from next_id on) -> their ids."""
    ids = list(range(next_id, next_id + groups_for_iteration(dock, iterations)))
    if ids:
        dock.load_groups(ids, [simulated_prompt(g, prompt_tokens) for g in ids], [None] * len(ids))
    return ids


def check_trained_group(dock: TransferDock, g: int, natural: np.ndarray, max_tokens: int) -> int:
    """The batch's group g holds exactly its natural responses (capped at max_tokens), each as the simulated engine
    writes it (its sample key, fill, EOS when it stopped) -> the group's tokens."""
    slot = int(np.flatnonzero(dock.group_ids == g)[0])
    got = []
    for row in range(slot * dock.n, slot * dock.n + dock.n):
        tokens = dock.responses.gather(np.array([row]), "tokens").tolist()
        stops = bool(dock.stopped[row])
        assert dock.complete[row] and (stops or len(tokens) == max_tokens)
        if len(tokens) > 1 or not stops:  # a 1-token sample is only its EOS (it overwrites the key)
            j = tokens[0] - SAMPLE_KEY_BASE  # the engine's sample index: the first response token
            assert tokens == [SAMPLE_KEY_BASE + j] + [FILL_TOKEN] * (len(tokens) - 1 - stops) + [DEFAULT_EOS] * stops
            assert len(tokens) == min(int(natural[j]), max_tokens)
        else:
            assert tokens == [DEFAULT_EOS]
        got.append(len(tokens))
    assert sorted(got) == sorted(np.minimum(natural, max_tokens).tolist())
    return sum(got)


def held_samples(dock: TransferDock, lengths) -> dict[int, list[int]]:
    """The sample indices the dock's rows hold already, per group id (SimulatedEngine.claim_samples, for new engines
    after a resume): a row's first response token is its sample key; a row that is only its EOS is a sample of
    natural length 1."""
    held: dict[int, list[int]] = {}
    for slot in np.flatnonzero(dock.group_ids >= 0).tolist():
        group = int(dock.group_ids[slot])
        natural = lengths.group_lengths(group)
        taken = held.setdefault(group, [])
        for row in range(slot * dock.n, slot * dock.n + dock.n):
            tokens = dock.responses.gather(np.array([row]), "tokens").tolist()
            if not tokens:
                continue
            if tokens[0] >= SAMPLE_KEY_BASE:
                taken.append(tokens[0] - SAMPLE_KEY_BASE)
            else:  # [EOS]: the first natural-length-1 sample not counted yet
                taken.append(next(j for j in range(len(natural)) if natural[j] == 1 and j not in taken))
    return held


def token_staleness_max(weight_versions, update_version: int) -> int:
    """max(update_version - v) over a batch's per-token weight versions v (any shape; -1 marks padding and
    SFT tokens, which no policy generated: not stale); 0 for no tokens. update_version: the version of the
    weights the update starts from (the learner's version before it steps)."""
    versions = np.asarray(weight_versions, dtype=np.int64).reshape(-1)
    versions = versions[versions >= 0]
    return int(max(0, int(update_version) - int(versions.min()))) if len(versions) else 0
