"""Dispatch modes through the training flow (in-process `grpo_train` on warm parts): length-aware scheduling with
tail batching, and an external sglang-router (engines.router_address). Other modes: test_modes_flow.py."""
import json
import subprocess
import sys

import httpx
import pytest

from test_train_flow import small_config

FLOW = ["prefect_harness", "ray_session"]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def record_dispatch(monkeypatch) -> list[dict]:
    """Every round the drivers dispatch (spillover.rollout.drivers.dispatch.DispatchPlanner.next_rows, wrapped): its
    planner (one per iteration), whether the iteration is a long round, the rows in dispatch order with
    their engine, group age, load order and generated length, and the rows held back for the long round after it."""
    from spillover.rollout.drivers.dispatch import DispatchPlanner

    seen, next_rows = [], DispatchPlanner.next_rows

    def spy(self, dock, limit=None):
        rows_, engines = next_rows(self, dock, limit)
        # the planner itself, not its id(): held here, a freed planner's address cannot come back as the next one's
        seen.append({"planner": self, "long": self.long_round, "rows": rows_.tolist(),
                     "engines": None if engines is None else engines.tolist(), "age": dock.age[rows_].tolist(),
                     "load": dock.load_seq[rows_ // dock.n].tolist(), "length": dock.responses.length[rows_].tolist(),
                     "held": self.held.tolist()})
        return rows_, engines

    monkeypatch.setattr(DispatchPlanner, "next_rows", spy)
    return seen


@pytest.mark.usefixtures(*FLOW)
def test_length_aware_dispatch_pins_rows_reorders_them_and_holds_the_tail_for_the_long_round(tmp_path, monkeypatch,
                                                                                             warm_parts):
    """rollout.scheduling=length_aware with tail batching (tail_factor 1, a long round every 3rd weight version; the
    last iteration drains, so iterations 2 and 3 are long rounds): every row goes to a chosen engine (both used),
    oldest group first but not in the dock's load order; in iterations 0 and 1 rows expected above the median wait
    (held, untouched) and the long round of iteration 2 sends them first among their age; no long round holds any.
    Ignored (fifo, or no tail batching): no engine choice, load order, nothing held."""
    from spillover.flows.train import grpo_train

    seen = record_dispatch(monkeypatch)
    grpo_train(small_config(tmp_path / "run", iterations=4, **{
        "rollout.scheduling": "length_aware", "rollout.tail_factor": 1.0, "rollout.tail_round_every": 3,
        "rollout.max_split": 4, "rollout.deterministic_sampling": "true"}), parts=warm_parts)
    iterations = list(dict.fromkeys(s["planner"] for s in seen))
    by_iteration = [[s for s in seen if s["planner"] == p] for p in iterations]
    assert len(by_iteration) == 4 and [its[0]["long"] for its in by_iteration] == [False, False, True, True]
    for s in seen:
        assert s["engines"] is not None and len(s["engines"]) == len(s["rows"]), s
        assert s["age"] == sorted(s["age"], reverse=True), s  # oldest group first
    assert {e for s in seen for e in s["engines"]} == {0, 1}
    fifo = lambda s: sorted(zip(s["age"], s["load"]), key=lambda k: (-k[0], k[1]))  # noqa: E731
    assert any(list(zip(s["age"], s["load"])) != fifo(s) for s in seen)  # reordered within an age

    assert all(not s["held"] for its in by_iteration[2:] for s in its)  # long rounds hold nothing
    held = by_iteration[1][-1]["held"]  # what iteration 1 still held when it was ready
    assert held, [s["held"] for s in by_iteration[1]]
    long_round = by_iteration[2][0]
    assert set(held) <= set(long_round["rows"])  # the tail went out in the long round's first dispatch
    assert rows(tmp_path / "run")[-1]["partial_rows"] == 0


def router_generate_requests(metrics_url: str) -> float:
    """/generate requests the router has served (its Prometheus counter, summed over label sets)."""
    text = httpx.get(metrics_url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("smg_router_requests_total{") and 'endpoint="generate"' in line)


@pytest.fixture
def external_router(tmp_path):
    """A real sglang-router on 127.0.0.1 that no run starts or stops: (url, its Prometheus metrics URL)."""
    from spillover.rollout.fleet.router import free_port, stop_process
    from waiting import wait_for

    port, metrics_port = free_port(), free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                                 str(port), "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                                 "--prometheus-port", str(metrics_port), "--log-level", "warn"], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"sglang-router exited: {log.read_text()[-2000:]}"
            return httpx.get(url + "/workers", timeout=1).status_code == 200

        wait_for(ready, 60, "the external sglang-router answering /workers", not_yet=(httpx.HTTPError,))
        yield url, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        stop_process(proc)


@pytest.mark.usefixtures(*FLOW)
def test_an_external_router_serves_the_runs_generation(tmp_path, warm_parts, external_router):
    """engines.router_address: the run launches no router; it registers its engine with the given one, every rollout
    request goes through it (the router's own request counter), and the engine leaves it when it is shut down.
    Ignored, the run would start a router of its own and the given one would see no worker and no request."""
    from spillover.flows.train import grpo_train
    from spillover.rollout.fleet.router import Router

    url, metrics_url = external_router
    grpo_train(small_config(tmp_path / "run", iterations=2, **{"engines.router_address": url,
                                                              "engines.rollout_num_gpus": 1}), parts=warm_parts)
    idle = warm_parts._idle["engine"]  # the run gave its engine back to the session's pool, still registered
    (key, manager), = [(k, m) for k, m in idle if m.cfg.router_address == url]
    idle.remove((key, manager))
    try:
        assert manager.router.url == url and manager.router.proc is None  # joined, launched nothing
        assert Router(url, None).workers() == manager.urls and len(manager.urls) == 1
        assert router_generate_requests(metrics_url) == sum(r["requests"] for r in rows(tmp_path / "run")) > 0
    finally:
        manager.shutdown()  # an external router outlives the run: the engine takes itself off it
    assert Router(url, None).workers() == []
