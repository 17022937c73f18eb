"""A real Ray actor joins the driver's wandb run (offline mode: no network) with join_shared_run."""
from __future__ import annotations

from spillover.infra.tracking import wandb_shared
from wandb_records import read_segments


def test_ray_actor_joins_the_driver_run_offline(ray_session, tmp_path):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class MetricsActor:
        def log(self, run_id: str, directory: str) -> tuple:
            from spillover.infra.tracking.wandb_shared import join_shared_run, log_at_iteration

            run = join_shared_run(run_id, mode="offline", label="learner", directory=directory)
            log_at_iteration(run, {"train/actor_grad_norm": 7.0}, 0)
            log_at_iteration(run, {"train/actor_grad_norm": 6.0}, 1)
            out = (run.id, run.settings.x_label)
            run.finish()
            return out

    driver = wandb_shared.start_driver_run(tmp_path, "offline", "spillover", name="driver")
    actor = MetricsActor.remote()
    try:
        try:
            wandb_shared.log_at_iteration(driver, {"rollout/reward_mean": 0.5}, 0)
            run_id, label = ray.get(actor.log.remote(driver.id, str(tmp_path)), timeout=120)
        finally:
            wandb_shared.finish(driver)
        assert (run_id, label) == (driver.id, "learner")
        segments = read_segments(tmp_path, 2)
    finally:
        # only once its segment is read to the end: wandb's writer may still be busy after run.finish() returns, and
        # it dies with the actor's process (a kill right after finish() once left a segment without its run record)
        ray.kill(actor)
    assert [s["run_id"] for s in segments] == [driver.id, driver.id]  # one run id, two writers
    actor_rows = [(h["iteration"], h["train/actor_grad_norm"]) for s in segments for h in s["history"]
                  if "train/actor_grad_norm" in h]
    assert actor_rows == [("0", "7"), ("1", "6")]
    assert any("rollout/reward_mean" in h for s in segments for h in s["history"])
    assert wandb_shared.join_shared_run(driver.id, mode="disabled") is None
