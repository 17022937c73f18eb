"""A sharded learner under kill -9 (issue 12): `spillover train` with learner.world_size=2 (two FSDP ranks on gloo, joined
to the background Ray cluster: the run starts with the session as background work, tests/fixtures_early.py; no KL
reference, whose sharded logprobs test_learner_group.py checks: two rank starts less per run) SIGKILLs itself at the
start of iteration 1's update;
`resume` (in process, on new ranks) finishes the run from checkpoint 0, whose weights and AdamW state are the two
ranks' slices. The end equals an uninterrupted world_size 2 run bit for bit (metrics rows, and every tensor of the
final checkpoint put back together); that run reuses the resumed run's two ranks, reset (flows/parts.py), so the
comparison also checks a kept sharded group against new ranks. The reward rises over that run, and it then resumes
on one rank (the slices reshard on load) for one more iteration.
Tokens do not depend on timing or the engine count (test_kill_resume.py's DETERMINISTIC settings), so the reference
can use the session's two warm engines while the killed run starts one of its own.
"""
from __future__ import annotations

import signal

import pytest
import torch
from small_run import SMALL_RUN
from spillover_runs import ROUTER, assert_joined_runs_left_nothing, metrics_rows

ITERATIONS = 4
SHARDED = ["learner.world_size=2", "grpo.kl_coef=0", "optimizer.lr=0.01",
           "grpo.reward_function_path=small_run.distinct_ones", "rollout.deterministic_sampling=true",
           "grpo.skip_old_logprob=false", "grpo.off_policy=none"]


def run_args(run_dir) -> list[str]:
    return [f"run_dir={run_dir}", f"schedule.num_iterations={ITERATIONS}", *SMALL_RUN, *SHARDED,
            "tracking.wandb_mode=disabled", "tracking.progress=false"]


def final_policy(run_dir) -> tuple[int, dict[str, torch.Tensor]]:
    from spillover.flows.eval import policy_state
    from spillover.infra.storage.checkpoint import load_latest_checkpoint
    from spillover.infra.storage.store import open_store

    state = load_latest_checkpoint(open_store(str(run_dir / "checkpoints")))
    return state.iteration, policy_state(state)


@pytest.mark.slow  # ~50 s: three runs, each starting a sharded learner group
@pytest.mark.early("sharded_killed_run", cpu_s=15)
@pytest.mark.timeout(900)
def test_kill_9_at_a_sharded_update_then_resume_equals_the_uninterrupted_run(sharded_killed_run, background,
                                                                            prefect_harness, warm_parts, tmp_path):
    from spillover.infra.config.run_config import load_run_config
    from spillover.flows.train import grpo_train
    from spillover.infra.config.run_config import load_config

    spillover, killed, killed_dir = sharded_killed_run.result()
    ref_dir = tmp_path / "reference"
    assert killed.returncode == -signal.SIGKILL and killed.saw(ROUTER), spillover.output(killed)
    written = sorted(p.name for p in (killed_dir / "checkpoints" / "ckpt-00000000" / "tensors").iterdir())
    assert written == ["policy-rank000-00000.safetensors", "policy-rank001-00000.safetensors"]  # each rank its own
    grpo_train(load_run_config(killed_dir, ["engines.rollout_num_gpus=2"]), resume=True, parts=warm_parts)
    spillover.check_gone(killed)
    # Ray ended the killed driver's job: its learner ranks are gone too
    assert_joined_runs_left_nothing(lambda: background.actors_of([killed.session]))

    started = warm_parts.started
    grpo_train(load_config("configs/tiny.yaml", [*run_args(ref_dir), "engines.rollout_num_gpus=2"]), parts=warm_parts)
    assert warm_parts.started == started  # the resumed run's two ranks (and engines) were kept and reset for it
    rows, ref_rows = metrics_rows(killed_dir), metrics_rows(ref_dir)
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in ref_rows] == list(range(ITERATIONS))
    for key in ("trained_stream_ids", "reward_mean", "response_length_p50", "weight_version", "loss"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    rewards = [r["reward_mean"] for r in ref_rows]
    assert sum(rewards[-2:]) > sum(rewards[:2]), rewards  # world_size 2 learns the easy reward
    (iteration, got), (ref_iteration, want) = final_policy(killed_dir), final_policy(ref_dir)
    assert iteration == ref_iteration == ITERATIONS - 1 and sorted(got) == sorted(want)
    differing = [name for name in want if not torch.equal(got[name], want[name])]
    assert differing == [], f"{len(differing)} tensors differ from the uninterrupted run, e.g. {differing[:3]}"

    cfg = load_run_config(ref_dir, [f"schedule.num_iterations={ITERATIONS + 1}", "learner.world_size=1"])
    grpo_train(cfg, resume=True, parts=warm_parts)  # the two ranks' slices reshard onto one
    rows = metrics_rows(ref_dir)
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS + 1)) and rows[-1]["weight_version"] == ITERATIONS + 1
    assert sorted(g for r in rows for g in r["trained_stream_ids"]) == list(range(4 * (ITERATIONS + 1)))
