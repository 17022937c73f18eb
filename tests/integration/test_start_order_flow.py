"""rollout.start_order = predicted_longest through the training flow (in-process `grpo_train` on warm parts): prompts
recur across epochs, the dock's per-prompt length history predicts each group's length, and the driver starts the
groups predicted longest first; the predictions are recorded in metrics.jsonl and the history survives a resume
through a real storage checkpoint. The history's own rules: tests/unit/test_dock_length_history.py."""
import json

import numpy as np
import pytest

from test_train_flow import small_config

FLOW = ["prefect_harness", "ray_session"]
GBS, N, PROMPTS = 4, 4, 8  # 8 prompts: the async dock (2 x GBS groups) reaches the second epoch in iteration 1
FIRST, TOTAL = 4, 6  # iterations before the resume, and in all
# async (every open row starts at once, in the planner's order), length-aware, seeded; one stop string gives the
# random tiny model varied lengths (test_modes_flow.ASYNC_ROWS), so prompts differ in what they reach
START_ORDER_RUN = {"rollout.mode": "async", "rollout.scheduling": "length_aware", "rollout.start_order":
                   "predicted_longest", "rollout.deterministic_sampling": "true", "rollout.stop": '["x"]',
                   "rollout.max_tokens": 64, "rollout.max_model_len": 80, "rollout.global_batch_size": GBS,
                   "rollout.n_samples_per_prompt": N, "data.num_prompts": PROMPTS, "storage.keep_checkpoints": 1}


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def record_starts(monkeypatch) -> list[dict]:
    """Every dispatch of the driver (DispatchPlanner.next_rows, wrapped): the rows in the order sent, the order
    start_order=oldest would have sent the same rows in (plan_dispatch on the same dock), and per row its group's
    age, predicted length (the history's, NaN: none) and whether the group had started before."""
    from spillover.rollout.drivers.dispatch import DispatchPlanner
    from spillover.rollout.drivers.scheduling import plan_dispatch

    seen, next_rows = [], DispatchPlanner.next_rows

    def spy(self, dock, limit=None):
        rows_, engines = next_rows(self, dock, limit)
        groups = rows_ // dock.n
        started = dock.started_groups()
        taken = np.sort(rows_)  # as take_rows handed them out: oldest group first, then load order
        oldest, _, _ = plan_dispatch(dock, taken[dock.oldest_first(taken // dock.n)], "length_aware",
                                     start_order="oldest")
        seen.append({"planner": self, "rows": rows_.tolist(), "oldest": oldest.tolist(),
                     "age": dock.age[rows_].tolist(), "predicted": dock.predicted_length(groups).tolist(),
                     "fresh": (~started[groups]).tolist()})
        return rows_, engines

    monkeypatch.setattr(DispatchPlanner, "next_rows", spy)
    return seen


def assert_fresh_groups_start_longest_predicted_first(dispatch: dict) -> int:
    """Among the dispatch's rows of groups not started yet that have a prediction, within one age: predicted length
    never rises along the order sent. -> how many such rows there were."""
    fresh = [(age, p) for age, p, f in zip(dispatch["age"], dispatch["predicted"], dispatch["fresh"])
             if f and not np.isnan(p)]
    for age in {a for a, _ in fresh}:
        lengths = [p for a, p in fresh if a == age]
        assert lengths == sorted(lengths, reverse=True), dispatch
    return len(fresh)


def replayed_history(metrics: list[dict], run_dir) -> list[float]:
    """The history's lengths rebuilt from metrics.jsonl: each trained group's true_group_len, in the order trained,
    under its prompt's text (the built-in data set repeats some prompts: they share one entry, as in the dock).
    -> sorted."""
    from spillover.rollout.dock.length_history import LengthHistory

    texts = [json.loads(line)["prompt"] for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    key = {text: k for k, text in enumerate(dict.fromkeys(texts))}
    history = LengthHistory()
    for row in metrics:
        history.record(np.asarray([key[texts[g]] for g in row["trained_group_ids"]]), np.asarray(row["true_group_len"]))
    return sorted(history.lengths.values())


@pytest.mark.usefixtures(*FLOW)
def test_predicted_longest_starts_long_prompts_first_and_the_history_survives_a_resume(tmp_path, monkeypatch,
                                                                                      warm_parts):
    """From the second epoch on, fresh groups start longest predicted first (within an age): an order start_order
    oldest would not have sent (it sends them in load order); so ignored, no dispatch would differ from oldest's.
    Every iteration records the predictions (predicted_group_len against true_group_len, predictor_r); after the
    resume from the checkpoint of iteration FIRST - 1 every trained group still has a prediction (a history lost
    with the process would leave the groups loaded after the resume without one), and the checkpoint's history is
    exactly what the recorded true lengths build. The staleness bound holds and every group is trained once."""
    from spillover.flows.train import grpo_train
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.infra.storage.store import open_store
    from spillover.rollout.context import restore_dock_and_cursor

    seen, run_dir = record_starts(monkeypatch), tmp_path / "run"
    cfg = small_config(run_dir, iterations=FIRST, **START_ORDER_RUN)
    grpo_train(cfg, parts=warm_parts)
    grpo_train(small_config(run_dir, iterations=TOTAL, **START_ORDER_RUN), resume=True, parts=warm_parts)
    got = rows(run_dir)
    assert [r["iteration"] for r in got] == list(range(TOTAL))

    # one planner per generate call that dispatched; an iteration whose carried groups completed its batch before it
    # sent anything makes none (how far the engines got before each cut is timing), iteration 0 always does
    per_iteration = [[s for s in seen if s["planner"] == p] for p in dict.fromkeys(s["planner"] for s in seen)]
    assert 2 <= len(per_iteration) <= TOTAL
    assert all(np.isnan(p) for s in per_iteration[0] for p in s["predicted"])  # the first epoch knows nothing
    ordered = [assert_fresh_groups_start_longest_predicted_first(s) for its in per_iteration for s in its]
    assert max(ordered) >= 2 * N, ordered  # at least two fresh groups with a prediction went out together
    reordered = [i for i, its in enumerate(per_iteration) if any(s["rows"] != s["oldest"] for s in its)]
    assert reordered and min(reordered) >= 1, reordered  # predictions changed the start order

    for r in got:
        assert len(r["predicted_group_len"]) == len(r["true_group_len"]) == len(r["trained_stream_ids"]) == GBS
        assert r["predicted_groups"] == sum(p is not None for p in r["predicted_group_len"])
    assert got[0]["predicted_groups"] == 0 and got[0]["predictor_r"] is None
    # every prompt is trained by iteration 1 (the staleness bound), so from iteration 3 on every group has a prediction,
    # also after the resume
    assert [r["predicted_groups"] for r in got[3:]] == [GBS] * (TOTAL - 3), got
    assert any(r["predictor_r"] is not None for r in got), [r["predictor_r"] for r in got]

    saved = load_latest_checkpoint(open_store(str(run_dir / "checkpoints")))
    dock, _ = restore_dock_and_cursor(saved)
    assert saved.iteration == TOTAL - 1
    assert sorted(dock.length_history.lengths.values()) == pytest.approx(replayed_history(got, run_dir))

    max_age = cfg.rollout.effective_max_age
    assert max(r["token_staleness_max"] for r in got) <= max_age - 1
    trained = [g for r in got for g in r["trained_stream_ids"]]
    assert len(trained) == len(set(trained)) == TOTAL * GBS
