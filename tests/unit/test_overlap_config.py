"""rollout.overlap's small pieces: the config refuses it outside async mode; SGLang's weight_versions spans -> one
version per token."""
from __future__ import annotations

import numpy as np
import pytest

from spillover.infra.config.rollout import RolloutConfig
from spillover.rollout.drivers.requests import parse_responses, token_versions


def test_overlap_needs_async_mode():
    with pytest.raises(ValueError, match="rollout.overlap.*rollout.mode=async"):
        RolloutConfig(mode="sync", overlap=True)
    assert RolloutConfig(mode="async", overlap=True).overlap


def _answer(count: int, version: str, spans=None) -> dict:
    meta = {"id": "r", "finish_reason": {"type": "length"}, "weight_version": version,
            "output_token_logprobs": [[-1.0, 7, None]] * count}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": [7] * count, "meta_info": meta}


def test_spans_become_one_version_per_token():
    spans = [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5}]
    assert token_versions(spans, 5, 3).tolist() == [2, 2, 2, 3, 3]
    _, _, _, versions = parse_responses([_answer(5, "3", spans), _answer(2, "3")], 0)
    assert [v.tolist() for v in versions] == [[2, 2, 2, 3, 3], [3, 3]]


def test_without_spans_versions_stay_one_per_row():
    _, _, _, versions = parse_responses([_answer(4, "1"), _answer(0, "2")], 0)
    assert isinstance(versions, np.ndarray) and versions.tolist() == [1, 2]


def test_a_span_outside_the_output_is_refused():
    with pytest.raises(ValueError, match=r"span \[2, 9\)"):
        token_versions([{"version": "1", "start": 2, "end": 9}], 4, 1)
