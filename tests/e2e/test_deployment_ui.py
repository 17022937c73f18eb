"""Deploy, run and watch, end to end: a real `prefect server` (API auth on) on 127.0.0.1, `spillover serve`
serving prefect.yaml's deployments, a run started with `spillover submit` through the API, its iteration
artifacts read back through the API, a second run on the same run_dir refused by the run lock, and the
flow run pages checked in headless Chromium (Debian's chromium driven by playwright). Screenshots go to
test-outputs/e2e/ (SPILLOVER_UPDATE_DOCS=1 also refreshes docs/ui-screenshot.png), phase times to
test-outputs/e2e/timings.json.

Kept short on 2 cores: the serving process polls for runs every second (Prefect's default is 10 s), one
engine, the served runs join the session's Ray cluster (RAY_ADDRESS, as a deployment on a cluster would) instead
of starting one, Chromium starts and logs in while `spillover serve` starts up, and the server starts on a copy of
the session's Prefect database (already migrated: an empty one costs ~100 migrations, ~8 s on 2 cores)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from spillover.infra.tracking.report import PLOTS
from spillover.flows.serve import SHUTDOWN_GRACE_S
from fixtures_prefect import copy_migrated_database
from processes import free_port, running, stop_group, wait_http
from small_run import SMALL_RUN
from waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OUT = REPO / "test-outputs" / "e2e"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SMALL = ["schedule.num_iterations=2", *SMALL_RUN, "engines.rollout_num_gpus=1", "tracking.wandb_mode=offline",
         "tracking.report=true"]  # the report artifact and plots are checked here
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUNNER_POLL_S = 1  # PREFECT_RUNNER_POLL_FREQUENCY of `spillover serve`: how soon a submitted run starts


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
                "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "2"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _submit(env: dict, *overrides: str) -> str:
    out = subprocess.run([str(BIN / "spillover"), "submit", *overrides], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["flow_run_id"]


def _flow_run(api: httpx.Client, run_id: str) -> dict:
    return api.get(f"/flow_runs/{run_id}").json()


def _artifacts(api: httpx.Client, flow_run_ids: list[str]) -> list[dict]:
    return api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": flow_run_ids}}}).json()


def test_served_deployment_runs_shows_artifacts_and_locks_its_run_dir(ray_session, prefect_harness, tmp_path):
    assert Path(CHROMIUM).exists(), "chromium missing: `make test` installs it (apt-get install -y chromium)"
    OUT.mkdir(parents=True, exist_ok=True)
    port, user, password = free_port(), "spillover", secrets.token_hex(8)
    url, auth = f"http://127.0.0.1:{port}", f"{user}:{password}"
    run_dir = tmp_path / "e2e-run"
    server_env = _env(PREFECT_HOME=tmp_path / "server-home", PREFECT_SERVER_API_AUTH_STRING=auth,
                      PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=port,
                      PREFECT_UI_API_URL=f"{url}/api")
    client_env = _env(PREFECT_HOME=tmp_path / "client-home", PREFECT_API_URL=f"{url}/api",
                      PREFECT_API_AUTH_STRING=auth)
    serve_env = {**client_env, "PREFECT_RUNNER_POLL_FREQUENCY": str(RUNNER_POLL_S),
                 "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    assert prefect_harness.database is not None
    copy_migrated_database(prefect_harness.database, tmp_path / "server-home")
    timings = {}
    with ExitStack() as stack:
        t0 = time.monotonic()
        server_log = OUT / "server.log"
        server = stack.enter_context(running(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], server_log,
            server_env))
        wait_http(f"{url}/api/health", 180, server, server_log)
        timings["server_ready_s"] = time.monotonic() - t0
        assert httpx.post(f"{url}/api/flows/filter", json={}).status_code == 401  # auth is on
        api = stack.enter_context(httpx.Client(base_url=f"{url}/api", auth=(user, password), timeout=30))

        serve_log = OUT / "serve.log"
        serve = stack.enter_context(running(
            [str(BIN / "spillover"), "serve", "--config", "configs/tiny.yaml", *SMALL, f"run_dir={run_dir}",
             "--cron", "17 4 * * *"], serve_log, serve_env, cwd=str(REPO)))
        page = stack.enter_context(logged_in_page(url, auth))  # while `spillover serve` starts up
        timings["browser_logged_in_s"] = time.monotonic() - t0

        def deployments() -> dict[str, dict]:
            return {d["name"]: d for d in api.post("/deployments/filter", json={}).json()}
        # served by this `spillover serve`: the copied database may hold the same names from the session's other
        # tests (registered with the default cron) until serve updates them
        found = wait_for(deployments, 120, f"deployments served (log: {serve_log})", every=0.25,
                         until=lambda named: {"train", "nightly-smoke"} <= set(named) and [
                             s["schedule"]["cron"] for s in named["nightly-smoke"]["schedules"]] == ["17 4 * * *"]
                         and named["train"]["parameters"]["config"]["run_dir"] == str(run_dir))
        timings["deployments_served_s"] = time.monotonic() - t0
        train, smoke = found["train"], found["nightly-smoke"]
        schema = json.dumps(train["parameter_openapi_schema"])
        assert "RunConfig" in schema and "max_split" in schema  # the config is a typed form in the UI
        assert train["parameters"]["config"]["run_dir"] == str(run_dir)
        assert train["parameters"]["config"]["rollout"]["global_batch_size"] == 4
        assert [s["schedule"]["cron"] for s in smoke["schedules"]] == ["17 4 * * *"]

        first = _submit(client_env)
        timings["first_submitted_s"] = time.monotonic() - t0
        wait_for(lambda: (run_dir / ".spillover.lock").is_file(), 180, f"the first run locks its run_dir ({serve_log})",
                 every=0.1)
        timings["first_locked_s"] = time.monotonic() - t0
        second = _submit(client_env, "schedule.num_iterations=1")
        def states_now() -> list[str]:
            return [_flow_run(api, first)["state_type"], _flow_run(api, second)["state_type"]]
        states = wait_for(states_now, 300, f"both runs final (log: {serve_log})", every=0.25,
                          until=lambda now: all(s in FINAL for s in now))
        timings["run_done_s"] = time.monotonic() - t0
        assert states == ["COMPLETED", "FAILED"], (states, serve_log.read_text()[-4000:])
        refused = _flow_run(api, second)["state"]["message"]
        assert "RunLockedError" in refused and f"flow run {first}" in refused, refused
        assert not (run_dir / ".spillover.lock").exists()  # released at the end of the first run

        children = api.post("/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [first]}}}).json()
        iteration_ids = {r["name"]: r["id"] for r in children}
        assert sorted(iteration_ids) == ["iteration-0000", "iteration-0001"]
        for i, name in enumerate(sorted(iteration_ids)):
            by_type = {a["type"]: a for a in _artifacts(api, [iteration_ids[name]])}
            table = {row["metric"]: row["value"] for row in json.loads(by_type["table"]["data"])}
            assert table["iteration"] == str(i) and "reward_mean" in table and "task_s.update" in table
            assert by_type["table"]["key"] == "spillover-e2e-run-metrics"
            assert f"### Iteration {i}" in by_type["markdown"]["data"]
            # a progress artifact for every iteration that generated (the first always does)
            assert (table["rounds"] != "0") == ("progress" in by_type), (table["rounds"], by_type.keys())
            if "progress" in by_type:
                assert by_type["progress"]["data"] == 100.0 and by_type["progress"]["task_run_id"]
        report = [a for a in _artifacts(api, [first]) if a["key"] == "spillover-e2e-run-report"]
        assert report and "data:image/png;base64," in report[0]["data"]
        assert sorted(p.name for p in (run_dir / "report").iterdir()) == [
            "carryover.png", "is_weights.png", "lengths.png", "predictions.png", "reward.png", "task_time.png"]

        t1 = time.monotonic()
        checked = check_in_browser(page, url, _flow_run(api, first)["name"], first, iteration_ids["iteration-0001"],
                                   report[0]["id"])
        timings["browser_s"] = time.monotonic() - t1
        # the Prefect server goes first: `spillover serve` still stops on SIGTERM (Prefect's own stop would retry
        # pausing the schedules there for minutes: flows/serve.py ends it after SHUTDOWN_GRACE_S)
        t2 = time.monotonic()
        stop_group(server)
        os.killpg(serve.pid, signal.SIGTERM)
        code = wait_for(serve.poll, SHUTDOWN_GRACE_S + 30, f"spillover serve ends on SIGTERM without its server "
                        f"({serve_log})", every=0.5, until=lambda c: c is not None)
        assert code == 0, serve_log.read_text()[-3000:]
        timings["stop_without_server_s"] = time.monotonic() - t2
    timings["stop_s"] = time.monotonic() - t2
    (OUT / "timings.json").write_text(json.dumps({**timings, "browser_checked": checked}, indent=2))


@contextmanager
def logged_in_page(url: str, auth: str):
    """A headless Chromium page logged in to the UI with the API auth string (kept in the UI's localStorage)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.set_default_timeout(30_000)
            page.goto(f"{url}/login")
            page.locator("input[type=password]").fill(auth)
            page.locator("input[type=password]").press("Enter")
            page.wait_for_function("() => localStorage.getItem('prefect-password') !== null")
            page.goto("about:blank")  # the dashboard the login leads to polls the API; nothing to watch yet
            yield page
        finally:
            browser.close()


def _shows(page, *texts: str) -> None:
    """Wait until the page's rendered text holds every one of texts (one wait, not one per text)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function("texts => texts.every(t => document.body.innerText.includes(t))", arg=list(texts),
                               polling=100)
    except PlaywrightTimeout:
        shown = page.evaluate("document.body.innerText")
        raise AssertionError(f"{page.url} does not show {[t for t in texts if t not in shown]}") from None


def check_in_browser(page, url: str, run_name: str, run_id: str, iteration_id: str, report_id: str) -> list:
    """The run page, an iteration page and the report artifact, seen by a logged-in page."""
    checked = []
    page.goto(f"{url}/runs/flow-run/{run_id}")
    _shows(page, run_name, "Completed")
    page.get_by_text("Subflow Runs", exact=True).first.click()  # the timeline itself is a canvas
    _shows(page, "iteration-0000", "iteration-0001")
    page.get_by_text("Artifacts", exact=True).first.click()
    _shows(page, "spillover-e2e-run-report")
    page.screenshot(path=str(OUT / "ui-flow-run.png"))
    checked.append("run page: name, Completed, both iteration subflows, report artifact")

    page.goto(f"{url}/runs/flow-run/{iteration_id}")
    page.get_by_text("Task Runs", exact=True).first.click()
    _shows(page, "load_prompts", "generate_until_ready", "compute_reward", "compute_ref_logprob", "compute_old_logprob",
           "update-", "clear_and_age_sort", "save_checkpoint")
    page.get_by_text("Artifacts", exact=True).first.click()
    _shows(page, "spillover-e2e-run-metrics", "spillover-e2e-run-summary", "spillover-e2e-run-progress")
    update_docs = os.environ.get("SPILLOVER_UPDATE_DOCS") == "1"
    if update_docs:
        page.wait_for_timeout(1000)  # let the cards settle for the docs image
    page.screenshot(path=str(OUT / "ui-iteration.png"))
    checked.append("iteration page: its eight task runs, metrics/summary/progress artifacts")

    page.goto(f"{url}/artifacts/artifact/{report_id}")
    images = page.locator("img[src^='data:image/png']")
    images.first.wait_for()
    page.wait_for_function("() => [...document.querySelectorAll(\"img[src^='data:image/png']\")]"
                           ".every(i => i.complete && i.naturalWidth > 0)")
    assert images.count() == len(PLOTS)  # every plot of the report
    page.screenshot(path=str(OUT / "ui-report.png"), full_page=True)
    checked.append("report artifact: 4 plots rendered")
    if update_docs:
        shutil.copy(OUT / "ui-iteration.png", REPO / "docs" / "ui-screenshot.png")
    return checked
