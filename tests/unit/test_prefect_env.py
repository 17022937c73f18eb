"""spillover.infra.prefect.env: which defaults a process gets, and that a user's own settings always win."""
from __future__ import annotations

import os

import pytest

from spillover.infra.prefect.env import EPHEMERAL_SERVER_DEFAULTS, apply_process_defaults

DB = "PREFECT_SERVER_DATABASE_CONNECTION_URL"


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("PREFECT_API_URL", DB, "PREFECT_API_DATABASE_CONNECTION_URL",
                "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_ephemeral_server_gets_the_in_memory_database(clean_env):
    apply_process_defaults()
    assert os.environ[DB] == EPHEMERAL_SERVER_DEFAULTS[DB] and ":memory:" in os.environ[DB]
    assert os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] == "WARNING"


@pytest.mark.parametrize("key, value", [("PREFECT_API_URL", "http://127.0.0.1:4200/api"),
                                        ("PREFECT_API_DATABASE_CONNECTION_URL", "sqlite+aiosqlite:////tmp/p.db")])
def test_a_named_server_or_database_is_left_alone(clean_env, key, value):
    clean_env.setenv(key, value)
    apply_process_defaults()
    assert DB not in os.environ and os.environ[key] == value


def test_user_values_win(clean_env):
    clean_env.setenv(DB, "sqlite+aiosqlite:////tmp/mine.db")
    clean_env.setenv("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "INFO")
    apply_process_defaults()
    assert os.environ[DB] == "sqlite+aiosqlite:////tmp/mine.db"
    assert os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] == "INFO"


def test_writes_never_collide_only_on_the_ephemeral_in_memory_database(clean_env):
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    from spillover.infra.prefect.env import writes_never_collide

    memory = EPHEMERAL_SERVER_DEFAULTS[DB]
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_SERVER_DATABASE_CONNECTION_URL: memory}):
        assert writes_never_collide()
    with temporary_settings(updates={PREFECT_API_URL: None,
                                     PREFECT_SERVER_DATABASE_CONNECTION_URL: "sqlite+aiosqlite:////tmp/p.db"}):
        assert not writes_never_collide()
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api",
                                     PREFECT_SERVER_DATABASE_CONNECTION_URL: memory}):
        assert not writes_never_collide()
