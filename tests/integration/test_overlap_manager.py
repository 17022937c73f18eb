"""rollout.overlap on the real fleet (the session's two torch engines as Ray actors behind the real sglang-router):
a round detached by its on_result (or at the call, without one) returns at once while its other requests run on; a
weight update meanwhile pauses them in engines.pause_mode, loads and continues; collect_detached hands every one of
them over. retract and in_place: the requests live through the update and report SGLang's meta_info.weight_versions
spans (tokens of both versions, none lost; in_place loads without a cache flush, which the engine would refuse while
they keep their KV cache); abort: they end at the pause with their tokens so far (kept: the dock continues them next
iteration)."""
from __future__ import annotations

import os
import signal

import httpx
import pytest

from waiting import wait_for

from spillover.rollout.drivers.requests import parse_responses
from spillover.rollout.fleet.engine_client import EngineClient
from spillover.rollout.fleet.weights.weight_update import WeightUpdate
from spillover.rollout.sglang.protocol import GenerateJob, GenerateRequest

LONG = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
SHORT = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


def requests(count: int) -> list[GenerateJob]:
    """One short request (its answer detaches the round) and count - 1 long ones (still running then)."""
    return [GenerateJob(GenerateRequest(input_ids=[5, 6, 7, 8 + i], sampling_params=SHORT if i == 0 else LONG,
                                        return_logprob=True)) for i in range(count)]


def output_tokens(urls: list[str]) -> int:
    """Tokens the engines' running requests have generated so far: SGLang's /v1/loads counts prompt and output tokens
    of the running requests, and every prompt here is 4 tokens."""
    loads = [httpx.get(url + "/v1/loads", timeout=10).json()["aggregate"] for url in urls]
    return sum(load["total_used_tokens"] - 4 * load["total_running_reqs"] for load in loads)


def record_posts(monkeypatch) -> list[str]:
    """The paths every EngineClient (the manager's and its router's) POSTs to from now on."""
    posted: list[str] = []
    post = EngineClient.post

    async def recording(self, path, json=None, timeout=None):
        posted.append(path)
        return await post(self, path, json=json, timeout=timeout)

    monkeypatch.setattr(EngineClient, "post", recording)
    return posted


def weight_update(kind: str, model_dir, version: int) -> WeightUpdate:
    """The model folder's weights as a disk update, or as a state dict (tensor: through Ray's object store)."""
    if kind == "disk":
        return WeightUpdate("disk", model_dir, version)
    from safetensors.torch import load_file

    return WeightUpdate("tensor", load_file(str(next(model_dir.glob("*.safetensors")))), version)


@pytest.mark.parametrize("pause_mode, kind", [("retract", "disk"), ("in_place", "disk"), ("in_place", "tensor"),
                                              ("abort", "disk")])
def test_detached_requests_run_through_an_update_and_are_collected(rollout_manager, varied_model_dir, pause_mode,
                                                                   kind, monkeypatch):
    m = rollout_manager
    posted = record_posts(monkeypatch)
    shared_cfg = m.cfg
    m.cfg = shared_cfg.model_copy(update={"pause_mode": pause_mode})
    before = m.overlap_stats()
    try:
        answers = m.generate(requests(16), on_result=lambda index, answer: index == 0, detach=True)
        assert answers[0] is not None and len(answers[0].output_ids) == 1
        pending = [i for i, a in enumerate(answers) if a is None]
        assert pending, "every request had finished before the round detached"
        # paused mid-way: on a busy machine the update could otherwise reach requests that made no token yet
        wait_for(lambda: output_tokens(m.urls), 60, "the detached requests' first tokens")
        assert m.update_weights(weight_update(kind, varied_model_dir, 3)) == {0: 3, 1: 3}
        if pause_mode != "abort":
            wait_for(lambda: not m.detached_running, 120, "the detached requests finishing after the update")
        collected = m.collect_detached()
        assert sorted(collected) == pending  # every detached request is handed over, once
        # in_place kept the prefixes cached under the old weights: flushed once the engines are idle
        assert posted.count("/flush_cache") == (len(m.urls) if pause_mode == "in_place" else 0)
        assert m.collect_detached() == {}
        tokens, _, _, versions = parse_responses([collected[i] for i in pending], default_version=0)
        kinds = {collected[i].meta_info.finish_reason.type for i in pending}
        if pause_mode != "abort":
            # they lived through the update: every token kept, the ones after it made by version 3
            assert all(len(t) == LONG["max_new_tokens"] for t in tokens), [len(t) for t in tokens]
            spanned = [v for v in versions if len(set(v.tolist())) > 1]
            assert spanned, "no request reports tokens of two versions"
            assert all(v[0] == 0 and v[-1] == 3 and (v[1:] >= v[:-1]).all() for v in spanned)
            assert kinds == {"length"}
        else:
            # they ended at the pause with their tokens so far (an aborted request keeps them)
            assert "abort" in kinds and all(len(t) < LONG["max_new_tokens"] for t, i in zip(tokens, pending)
                                            if collected[i].meta_info.finish_reason.type == "abort")
        after = m.overlap_stats()
        cut = after["tokens_cut_by_updates"] - before["tokens_cut_by_updates"]
        if pause_mode == "abort":  # requests not yet running at the pause end at collect_detached's abort instead
            assert 0 < cut <= sum(len(t) for t, i in zip(tokens, pending)
                                  if collected[i].meta_info.finish_reason.type == "abort")
        else:
            assert cut == 0
        assert after["updates_while_generating"] == before["updates_while_generating"] + 1
        assert after["detached_tokens"] - before["detached_tokens"] == sum(len(t) for t in tokens)
        span = after["detached_span_s"] - before["detached_span_s"]
        generating = after["detached_generating_s"] - before["detached_generating_s"]
        if pause_mode != "abort":  # they ran until they finished, before the collection
            assert 0 < generating < span, (generating, span)
    finally:
        m.collect_detached()
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))
        m.cfg = shared_cfg


def test_an_engine_killed_while_detached_requests_run_is_restarted_by_the_update(rollout_manager, varied_model_dir):
    """kill -9 of one engine while a detached round runs: the update's pause skips the dead engine, the update restarts
    it (it loads the new version), the living engine continues; collect_detached then hands every request over at once
    (those of the dead engine were sent again or end as aborts) instead of waiting for them."""
    m = rollout_manager
    restarts = m.restarts
    try:
        answers = m.generate(requests(16), on_result=lambda index, answer: index == 0, detach=True)
        pending = [i for i, a in enumerate(answers) if a is None]
        victim = m.engines[1]
        os.kill(victim.pids[0], signal.SIGKILL)
        assert m.update_weights(WeightUpdate("disk", varied_model_dir, 3)) == {0: 3, 1: 3}
        assert m.restarts == restarts + 1 and m.engines[1].url != victim.url
        collected = m.collect_detached()
        assert sorted(collected) == pending
        for i in pending:
            meta = collected[i].meta_info
            assert meta.finish_reason.type == "abort" or len(collected[i].output_ids) == LONG["max_new_tokens"]
        assert sorted(m.router.workers()) == sorted(m.urls)
    finally:
        m.collect_detached()
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))


def test_a_round_detached_at_the_call_runs_on_until_collected(rollout_manager):
    """detach=True without on_result (the driver's dock was ready already): generate returns before any answer, the
    requests run to their end on the engines, and collect_detached hands every one over."""
    m = rollout_manager
    try:
        answers = m.generate(requests(4), detach=True)
        assert answers == [None] * 4 and m.detached_running
        wait_for(lambda: not m.detached_running, 120, "the requests detached at the call finishing")
        collected = m.collect_detached()
        assert sorted(collected) == [0, 1, 2, 3]
        assert [len(collected[i].output_ids) for i in range(4)] == [1] + [LONG["max_new_tokens"]] * 3
        assert {collected[i].meta_info.finish_reason.type for i in range(4)} == {"length"}
    finally:
        m.collect_detached()


def test_requests_adopted_after_an_update_answer_in_the_next_round(rollout_manager, varied_model_dir, monkeypatch):
    """rollout.adopt_detached on the real fleet: after an in_place update, collect_detached(adopt=True) leaves the
    requests still running alone (no abort, no flush while they keep their KV) and the next generate call reports
    them as its indices len(jobs) + k, whole: every token kept, those after the update made by the new version."""
    m = rollout_manager
    posted = record_posts(monkeypatch)
    shared_cfg = m.cfg
    m.cfg = shared_cfg.model_copy(update={"pause_mode": "in_place"})
    try:
        answers = m.generate(requests(4), on_result=lambda index, answer: index == 0, detach=True)
        pending = [i for i, a in enumerate(answers) if a is None]
        wait_for(lambda: output_tokens(m.urls), 60, "the detached requests' first tokens")
        assert m.update_weights(weight_update("disk", varied_model_dir, 3)) == {0: 3, 1: 3}
        early = m.collect_detached(adopt=True)
        running = [i for i in pending if i not in early]
        assert running, "every detached request had finished before the collection"
        assert "/flush_cache" not in posted and "/abort_request" not in posted
        seen: dict[int, object] = {}
        jobs = [GenerateJob(GenerateRequest(input_ids=[5, 6, 7, 40], sampling_params=SHORT, return_logprob=True))]
        out = m.generate(jobs, on_result=lambda index, answer: seen.setdefault(index, answer) and None)
        assert sorted(seen) == list(range(1 + len(running)))
        tokens, _, _, versions = parse_responses(out[1:], default_version=0)
        assert all(len(t) == LONG["max_new_tokens"] for t in tokens), [len(t) for t in tokens]
        assert all(v[0] == 0 and v[-1] == 3 for v in versions)
        assert m.collect_detached() == {}
    finally:
        m.collect_detached()
        m.update_weights(WeightUpdate("disk", varied_model_dir, 0))
        m.cfg = shared_cfg
