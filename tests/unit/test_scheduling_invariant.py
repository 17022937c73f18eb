"""The dock invariant under every scheduling mode, through the real drivers and the simulated engine: every
loaded group is trained exactly once, every trained sample holds exactly its natural response (capped at
max_tokens: no token lost or duplicated across rounds, aborts and carried-over iterations), the engine
generated exactly the tokens that were trained, and no trained token is older than max_age - 1 versions."""
from __future__ import annotations

from collections import Counter

import pytest

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.drivers import dispatch
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.bench.simulator.engine import EngineTiming, SimulatedEngine
from spillover.bench.simulator.workload import DEFAULT_EOS, LognormalLengths
from spillover.rollout.drivers.default_rollout import generate_training_batch
from simulated_dock import check_trained_group, load_iteration, token_staleness_max

PROMPT = 4
ITERATIONS = 7

MODES = {  # name: (mode, max_split, max_age, over_sampling_groups, scheduling, tail_factor)
    "sync_split4_la": ("sync", 4, None, 0, "length_aware", 0.0),
    "sync_split2_la_oversampled": ("sync", 2, 3, 2, "length_aware", 0.0),
    "async_la": ("async", 2, 3, 0, "length_aware", 0.0),
    "async_age2_la": ("async", 2, 2, 0, "length_aware", 0.0),
    "async_age2": ("async", 2, 2, 0, "fifo", 0.0),
    "over_sampling_la": ("async", 1, 3, 2, "length_aware", 0.0),
    "tail_batching": ("async", 1, 4, 3, "length_aware", 1.5),
    "tail_batching_sync": ("sync", 2, 4, 3, "length_aware", 1.5),
}


@pytest.mark.parametrize("name", sorted(MODES))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_group_trained_once_with_its_whole_response(name, seed, monkeypatch):
    mode, split, age, extra, scheduling, tail = MODES[name]
    held = []

    def recording(*args, **kwargs):
        plan = dispatch.plan_dispatch.__wrapped__(*args, **kwargs)
        held.append(len(plan[2]))
        return plan

    recording.__wrapped__ = dispatch.plan_dispatch
    monkeypatch.setattr(dispatch, "plan_dispatch", recording)
    cfg = RolloutConfig(global_batch_size=3, n_samples_per_prompt=3, max_tokens=48, max_model_len=48 + PROMPT,
                        max_split=split, mode=mode, max_age=age, over_sampling_groups=extra, scheduling=scheduling,
                        tail_factor=tail, tail_round_every=2)
    lengths = LognormalLengths(n=3, median=8, sigma=1.2, seed=seed)
    engine = SimulatedEngine(EngineTiming(2, 3, 0.01, 0.001, 0.0), lengths, eos_token_id=DEFAULT_EOS)
    dock = TransferDock.from_config(cfg, [DEFAULT_EOS])
    loaded, trained, tokens_trained, next_id = [], Counter(), 0, 0
    for it in range(ITERATIONS):
        ids = load_iteration(dock, ITERATIONS, next_id, PROMPT)
        next_id += len(ids)
        loaded += ids
        generate_training_batch(dock, engine, cfg, [DEFAULT_EOS], it, drain=it == ITERATIONS - 1)
        batch = dock.batch_arrays()
        assert token_staleness_max(batch["weight_versions"], it) <= cfg.effective_max_age - 1
        for g in dock.batch_group_ids().tolist():
            trained[g] += 1
            tokens_trained += check_trained_group(dock, g, lengths.group_lengths(g), cfg.max_tokens)
        dock.clear()
        engine.update_weights(None, it + 1)  # the engines report the version they generate with
    assert dock.stats()["loaded_groups"] == 0
    assert sorted(trained) == sorted(loaded) and set(trained.values()) == {1}
    assert engine.tokens_generated == tokens_trained
    assert (sum(held) > 0) == (tail > 0)  # tail batching did set rows aside (and only there)

