"""The gateway's side of ASGI: the message types, and a whole JSON response (errors and the
small answers the gateway gives itself) in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def error_body(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    return DUMPS({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    allow: bytes | None = None,
    retry_after: bytes | None = None,
    variant: str = "",
    request_id: str = "",
    traceparent: str = "",
) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if allow:
        headers.append((b"allow", allow))
    if retry_after:
        headers.append((b"retry-after", retry_after))
    if variant:
        headers.append((b"x-abplat-variant", variant.encode()))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    if traceparent:
        headers.append((b"traceparent", traceparent.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
