"""What a client sent, checked, and what one routed request carries through its attempts.

``parse_body``: the JSON body as the gateway requires it (an object, ``stream`` a boolean, token
counts positive integers, nested at most MAX_JSON_DEPTH deep), a RequestError naming the field
otherwise. ``RequestContext``: everything the attempts need about one request, decided once
before the first send (gateway/attempts.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.limits import json_depth
from gateway.routing import Decision, RequestError
from streaming.trace_context import trace_ids

_TRACEPARENT_RE = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One routed request: what goes to the variant and what its samples say."""

    api_path: str  # /v1/chat/completions or /v1/completions, after any route prefix
    request: dict[str, Any]  # the parsed body; each attempt sets its variant's model name
    decision: Decision
    user_id: str  # "" when the request named no user
    request_id: str  # the gateway's own id (X-Request-Id)
    traceparent: str
    trace_id: str
    max_tokens: int  # 0: not given
    forwarded: dict[str, str]  # the client headers passed on (ABPLAT_GATEWAY_FORWARD_HEADERS)
    accept: str
    # what the shadow sampling hashes (fidelity.shadow.sampled): the client's own X-Request-Id
    # when it sent one (its retries carry it again), else request_id
    sample_key: str = ""


def estimate_prompt_tokens(request: dict) -> int:
    """The prompt's length when the variant reported no usage: 4 UTF-8 bytes a token (the
    simulator's default tokenizer, close to English text on real ones); the recorder flags it
    as an estimate."""
    size = 0
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        size = len(prompt.encode())
    elif isinstance(prompt, list):
        size = sum(len(p.encode()) for p in prompt if isinstance(p, str))
    messages = request.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                size += len(content.encode())
            elif isinstance(content, list):  # content parts: the text ones
                size += sum(len(str(c.get("text", "")).encode()) for c in content if isinstance(c, dict))
    return max(1, (size + 3) // 4)


MAX_JSON_DEPTH = 64  # objects and arrays in one another; a tool's JSON schema is well within


def parse_body(raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise RequestError(400, f"body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):
        raise RequestError(400, "body: not valid JSON") from None
    if not isinstance(obj, dict):
        raise RequestError(400, "body: must be a JSON object")
    # Fewer brackets than the limit cannot nest deeper than it (the usual body: no walk at all).
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    if deep and json_depth(obj, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise RequestError(400, f"body: nested deeper than {MAX_JSON_DEPTH} levels")
    stream = obj.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(400, "stream: must be true or false", param="stream")
    for name in ("max_tokens", "max_completion_tokens"):
        value = obj.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RequestError(400, f"{name}: must be a positive integer", param=name)
    return obj


def traceparent_for(raw: bytes | None, request_id: str) -> tuple[str, str]:
    """The client's W3C traceparent when valid, else one derived from the request id."""
    if raw is not None:
        value = raw.decode("latin-1").strip().lower()
        if _TRACEPARENT_RE.match(value):
            return value, value[3:35]
    trace_id, span_id = trace_ids(request_id)
    return f"00-{trace_id}-{span_id}-01", trace_id


MAX_CLIENT_ID_CHARS = 256


def sample_key_for(raw: bytes | None, request_id: str) -> str:
    """The client's X-Request-Id when it is printable text of at most MAX_CLIENT_ID_CHARS, else
    the gateway's own request id."""
    if raw:
        value = raw.decode("latin-1").strip()
        if value and len(value) <= MAX_CLIENT_ID_CHARS and value.isprintable():
            return value
    return request_id
