"""W3C trace context for the requests we send: ids derived from the request id, so a replayed
run sends the same ``traceparent`` and the join with the servers' logs is reproducible."""

from __future__ import annotations

import hashlib


def trace_ids(request_id: str) -> tuple[str, str]:
    """W3C trace-id (32 hex) and parent span-id (16 hex) of ``request_id``."""
    h = hashlib.sha256(b"abplat-trace-v1:" + request_id.encode()).hexdigest()
    trace_id, span_id = h[:32], h[32:48]
    # All-zero ids are invalid in W3C trace context; vanishingly unlikely, but never send one.
    if trace_id == "0" * 32:
        trace_id = "0" * 31 + "1"
    if span_id == "0" * 16:
        span_id = "0" * 15 + "1"
    return trace_id, span_id


def traceparent(request_id: str) -> str:
    trace_id, span_id = trace_ids(request_id)
    return f"00-{trace_id}-{span_id}-01"
