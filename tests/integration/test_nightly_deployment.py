"""prefect.yaml's nightly-smoke deployment run on two schedules (issue 41 item 3): registered on the session's Prefect
server as `spillover serve` registers it (flows/serve.py build_deployments), two flow runs started from it as the
scheduler or `prefect deployment run` starts them, each executed here, in process, on the session's warm parts (a
runner would start the same flow in a subprocess with new Ray actors: minutes on 2 cores). Before, both trained in
the one run_dir prefect.yaml named, and the second was refused ("already holds checkpoints")."""
from __future__ import annotations

import json

from small_run import SMALL_RUN


def test_every_scheduled_run_of_the_nightly_deployment_trains_in_its_own_run_dir(prefect_harness, warm_parts,
                                                                                tmp_path):
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.flow_engine import run_flow

    from spillover.flows.serve import build_deployments, nightly_smoke
    from spillover.infra.config.run_config import load_config

    smoke = build_deployments(load_config("configs/tiny.yaml"), only=["nightly-smoke"])[0]
    smoke.apply()
    runs_dir = tmp_path / "nightly-smoke"
    # the deployment's own parameters (prefect.yaml), with its runs under this test's folder and a small config
    shrink = {"runs_dir": str(runs_dir), "iterations": 1,
              "overrides": [*SMALL_RUN, "tracking.wandb_mode=disabled", "tracking.progress=false"]}
    finished = []
    for _ in range(2):
        flow_run = run_deployment(f"spillover-smoke/{smoke.name}", parameters=shrink, timeout=0, as_subflow=False)
        assert flow_run.parameters["config_path"] == "configs/tiny.yaml"  # prefect.yaml's default, kept
        state = run_flow(nightly_smoke, flow_run=flow_run, parameters={**flow_run.parameters, "parts": warm_parts},
                         return_type="state")
        assert state.is_completed(), state.message
        finished.append(flow_run)

    with get_client(sync_client=True) as client:
        assert [client.read_flow_run(r.id).state.type.value for r in finished] == ["COMPLETED", "COMPLETED"]
        # a retry of the first (its name and scheduled start kept, so its run_dir) goes on from its checkpoint: here
        # with one iteration more, where a fresh start would be refused ("already holds checkpoints")
        from prefect.states import AwaitingRetry

        client.set_flow_run_state(finished[0].id, AwaitingRetry(), force=True)
        retried = client.read_flow_run(finished[0].id)
    state = run_flow(nightly_smoke, flow_run=retried, parameters={**retried.parameters, "iterations": 2,
                                                                   "parts": warm_parts}, return_type="state")
    assert state.is_completed(), state.message
    run_dirs = sorted(p for p in runs_dir.iterdir() if p.is_dir())
    assert len(run_dirs) == 2 and {p.name.split("-", 1)[1] for p in run_dirs} == {r.name for r in finished}
    for run_dir in run_dirs:  # <scheduled start, UTC>-<flow run name>, each a whole run of its own
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        again = run_dir.name.endswith(finished[0].name)  # the retried one trained on
        assert [r["iteration"] for r in rows] == ([0, 1] if again else [0])
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == (
            ["ckpt-00000000", "ckpt-00000001"] if again else ["ckpt-00000000"])
        assert json.loads((run_dir / "config.json").read_text())["run_dir"] == str(run_dir)


def test_submit_with_resume_asks_the_training_deployment_to_go_on(prefect_harness):
    """`spillover submit --resume`: the flow run gets resume=True (the deployment's config kept), so a run_dir that
    holds checkpoints goes on instead of being refused. Only the flow run is created here; nothing executes it."""
    from prefect import get_client

    from spillover.flows.serve import TRAIN_DEPLOYMENT, build_deployments, submit_run
    from spillover.infra.config.run_config import load_config

    build_deployments(load_config("configs/tiny.yaml"), only=["train"])[0].apply()
    run = submit_run(TRAIN_DEPLOYMENT, resume=True)
    try:
        assert run.parameters["resume"] is True and run.parameters["config"]["run_dir"] == "runs/tiny"
        assert "resume" not in submit_run(TRAIN_DEPLOYMENT).parameters
    finally:
        with get_client(sync_client=True) as client:
            for flow_run in client.read_flow_runs():
                if flow_run.deployment_id == run.deployment_id and flow_run.state.is_scheduled():
                    client.delete_flow_run(flow_run.id)
