"""The replay's request spans (telemetry/tracing.py) from its samples, when
``ABPLAT_OTEL_ENABLED`` is on: one span per recorded request, the parent its traceparent named.

The span is built from the sample row the runner records when the request has ended, after
its measurement, so tracing never touches a send or a measured time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings

from telemetry import tracing

log = logging.getLogger(__name__)

# Sample outcomes that are not failures of the request (a cancelled run is not the server's fault).
NOT_FAILED = frozenset({"ok", "cancelled"})


def configure_from_settings() -> bool:
    """This process's tracing as the settings say; True when it is on."""
    tracing.configure(settings.OTEL_ENABLED, settings.OTEL_ENDPOINT, settings.OTEL_SERVICE_NAME)
    return tracing.enabled()


def span_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """record_request_span's arguments for one sample row (samples/columns.py names)."""
    trace_id, span_id = tracing.parse_traceparent(row["traceparent"])
    # Whole microseconds first: unix nanoseconds (about 1.8e18) are beyond a float's precision.
    start_ns = round(row["sent_unix_ms"] * 1000) * 1000
    if row["e2e_ms"] is not None:
        end_ns = start_ns + round(row["e2e_ms"] * 1e6)
    else:  # never measured (the client could not start it): it ended when it was recorded
        end_ns = max(start_ns, int(row["recorded_ms"]) * 1_000_000)
    outcome = row["outcome"]
    return {
        "trace_id": trace_id,
        "span_id": span_id,
        "start_ns": start_ns,
        "end_ns": end_ns,
        "attributes": {
            "abplat.experiment": row["experiment"],
            "abplat.run": row["run_id"],
            "abplat.variant": row["variant"],
            "abplat.request_id": row["request_id"],
            "abplat.mode": row["mode"],
            "abplat.outcome": outcome,
            "abplat.ttft_ms": row["ttft_ms"],
            "http.response.status_code": row["http_status"] or None,
        },
        "error": None if outcome in NOT_FAILED else (row["error"] or outcome),
    }


def traced(put_row: Callable[[Any], None]) -> Callable[[Any], None]:
    """``put_row`` that also exports each row's request span; ``put_row`` itself when tracing is
    off (nothing added per request). A row without a traceparent (a request the client never
    built) has no span: no header named one."""
    if not configure_from_settings():
        return put_row
    failed = 0

    def put(row: Any) -> None:
        nonlocal failed
        put_row(row)
        if not row["traceparent"]:
            return
        try:
            tracing.record_request_span(**span_of(row))
        except Exception:  # a trace must never fail the replay; the first failure of a shard is logged
            failed += 1
            if failed == 1:
                log.warning(
                    "request %s: its span was not recorded (later failures of this shard are not logged)",
                    row["request_id"],
                    exc_info=True,
                )

    return put
