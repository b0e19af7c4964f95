"""Fixtures for the rollout tests: an experiment with a two-variant rollout plan, the real
weights stores (tests/split/conftest.py) and a sample store on the real ClickHouse server."""

from __future__ import annotations

import copy

import pytest

from tests.split.conftest import etcd_endpoints, private_etcd, weights_backend  # noqa: F401  (fixtures)
from tests.workers.conftest import broker_env  # noqa: F401  (the fixture, reused)

ROLLOUT_DOCUMENT = {
    "key": "rollout-demo",
    "name": "AWQ + FA2 rollout",
    "sla": {"ttft_ms": 200, "target": 0.95},
    "variants": [
        {
            "key": "fp16",
            "control": True,
            "weight": 100,
            "endpoint": "http://127.0.0.1:8100/v1",
            "model": "tiny-llama",
        },
        {"key": "awq-fa2", "weight": 0, "endpoint": "http://127.0.0.1:8102/v1", "model": "tiny-llama"},
    ],
    "rollout": {
        "candidate": "awq-fa2",
        "steps": [10, 50, 100],
        "min_samples": 50,
        "min_duration": "0s",
        "guardrails": [
            {"metric": "attainment", "at_least": "sla_target"},
            {"metric": "error_rate", "at_most_over_control": 0.05},
            {"metric": "p99_ttft_ms", "at_most_over_control": 100},
        ],
        "on_breach": "rollback",
    },
}


@pytest.fixture
def rollout_document():
    return copy.deepcopy(ROLLOUT_DOCUMENT)


@pytest.fixture
def ch_store(settings, shared_database, clickhouse_server):
    """The Django-configured sample store on the real ClickHouse server: the session's migrated
    database, empty when the test starts (tests/sample_dbs.py)."""
    from samples import factory
    from tests.plugin import server_url_for

    settings.CLICKHOUSE_URL = server_url_for(shared_database("server"), clickhouse_server)
    factory._cache.clear()
    store = factory.sample_store()
    store.check_schema()
    yield store
    factory._cache.clear()


class Receiver:
    """A tiny local webhook receiver: every JSON body POSTed to it, in order."""

    def __init__(self, status: int = 200) -> None:
        import http.server
        import json
        import threading

        self.bodies: list[dict] = []
        self.status = status
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                length = int(self.headers.get("Content-Length") or 0)
                outer.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def insert_step(store, key: str, revision: int, arms: dict, *, run_id: int = 1, seq0: int = 0) -> int:
    """Insert samples under one config revision: arms = {variant: [(ttft_ms or None for an
    error), ...]}; each request its own user. Returns the next seq."""
    import time

    from samples.rows import SampleContext, row_from
    from streaming.result import Outcome, StreamResult

    rows, seq = [], seq0
    now = time.time() * 1000
    for variant, ttfts in arms.items():
        for ttft in ttfts:
            result = (
                StreamResult(outcome=Outcome.HTTP_5XX, http_status=500, error="boom")
                if ttft is None
                else StreamResult(ttft_ms=float(ttft), e2e_ms=float(ttft) + 50.0)
            )
            rows.append(
                row_from(
                    result,
                    SampleContext(
                        experiment=key,
                        run_id=run_id,
                        seq=seq,
                        variant=variant,
                        mode="split",
                        sent_unix_ms=now,
                        user_id=f"u{run_id}-{seq}",
                        config_revision=revision,
                    ),
                )
            )
            seq += 1
    store.insert_samples(rows)
    return seq


def shadow_rows(
    key: str, revision: int, identical: list[list[int]], *, variant: str = "awq-fa2", not_ok: int = 0
) -> list[dict]:
    """The gateway's fidelity_shadows rows: identical[u] = user u's compared shadows, 1 where the
    answer was the control's (user "" for the users at odd positions: a request without a user),
    then ``not_ok`` shadows whose control answered an error, on the first user."""
    import time

    rows, now = [], int(time.time())
    for u, answers in enumerate(identical):
        for i, same in enumerate(answers):
            rows.append(
                shadow_row(key, revision, f"sh-{revision}-{u}-{i}", "" if u % 2 else f"user-{u}", same)
            )
    for i in range(not_ok):
        rows.append(shadow_row(key, revision, f"sh-{revision}-err-{i}", "user-0", 0, outcome="control_error"))
    for row in rows:
        row["variant"], row["sent_at"] = variant, now
    return rows


def shadow_row(key: str, revision: int, request_id: str, user: str, same: int, outcome: str = "ok") -> dict:
    return {
        "experiment": key,
        "variant": "awq-fa2",
        "control": "fp16",
        "request_id": request_id,
        "user_id": user,
        "config_revision": revision,
        "sent_at": 0,
        "compared": "live",
        "outcome": outcome,
        "error": "" if outcome == "ok" else "connect refused",
        "identical": int(same),
        "first_divergence": -1 if same else 3,
        "unit": "token",
        "variant_tokens": 16,
        "control_tokens": 16,
        "variant_fp": 1,
        "control_fp": 1 if same else 2,
    }
