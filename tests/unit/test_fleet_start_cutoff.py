"""rollout.start_cutoff in the real fleet's request loop (rollout/fleet/generation.py BatchGenerator): a request
whose group has not started when its detached round stops is answered never-sent instead of going to an engine; a
detached round without on_result (the driver's dock ready already) returns at the call. The engine client is a
recording stand-in (tests/fleet_stand_ins.py: no SGLang runs here); the semaphore and the detach are the real code."""
from __future__ import annotations

import asyncio

from fleet_stand_ins import StandInClient, stand_in_generator
from spillover.rollout.drivers.requests import SamplingSettings, build_requests
from spillover.rollout.sglang.protocol import GenerateJob, GenerateResponse


def _sent_after_detach(cutoff_group: int | None) -> tuple[list[str], GenerateResponse | None]:
    """Two requests, one in flight at a time: the first one's answer detaches the round, the second waits for the
    in-flight slot until then. -> (rids the engine got, the second request's answer if it came back at once)."""
    client = StandInClient()
    generator = stand_in_generator(client, max_in_flight=1)
    requests = build_requests([[5, 6, 7], [5, 6, 8]], [4, 4], SamplingSettings())
    jobs = [GenerateJob(requests[0]), GenerateJob(requests[1], None, cutoff_group)]

    async def main():
        answers = await generator.generate_round(jobs, on_result=lambda index, answer: index == 0, detach=True)
        await asyncio.sleep(0.01)  # let a request that was let through reach the engine
        held = generator.detached.results[1] if generator.detached is not None else answers[1]
        return held

    held = asyncio.run(main())
    return client.sent, held


def test_a_group_not_started_at_the_detach_is_not_sent():
    sent, held = _sent_after_detach(cutoff_group=3)
    assert len(sent) == 1  # only the first request reached the engine
    assert held is not None and held.output_ids == [] and held.meta_info.finish_reason.type == "abort"
    assert "start_cutoff" in held.meta_info.finish_reason.message
    sent, _ = _sent_after_detach(cutoff_group=None)
    assert len(sent) == 2  # without the cutoff it starts while the caller has gone on (the update)


def test_a_detached_round_without_on_result_returns_at_the_call():
    """The call returns with the requests running (none answered); a start-cutoff group's request is never sent: the
    batch choice is now."""
    client = StandInClient(gated=True)
    generator = stand_in_generator(client, max_in_flight=1)
    requests = build_requests([[5, 6, 7], [5, 6, 8], [5, 6, 9]], [4, 4, 4], SamplingSettings())
    jobs = [GenerateJob(requests[0]), GenerateJob(requests[1]), GenerateJob(requests[2], None, 3)]

    async def main():
        answers = await generator.generate_round(jobs, detach=True)  # returns with nothing answered yet
        detached_at_return = generator.detached is not None
        client.open_all()
        collected = await generator.collect_detached()
        return answers, detached_at_return, collected

    answers, detached_at_return, collected = asyncio.run(main())
    assert answers == [None, None, None] and detached_at_return
    # one request in flight went out; the collect came before the second could (it comes back never sent)
    assert client.sent == [requests[0].rid] and sorted(collected) == [0, 1, 2]
    assert "start_cutoff" in collected[2].meta_info.finish_reason.message
