"""Debug rollout data: save and replay a rollout's samples on a local path and on the real S3 server
(SeaweedFS, tests/fixtures_s3.py); the replay reproduces the train data exactly."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spillover.rollout.debug_data import DebugDataError, debug_data_url, load_debug_rollout_data, save_debug_rollout_data
from batch_views import convert_samples_to_train_data
from spillover.rollout.sample import Sample, Status
from spillover.rollout.batch import RolloutBatch
from spillover.tasks.reward import build_advantages


def rollout_groups(seed: int = 0, groups: int = 3, n: int = 2) -> list[list[Sample]]:
    """Groups with everything a rollout can carry: multi-round versions, loss masks or none, odd floats,
    every status, labels and metadata of several JSON types."""
    rng = np.random.default_rng(seed)
    statuses = list(Status)
    out = []
    for g in range(groups):
        group = []
        for i in range(n):
            length = int(rng.integers(1, 9))
            s = Sample(g + 100, i, prompt_tokens=[int(t) for t in rng.integers(2, 50, size=3)],
                       label={"n": g, "text": "a\u00e9\n"} if g % 2 else g, prompt=f"a*{g}=",
                       status=statuses[(g * n + i) % len(statuses)], metadata={"raw_reward": 0.5 + g,
                                                                               "round_number": i, "tags": [g, None]})
            split = length // 2
            s.append_segment([int(t) for t in rng.integers(2, 50, size=split)],
                             rng.normal(-1, 1, size=split).tolist(), weight_version=g,
                             loss_mask=[1] * split if i else None)
            s.append_segment([int(t) for t in rng.integers(2, 50, size=length - split)],
                             (rng.normal(-1, 1, size=length - split) * 1e-7).tolist(), weight_version=g + 1,
                             loss_mask=[int(b) for b in rng.integers(0, 2, size=length - split)] if i else None)
            s.reward = float(rng.normal()) if i else 1 / 3
            s.response = "a" * length
            group.append(s)
        out.append(group)
    out[0][0].rollout_logprobs[0] = -1.2345678901234567e-300  # not a float32
    return out


def test_replay_reproduces_samples_and_train_data(storage_target):
    template = storage_target.url + "/debug/rollout_{rollout_id}.parquet"
    groups = rollout_groups()
    url = save_debug_rollout_data(template, 7, groups, storage_target.cfg)
    assert url.endswith("/debug/rollout_7.parquet") and url.startswith(storage_target.kind)
    loaded = load_debug_rollout_data(template, 7, storage_target.cfg)
    assert [[s.to_dict() for s in g] for g in loaded] == [[s.to_dict() for s in g] for g in groups]
    assert convert_samples_to_train_data(loaded) == convert_samples_to_train_data(groups)
    rewards = np.array([s.reward for g in groups for s in g])
    batch, replayed = RolloutBatch.from_samples(groups), RolloutBatch.from_samples(loaded)
    for column in ("prompt_tokens", "prompt_lengths", "response_tokens", "response_lengths", "rollout_logprobs",
                   "weight_versions", "loss_mask", "truncated", "group_ids"):
        assert np.array_equal(getattr(batch, column), getattr(replayed, column)), column
    assert np.array_equal(build_advantages(batch, rewards), build_advantages(replayed, rewards))


def test_each_rollout_id_has_its_own_file_and_grouping_is_kept(storage_target):
    template = storage_target.url + "/rollout_{rollout_id}/samples.parquet"
    a, b = rollout_groups(seed=1, groups=2, n=3), rollout_groups(seed=2, groups=4, n=2)
    b[1] = b[1] + b[2]  # groups of uneven size and repeated group_index survive as saved
    del b[2]
    save_debug_rollout_data(template, 0, a, storage_target.cfg)
    save_debug_rollout_data(template, 1, b, storage_target.cfg)
    assert [len(g) for g in load_debug_rollout_data(template, 1, storage_target.cfg)] == [2, 4, 2]
    assert load_debug_rollout_data(template, 0, storage_target.cfg)[1][2].to_dict() == a[1][2].to_dict()


def test_a_missing_rollout_names_the_url_and_no_secret(storage_target):
    template = storage_target.url + "/debug/rollout_{rollout_id}.parquet"
    with pytest.raises(DebugDataError, match=r"no debug rollout data for rollout 3 at .*/debug/rollout_3\.parquet") as err:
        load_debug_rollout_data(template, 3, storage_target.cfg)
    if storage_target.server is not None:
        assert storage_target.server.secret_key not in str(err.value)
        assert storage_target.server.access_key not in str(err.value)


def test_none_and_nan_rewards_and_empty_responses_round_trip(tmp_path):
    template = str(tmp_path / "r{rollout_id}.parquet")
    pending, nan = Sample(0, 0, [5]), Sample(0, 1, [5], reward=float("nan"), loss_mask=[])
    save_debug_rollout_data(template, 0, [[pending, nan]])
    (a, b), = load_debug_rollout_data(template, 0)
    assert a.reward is None and a.loss_mask is None and a.status == Status.PENDING
    assert math.isnan(b.reward) and b.loss_mask == []


def test_bad_templates_and_files_are_refused(tmp_path):
    with pytest.raises(DebugDataError, match=r"must contain \{rollout_id\}"):
        debug_data_url(str(tmp_path / "fixed.parquet"), 0)
    with pytest.raises(DebugDataError, match=r"only \{rollout_id\} may appear"):
        debug_data_url(str(tmp_path / "{run}_{rollout_id}.parquet"), 0)
    with pytest.raises(DebugDataError, match="names no file"):
        save_debug_rollout_data("s3://{rollout_id}", 0, [])
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other_0.parquet")
    with pytest.raises(DebugDataError, match="not debug rollout data written by spillover"):
        load_debug_rollout_data(str(tmp_path / "other_{rollout_id}.parquet"), 0)
    (tmp_path / "junk_0.parquet").write_bytes(b"not parquet")
    with pytest.raises(DebugDataError, match="is not a Parquet file"):
        load_debug_rollout_data(str(tmp_path / "junk_{rollout_id}.parquet"), 0)
    with pytest.raises(DebugDataError, match="must be JSON values"):
        save_debug_rollout_data(str(tmp_path / "{rollout_id}.parquet"), 0, [[Sample(0, 0, [1], label={1, 2})]])
