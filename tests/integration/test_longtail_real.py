"""bench/longtail.py --real in small: natural lengths over the real engines (Ray actors behind the real
router), the real async driver with aborts, and the real dock, for three iterations."""
from __future__ import annotations

from collections import Counter

from spillover.bench.longtail import Workload, run_mode
from spillover.bench.longtail_real import NaturalLengths
from spillover.bench.simulator.workload import LognormalLengths

EOS = 1


def test_cut_rows_continue_to_their_natural_length(rollout_manager):
    lengths = LognormalLengths(n=4, median=10, sigma=1.0, seed=2)
    engine = NaturalLengths(rollout_manager, lengths)
    engine.slots = (2, 32)
    work = Workload(gbs=4, n=4, max_tokens=48, prompt_tokens=8, async_max_age=3, over_sampling_groups=2,
                    update_s=0.0)
    seen = []

    def prompt_for(group: int) -> list[int]:
        return engine.register_prompt(group, [14, 10 + group % 30, 11 + group // 30])

    def clock():
        return len(seen)  # the wall clock is not what this test checks

    original = engine._fix

    def recording_fix(plan, answer):
        original(plan, answer)
        _, group, j, *_ = plan
        seen.append((group, j, answer.meta_info.finish_reason.type, len(answer.output_ids)))

    engine._fix = recording_fix
    result = run_mode("async", work, engine, prompt_for, clock, lambda version: 0.0, iterations=2, warmup=1,
                      eos_ids=[EOS])
    assert result["trained_tokens_per_iteration"] > 0 and 0 <= result["stale_token_share"] <= 1
    assert any(kind == "abort" and n > 0 for *_, kind, n in seen), "some rows should be cut mid-response"
    # every sample that reached its end got exactly its natural length (capped at max_tokens) over all of
    # its answers, however many aborts cut it on the way
    produced, ended = Counter(), set()
    for group, j, kind, n in seen:
        produced[group, j] += n
        if kind == "stop" or produced[group, j] == 48:
            ended.add((group, j))
    assert len(ended) >= 3 * 4 * 4  # at least the three trained batches
    for group, j in ended:
        assert produced[group, j] == min(int(lengths.group_lengths(group)[j]), 48), (group, j)
