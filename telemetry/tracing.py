"""OpenTelemetry, optional and off by default: the replay exports the parent span of every
request it sends, so a variant's own server spans (vLLM ``--otlp-traces-endpoint``) join it.

The replay already sends a W3C ``traceparent`` with every request, its trace id and span id
derived from the request id (streaming/trace_context.py ``trace_ids``: a replayed run sends the same
ones). ``record_request_span`` exports the span that header names: the same trace id and span id,
a root span (no parent), from the request's start to its end. Nothing here knows the replay: the
caller passes ids, times and attributes (workers/spans.py maps a sample onto them).

- Disabled (the default), every call is a no-op and ``opentelemetry`` is never imported.
- Enabled, the SDK is imported on the first ``configure``; spans go through a
  ``BatchSpanProcessor`` (exported by its own thread, never on the request path) to an OTLP/HTTP
  exporter, or to the exporter a test passes; ``flush`` waits for them (the end of a shard).

Stdlib only at import time (the package rule, telemetry/__init__.py).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

SPAN_NAME = "abplat.replay.request"
SCOPE = "abplat.replay"
EXPORT_TIMEOUT_S = 5.0  # one OTLP POST; a collector that is down costs a shard at most this at its end
FLUSH_TIMEOUT_S = 10.0
# Spans waiting for the export thread (about 1-2 kB each). Beyond this a burst's spans are
# dropped (the SDK logs "Queue full, dropping Span"), never waited for: the replay must not
# slow down for its traces. The SDK's default (2,048) drops in a burst of a few seconds' sends.
MAX_QUEUED_SPANS = 16384


class TracingError(ValueError):
    """A span the caller described wrongly (ids that are not W3C hex, an end before the start)."""


@dataclasses.dataclass(frozen=True)
class Config:
    enabled: bool
    endpoint: str = ""
    service_name: str = "abplat-replay"


@dataclasses.dataclass
class _State:
    config: Config
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider
    tracer: Any = None
    ids: Any = None  # _PresetIds
    api: Any = None  # (trace module, Status, StatusCode, SpanKind)


_lock = threading.Lock()
_state = _State(Config(enabled=False))


def enabled() -> bool:
    return _state.config.enabled


def configure(
    enabled: bool, endpoint: str = "", service_name: str = "abplat-replay", *, exporter: Any = None
) -> None:
    """Set this process's tracing (idempotent: the same settings keep the running exporter).

    ``exporter``: a SpanExporter to use instead of OTLP/HTTP (tests: the SDK's in-memory one).
    A change of settings flushes and shuts down the previous exporter first."""
    global _state
    config = Config(enabled, endpoint, service_name)
    with _lock:
        if _state.config == config and exporter is None and (_state.provider is not None or not enabled):
            return
        previous = _state
        _state = _build(config, exporter) if enabled else _State(config)
    if previous.provider is not None:
        previous.provider.shutdown()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given, or with ``/v1/traces`` when it names
    only the collector (``http://collector:4318``), as OTel's own base-URL setting does."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return urlunsplit(parts._replace(path="/v1/traces"))
    return endpoint


def _build(config: Config, exporter: Any) -> _State:
    if exporter is None and not config.endpoint:
        raise TracingError("tracing enabled without an OTLP endpoint")
    # Imported here, and only here: with tracing off the SDK is never loaded.
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON
    from opentelemetry.trace import SpanKind, Status, StatusCode

    class PresetIds(IdGenerator):
        """Hands out the ids the request already sent (set just before each span starts)."""

        def __init__(self) -> None:
            self.local = threading.local()

        def generate_trace_id(self) -> int:
            return self.local.trace_id

        def generate_span_id(self) -> int:
            return self.local.span_id

        def is_trace_id_random(self) -> bool:
            return False  # derived from the request id (W3C "random" flag not set)

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=traces_url(config.endpoint), timeout=EXPORT_TIMEOUT_S)
    ids = PresetIds()
    # ALWAYS_ON: the header the replay sent says "sampled", so its parent span must exist.
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: config.service_name}), id_generator=ids, sampler=ALWAYS_ON
    )
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS))
    # The provider is this module's own (not the global one): abplat's spans never mix with
    # whatever else a process may have set up.
    return _State(config, provider, provider.get_tracer(SCOPE), ids, (trace, Status, StatusCode, SpanKind))


_HEX = {32: re.compile(r"[0-9a-f]{32}"), 16: re.compile(r"[0-9a-f]{16}")}


def _hex_id(value: str, digits: int, what: str) -> int:
    if not isinstance(value, str) or not _HEX[digits].fullmatch(value):
        raise TracingError(f"{what} {value!r}: must be {digits} lowercase hex digits")
    number = int(value, 16)
    if number == 0:
        raise TracingError(f"{what} {value!r}: all zeros is invalid (W3C trace context)")
    return number


def parse_traceparent(traceparent: str) -> tuple[str, str]:
    """``00-<trace id>-<span id>-<flags>`` -> (trace id, span id), checked."""
    parts = traceparent.split("-")
    if len(parts) != 4 or parts[0] != "00":
        raise TracingError(f"traceparent {traceparent!r}: not a version 00 W3C traceparent")
    _hex_id(parts[1], 32, "trace id")
    _hex_id(parts[2], 16, "span id")
    return parts[1], parts[2]


def record_request_span(
    *,
    trace_id: str,
    span_id: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, str | int | float | bool | None],
    error: str | None = None,
) -> None:
    """Export one finished request's span: ``trace_id`` (32 hex) and ``span_id`` (16 hex) as sent
    in its traceparent, unix-nanosecond start and end, attributes (None values left out), and
    ``error`` (a failure: status ERROR with this description). A no-op when tracing is off."""
    state = _state
    if state.provider is None:
        return
    trace_number = _hex_id(trace_id, 32, "trace id")
    span_number = _hex_id(span_id, 16, "span id")
    if end_ns < start_ns:
        raise TracingError(f"span of trace {trace_id}: ends ({end_ns}) before it starts ({start_ns})")
    trace, status_cls, status_code, kind = state.api
    with _lock:  # the preset ids are per thread; the lock keeps a shutdown from racing a span
        state.ids.local.trace_id, state.ids.local.span_id = trace_number, span_number
        span = state.tracer.start_span(
            SPAN_NAME,
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root, whatever is current
            kind=kind.CLIENT,
            attributes={k: v for k, v in attributes.items() if v is not None},
            start_time=start_ns,
        )
    if error is not None:
        span.set_status(status_cls(status_code.ERROR, error[:500]))
    span.end(end_time=end_ns)


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Export what is buffered; True when done in time (or nothing to do)."""
    state = _state
    if state.provider is None:
        return True
    done = state.provider.force_flush(int(timeout_s * 1000))
    if not done:
        log.warning(
            "traces: spans not exported within %.3g s (the collector at %s)", timeout_s, state.config.endpoint
        )
    return done


def shutdown() -> None:
    """Flush and stop the exporter; tracing is off afterwards until ``configure``."""
    configure(False)
