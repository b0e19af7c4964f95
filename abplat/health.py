"""/healthz: each backing service as ok or its error; HTTP 503 when any is down. No auth,
so load balancers and probes can call it; it reveals only service names and error classes."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.conf import settings
from django.db import connection
from django.http import JsonResponse


def check_database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return f"ok ({connection.vendor})"


def check_broker() -> str:
    if settings.CELERY_TASK_ALWAYS_EAGER:
        return "ok (eager, in-process)"
    from abplat.celery import app

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
    return f"ok ({conn.transport_cls})"


def check_weights_store() -> str:
    from experiments.weights.process import weights_store

    store = weights_store()
    listing = store.list_raw()  # a read at the store's current revision
    return f"ok ({store.description}, {len(listing.values)} experiments, revision {listing.revision})"


def check_sample_store() -> str:
    from samples.factory import sample_store

    store = sample_store()
    store.ping()
    return f"ok ({store.describe()})"


CHECKS: dict[str, Callable[[], str]] = {
    "database": check_database,
    "broker": check_broker,
    "weights_store": check_weights_store,
    "sample_store": check_sample_store,
}


def run_checks() -> tuple[bool, dict[str, dict]]:
    healthy, report = True, {}
    for name, check in CHECKS.items():
        started = time.perf_counter()
        try:
            status = check()
            ok = True
        except Exception as exc:  # any failure of a dependency is reported, never raised
            status, ok = f"error: {type(exc).__name__}: {exc}"[:500], False
        healthy &= ok
        report[name] = {"ok": ok, "status": status, "ms": round((time.perf_counter() - started) * 1000, 1)}
    return healthy, report


def healthz(request):
    healthy, report = run_checks()
    return JsonResponse({"ok": healthy, "services": report}, status=200 if healthy else 503)
