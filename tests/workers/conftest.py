"""Fixtures of the replay tests that run real Celery workers on Redis, or `manage.py` processes."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from samples.backends.clickhouse import ClickHouseServerBackend
from samples.store import StoreError
from tests.plugin import server_url_for
from tests.workers.background import install_demo, make_demo_template, subprocess_env

REDIS_URL = os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(autouse=True)
def short_start_lead(monkeypatch):
    """Replays on eager Celery in this process start their schedule 0.5 s after it is planned
    instead of START_LEAD_S (1 s: the time a worker gets to pick its shard up; here the shard
    runs at once, and is ready in 0.2-0.5 s on a busy machine). The worker and `manage.py`
    processes the tests start keep the 1 s."""
    from workers import tasks

    monkeypatch.setattr(tasks, "START_LEAD_S", 0.5)


@contextlib.contextmanager
def fresh_database(clickhouse_server: str) -> Iterator[str]:
    """The URL of a new ClickHouse database on the test server, dropped afterwards."""
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    try:
        yield server_url_for(database, clickhouse_server)
    finally:
        try:
            ClickHouseServerBackend(server_url_for(database, clickhouse_server)).execute(
                f"DROP DATABASE IF EXISTS {database}"
            )
        except StoreError:  # 18.16 refuses IF EXISTS for a database never created (a failed setup)
            pass


@pytest.fixture
def clickhouse_database(clickhouse_server):
    """The URL of a fresh ClickHouse database of this test, dropped after it."""
    with fresh_database(clickhouse_server) as url:
        yield url


@pytest.fixture
def broker_env(tmp_path, clickhouse_server):
    """The environment of worker and manage.py subprocesses: Redis (its test database emptied),
    a fresh ClickHouse database, this test's ABPLAT_VAR (a file SQLite the processes share), a
    5 s visibility timeout (a dead worker's task comes back quickly), and nothing else of ours.
    (Other test directories import this fixture alone: it takes only root fixtures.)"""
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).flushdb()
    except redis.RedisError as exc:
        pytest.fail(f"Redis not reachable at {REDIS_URL} ({exc}); start it (scripts/services.sh start)")
    with fresh_database(clickhouse_server) as url:
        yield subprocess_env(
            ABPLAT_VAR=str(tmp_path),
            ABPLAT_BROKER_URL=REDIS_URL,
            ABPLAT_CLICKHOUSE_URL=url,
            ABPLAT_VISIBILITY_TIMEOUT="5",
            ABPLAT_LOG_LEVEL="INFO",
        )


@pytest.fixture(scope="session")
def demo_sims():
    """Three fast simulators (threads of this process) serving the demo experiment's variants
    for every test of the session that installs it: they keep no state a test reads but the
    counters of their /metrics, which tests read as increases over their own run."""
    from simulator.serve import start_in_thread

    handles = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    yield handles
    for h in handles:
        h.stop()


@pytest.fixture(scope="session")
def demo_template(tmp_path_factory, demo_sims):
    """An ABPLAT_VAR with the database migrated and the demo experiment running on demo_sims,
    made once per session (one Django start-up) for install_demo to copy."""
    var = tmp_path_factory.mktemp("demo-template")
    make_demo_template(var, demo_sims)
    return var


@pytest.fixture
def demo_env(broker_env, demo_template):
    """broker_env with the demo experiment running in its database and its sample store migrated."""
    install_demo(broker_env, demo_template)
    return broker_env
