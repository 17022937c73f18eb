"""rollout.overlap's small pieces: the config refuses it outside async mode; SGLang's weight_versions spans -> one
version per token; the dock keeps rows generating through clear."""
from __future__ import annotations

import numpy as np
import pytest
from dock_helpers import finish_groups, load, make_dock

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.dock.transfer_dock import DockError
from spillover.rollout.drivers.requests import parse_responses, token_versions
from spillover.rollout.sglang.protocol import GenerateResponse, WeightVersionSpan


def test_overlap_needs_async_mode():
    with pytest.raises(ValueError, match="rollout.overlap.*rollout.mode=async"):
        RolloutConfig(mode="sync", overlap=True)
    assert RolloutConfig(mode="async", overlap=True).overlap


def _answer(count: int, version: str, spans=None) -> GenerateResponse:
    meta = {"id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 2, "completion_tokens": count,
            "weight_version": version, "output_token_logprobs": [[-1.0, 7, None]] * count}
    if spans is not None:
        meta["weight_versions"] = spans
    return GenerateResponse.model_validate({"output_ids": [7] * count, "meta_info": meta})


def test_spans_become_one_version_per_token():
    spans = [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5}]
    assert token_versions([WeightVersionSpan(**s) for s in spans], 5, 3).tolist() == [2, 2, 2, 3, 3]
    _, _, _, versions = parse_responses([_answer(5, "3", spans), _answer(2, "3")], 0)
    assert [v.tolist() for v in versions] == [[2, 2, 2, 3, 3], [3, 3]]


def test_without_spans_versions_stay_one_per_row():
    _, _, _, versions = parse_responses([_answer(4, "1"), _answer(0, "2")], 0)
    assert isinstance(versions, np.ndarray) and versions.tolist() == [1, 2]


def test_spans_of_one_version_give_that_version_per_row():
    """SGLang 0.5.23 sends spans on every finished answer: a single span labels the row, whatever else it says; an
    answer with no tokens (an empty span) takes its weight_version."""
    one = [{"version": "2", "start": 0, "end": 4}]
    _, _, _, versions = parse_responses([_answer(4, "3", one), _answer(0, "3", [{"version": "3", "start": 0,
                                                                                 "end": 0}])], 0)
    assert isinstance(versions, np.ndarray) and versions.tolist() == [2, 3]


def test_a_span_outside_the_output_is_refused():
    with pytest.raises(ValueError, match=r"span \[2, 9\)"):
        token_versions([WeightVersionSpan(version="1", start=2, end=9)], 4, 1)


def test_clear_keeps_rows_generating_and_their_older_tokens_age_the_group_when_they_arrive():
    dock = make_dock(gbs=1, n=2, max_split=2, max_age=3)
    load(dock, [0, 1])
    finish_groups(dock, [0])
    dock.take_rows()  # group 1's rows: no token yet, still running when the batch is chosen
    dock.select_batch()
    dock.clear(keep_generating=True)
    assert dock.in_flight[2:4].tolist() == [True, True] and dock.age[2:4].tolist() == [0, 0]
    # made through the update by version 0 (and one token by version 1), written while version 1 trains
    dock.put_generation(np.array([2, 3]), [[5, 6], [7]], [[-1.0, -1.0], [-1.0]], [[0, 1], [1]], [False, False],
                        current_version=1)
    assert dock.age[2:4].tolist() == [1, 1]


def test_clear_refuses_batch_rows_in_flight_even_when_keeping_others():
    dock = make_dock(gbs=1, n=2, max_split=2)
    load(dock, [0])
    rows = dock.take_rows()
    dock.put_generation(rows, [[5, 0], [6, 0]], [[-1.0, -1.0]] * 2, 0, [True, True])
    dock.select_batch()
    dock.in_flight[0] = True  # a batch row in flight can only be a bug upstream: refused
    with pytest.raises(DockError, match="1 batch rows are in flight"):
        dock.clear(keep_generating=True)
