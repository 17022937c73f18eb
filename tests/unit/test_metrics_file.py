"""metrics.jsonl across crashes (infra/tracking/run_tracker.py, tasks/run_state.py rewind_metrics): an append cut
short by kill -9 does not block the resume, and the resume's rewrite never leaves the file half written."""
from __future__ import annotations

import json

import pytest

from spillover.infra.tracking.run_tracker import append_metrics, read_metrics
from spillover.tasks.run_state import rewind_metrics


def test_a_last_line_cut_short_is_left_out_and_a_bad_line_elsewhere_is_named(tmp_path):
    for it in range(2):
        append_metrics(tmp_path, {"iteration": it, "reward": 0.5})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as fh:
        fh.write('{"iteration": 2, "rew')  # the crash came mid-append
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [0, 1]
    path.write_text('{"iteration": 0}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON metrics row"):
        read_metrics(tmp_path)


def test_rewind_keeps_the_rows_before_the_checkpoint_and_drops_a_cut_append(tmp_path):
    for it in range(3):
        append_metrics(tmp_path, {"iteration": it})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"iteration": 3, "rew')
    rewind_metrics(tmp_path, next_iteration=2, saved_row=None)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps({"iteration": i}) + "\n" for i in (0, 1))
    assert not list(tmp_path.glob("*.partial"))
    rewind_metrics(tmp_path, next_iteration=3, saved_row={"iteration": 2, "from": "checkpoint"})
    assert read_metrics(tmp_path)[-1] == {"iteration": 2, "from": "checkpoint"}
