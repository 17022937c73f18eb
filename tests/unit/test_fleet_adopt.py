"""rollout.adopt_detached in the real fleet's request loop (rollout/fleet/generation.py BatchGenerator): the requests
a detached round still runs when it is collected with adopt=True are not aborted or sent again; the next round takes
them over as its indices len(batch) + k, also an answer that came between the collection and that round. The engine
client is a gated stand-in (tests/fleet_stand_ins.py: no SGLang runs here) that answers each request when the test
lets it; the loop is the real code."""
from __future__ import annotations

import asyncio

from fleet_stand_ins import StandInClient, stand_in_generator
from spillover.rollout.drivers.requests import SamplingSettings, build_requests
from spillover.rollout.sglang.protocol import GenerateJob


def test_adopted_requests_answer_in_the_next_round_and_are_sent_once():
    client = StandInClient(gated=True)
    generator = stand_in_generator(client)
    first = build_requests([[5, 6, 7], [5, 6, 8], [5, 6, 9]], [4, 4, 4], SamplingSettings())
    second = build_requests([[5, 6, 10]], [4], SamplingSettings())
    seen: list[tuple[int, str]] = []

    async def main():
        client.gate(first[0].rid).set()  # the first answer detaches the round; the other two run on
        answers = await generator.generate_round([GenerateJob(r) for r in first],
                                                 on_result=lambda index, answer: True, detach=True)
        assert answers[0] is not None and answers[1:] == [None, None]
        assert await generator.collect_detached(adopt=True) == {}  # nothing else has answered: nothing aborted
        client.gate(first[1].rid).set()  # answers between the collection and the next round
        await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.02, client.gate(first[2].rid).set)
        client.gate(second[0].rid).set()
        return await generator.generate_round([GenerateJob(second[0])],
                                              on_result=lambda index, answer: seen.append((index, answer.meta_info.id)))

    results = asyncio.run(main())
    assert client.sent == [r.rid for r in first] + [second[0].rid]  # every request sent once
    assert sorted(seen) == [(0, second[0].rid), (1, first[1].rid), (2, first[2].rid)]
    assert [a.meta_info.id for a in results] == [second[0].rid, first[1].rid, first[2].rid]
    assert generator.rounds == set() and generator.detached is None and generator.adopted is None


def test_collecting_without_adopt_after_an_adoption_aborts_them():
    """A run that ends after adopting (no next round): collect_detached() answers the adopted requests."""
    client = StandInClient(gated=True)
    generator = stand_in_generator(client)
    first = build_requests([[5, 6, 7], [5, 6, 8]], [4, 4], SamplingSettings())

    async def main():
        client.gate(first[0].rid).set()
        await generator.generate_round([GenerateJob(r) for r in first], on_result=lambda i, a: True, detach=True)
        await generator.collect_detached(adopt=True)
        asyncio.get_running_loop().call_later(0.02, client.gate(first[1].rid).set)  # the stand-in's "abort"
        return await generator.collect_detached()

    collected = asyncio.run(main())
    assert sorted(collected) == [1] and collected[1].meta_info.id == first[1].rid
    assert generator.rounds == set() and generator.adopted is None
