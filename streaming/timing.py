"""The TTFT clock: turns timestamped stream events into a StreamResult.

Pure: every method takes the nanosecond timestamp the caller read when the bytes arrived, so
tests drive it with fake times. All times are relative to ``start_ns``, read just before the
request is written (vLLM's benchmark starts its clock at the same point).

Definitions (see docs/services.md, "How vLLM's own benchmark client defines the latencies"):
- ``ttft_event_ms``: first event with non-empty ``choices``, even if its text is empty (vLLM).
- ``ttft_ms``: first event carrying non-empty text (LLMPerf, genai-perf; the SLA uses this).
- token chunk: an event with non-empty ``choices`` other than the chat role-only event.
- ITL: gaps between consecutive token chunks. ``itl_gaps_us`` keeps every one (integer
  microseconds, in arrival order), which the report pools over requests (vLLM's
  benchmark_serving ITL); per request, their mean and p50/p99 (exact order statistics: nearest
  rank, stats.quantiles, the project's one convention). TPOT: (last token - ttft) / (tokens - 1).
- ``e2e_ms``: when the stream ended ([DONE] or the error that ended it).
- output tokens from the usage event; the token-chunk count only when there is none.
"""

from __future__ import annotations

import json
from typing import Any

from stats.quantiles import nearest_rank
from streaming.result import Outcome, StreamResult
from streaming.sse import DONE

_NS_PER_MS = 1_000_000.0


class StreamProtocolError(ValueError):
    """An event that is not what an OpenAI-compatible server sends (-> Outcome.MALFORMED)."""


class StreamTimer:
    # Return values of event(): the caller keeps reading, stops because [DONE] came, or stops
    # because the server reported an in-stream error.
    MORE = 0
    DONE = 1
    ENGINE_ERROR = 2

    def __init__(self, start_ns: int, result: StreamResult | None = None) -> None:
        self.start_ns = start_ns
        self.r = result if result is not None else StreamResult()
        self.r.start_ns = start_ns
        self._token_times: list[int] = []
        self._first_event_ns: int | None = None
        self._first_content_ns: int | None = None
        self._end_ns: int | None = None
        self.done = False

    def _ms(self, t_ns: int) -> float:
        return (t_ns - self.start_ns) / _NS_PER_MS

    # 1. connection phases -------------------------------------------------------------
    def connected(self, started_ns: int, complete_ns: int) -> None:
        self.r.new_connection = True
        self.r.connect_ms = (complete_ns - started_ns) / _NS_PER_MS

    def headers(self, t_ns: int, status: int) -> None:
        self.r.ttfb_ms = self._ms(t_ns)
        self.r.http_status = status

    def body_bytes(self, t_ns: int) -> None:
        if self.r.first_byte_ms is None:
            self.r.first_byte_ms = self._ms(t_ns)

    @property
    def first_content_seen(self) -> bool:
        return self._first_content_ns is not None

    # 2. one SSE event's data ------------------------------------------------------------
    def event(self, t_ns: int, data: str) -> int:
        if data == DONE:
            self.done = True
            self._end_ns = t_ns
            return self.DONE
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise StreamProtocolError(f"event is not JSON ({exc}): {data[:120]!r}") from None
        if not isinstance(obj, dict):
            raise StreamProtocolError(f"event is not a JSON object: {data[:120]!r}")
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", "") if isinstance(err, dict) else str(err)
            code = err.get("code", "") if isinstance(err, dict) else ""
            self.r.error = f"in-stream error (code {code}): {msg}"[:500]
            self._end_ns = t_ns
            return self.ENGINE_ERROR
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise StreamProtocolError(f"event has no 'choices' list: {data[:120]!r}")
        usage = obj.get("usage")
        if usage:
            self._usage(usage, data)
        if choices:
            self._choice(t_ns, choices[0], data)
        return self.MORE

    def _choice(self, t_ns: int, choice: Any, data: str) -> None:
        if not isinstance(choice, dict):
            raise StreamProtocolError(f"choice is not an object: {data[:120]!r}")
        if self._first_event_ns is None:
            self._first_event_ns = t_ns
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat
            text = delta.get("content") or ""
            role_only = "role" in delta and not text and not choice.get("finish_reason")
        elif "text" in choice:  # completions
            text = choice["text"] or ""
            role_only = False
        else:
            raise StreamProtocolError(f"choice has neither 'delta' nor 'text': {data[:120]!r}")
        if not isinstance(text, str):
            raise StreamProtocolError(f"content is not a string: {data[:120]!r}")
        if not role_only:
            self._token_times.append(t_ns)
        if text and self._first_content_ns is None:
            self._first_content_ns = t_ns
        reason = choice.get("finish_reason")
        if reason:
            self.r.finish_reason = str(reason)

    def _usage(self, usage: Any, data: str) -> None:
        if not isinstance(usage, dict):
            raise StreamProtocolError(f"usage is not an object: {data[:120]!r}")
        try:
            self.r.output_tokens = int(usage.get("completion_tokens") or 0)
            self.r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        except (TypeError, ValueError):
            raise StreamProtocolError(f"usage counts are not integers: {data[:120]!r}") from None
        self.r.usage_reported = True
        truth = usage.get("abplat")  # the simulator's ground truth, see simulator/README.md
        if isinstance(truth, dict):
            if truth.get("server_ttft_ms") is not None:
                self.r.server_ttft_ms = float(truth["server_ttft_ms"])
            if truth.get("first_content_ns") is not None:
                self.r.server_first_content_ns = int(truth["first_content_ns"])

    # 3. the end ---------------------------------------------------------------------------
    def finish(self, t_ns: int, outcome: Outcome, error: str = "") -> StreamResult:
        r = self.r
        r.outcome = outcome
        if error:
            r.error = error[:500]
        end_ns = self._end_ns if self._end_ns is not None else t_ns
        r.e2e_ms = self._ms(end_ns)
        if self._first_event_ns is not None:
            r.ttft_event_ms = self._ms(self._first_event_ns)
        if self._first_content_ns is not None:
            r.ttft_ms = self._ms(self._first_content_ns)
        times = self._token_times
        r.chunks = len(times)
        if not r.usage_reported:
            r.output_tokens = len(times)
        if len(times) >= 2:
            gaps_ns = [b - a for a, b in zip(times, times[1:])]
            # rounded half up to whole microseconds in integers (no float on the way); a gap is
            # never negative (a clock step between two reads counts as 0)
            r.itl_gaps_us = [max(0, (g + 500) // 1000) for g in gaps_ns]
            gaps = sorted(g / _NS_PER_MS for g in gaps_ns)
            r.itl_mean_ms = sum(gaps) / len(gaps)
            r.itl_p50_ms = nearest_rank(gaps, 0.5)
            r.itl_p99_ms = nearest_rank(gaps, 0.99)
            r.itl_max_ms = gaps[-1]
        if r.ttft_ms is not None and r.output_tokens >= 2 and times:
            r.tpot_ms = (self._ms(times[-1]) - r.ttft_ms) / (r.output_tokens - 1)
        return r
