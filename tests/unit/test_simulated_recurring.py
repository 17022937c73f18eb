"""bench/longtail.py for issue 38: the recurring workload's lengths, --seeds and its summary rows, the *_hist modes."""
from __future__ import annotations

import numpy as np

from spillover.bench.longtail import parse_args, seed_summary
from spillover.bench.longtail_modes import Workload, pause_mode
from spillover.bench.simulator.workload import RecurringLengths


def test_recurring_lengths_keep_a_prompt_difficulty_across_epochs():
    lengths = RecurringLengths(n=8, num_prompts=50, seed=3, group_share=0.5, prompt_share=0.5)
    epoch0 = np.array([lengths.group_lengths(g).mean() for g in range(50)])
    epoch1 = np.array([lengths.group_lengths(g + 50).mean() for g in range(50)])
    assert lengths.prompt_of(57) == 7
    assert (lengths.group_lengths(57) != lengths.group_lengths(7)).any()  # a new draw of the same prompt
    assert np.corrcoef(np.log(epoch0), np.log(epoch1))[0, 1] > 0.8  # no epoch part left: the prompt decides


def test_seeds_defaults_and_summary():
    args = parse_args(["--workload", "recurring", "--seeds", "0,2", "--modes", "no_partial,overlap_in_place_hist"])
    assert args.seeds == [0, 2] and args.iterations == 15 and args.update_s == 450.0
    assert parse_args(["--workload", "disaggregated"]).iterations == 15
    assert parse_args([]).iterations == 3 and parse_args([]).seeds == [0]
    cfg = Workload(4, 2, 64, 8, 4, 2, 1.0).rollout_config("overlap_in_place_hist")
    assert cfg.start_order == "predicted_longest" and cfg.overlap and cfg.effective_max_age == 3
    assert pause_mode("overlap_in_place_hist") == "in_place"
    rows = [{"mode": "m", "seed": s, "speedup": v, "rollout_speedup": v, "predictor_r": None,
             "token_staleness_max": s, "trained_tokens_per_iteration": 10, "discarded_tokens_per_update": 0}
            for s, v in ((0, 2.0), (1, 3.0))]
    (row,) = seed_summary(rows)
    assert row["speedup_min"] == 2.0 and row["speedup_mean"] == 2.5 and row["seeds"] == [0, 1]
    assert row["predictor_r_mean"] is None and row["token_staleness_max"] == 1
