"""The gateway and the web app in one process: ``manage.py gateway --with-web``.

On the embedded default the sample store is chDB, which one process opens at a time: with the
gateway in one process and the web app in another, the dashboard could not read what the
gateway records. ``GatewayAndWeb`` serves both from one ASGI app: the gateway's API paths
(``/v1/...`` and the configured route prefixes' ``/PREFIX/v1/...``) go to the gateway, every
other path to Django (admin, API, dashboards, static files through WhiteNoise), and the
lifespan (start the router, the variants, the recorder; drain and close them) to the gateway
(Django's ASGI handler takes HTTP only).

Django's ASGI handler reads a request's whole body (to memory, then a temporary file) before
any middleware, view, CSRF check or upload cap runs. Under gunicorn (WSGI) nothing is read until
a view asks, and the views cap what they read; here the body is capped on its way in instead,
with the same numbers (``web_body_rule``): a declared Content-Length over the cap is a 413
before a byte of the body is read, a chunked body is counted as it arrives and cut off with a
413 at the cap, and a body other than a trace upload must arrive within the gateway's body
deadline (408), as the gateway's own do.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

from gateway.app import Gateway
from gateway.http import Receive, Scope, Send


@functools.cache
def _upload_paths() -> frozenset[str]:
    from django.urls import reverse

    return frozenset({reverse("trace-list"), reverse("admin:traces_trace_upload")})


@dataclass(frozen=True)
class BodyRule:
    max_bytes: int
    timeout_s: float | None  # the whole body within this (None: no deadline of ours)


def web_body_rule(path: str) -> BodyRule:
    """What the web app takes on ``path``, as under gunicorn: a trace upload up to the trace cap
    (traces/uploads.py, ABPLAT_TRACE_MAX_BYTES) at the client's pace (a large trace over a slow
    link takes what it takes), anything else up to Django's DATA_UPLOAD_MAX_MEMORY_SIZE (what a
    view reading request.body or a form accepts) within the gateway's body deadline
    (ABPLAT_GATEWAY_BODY_TIMEOUT_S)."""
    from django.conf import settings

    from traces import uploads

    if path in _upload_paths() or settings.DATA_UPLOAD_MAX_MEMORY_SIZE is None:
        return BodyRule(uploads.max_body_bytes(), None)
    return BodyRule(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, settings.GATEWAY_BODY_TIMEOUT_S)


class GatewayAndWeb:
    def __init__(self, gateway: Gateway, web, body_rule: Callable[[str], BodyRule] = web_body_rule) -> None:
        self.gateway = gateway
        self.web = web
        self.body_rule = body_rule
        self._prefixes = tuple(prefix + "/v1/" for prefix, _ in gateway.config.routes.prefixes)

    def is_gateway_path(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or path.startswith(self._prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or self.is_gateway_path(scope.get("path", "")):
            return await self.gateway(scope, receive, send)
        if scope["type"] != "http":
            return await self.web(scope, receive, send)
        return await self._capped_web(scope, receive, send, self.body_rule(scope["path"]))

    async def _capped_web(self, scope: Scope, receive: Receive, send: Send, rule: BodyRule) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > rule.max_bytes:
            return await _refuse(send, 413, f"request body over {rule.max_bytes} bytes")
        loop = asyncio.get_running_loop()
        deadline = None if rule.timeout_s is None else loop.time() + rule.timeout_s
        received = 0
        done = refused = False

        async def capped_receive():
            nonlocal received, done, refused
            if refused:
                return {"type": "http.disconnect"}
            if done:
                return await receive()  # Django waiting for the client to go away
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                message = None
                refusal = 408, f"the request body did not arrive within {rule.timeout_s:g} s"
            else:
                if message["type"] != "http.request":
                    return message
                received += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if received <= rule.max_bytes:
                    return message
                refusal = 413, f"request body over {rule.max_bytes} bytes"
            # Django's handler, reading the body, takes the disconnect as the client's going
            # away and returns without an answer: the refusal is ours.
            refused = True
            await _refuse(send, *refusal)
            return {"type": "http.disconnect"}

        await self.web(scope, capped_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before it gets here
    return None


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps({"detail": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # the rest of the body is not read: the connection ends with the answer
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
