"""Prefect artifacts of a run, sent from a background thread so the training loop never waits on the API.

Per iteration: a table artifact (the metrics, one row per metric) and a markdown summary, linked to that
iteration's subflow run (`iteration-0007`); during generate-until-ready, a progress artifact (ready
groups of GBS) linked to the generate task, updated at most every `min_interval_s`. Outside a flow run
(plain function calls, unit tests) nothing is sent.
"""
from __future__ import annotations

import contextvars
import json
import logging
import queue
import re
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)
_STOP = object()


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return re.sub(r"-{2,}", "-", key) or "spillover"


def current_run_ids() -> tuple[Any, Any]:
    """(task_run_id, flow_run_id) of the calling context, (None, None) outside Prefect runs."""
    from prefect.context import FlowRunContext, TaskRunContext

    task_ctx = TaskRunContext.get()
    if task_ctx is not None:
        return task_ctx.task_run.id, task_ctx.task_run.flow_run_id
    flow_ctx = FlowRunContext.get()
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        return None, flow_ctx.flow_run.id
    return None, None


def metrics_table(metrics: dict) -> list[dict]:
    """Flat rows {metric, value} of the scalar and small-dict metrics (lists are left out)."""
    rows = []
    for key, value in metrics.items():
        if key.endswith("_hist"):
            continue
        if isinstance(value, dict):
            rows += [{"metric": f"{key}.{k}", "value": _fmt(v)} for k, v in value.items()
                     if not isinstance(v, (dict, list))]
        elif not isinstance(value, (list, tuple)):
            rows.append({"metric": key, "value": _fmt(value)})
    return rows


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class ArtifactSink:
    """A daemon thread that sends artifacts in order; `send(fn)` queues fn(client). close() drains it."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        ctx = contextvars.copy_context()  # Prefect settings (API URL, auth) live in context variables
        self._thread = threading.Thread(target=ctx.run, args=(self._loop,), name="prefect-artifacts", daemon=True)
        self._thread.start()

    def send(self, fn: Callable) -> None:
        if self._thread is not None:
            self._queue.put(fn)

    def _loop(self) -> None:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            while True:
                fn = self._queue.get()
                if fn is _STOP:
                    return
                try:
                    fn(client)
                except Exception as err:  # an artifact must never stop training; keep the reason
                    self.errors.append(f"{type(err).__name__}: {err}")
                    log.warning("prefect artifact not sent: %s: %s", type(err).__name__, err)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until everything queued is sent. The flow calls it before the next iteration's subflow: on
        a SQLite-backed server a write landing while that subflow is created makes the server refuse it
        ("database is locked") and the client retries only after ~2 s."""
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(lambda client: done.set())
        done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self._thread = None


class RunArtifacts:
    """The artifacts of one training run (keys: <prefix>-metrics, -summary, -progress)."""

    def __init__(self, key_prefix: str, min_interval_s: float = 2.0, clock=time.monotonic):
        self.prefix = artifact_key(key_prefix)
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.sink = ArtifactSink()
        self.parent_flow_run_id = None
        self._progress: dict[int, dict] = {}  # iteration -> {"id": future id holder, "last": t}
        self.progress_sent = 0

    def start(self) -> bool:
        """Start sending when called inside a flow run; returns whether artifacts are on."""
        _, self.parent_flow_run_id = current_run_ids()
        self.sink.enabled = self.parent_flow_run_id is not None
        self.sink.start()
        return self.sink.enabled

    def on_round(self, iteration: int, progress: dict) -> None:
        """Create the iteration's progress artifact on its first round; then update it, throttled."""
        if not self.sink.enabled:
            return
        ready, target = progress.get("ready_groups", 0), max(1, progress.get("target_groups", 1))
        pct = min(100.0, 100.0 * ready / target)
        desc = (f"iteration {iteration}: {ready}/{target} groups ready after round {progress.get('round', 0)}, "
                f"{progress.get('tokens', 0)} tokens")
        state = self._progress.get(iteration)
        now = self.clock()
        if state is None:
            task_run_id, flow_run_id = current_run_ids()
            state = self._progress[iteration] = {"id": None, "last": now}
            self.sink.send(lambda c: state.update(id=self._create_progress(c, pct, desc, task_run_id, flow_run_id)))
        elif pct >= 100.0 or now - state["last"] >= self.min_interval_s:
            state["last"] = now
            self.sink.send(lambda c: state["id"] and c.update_artifact(state["id"], _progress_update(pct, desc)))
        else:
            return
        self.progress_sent += 1

    def _create_progress(self, client, pct, desc, task_run_id, flow_run_id):
        from prefect.client.schemas.actions import ArtifactCreate

        return client.create_artifact(ArtifactCreate(
            type="progress", key=f"{self.prefix}-progress", description=desc, data=float(pct),
            task_run_id=task_run_id, flow_run_id=flow_run_id)).id

    def on_iteration(self, iteration: int, metrics: dict, summary_md: str, flow_run_id=None) -> None:
        """Table + markdown artifacts of a finished iteration, linked to its subflow run (flow_run_id, else
        to the training run)."""
        if not self.sink.enabled:
            return
        table, parent = metrics_table(metrics), self.parent_flow_run_id

        def send(client):
            from prefect.client.schemas.actions import ArtifactCreate

            run_id = flow_run_id or parent
            client.create_artifact(ArtifactCreate(
                type="table", key=f"{self.prefix}-metrics", description=f"iteration {iteration} metrics",
                data=json.dumps(table), flow_run_id=run_id))
            client.create_artifact(ArtifactCreate(
                type="markdown", key=f"{self.prefix}-summary", description=f"iteration {iteration} summary",
                data=summary_md, flow_run_id=run_id))
        self.sink.send(send)

    def markdown(self, key_suffix: str, text: str, description: str) -> None:
        """A markdown artifact on the training flow run itself (e.g. the report)."""
        if not self.sink.enabled:
            return
        parent = self.parent_flow_run_id

        def send(client):
            from prefect.client.schemas.actions import ArtifactCreate

            client.create_artifact(ArtifactCreate(type="markdown", key=f"{self.prefix}-{key_suffix}",
                                                  description=description, data=text, flow_run_id=parent))
        self.sink.send(send)

    def drain(self) -> None:
        self.sink.drain()

    def close(self) -> None:
        self.sink.close()


def _progress_update(pct: float, desc: str):
    from prefect.client.schemas.actions import ArtifactUpdate

    return ArtifactUpdate(data=float(pct), description=desc)
