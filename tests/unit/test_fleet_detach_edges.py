"""Edges of the real fleet's detached rounds (rollout/fleet/generation.py BatchGenerator): answers that end together with
the stopping one, requests that fail while detached or adopted, a second collection after an adopting one, and
retries. The engine client is a stand-in (tests/fleet_stand_ins.py: no SGLang runs here); the loop is the real code."""
from __future__ import annotations

import asyncio

import pytest

from fleet_stand_ins import StandInClient, stand_in_generator
from spillover.rollout.drivers.requests import SamplingSettings, build_requests
from spillover.rollout.fleet.engine_client import EngineError, EngineUnreachable
from spillover.rollout.fleet.generation import BatchGenerator
from spillover.rollout.sglang.protocol import RID_HEX_CHARS, GenerateJob


class FailingClient(StandInClient):
    """Gated; the rids in `refused` answer 400 when their gate opens; the first `unreachable` calls fail to connect."""

    def __init__(self, refused=(), unreachable: int = 0, gated: bool = True):
        super().__init__(gated=gated)
        self.refused, self.unreachable = set(refused), unreachable

    async def generate(self, request):
        if self.unreachable:
            self.unreachable -= 1
            self.sent.append(request.rid)
            raise EngineUnreachable("connection reset")
        answer = await super().generate(request)
        if request.rid in self.refused:
            raise EngineError("http://engine", 400, "refused by the stand-in")
        return answer


def requests(count: int):
    return build_requests([[5, 6, 7 + i] for i in range(count)], [4] * count, SamplingSettings())


def test_answers_that_end_together_with_the_stopping_one_are_collected():
    """Every request ends before the detached call returns: the ones after the stop were not reported, so the round
    stays detached and collect_detached hands them over (they were lost)."""
    client = StandInClient()  # ungated: both answer in the same turn of the loop
    generator = stand_in_generator(client)
    first = requests(2)

    async def main():
        answers = await generator.generate_round([GenerateJob(r) for r in first], on_result=lambda i, a: True,
                                                 detach=True)
        return answers, await generator.collect_detached()

    answers, collected = asyncio.run(main())
    assert answers[0] is not None and answers[1] is None
    assert list(collected) == [1] and collected[1].meta_info.id == first[1].rid
    assert generator.rounds == set() and generator.detached is None


def test_a_request_that_failed_while_detached_is_not_adopted_and_its_error_is_raised():
    first = requests(3)
    client = FailingClient(refused=[first[1].rid])
    generator = stand_in_generator(client)

    async def main():
        client.gate(first[0].rid).set()
        await generator.generate_round([GenerateJob(r) for r in first], on_result=lambda i, a: True, detach=True)
        client.gate(first[1].rid).set()  # fails now, while detached
        await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.02, client.gate(first[2].rid).set)  # the stand-in's "abort"
        await generator.collect_detached(adopt=True)

    with pytest.raises(ValueError, match="refused by the stand-in"):
        asyncio.run(main())
    assert generator.adopted is None and generator.detached is None and generator.rounds == set()


def test_a_request_that_fails_after_it_was_adopted_fails_the_next_collection():
    first, second = requests(2), requests(1)
    client = FailingClient(refused=[first[1].rid])
    generator = stand_in_generator(client)

    async def main():
        client.gate(first[0].rid).set()
        await generator.generate_round([GenerateJob(r) for r in first], on_result=lambda i, a: True, detach=True)
        assert await generator.collect_detached(adopt=True) == {}  # request 1 runs on, adopted
        client.gate(second[0].rid).set()
        await generator.generate_round([GenerateJob(second[0])], on_result=lambda i, a: True, detach=True)
        client.gate(first[1].rid).set()  # the adopted request fails in the adopting round, detached
        await asyncio.sleep(0.01)
        await generator.collect_detached(adopt=True)

    with pytest.raises(ValueError, match="refused by the stand-in"):
        asyncio.run(main())
    assert generator.adopted is None and generator.detached is None


def test_a_plain_collection_after_an_adopting_one_hands_each_answer_over_once():
    first = requests(3)
    client = StandInClient(gated=True)
    generator = stand_in_generator(client)

    async def main():
        client.gate(first[0].rid).set()
        await generator.generate_round([GenerateJob(r) for r in first], on_result=lambda i, a: True, detach=True)
        client.gate(first[1].rid).set()
        await asyncio.sleep(0.01)
        adopting = await generator.collect_detached(adopt=True)  # request 1 has answered, request 2 runs on
        asyncio.get_running_loop().call_later(0.02, client.gate(first[2].rid).set)
        return adopting, await generator.collect_detached()  # no generate in between (the call failed before it)

    adopting, plain = asyncio.run(main())
    assert list(adopting) == [1] and list(plain) == [2]


def test_a_retried_request_goes_out_under_a_new_request_id():
    """SGLang refuses a request id it still holds (400 "Duplicate request ID"): the first try may still run there."""
    client = FailingClient(unreachable=1, gated=False)
    recovered = []

    async def recover():
        recovered.append(True)

    generator = BatchGenerator(type("Router", (), {"client": lambda self, engine: client})(), lambda: [],
                               lambda url: client, recover)
    request = requests(1)[0]
    answers = asyncio.run(generator.generate_round([GenerateJob(request)]))
    assert recovered == [True] and len(client.sent) == 2 and client.sent[0] == request.rid
    assert client.sent[1] != request.rid and len(client.sent[1]) == RID_HEX_CHARS
    assert answers[0].meta_info.id == client.sent[1]
