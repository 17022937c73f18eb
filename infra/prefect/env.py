"""Prefect settings for a training process, applied before Prefect starts (env vars, defaults only).

The task-run recorder of a SQLite-backed Prefect server writes each task event in its own transaction;
a subflow created meanwhile hits "database is locked" and the client retries after 1-3 s. Batching the
recorder's writes (flushed every 2 s) makes that collision rare: a subflow then costs ~0.1-0.5 s instead
of ~2.5 s on these machines. These settings matter for the server process: the ephemeral server that
`spillover train` starts inherits them; for `prefect server start`, export them there too (README).

Batching leaves a ~5% chance per subflow (more on a loaded machine) of one 2 s retry: SQLite refuses a
read-then-write transaction when another connection committed in between. The ephemeral server (no
PREFECT_API_URL) therefore keeps its database in memory: Prefect gives an in-memory SQLite database one
pooled connection, so the server's transactions queue instead of colliding (0 retries in 120 subflows
against 2 with the file database, measured side by side). Its records last as long as the process; set
PREFECT_SERVER_DATABASE_CONNECTION_URL to keep them in a file, or run a Prefect server (README: deploy).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

PREFECT_SERVER_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "2",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # the ephemeral server's start can take > 20 s (the default) on a busy 2-core machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
}
EPHEMERAL_SERVER_DEFAULTS = {
    "PREFECT_SERVER_DATABASE_CONNECTION_URL":
        "sqlite+aiosqlite:///file::memory:?cache=shared&uri=true&check_same_thread=false",
}
RUNTIME_DEFAULTS = {
    # Prefect's rich console handler costs ~0.1 s of CPU per iteration at INFO (flow/task run state lines);
    # the terminal has our progress bar, and INFO logs still go to the API (the UI shows them).
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "TOKENIZERS_PARALLELISM": "false",
    # (no HF_HUB_OFFLINE here: a Hub id in model.path downloads when online; local folders load with
    # local_files_only, and the user's HF_HUB_OFFLINE=1 is honoured: infra/hub_models.py)
}


def apply_process_defaults(prefect: bool = True) -> None:
    """Set the defaults above where the user has not set them (the in-memory database only when no
    PREFECT_API_URL names a server, i.e. when Prefect will start an ephemeral one). Without PREFECT_API_URL,
    the ephemeral server this process may start dies with it, even when it is SIGKILLed
    (infra/prefect/server.py; importing Prefect's server module costs ~1-2 s, which a flow run pays anyway).
    prefect=False: a process that runs no flow (`spillover check`): the variables only, Prefect is not imported."""
    chosen = {"PREFECT_API_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL"}
    ephemeral = {} if chosen & set(os.environ) else EPHEMERAL_SERVER_DEFAULTS
    for key, value in {**PREFECT_SERVER_DEFAULTS, **ephemeral, **RUNTIME_DEFAULTS}.items():
        os.environ.setdefault(key, value)
    if prefect and "PREFECT_API_URL" not in os.environ:
        from . import server as prefect_server

        prefect_server.install()


def writes_never_collide() -> bool:
    """True when this process's Prefect API is an ephemeral server on the in-memory database above: its
    writes queue on one connection, so nothing needs to wait for other writes before a subflow starts."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    return settings.api.url is None and url is not None and ":memory:" in url.get_secret_value()


RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")  # where Prefect reports a run's own failure


class PrefectEngineLines(logging.Filter):
    """Drops from a console handler the INFO lines Prefect's own code writes about runs ('Finished in state
    Completed()' after every task, 'Beginning subflow run ...', 'Starting temporary server ...'), and its ERROR
    lines about a failed task or flow run with their tracebacks (one per enclosing run: the same exception reaches
    the command, which reports it once). What the run prints or logs itself through Prefect's run loggers
    (log_prints: the iteration summary) passes, and so does every other WARNING and above. Only the console's
    handlers get it: the API handler still sends every line to the UI."""

    def __init__(self):
        super().__init__("spillover.quiet_console")
        import prefect

        self.prefect_dir = str(Path(prefect.__file__).parent)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("prefect") or not record.pathname.startswith(self.prefect_dir):
            return True
        run_failed = record.levelno >= logging.ERROR and record.name.startswith(RUN_LOGGERS)
        return record.levelno >= logging.WARNING and not run_failed


def quiet_console(verbose: bool = False) -> None:
    """Put PrefectEngineLines on the root logger's handlers (the console: Prefect's run loggers propagate there),
    or take it off with verbose=True. Idempotent."""
    handlers = logging.getLogger().handlers
    for handler in handlers:
        for old in [f for f in handler.filters if isinstance(f, PrefectEngineLines)]:
            handler.removeFilter(old)
    if not verbose:
        quiet = PrefectEngineLines()
        for handler in handlers:
            handler.addFilter(quiet)
