"""WeightUpdate, the one message that carries weights to the engines: a bad kind, version or source is refused at
construction with one message naming the field, and an engine's reported version is read as an int."""
from __future__ import annotations

from pathlib import Path

import pytest

from spillover.rollout.fleet.weights.weight_update import WeightUpdate, reported_version


@pytest.mark.parametrize("version", ["3", 3.0, None, True])
def test_a_version_that_is_not_an_int_is_refused(version):
    with pytest.raises(TypeError) as refused:
        WeightUpdate("disk", "/models/step-3", version)
    assert str(refused.value) == (f"WeightUpdate.version must be an int (the learner's weight version); got "
                                  f"{version!r} ({type(version).__name__})")


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError) as refused:
        WeightUpdate("nfs", "/models/step-3", 3)
    assert str(refused.value) == "WeightUpdate.kind must be one of disk, tensor, distributed, colocated; got 'nfs'"


@pytest.mark.parametrize("kind, source, expected", [
    ("disk", {"w": 1}, "a disk WeightUpdate's source is an HF folder path; got dict"),
    ("tensor", "/models/step-3", "a tensor WeightUpdate's source is a state dict or its ObjectRef; got str"),
    ("distributed", "/models/step-3", "a distributed WeightUpdate's source is the policy learner group; got str"),
    ("colocated", {"w": 1}, "a colocated WeightUpdate's source is the policy learner group; got dict"),
])
def test_a_source_the_kind_cannot_use_is_refused(kind, source, expected):
    with pytest.raises(TypeError, match=expected):
        WeightUpdate(kind, source, 1)


def test_a_disk_update_holds_its_folder_as_text_and_is_frozen():
    update = WeightUpdate("disk", Path("/models/step-3"), 3)
    assert update.source == "/models/step-3" and update.version == 3
    with pytest.raises(AttributeError):
        update.version = 4


def test_reported_versions_are_ints():
    assert reported_version(7, "engine 0") == 7
    assert reported_version("7", "engine 0") == 7  # SGLang reports its version as text
    for bad in ("default", None, "7.5"):
        with pytest.raises(ValueError, match="engine 1 reports weight version"):
            reported_version(bad, "engine 1")
