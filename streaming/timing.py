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

Decoding: every event that is not [DONE] is read with json.loads, except the token events of a
stream after its first: vLLM (and the simulator) send them byte for byte alike but for the token
text, e.g. ``{"id":"cmpl-1","object":"text_completion",...,"choices":[{"index":0,"text":"so",
"logprobs":null,"finish_reason":null,...}]}``. The first plain token event (no role, no
finish_reason, no usage) is decoded in full, and its bytes before and after the text's JSON
string become the stream's template, once a probe proves it: the template with another string
in that place decodes to the same event with only the text changed (_Template.learn). Later
events that are that prefix, one valid JSON string and that suffix are then the same event
with another text, which is all event() needs to know of them: a token chunk, with content or
empty. Anything else (the role event, the last token with its finish_reason, usage, errors,
another server's shape, bytes that only look alike) takes json.loads, so the result is exactly
json.loads' (tests/streaming/test_timing.py compares both on vLLM's captures and hostile input).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fidelity.fingerprints import output_fp, token_fp
from stats.quantiles import nearest_rank
from streaming.result import Outcome, StreamResult, capped_answer
from streaming.sse import DONE

_NS_PER_MS = 1_000_000.0
_CHAT, _COMPLETION = 1, 2  # a plain token event's shape (StreamTimer._choice)


# A JSON string token exactly as json.loads reads one (strict: no raw control character, only
# its escapes), unrolled so that a near miss fails in linear time.
_JSON_STRING = re.compile(r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"')
# What the probe puts where the text was: escapes, a line separator, nothing a real token holds.
_PROBE = '"\\u0000abplat\\"probe\\u2028"'
_PROBE_TEXT = '\x00abplat"probe\u2028'


class _Template:
    """A stream's token events, known from its first plain one: ``prefix`` + a JSON string (the
    text) + ``suffix``. Made only by learn(), which proves it."""

    __slots__ = ("prefix", "suffix", "start", "end_from")

    def __init__(self, prefix: str, suffix: str) -> None:
        self.prefix, self.suffix = prefix, suffix
        self.start = len(prefix)
        self.end_from = len(prefix) + len(suffix)  # the text's end, counted from the data's end

    def text(self, data: str) -> str | None:
        """The raw JSON string of the text when ``data`` is this template's event, else None."""
        if (
            len(data) < self.end_from + 2
            or not data.startswith(self.prefix)
            or not data.endswith(self.suffix)
        ):
            return None
        raw = data[self.start : len(data) - len(self.suffix)]
        return raw if _JSON_STRING.fullmatch(raw) else None

    @classmethod
    def learn(cls, data: str, obj: dict, chat: bool) -> _Template | None:
        """The template of ``data`` (decoded: ``obj``; its text at choices[0].delta.content when
        ``chat``, else choices[0].text), or None. Proof: the bytes around the text's string,
        with the probe's string in its place, decode to ``obj`` with only the text changed.
        JSON is read left to right, so those bytes read the same around any string: the probe
        shows that the string is one token and that the decoder keeps it at that place (the
        last of duplicate keys wins, so a key seen twice still passes only if this is the one)."""
        name = "content" if chat else "text"
        at = data.rfind(f'"{name}"')
        if at < 0:
            return None
        i = at + len(name) + 2
        while i < len(data) and data[i] in " \t\n\r:":
            i += 1
        m = _JSON_STRING.match(data, i)
        if m is None:
            return None
        prefix, suffix = data[:i], data[m.end() :]
        try:
            probed = json.loads(prefix + _PROBE + suffix)
            holder = probed["choices"][0]["delta"] if chat else probed["choices"][0]
            if holder[name] != _PROBE_TEXT:
                return None
            holder[name] = (obj["choices"][0]["delta"] if chat else obj["choices"][0])[name]
        except (ValueError, LookupError, TypeError):
            return None
        return cls(prefix, suffix) if probed == obj else None


class StreamProtocolError(ValueError):
    """An event that is not what an OpenAI-compatible server sends (-> Outcome.MALFORMED)."""


class StreamTimer:
    # Return values of event(): the caller keeps reading, stops because [DONE] came, or stops
    # because the server reported an in-stream error.
    MORE = 0
    DONE = 1
    ENGINE_ERROR = 2

    def __init__(
        self,
        start_ns: int,
        result: StreamResult | None = None,
        *,
        fingerprint: bool = False,
        keep_text: bool = False,
    ) -> None:
        """``fingerprint``: keep each token chunk's text for the answer's fingerprints
        (fidelity/fingerprints.py), what a mirror replay compares between variants.
        ``keep_text`` (with ``fingerprint``): a whole answer's text, those chunks joined and
        capped (streaming.result.capped_answer), goes into the result's ``answer_text`` too."""
        if keep_text and not fingerprint:
            raise ValueError("keep_text: the text is joined from the chunks fingerprint keeps; set both")
        self.start_ns = start_ns
        self.r = result if result is not None else StreamResult()
        self.r.start_ns = start_ns
        self._token_times: list[int] = []
        self._first_event_ns: int | None = None
        self._first_content_ns: int | None = None
        self._end_ns: int | None = None
        self.done = False
        self._template: _Template | None = None
        self._learn = True
        self._texts: list[str] | None = [] if fingerprint else None
        self._keep_text = keep_text

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
        template = self._template
        if template is not None:
            text = template.text(data)
            if text is not None:  # this stream's token event again, another text (see above)
                self._token_times.append(t_ns)
                if text != '""' and self._first_content_ns is None:
                    self._first_content_ns = t_ns
                if self._texts is not None:
                    # the JSON string's text: its inner bytes unless it holds an escape
                    self._texts.append(json.loads(text) if "\\" in text else text[1:-1])
                return self.MORE
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
            plain = self._choice(t_ns, choices[0], data)
            if plain and self._learn and not usage:
                self._learn = False  # one try per stream: a stream that does not fit pays once
                self._template = _Template.learn(data, obj, plain == _CHAT)
        return self.MORE

    def _choice(self, t_ns: int, choice: Any, data: str) -> int:
        """One choice's token; returns _CHAT or _COMPLETION for a plain token event (no role,
        no finish_reason: what a template may stand for), else 0."""
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
            if self._texts is not None:
                self._texts.append(text)
        if text and self._first_content_ns is None:
            self._first_content_ns = t_ns
        reason = choice.get("finish_reason")
        if reason:
            self.r.finish_reason = str(reason)
            return 0
        if isinstance(delta, dict):
            return 0 if "role" in delta else _CHAT
        return _COMPLETION

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
        texts = self._texts
        if texts is not None and outcome is Outcome.OK:  # only a whole answer is compared
            r.token_fps = [token_fp(t) for t in texts]
            r.output_fp = output_fp(texts)
            if self._keep_text:
                r.answer_text = capped_answer("".join(texts))
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
