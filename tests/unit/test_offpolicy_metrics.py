"""Off-policy metrics of an update (tasks/learner/offpolicy_metrics.py) against hand-computed values."""
import json
import math

import numpy as np
import pytest
import torch

from spillover.tasks.grpo_loss import off_policy_correction
from spillover.tasks.learner.offpolicy_metrics import (IS_WEIGHT_BIN_EDGES, SCALAR_KEYS, OffPolicyStats, is_weight_histogram,
                                     is_weight_quantiles, mismatch_kl, token_staleness, version_spans)

T = torch.tensor
# three samples: versions 3, 2, 2 (a partial rollout continued under newer weights), then padding; one token
# of version 1; and a sample whose only tokens are masked out (-1 = no policy made it, e.g. SFT)
VERSIONS = T([[3, 2, 2, -1], [1, 1, -1, -1], [-1, 3, 0, -1]])
MASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_token_staleness_and_version_span():
    staleness = token_staleness(VERSIONS, MASK, current_version=3)
    assert staleness.tolist() == [[0, 1, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]]  # masked / unversioned tokens: 0
    assert version_spans(VERSIONS, MASK).tolist() == [1, 0, 0]  # 3 - 2; one token; no versioned loss token


def test_is_weight_quantiles_and_histogram():
    q = is_weight_quantiles(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    # linear interpolation at (K - 1) * p: 2 -> 3; 3.6 -> 4.6; 3.96 -> 4.96
    assert q == pytest.approx({"is_weight_p50": 3.0, "is_weight_p90": 4.6, "is_weight_p99": 4.96, "is_weight_max": 5.0})
    assert is_weight_quantiles(np.zeros(0))["is_weight_p99"] == 1.0
    # [1, 2) holds 1, 1.5 and the clipped 0.5; [2, 4] holds 2, 3.9, 4 and the clipped 100
    assert is_weight_histogram([0.5, 1.0, 1.5, 2.0, 3.9, 4.0, 100.0], edges=(1.0, 2.0, 4.0)) == [3, 4]
    counts = is_weight_histogram([1.0, 1.0, 0.7, 16.0])
    assert len(counts) == len(IS_WEIGHT_BIN_EDGES) - 1 == 17 and sum(counts) == 4
    # 1 in the middle bin [2^-0.25, 2^0.25); 0.7 (2^-0.51) in [2^-0.75, 2^-0.25); 16 in the last, [2^3.75, 2^4.25]
    assert counts[8] == 2 and counts[7] == 1 and counts[16] == 1


def test_mismatch_kl_is_k3_of_engine_vs_learner_on_chosen_tokens():
    rollout, trainer = T([[math.log(0.5), math.log(0.5)]]), T([[math.log(0.25), 0.0]])
    total, count = mismatch_kl(rollout, trainer, T([[1.0, 0.0]]))
    # k3 with r = trainer - rollout = -log 2: e^r - r - 1 = 0.5 + 0.693147 - 1
    assert count == 1 and total == pytest.approx(0.193147, abs=1e-6)
    assert mismatch_kl(rollout, trainer, T([[0.0, 0.0]])) == (0.0, 0)


def test_stats_over_micro_batches_hand_computed():
    old = T([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rollout = T([[0.0, -1.0, 0.5, 0.0], [math.log(0.5), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    stats = OffPolicyStats("masked_is", current_version=3)
    for rows in ([0], [1, 2]):  # two micro-batches add up
        _, keep = off_policy_correction("masked_is", old[rows], rollout[rows], MASK[rows], cap=2.0)
        stats.add(VERSIONS[rows], MASK[rows], old[rows], rollout[rows], keep)
        stats.add_mismatch(VERSIONS[rows], MASK[rows], rollout[rows], old[rows])
    m = stats.metrics()
    assert m["token_staleness_max"] == 2 and m["version_span_max"] == 1
    # weights of the versioned loss tokens: 1, e, e^-0.5, 2 (the third sample's token has no version)
    weights = [1.0, math.e, math.exp(-0.5), 2.0]
    assert m["is_weight_max"] == pytest.approx(math.e) and m["is_weight_p50"] == pytest.approx(1.5)
    assert m["masked_token_share"] == pytest.approx(1 / 5)  # e > 2 dropped, of 5 loss tokens
    assert m["rejected_sequence_share"] == 0.0
    # current-version (3) loss tokens: only the first token, where old == rollout -> KL 0
    assert m["logprob_mismatch_tokens"] == 1 and m["logprob_mismatch_kl"] == 0.0
    assert m["is_weight_hist"]["counts"] == is_weight_histogram(weights)
    json.dumps(m)  # small and JSON-able for metrics.jsonl


def test_rejected_sequence_share_counts_only_under_seq_reject():
    old, rollout = torch.zeros(2, 2), T([[-1.0, -1.0], [0.0, 0.0]])  # geometric ratios e, 1
    versions, mask = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    for mode, rejected in (("seq_reject", 0.5), ("tis", 0.0)):
        stats = OffPolicyStats(mode, current_version=1)
        _, keep = off_policy_correction(mode, old, rollout, mask, cap=2.0, low=0.8, high=1.25)
        stats.add(versions, mask, old, rollout, keep)
        m = stats.metrics()
        assert m["rejected_sequence_share"] == rejected and m["masked_token_share"] == 0.0, mode
        assert m["token_staleness_max"] == 1 and m["logprob_mismatch_kl"] == 0.0, mode


def test_the_prefect_metrics_table_carries_the_scalars_not_the_histogram():
    from spillover.infra.tracking.prefect_artifacts import metrics_table

    stats = OffPolicyStats("tis", current_version=3)
    stats.add(VERSIONS, MASK, torch.zeros(3, 4), torch.full((3, 4), -0.1), MASK)
    metrics = json.loads(json.dumps(stats.metrics()))  # as the iteration's row holds it
    table = {row["metric"]: row["value"] for row in metrics_table({"iteration": 0, **metrics})}
    assert set(SCALAR_KEYS) <= set(table) and table["token_staleness_max"] == "2"
    assert not any(key.startswith("is_weight_hist") for key in table)


def test_tracker_sends_the_scalars_and_the_histogram_to_wandb_and_the_summary(tmp_path):
    """Through the real reporting path: the update task's LOGGED keys -> Updated -> RunTracker -> offline wandb."""
    from spillover.infra.config.run_config import load_config
    from spillover.infra.tracking.run_tracker import RunTracker, summary_markdown
    from spillover.tasks.results import Updated
    from spillover.tasks.update import LOGGED
    from wandb_records import read_segments

    stats = OffPolicyStats("tis", current_version=3)
    stats.add(VERSIONS, MASK, torch.zeros(3, 4), torch.full((3, 4), -0.1), MASK)
    metrics = stats.metrics()
    updated = Updated(metrics={k: metrics[k] for k in LOGGED if k in metrics}, weight_version=4)
    row = {"iteration": 0, **json.loads(json.dumps(updated.metrics))}
    assert "Off-policy: token staleness max 2, version span max 1" in summary_markdown(row)
    cfg = load_config("configs/tiny.yaml", [f"run_dir={tmp_path}", "tracking.wandb_mode=offline"])
    tracker = RunTracker(tmp_path, cfg.tracking, lambda _: None, run_config=cfg)
    tracker.start()
    tracker.on_iteration(row, updated.scalars())
    tracker.close()
    [segment] = read_segments(tmp_path, 1)
    [logged] = [h for h in segment["history"] if "train/token_staleness_max" in h]
    assert {f"train/{k}" for k in SCALAR_KEYS} <= set(logged) and logged["train/token_staleness_max"] == "2"
    assert json.loads(logged["train/is_weight_log2_hist.bins"]) == pytest.approx([(k + 0.5) / 2 for k in range(-9, 9)])
    assert json.loads(logged["train/is_weight_log2_hist.values"]) == metrics["is_weight_hist"]["counts"]
