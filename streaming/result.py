"""What one streamed request measured: the record every layer agrees on.

Pure: no Django, no network. The client fills it; the replay turns it and the request's
context into one samples row; the analysis reads those rows back.
All durations are milliseconds as floats, measured on a monotonic nanosecond clock that
starts just before the request is written. A phase that never happened is ``None``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from enum import StrEnum

# The most of an answer's text a sample keeps (StreamResult.answer_text): 16 KiB of UTF-8, cut
# at the last whole character within it. Thousands of tokens of prose, far more than the report
# shows (a few hundred characters around the first divergence), and a bound on what one answer
# adds to a row.
ANSWER_TEXT_MAX_BYTES = 16 * 1024


def capped_answer(text: str, max_bytes: int | None = None) -> str:
    """``text`` as a sample keeps it: whole when its UTF-8 takes at most ``max_bytes``
    (ANSWER_TEXT_MAX_BYTES), else its longest prefix of whole characters that does. A lone
    surrogate (JSON can escape one; it is no character and UTF-8 cannot hold it) becomes "?"."""
    limit = ANSWER_TEXT_MAX_BYTES if max_bytes is None else max_bytes
    if text.isascii():  # a byte a character: nothing to encode
        return text[:limit]
    # cut at the byte limit; "ignore" drops only the bytes of a last character cut in two
    return text.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


class Outcome(StrEnum):
    """How a request ended. Every value but OK counts as a miss against the SLA, except
    CLIENT_ERROR, which says the replay (not the server) failed the request, and an HTTP_4XX
    whose status is not 408 or 429: a setup error (an unknown model, auth, a bad request), which
    the report counts apart and leaves out of the SLA (analysis.definitions.SETUP_ERROR)."""

    OK = "ok"
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    CONNECT_ERROR = "connect_error"  # refused, DNS, TLS: no connection at all
    CONNECT_TIMEOUT = "connect_timeout"
    HEADERS_TIMEOUT = "headers_timeout"  # connected, but no response headers in time
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    STALL = "stall"  # a gap between two events longer than the stall timeout
    DISCONNECT = "disconnect"  # the server closed the stream before [DONE]
    MALFORMED = "malformed"  # an event that is not valid JSON / not the expected shape
    ENGINE_ERROR = "engine_error"  # vLLM's in-stream error: HTTP 200 then data: {"error": ...}
    TOTAL_TIMEOUT = "total_timeout"
    CANCELLED = "cancelled"
    # Our own fault: the request could not be built or handed to the client (a bug or a
    # request-shape mismatch that escaped the replay's preflight). Never the server's fault, so
    # the report must keep it out of server-fault classes; it still leaves one sample.
    CLIENT_ERROR = "client_error"


@dataclasses.dataclass(slots=True)
class StreamResult:
    outcome: Outcome = Outcome.OK
    http_status: int = 0
    error: str = ""  # human-readable detail of a non-OK outcome
    # connection
    new_connection: bool = False
    connect_ms: float | None = None  # only when a new connection was opened
    ttfb_ms: float | None = None  # response headers received
    first_byte_ms: float | None = None  # first body byte
    # TTFT, three definitions
    ttft_event_ms: float | None = None  # first event with non-empty choices (vLLM bench)
    ttft_ms: float | None = None  # first non-empty content (LLMPerf/genai-perf; the SLA's)
    # decode
    itl_mean_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    # every gap between consecutive token chunks, in arrival order, integer microseconds
    # (rounded half up from the nanosecond clock); [] with fewer than two token chunks
    itl_gaps_us: list[int] = dataclasses.field(default_factory=list)
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0  # from the usage event when the server sends one
    usage_reported: bool = False  # False: output_tokens is a chunk count
    chunks: int = 0
    finish_reason: str = ""
    # what the answer said, for fidelity (fidelity/fingerprints.py): only when the client was asked
    # to fingerprint (a mirror replay); otherwise 0 and []
    output_fp: int = 0  # 64-bit fingerprint of the whole answer's text; 0: not fingerprinted
    token_fps: list[int] = dataclasses.field(default_factory=list)  # one 32-bit one per token chunk
    # the answer's text, capped (capped_answer): only when the client was asked to keep it (a
    # mirror replay of an experiment whose document allows it, fidelity.store_answers); else ""
    answer_text: str = ""
    # correlation
    request_id: str = ""  # X-Request-Id sent
    traceparent: str = ""  # W3C traceparent sent
    trace_id: str = ""
    # ground truth from the simulator (ms after it received the request); None elsewhere
    server_ttft_ms: float | None = None
    # Absolute CLOCK_MONOTONIC nanoseconds (time.perf_counter_ns on Linux, one clock for every
    # process on the host): when the client started its clock, and when the simulator wrote the
    # first non-empty content event. Their difference against ttft_ms is the measurement error.
    start_ns: int = 0
    server_first_content_ns: int | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class StreamCancelled(asyncio.CancelledError):
    """Raised instead of a bare CancelledError so the caller still gets the partial record.

    It is a CancelledError, so task groups and ``asyncio.timeout`` treat it as cancellation.
    """

    def __init__(self, result: StreamResult) -> None:
        super().__init__("stream cancelled")
        self.result = result
