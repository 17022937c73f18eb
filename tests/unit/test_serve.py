"""prefect.yaml -> the deployments `spillover serve` registers (built locally, no server)."""
from __future__ import annotations

import pytest

from spillover.flows.serve import build_deployments, config_parameter, read_deployment_specs
from spillover.infra.config.parsing import ConfigError
from spillover.infra.config.run_config import load_config


def test_prefect_yaml_declares_train_and_nightly_smoke():
    specs = {s["name"]: s for s in read_deployment_specs()}
    assert specs["train"]["entrypoint"] == "flows/train.py:grpo_train"
    assert specs["nightly-smoke"]["entrypoint"] == "flows/serve.py:nightly_smoke"
    assert specs["nightly-smoke"]["schedules"][0]["cron"] == "0 3 * * *"
    assert specs["nightly-smoke"]["parameters"]["runs_dir"] == "runs/nightly-smoke"  # a folder of runs, one each


def test_each_smoke_run_gets_a_run_dir_of_its_own():
    from datetime import datetime, timedelta, timezone

    from spillover.flows.serve import smoke_run_dir

    night = datetime(2026, 12, 5, 4, 0, tzinfo=timezone(timedelta(hours=1)))
    assert smoke_run_dir("runs/nightly-smoke", night, "witty-otter") == \
        "runs/nightly-smoke/20261205T030000Z-witty-otter"  # UTC: sorts in the order the runs were scheduled


def test_serve_builds_deployments_with_the_config_as_default_and_the_cron():
    cfg = load_config("configs/tiny.yaml", ["run_dir=runs/served", "schedule.num_iterations=5"])
    train, smoke = build_deployments(cfg, cron="5 4 * * *")
    assert (train.name, smoke.name) == ("train", "nightly-smoke")
    assert train.parameters["config"]["run_dir"] == "runs/served"
    assert train.parameters["config"]["schedule"]["num_iterations"] == 5
    assert "RunConfig" in str(train._parameter_openapi_schema.model_dump())
    assert not train.schedules and [s.schedule.cron for s in smoke.schedules] == ["5 4 * * *"]
    assert smoke.entrypoint == "spillover.flows.serve.nightly_smoke" and train.entrypoint == "spillover.flows.train.grpo_train"
    cron_from_config = load_config("configs/tiny.yaml", ["schedule.cron=1 2 * * *"])
    assert [s.schedule.cron for s in build_deployments(cron_from_config, only=["nightly-smoke"])[0].schedules] == [
        "1 2 * * *"]
    with pytest.raises(ConfigError, match="prefect.yaml declares train, nightly-smoke"):
        build_deployments(cfg, only=["nope"])


def test_secrets_never_go_into_deployment_parameters():
    cfg = load_config("configs/tiny.yaml", ["storage.access_key_id=AKIA123", "storage.secret_access_key=s3cr3t"])
    data = config_parameter(cfg)
    assert data["storage"]["access_key_id"] is None and "s3cr3t" not in str(data)


def test_submit_names_why_its_flow_run_failed():
    """`spillover submit --wait` of a run that failed prints the state's message (the exception), not only FAILED."""
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Completed, Failed

    from spillover.flows.cli import run_outcome

    failed = FlowRun(id=uuid.uuid4(), name="witty-otter", flow_id=uuid.uuid4(),
                     state=Failed(message="Flow run encountered an exception: RewardError: reward function 'x' raised"))
    assert run_outcome(failed) == {"flow_run_id": str(failed.id), "flow_run_name": "witty-otter", "state": "FAILED",
                                   "message": "Flow run encountered an exception: RewardError: reward function 'x' "
                                              "raised"}
    done = FlowRun(id=uuid.uuid4(), name="calm-cat", flow_id=uuid.uuid4(), state=Completed(message="All states completed."))
    assert "message" not in run_outcome(done) and run_outcome(done)["state"] == "COMPLETED"
