"""WeightUpdate, the one message that carries weights to the engines: a bad kind, version or source is refused at
construction with one message naming the field, and an engine's reported version is read as an int."""
from __future__ import annotations

from contextlib import nullcontext
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


def test_tensors_produced_as_needed_are_posted_a_bucket_at_a_time_and_dropped_once_posted():
    """WeightPoster.update with (name, tensor) pairs produced as needed (EngineActor fetches each from Ray's object
    store): a post per bucket, grouped as plan_buckets groups the specs, the version and the flush with the last one
    only, and no tensor alive past its bucket's post (issue 37, item 7: the old update took the whole state dict)."""
    import weakref

    import torch

    from spillover.rollout.fleet.weights.weight_poster import WeightPoster
    from spillover.rollout.sglang.update_group import plan_buckets

    shapes = [(64,), (300,), (10,), (128,), (128,), (500,), (7,), (40,)]
    produced: list[weakref.ref] = []
    alive_at_each: list[int] = []

    def produce():
        for i, shape in enumerate(shapes):
            alive_at_each.append(sum(r() is not None for r in produced))
            tensor = torch.ones(shape)
            produced.append(weakref.ref(tensor))
            yield f"w{i}", tensor

    posted = []
    poster = WeightPoster("http://engine", "torch")
    poster.session = nullcontext  # no server: the posts are recorded
    poster.post_bucket = lambda tensors, version, flush_cache=True: posted.append((list(tensors), version,
                                                                                  flush_cache))
    poster.reported_version = lambda: 3
    assert poster.update(produce(), 3, bucket_bytes=1200) == 3

    buckets = plan_buckets([(f"w{i}", "float32", list(s)) for i, s in enumerate(shapes)], 1200)
    assert [names for names, _, _ in posted] == [[name for name, _, _ in b] for b in buckets]
    assert [(v, flush) for _, v, flush in posted] == [(None, False)] * (len(buckets) - 1) + [(3, True)]
    assert max(alive_at_each) <= max(len(b) for b in buckets) < len(shapes)  # the unposted bucket only
    assert all(r() is None for r in produced)
