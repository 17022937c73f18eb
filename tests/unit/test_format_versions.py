"""Stored formats carry a version, and a release reads only the one it writes: a checkpoint manifest or a dock
snapshot of another version is one clear error naming the file, the version found and the version read."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from spillover.infra.storage.checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, CheckpointState,
                                                load_checkpoint, load_latest_checkpoint, save_checkpoint)
from spillover.infra.storage.format_version import FormatVersionError, format_tag
from spillover.infra.storage.store import open_store
from spillover.rollout.dock.transfer_dock import TransferDock
from spillover.rollout.prompt_data import PromptCursor

V1 = Path(__file__).resolve().parents[1] / "data" / "checkpoint_v1"


def _set_manifest_format(store, name: str, tag) -> None:
    key = f"{name}/manifest.json"
    manifest = json.loads(store.get_bytes(key))
    manifest["format"] = tag
    store.put_bytes(key, json.dumps(manifest).encode())


def test_the_stored_v1_checkpoint_is_the_version_this_release_writes_and_reads(tmp_path):
    manifest = json.loads((V1 / "ckpt-00000007" / "manifest.json").read_text())
    assert manifest["format"] == format_tag(CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION) == "spillover-checkpoint/1"
    store = open_store(str(tmp_path))
    save_checkpoint(store, CheckpointState(1, {"policy": {"w": torch.ones(2)}}))
    assert json.loads(store.get_bytes("ckpt-00000001/manifest.json"))["format"] == manifest["format"]
    shutil.copytree(V1, tmp_path / "v1")
    assert load_checkpoint(open_store(str(tmp_path / "v1")), 7).url.endswith("/v1/ckpt-00000007")


@pytest.mark.parametrize("tag, says", [
    ("spillover-checkpoint/2", "has spillover-checkpoint format version 2 (written by a newer release); "
                               "this release reads version 1 only"),
    ("spillover-checkpoint/0", "has spillover-checkpoint format version 0 (written by an older release); "
                               "this release reads version 1 only"),
    (None, "has no format tag, not a spillover-checkpoint one; this release reads spillover-checkpoint version 1"),
])
def test_a_manifest_of_another_version_is_refused_not_skipped(tmp_path, caplog, tag, says):
    store = open_store(str(tmp_path))
    for it in (1, 2):
        save_checkpoint(store, CheckpointState(it, {"policy": {"w": torch.full((2,), float(it))}}))
    _set_manifest_format(store, "ckpt-00000002", tag)
    url = store.key_url("ckpt-00000002/manifest.json")
    with pytest.raises(FormatVersionError) as err:
        load_checkpoint(store, 2)
    assert str(err.value).startswith(f"checkpoint manifest {url} {says}")
    caplog.set_level(logging.WARNING, logger="spillover.checkpoint")
    with pytest.raises(FormatVersionError, match="format"):  # no silent fall back to ckpt-00000001
        load_latest_checkpoint(store)
    assert "falling back" not in caplog.text


def test_a_dock_snapshot_of_another_version_is_refused_naming_the_checkpoints_meta(tmp_path):
    from spillover.rollout.context import restore_dock_and_cursor

    dock = TransferDock(1, 2, 2, 8, 16, [0])
    dock.load_groups([0], [[3, 4]], ["a"])
    arrays, meta = dock.snapshot()
    assert meta["format"] == "spillover.dock/1"
    store = open_store(str(tmp_path))
    for version in (1, 7):
        meta = {**meta, "format": f"spillover.dock/{version}"}
        save_checkpoint(store, CheckpointState(version, arrays={"dock": arrays},
                                               meta={"dock": meta, "cursor": PromptCursor(4, seed=0).state_dict()}))
    back, _ = restore_dock_and_cursor(load_checkpoint(store, 1))
    assert back.group_ids.tolist()[:1] == [0]
    with pytest.raises(FormatVersionError) as err:
        restore_dock_and_cursor(load_checkpoint(store, 7))
    assert str(err.value) == (f"dock snapshot in {store.key_url('ckpt-00000007')}/meta.json has spillover.dock format "
                              "version 7 (written by a newer release); this release reads version 1 only: use the "
                              "release that wrote it")


def test_a_format_1_learner_state_gets_the_decay_its_config_gave():
    """Learner state format 2 records the lr decay span; a format-1 one (tasks/run_state.py restore_weights) gets the
    span its run followed: from update 0 over the horizon of the config its checkpoint records."""
    from spillover.infra.config.run_config import build_config
    from spillover.tasks.run_state import written_decay_horizon
    from spillover.tasks.learner.state import from_format_1

    saved = build_config(overrides=["schedule.num_iterations=5", "grpo.num_steps_per_rollout=2"])
    saved = saved.model_dump(mode="json")
    assert written_decay_horizon(saved) == 10
    saved["optimizer"]["decay_steps"] = 7
    assert written_decay_horizon(saved) == 7
    meta = {"format": 1, "weight_version": 3, "kl_coef": 0.0}
    assert from_format_1(meta, 10) == {**meta, "format": 2,
                                       "lr_decay": {"start_step": 0, "start_progress": 0.0, "end_step": 10}}
    with pytest.raises(ValueError, match="format 2 is not 1"):
        from_format_1({**meta, "format": 2}, 10)
