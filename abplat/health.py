"""/healthz: is every backing service answering? HTTP 200 when all are, 503 when any is not.

Anyone may ask (load balancers and probes carry no credentials) and gets only {"ok": bool}:
no service errors, versions or timings, which would tell a stranger what runs behind us and
how it fails. Signed-in staff get each service's status, its error and how long it took.

The checks run at once, each in its own thread, and the answer waits at most CHECK_TIMEOUT_S
for them: a service that hangs is reported as timed out, not waited for (its check finishes in
the background, bounded by its own client timeout).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from django.conf import settings
from django.db import connection, connections
from django.http import JsonResponse

CHECK_TIMEOUT_S = 3.0


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


def _timed(check: Callable[[], str]) -> dict:
    started = time.perf_counter()
    try:
        status, ok = check(), True
    except Exception as exc:  # any failure of a dependency is reported, never raised
        status, ok = f"error: {type(exc).__name__}: {exc}"[:500], False
    finally:
        connections.close_all()  # this thread's database connection, if the check opened one
    return {"ok": ok, "status": status, "ms": round((time.perf_counter() - started) * 1000, 1)}


def run_checks(timeout: float | None = None) -> tuple[bool, dict[str, dict]]:
    """Every check at once; (all ok, {name: {"ok", "status", "ms"}}) within ``timeout`` s."""
    timeout = CHECK_TIMEOUT_S if timeout is None else timeout
    pool = ThreadPoolExecutor(max_workers=len(CHECKS), thread_name_prefix="healthz")
    try:
        futures = {name: pool.submit(_timed, check) for name, check in CHECKS.items()}
        wait(futures.values(), timeout=timeout)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # never wait for a hung check
    report = {
        name: future.result()
        if future.done()
        else {"ok": False, "status": f"error: no answer within {timeout:g} s", "ms": timeout * 1000}
        for name, future in futures.items()
    }
    return all(r["ok"] for r in report.values()), report


def healthz(request):
    healthy, report = run_checks()
    status = 200 if healthy else 503
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return JsonResponse({"ok": healthy, "services": report}, status=status)
    return JsonResponse({"ok": healthy}, status=status)
