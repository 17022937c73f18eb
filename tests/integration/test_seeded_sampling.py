"""Seeded sampling, the engine half of the kill/resume determinism (tests/e2e/test_kill_resume.py): a request
with a sampling_seed gets the same tokens whatever the batching, the engine or the partial-rollout split."""
from __future__ import annotations

import asyncio


def _generate(url: str, requests: list[dict]) -> list[list[int]]:
    from spillover.rollout.fleet.engine_client import EngineClient
    from spillover.rollout.sglang.protocol import GenerateRequest

    async def go():
        async with EngineClient(url) as client:
            answers = await asyncio.gather(*[client.generate(GenerateRequest.model_validate(r)) for r in requests])
            return [a.output_ids for a in answers]
    return asyncio.run(go())


def test_seeded_sampling_ignores_batching_engine_and_splitting(sglang_router, torch_engines):
    """Through the real router onto two engines whose own generators are seeded differently: a request with
    a sampling_seed gets the same tokens alone or among others, on either engine, and continued from half
    of its response; without the seed the engines disagree."""
    prompt = [5, 6, 7, 8, 9]
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    seeded = {**params, "sampling_seed": 1234}
    alone = _generate(sglang_router.url, [{"input_ids": prompt, "sampling_params": seeded}])[0]
    others = [{"input_ids": [20 + i, 3, 4 + i], "sampling_params": {**params, "sampling_seed": i}} for i in range(6)]
    mixed = _generate(sglang_router.url, others[:3] + [{"input_ids": prompt, "sampling_params": seeded}] * 4 + others[3:])
    assert mixed[3:7] == [alone] * 4  # round robin: both engines served it, in different batches
    first = _generate(sglang_router.url, [{"input_ids": prompt, "sampling_params": {**seeded, "max_new_tokens": 7}}])[0]
    rest = _generate(sglang_router.url, [{"input_ids": prompt + first,
                                          "sampling_params": {**seeded, "max_new_tokens": 9}}])[0]
    assert first + rest == alone  # the noise is keyed by absolute position: partial rollout changes nothing
    assert _generate(sglang_router.url, [{"input_ids": prompt, "sampling_params": {**seeded, "sampling_seed": 99}}])[0] != alone
    direct = [_generate(engine.url, [{"input_ids": prompt, "sampling_params": params}])[0] for engine in torch_engines]
    assert direct[0] != direct[1]  # unseeded: each engine's own generator decides


def test_request_seeds_come_from_group_and_sample_not_from_the_round():
    import numpy as np

    from spillover.rollout.dock.transfer_dock import TransferDock
    from spillover.rollout.drivers.requests import SamplingSettings, build_requests, request_seeds

    dock = TransferDock(gbs=2, n=2, max_split=2, max_tokens=8, max_model_len=16, eos_token_ids=[1])
    dock.load_groups([10, 11], [[5, 6], [7, 8]], [0, 0])
    rows = dock.take_rows()
    sampling = SamplingSettings(seed=3)
    seeds = request_seeds(dock, rows, sampling)
    assert len(set(seeds.tolist())) == 4 and all(0 <= s < 2**31 for s in seeds.tolist())
    dock.put_generation(rows, [[9, 9]] * 4, [[-1.0, -1.0]] * 4, 0, np.zeros(4, dtype=bool))
    assert request_seeds(dock, dock.take_rows(), sampling).tolist() == seeds.tolist()  # next round: same seeds
    assert request_seeds(dock, rows, SamplingSettings(seed=4)).tolist() != seeds.tolist()
    assert request_seeds(dock, rows, SamplingSettings()) is None
    requests = build_requests([[5]] * 4, np.full(4, 2), sampling, seeds)
    assert [r.sampling_params.sampling_seed for r in requests] == seeds.tolist()
    assert "sampling_seed" not in build_requests([[5]], np.full(1, 2), SamplingSettings())[0].body()["sampling_params"]
