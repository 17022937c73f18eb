"""The partial-rollout driver loop (sync and async rounds) against real engines (Ray actors behind the real router) and the real dock."""
import numpy as np
import pytest

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.drivers.rounds import generate_rounds
from spillover.rollout.drivers.requests import SamplingSettings
from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest

EOS = 1


def loaded_dock(cfg: RolloutConfig, groups: int, prompt=(14, 44, 11, 41)):
    dock = TransferDock.from_config(cfg, [EOS])
    dock.load_groups(np.arange(groups), [list(prompt)] * groups, [3] * groups)
    return dock


def rollout_cfg(**kw):
    base = dict(global_batch_size=4, n_samples_per_prompt=4, max_tokens=24, max_model_len=40, max_split=3)
    return RolloutConfig(**{**base, **kw})


class Recording:
    """Wraps the real manager and keeps what came back, to compare with what the dock kept."""

    def __init__(self, manager):
        self.manager, self.tokens_returned = manager, 0
        self.num_engines = manager.num_engines

    def generate(self, jobs, on_result=None):
        def record(i, resp):
            self.tokens_returned += len(resp.output_ids)
            return on_result(i, resp) if on_result else None  # True stops the round

        return self.manager.generate(jobs, on_result=record)


def test_sync_rounds_cut_at_max_tokens_over_max_split(rollout_manager):
    cfg = rollout_cfg()
    dock = loaded_dock(cfg, 8)
    engine = Recording(rollout_manager)
    sampling = SamplingSettings(temperature=1.0, stop_token_ids=[EOS])
    stats = generate_rounds(dock, engine, cfg, sampling, weight_version=0)
    assert dock.ready_group_count() >= 4 and stats.rounds >= 1
    assert stats.tokens_generated == engine.tokens_returned == dock.stats()["tokens_stored"]
    # no row got more than max_tokens // max_split tokens per round
    rounds = dock.rounds[dock.generated]
    lengths = dock.responses.length[dock.generated]
    assert np.all(lengths <= rounds * (cfg.max_tokens // cfg.max_split))


def test_async_abort_keeps_exactly_the_tokens_produced(rollout_manager):
    cfg = rollout_cfg(mode="async", max_tokens=300, max_model_len=320, max_split=2)
    dock = TransferDock.from_config(cfg, [EOS])
    # four groups whose prompts leave room for 3 tokens finish at once; four with room for 300 get cut
    prompts = [[14] * 317] * 4 + [[14, 44, 11, 41]] * 4
    dock.load_groups(np.arange(8), prompts, [3] * 8)
    engine = Recording(rollout_manager)
    sampling = SamplingSettings(temperature=1.0, stop_token_ids=[EOS])
    stats = generate_rounds(dock, engine, cfg, sampling, weight_version=0)
    assert dock.update_ready()
    assert stats.tokens_generated == engine.tokens_returned == dock.stats()["tokens_stored"]
    partial = dock.generated & ~dock.complete
    assert partial.any(), "with 8 groups and a long budget some rows should have been cut"
    assert not dock.in_flight.any()
    # the abort the callback asked for is over when generate() returns: the next round is not cut
    after = rollout_manager.generate([GenerateJob(GenerateRequest(input_ids=[14, 44, 11, 41], sampling_params={
        "max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}))])
    assert after[0].meta_info.finish_reason.type == "length" and len(after[0].output_ids) == 3
    # a cut row continues from its tokens: the next dispatch sends prompt + partial response
    rows = np.flatnonzero(partial)[:3]
    inputs, max_new = dock.generation_inputs(rows, None)
    for row, ids, budget in zip(rows, inputs, max_new):
        assert len(ids) == dock.prompts.length[row // cfg.n_samples_per_prompt] + dock.responses.length[row]
        assert budget == cfg.max_tokens - dock.responses.length[row]
