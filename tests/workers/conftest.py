"""Fixtures of the replay tests that run real Celery workers on Redis."""

from __future__ import annotations

import os
import uuid

import pytest
import redis

from samples.backends.clickhouse import ClickHouseServerBackend
from samples.store import StoreError
from tests.plugin import server_url_for

REDIS_URL = os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def broker_env(tmp_path, clickhouse_server):
    """The environment of worker and manage.py subprocesses: Redis (its test database emptied),
    a fresh ClickHouse database, this test's ABPLAT_VAR (a file SQLite the processes share), a
    5 s visibility timeout (a dead worker's task comes back quickly), and nothing else of ours."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).flushdb()
    except redis.RedisError as exc:
        pytest.fail(f"Redis not reachable at {REDIS_URL} ({exc}); start it (scripts/services.sh start)")
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    yield {
        **base, "ABPLAT_VAR": str(tmp_path), "ABPLAT_BROKER_URL": REDIS_URL,
        "ABPLAT_CLICKHOUSE_URL": server_url_for(database, clickhouse_server),
        "ABPLAT_VISIBILITY_TIMEOUT": "5", "ABPLAT_LOG_LEVEL": "INFO",
    }  # fmt: skip
    try:
        ClickHouseServerBackend(server_url_for(database, clickhouse_server)).execute(
            f"DROP DATABASE IF EXISTS {database}"
        )
    except StoreError:  # 18.16 refuses IF EXISTS for a database never created (a failed setup)
        pass
