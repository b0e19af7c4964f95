"""The one HTTP wrapper for variant endpoints: stream one request, measure it exactly.

One pooled ``httpx.AsyncClient`` per variant. The clock (``time.perf_counter_ns``, Linux
CLOCK_MONOTONIC) starts just before the request is handed to httpx, which opens or reuses a
connection and writes it; the body is read as raw bytes and the clock is read as soon as each
chunk arrives, before any parsing, so parse cost never leaks into the timings.

Every phase has its own deadline (connect, response headers, first content token, stall between
events, total), enforced by one ``asyncio.timeout`` rescheduled as the stream advances, so no
request can hang a worker. Every way a request can end maps to a distinct ``Outcome``.

Egress (``allow``, streaming/egress.py): with an allowlist, every new connection resolves the
variant's host itself, checks every address it got, and dials only those checked addresses
(the lean path passes them to h1; httpx gets a network backend that does the same), so the
name is resolved once per connection and cannot be rebound between the check and the
connect. TLS still verifies the certificate against the URL's host name (SNI), and HTTP/2
still negotiates as before. A refused connection is our side's decision: CLIENT_ERROR.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import httpcore
import httpx

from streaming.egress import (
    Allowlist,
    EgressError,
    EgressRefused,
    allowed_addresses,
    allowed_addresses_sync,
    split_url,
)
from streaming.h1 import Pool, request_bytes
from streaming.pacing import pacer_for
from streaming.result import Outcome, StreamCancelled, StreamResult
from streaming.sse import SSEEvent, SSEParser
from streaming.timed_exchange import TimedExchange
from streaming.timing import StreamProtocolError, StreamTimer

APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# json.dumps(body, separators=(",", ":")), without building an encoder per request
_ENCODE_JSON = json.JSONEncoder(separators=(",", ":")).encode
TRANSPORTS = ("auto", "h1", "httpx")
_ERROR_BODY_LIMIT = 2048


@dataclasses.dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds. headers/first_token/total count from the start of the request; stall is the
    longest gap allowed between two events once the first content token has arrived."""

    connect_s: float = 5.0
    headers_s: float = 30.0
    first_token_s: float = 60.0
    stall_s: float = 30.0
    total_s: float = 600.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Timeouts.{f.name}={v!r}: must be a positive number of seconds")


def trace_ids(request_id: str) -> tuple[str, str]:
    """W3C trace-id (32 hex) and parent span-id (16 hex), derived from the request id so a
    replayed run sends the same traceparent and the join with server logs is reproducible."""
    h = hashlib.sha256(b"abplat-trace-v1:" + request_id.encode()).hexdigest()
    trace_id, span_id = h[:32], h[32:48]
    # All-zero ids are invalid in W3C trace context; vanishingly unlikely, but never send one.
    if trace_id == "0" * 32:
        trace_id = "0" * 31 + "1"
    if span_id == "0" * 16:
        span_id = "0" * 15 + "1"
    return trace_id, span_id


class VariantClient:
    def __init__(
        self,
        endpoint: str,
        model: str,
        api: str = "chat",
        *,
        http2: bool = False,
        timeouts: Timeouts | None = None,
        max_connections: int = 4096,
        headers: Mapping[str, str] | None = None,
        transport: str = "auto",
        verify: bool | str = True,
        allow: Allowlist | None = None,
    ) -> None:
        """transport: "auto" streams plain-http HTTP/1.1 variants on the lean asyncio path
        (h1.py) and HTTP/2 or TLS variants on httpx; "httpx" forces httpx (the baseline the
        benchmark compares against); "h1" insists on the lean path.

        verify (TLS variants): True checks the server against the system trust store
        (OpenSSL's default paths, so a company CA installed on the worker host is trusted, and
        SSL_CERT_FILE / SSL_CERT_DIR are honoured); a path trusts exactly the CAs in that PEM
        bundle (variants behind a private CA; ABPLAT_VARIANT_CA_BUNDLE for the replay);
        False checks nothing and is for tests only.

        allow: the variant allowlist every new connection is checked against after name
        resolution (None: no egress policy, for benchmarks and tests of the client itself).
        headers: sent with every request (the variant's Authorization); never logged."""
        try:
            split_url(endpoint)  # http(s) only, and no credentials in it
        except EgressError as exc:
            # Not the URL itself in the message: it may carry a password.
            raise ValueError(f"endpoint: {exc}") from None
        if api not in APIS:
            raise ValueError(f"api {api!r}: must be one of {sorted(APIS)}")
        if not model:
            raise ValueError("model: must be a non-empty model name")
        self.endpoint = endpoint.rstrip("/")
        # Variants store the OpenAI-style base URL (".../v1"); the API paths carry /v1 themselves.
        base = self.endpoint[:-3] if self.endpoint.endswith("/v1") else self.endpoint
        self.model = model
        self.api = api
        self.http2 = http2
        self.timeouts = timeouts or Timeouts()
        self._path = APIS[api]
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: must be one of {TRANSPORTS}")
        lean_ok = base.startswith("http://") and not http2
        if transport == "h1" and not lean_ok:
            raise ValueError("transport 'h1': only for plain http:// variants without http2")
        self.transport = "h1" if lean_ok and transport != "httpx" else "httpx"
        self._default_headers = _checked_headers(headers)
        url = urllib.parse.urlsplit(base)
        self._host = url.hostname or ""
        # Built from host and port, never the netloc: nothing but the host reaches Host.
        self._host_header = (f"[{self._host}]" if ":" in self._host else self._host) + (
            f":{url.port}" if url.port else ""
        )
        self._allow = allow
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._base_path = url.path.rstrip("/")
        # The lean path's keep-alive connections (streaming/h1.py): the core the gateway shares.
        self._pool = Pool(self._host, self._port, allow=allow)
        self._client: httpx.AsyncClient | None = None
        tls = tls_verify(verify)
        if self.transport == "httpx":
            self._client = self._httpx_client(base, http2, max_connections, self._default_headers, tls)

    def _httpx_client(
        self,
        base: str,
        http2: bool,
        max_connections: int,
        headers: Mapping[str, str] | None,
        verify: bool | ssl.SSLContext,
    ) -> httpx.AsyncClient:
        t = self.timeouts
        # Plain-http HTTP/2 needs prior knowledge (h2c): disable HTTP/1.1 so httpx does not
        # silently fall back. Over TLS, ALPN negotiates h2 with http1 still allowed.
        http1 = not (http2 and base.startswith("http://"))
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=30.0,
        )
        transport = None
        if self._allow is not None:
            transport = AllowedTransport(self._allow, verify=verify, http1=http1, http2=http2, limits=limits)
        return httpx.AsyncClient(
            base_url=base,
            verify=verify,
            http1=http1,
            http2=http2,
            # Only connect is enforced by httpx; the later phases by our own deadlines, which
            # know which phase they are in. pool=None: the pool is sized so nobody waits.
            timeout=httpx.Timeout(connect=t.connect_s, read=None, write=t.headers_s, pool=None),
            limits=limits,
            transport=transport,
            headers=dict(headers or {}),
            trust_env=False,  # never route measurements through an env-configured proxy
        )

    def h1_connections(self) -> list:
        """The lean path's connections open now (streaming/h1.py), e.g. to read whether their
        reads carry kernel stamps."""
        return self._pool.connections()

    async def aclose(self) -> None:
        self._pool.close()
        if self._client is not None:
            await self._client.aclose()

    async def __aenter__(self) -> VariantClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def build_body(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        max_tokens: int,
        extra: Mapping[str, Any] | None = None,
    ) -> bytes:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: must be a positive integer")
        body: dict[str, Any] = {"model": self.model}
        if self.api == "chat":
            if isinstance(prompt, str):
                body["messages"] = [{"role": "user", "content": prompt}]
            elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
                body["messages"] = [dict(m) for m in prompt]
            else:
                raise ValueError("prompt: chat takes a string or a list of message objects")
        else:
            if not isinstance(prompt, str):
                raise ValueError("prompt: completions takes a string")
            body["prompt"] = prompt
        body["max_tokens"] = max_tokens
        if extra:
            for key in ("stream", "stream_options", "model"):
                if key in extra:
                    raise ValueError(f"extra[{key!r}]: set by the client, not by the caller")
            body.update(extra)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return _ENCODE_JSON(body).encode()

    async def stream(
        self,
        request_id: str,
        prompt: str | Sequence[Mapping[str, Any]],
        max_tokens: int,
        extra: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> StreamResult:
        """Send one streaming request and return what it measured; never raises for what the
        server or network did (that is the outcome). Cancellation raises StreamCancelled."""
        if not request_id:
            raise ValueError("request_id: must be a non-empty string")
        content = self.build_body(prompt, max_tokens, extra)
        trace_id, span_id = trace_ids(request_id)
        traceparent = f"00-{trace_id}-{span_id}-01"
        req_headers = {
            "content-type": "application/json",
            "accept": "text/event-stream",
            "x-request-id": request_id,
            "traceparent": traceparent,
        }
        if headers:
            for name, value in headers.items():
                if any(c in name or c in value for c in "\r\n\0"):
                    raise ValueError(f"headers[{name!r}]: name and value must not contain CR, LF or NUL")
            req_headers.update(headers)
        result = StreamResult(request_id=request_id, traceparent=traceparent, trace_id=trace_id)
        if self._client is None:
            all_headers = {**self._default_headers, **req_headers}
            return await self._stream_h1(content, all_headers, result)
        return await self._stream_httpx(content, req_headers, result)

    # the lean HTTP/1.1 path (h1.py) ------------------------------------------------------------
    async def _stream_h1(self, content: bytes, headers: dict[str, str], result: StreamResult) -> StreamResult:
        request = request_bytes(self._host_header, self._base_path + self._path, headers, content)
        loop = asyncio.get_running_loop()
        t = self.timeouts
        timer = StreamTimer(0, result)
        conn = self._pool.take(loop)
        if conn is None:
            # A new connection waits its turn in a start burst (pacing.py), before its clock
            # starts: the replay records the wait as schedule lag.
            try:
                await pacer_for(loop).take()
            except asyncio.CancelledError:
                timer.start_ns = result.start_ns = time.perf_counter_ns()
                raise StreamCancelled(
                    timer.finish(timer.start_ns, Outcome.CANCELLED, "cancelled by caller")
                ) from None
            conn = self._pool.take(loop)  # one may have come back meanwhile
        # The clock starts here, before a connection is taken or opened (as with httpx).
        start = time.perf_counter_ns()
        timer.start_ns = start
        result.start_ns = start
        try:
            if conn is None:
                budget = min(t.connect_s, t.headers_s, t.total_s)
                try:
                    async with asyncio.timeout(budget):
                        conn, c0, c1 = await self._pool.open()
                except EgressRefused as exc:
                    return timer.finish(
                        time.perf_counter_ns(), Outcome.CLIENT_ERROR, f"egress refused: {exc}"
                    )
                except TimeoutError:
                    return timer.finish(
                        time.perf_counter_ns(),
                        Outcome.CONNECT_TIMEOUT,
                        f"connect timeout after {budget}s to {self._host_header}",
                    )
                except OSError as exc:
                    return timer.finish(time.perf_counter_ns(), Outcome.CONNECT_ERROR, _msg(exc))
                timer.connected(c0, c1)
        except asyncio.CancelledError:
            res = timer.finish(time.perf_counter_ns(), Outcome.CANCELLED, "cancelled by caller")
            raise StreamCancelled(res) from None
        ex = TimedExchange(timer, t, loop)
        conn.start(ex, request, start)
        try:
            return await ex.future
        except asyncio.CancelledError:
            ex.end(time.perf_counter_ns(), Outcome.CANCELLED, "cancelled by caller")
            assert ex.result is not None
            raise StreamCancelled(ex.result) from None

    # the httpx path (HTTP/2, TLS, or transport="httpx") -------------------------------------
    async def _stream_httpx(
        self, content: bytes, req_headers: dict[str, str], result: StreamResult
    ) -> StreamResult:
        assert self._client is not None
        conn: dict[str, int] = {}

        async def trace(name: str, info: Mapping[str, Any]) -> None:
            if name == "connection.connect_tcp.started":
                conn["started"] = time.perf_counter_ns()
            elif name == "connection.connect_tcp.complete":
                conn["complete"] = time.perf_counter_ns()

        request = self._client.build_request(
            "POST", self._path, content=content, headers=req_headers, extensions={"trace": trace}
        )
        loop = asyncio.get_running_loop()
        t = self.timeouts
        timer = StreamTimer(0, result)
        state = _State()
        resp: httpx.Response | None = None
        # The clock starts here, just before httpx acquires a connection and writes.
        start = time.perf_counter_ns()
        t0 = loop.time()
        timer.start_ns = start
        result.start_ns = start
        state.total_deadline = t0 + t.total_s
        try:
            async with asyncio.timeout_at(min(t0 + t.headers_s, state.total_deadline)) as cm:
                resp = await self._client.send(request, stream=True)
                now = time.perf_counter_ns()
                timer.headers(now, resp.status_code)
                if "complete" in conn:
                    timer.connected(conn["started"], conn["complete"])
                status = resp.status_code
                if status >= 400:
                    state.phase = "error body"
                    detail = await _read_some(resp)
                    outcome = Outcome.HTTP_4XX if status < 500 else Outcome.HTTP_5XX
                    return timer.finish(time.perf_counter_ns(), outcome, f"HTTP {status}: {detail}")
                ctype = resp.headers.get("content-type", "")
                if status != 200 or not ctype.startswith("text/event-stream"):
                    return timer.finish(
                        now,
                        Outcome.MALFORMED,
                        f"expected HTTP 200 text/event-stream, got {status} {ctype!r}",
                    )
                state.phase = "first token"
                cm.reschedule(min(t0 + t.first_token_s, state.total_deadline))
                return await self._read_events(resp, timer, cm, loop, state)
        except TimeoutError:
            now = time.perf_counter_ns()
            if loop.time() >= state.total_deadline - 1e-3:
                return timer.finish(now, Outcome.TOTAL_TIMEOUT, f"total timeout {t.total_s}s")
            outcome, limit = {
                "headers": (Outcome.HEADERS_TIMEOUT, t.headers_s),
                "error body": (Outcome.HEADERS_TIMEOUT, t.headers_s),
                "first token": (Outcome.FIRST_TOKEN_TIMEOUT, t.first_token_s),
                "stall": (Outcome.STALL, t.stall_s),
            }[state.phase]
            return timer.finish(now, outcome, f"{state.phase} timeout after {limit}s")
        except EgressRefused as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.CLIENT_ERROR, f"egress refused: {exc}")
        except httpx.ConnectTimeout as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.CONNECT_TIMEOUT, _msg(exc))
        except httpx.ConnectError as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.CONNECT_ERROR, _msg(exc))
        except StreamProtocolError as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.MALFORMED, str(exc))
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.DISCONNECT, _msg(exc))
        except httpx.TimeoutException as exc:  # write/pool timeouts: the request never got out
            return timer.finish(time.perf_counter_ns(), Outcome.HEADERS_TIMEOUT, _msg(exc))
        except asyncio.CancelledError:
            res = timer.finish(time.perf_counter_ns(), Outcome.CANCELLED, "cancelled by caller")
            raise StreamCancelled(res) from None
        finally:
            if resp is not None:
                # Closing an unfinished stream drops the connection, so the server sees the
                # client go away (vLLM aborts the request) instead of streaming into the void.
                await resp.aclose()

    async def _read_events(
        self,
        resp: httpx.Response,
        timer: StreamTimer,
        cm: asyncio.Timeout,
        loop: asyncio.AbstractEventLoop,
        state: _State,
    ) -> StreamResult:
        parser = SSEParser()
        stall_s = self.timeouts.stall_s
        total = state.total_deadline
        finished: StreamResult | None = None
        async for chunk in resp.aiter_raw():
            if finished is not None:
                # After [DONE]: read the chunked terminator (still under the stall deadline)
                # so httpx can reuse the connection; closing a half-read response drops it.
                continue
            now = time.perf_counter_ns()  # first thing: the arrival time of these bytes
            timer.body_bytes(now)
            events = parser.feed(chunk)
            if events:
                done = self._handle(events, now, timer)
                if done is not None:
                    if done.outcome is not Outcome.OK:
                        return done
                    finished = done
                elif timer.first_content_seen:
                    state.phase = "stall"
                    cm.reschedule(min(loop.time() + stall_s, total))
        if finished is not None:
            return finished
        now = time.perf_counter_ns()
        done = self._handle(parser.finish(), now, timer)
        if done is not None:
            return done
        return timer.finish(now, Outcome.DISCONNECT, "stream ended before [DONE]")

    @staticmethod
    def _handle(events: list[SSEEvent], now: int, timer: StreamTimer) -> StreamResult | None:
        for ev in events:
            status = timer.event(now, ev.data)
            if status == StreamTimer.DONE:
                return timer.finish(now, Outcome.OK)
            if status == StreamTimer.ENGINE_ERROR:
                return timer.finish(now, Outcome.ENGINE_ERROR)
        return None


@dataclasses.dataclass(slots=True)
class _State:
    phase: str = "headers"
    total_deadline: float = 0.0


async def _read_some(resp: httpx.Response) -> str:
    buf = b""
    async for chunk in resp.aiter_raw():
        buf += chunk
        if len(buf) >= _ERROR_BODY_LIMIT:
            break
    return buf[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()


def _checked_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(headers or {})
    for name, value in out.items():
        if any(c in name or c in value for c in "\r\n\0"):
            # The name only: the value may be a credential.
            raise ValueError(f"headers[{name!r}]: name and value must not contain CR, LF or NUL")
    return out


# egress: resolve once, check every address, dial only those ----------------------------------
class _AllowedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's asyncio backend, dialling only addresses the allowlist accepts. httpcore
    hands it the URL's host; TLS is started afterwards with that host as SNI and for the
    certificate check, so pinning the address changes nothing the server sees."""

    def __init__(self, allow: Allowlist) -> None:
        self._allow = allow
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                addresses = await allowed_addresses(host, port, self._allow)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host!r} took over {timeout}s") from None
        except OSError as exc:
            raise httpcore.ConnectError(_msg(exc)) from None
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise EgressRefused("unix sockets are not variant endpoints")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# (host, port) -> the addresses that may be dialled, in order, resolved once; EgressRefused,
# or the OSError of a failed lookup.
AddressCheck = Callable[[str, int], Sequence[str]]


class _AllowedSyncBackend(httpcore.NetworkBackend):
    """The blocking twin of _AllowedBackend (the preflight's httpx.Client). ``addresses``
    replaces the allowlist's rule (allowed_addresses_sync) with another resolve-and-check step
    (the rollout webhooks' rule), dialled the same way."""

    def __init__(self, allow: Allowlist | None, addresses: AddressCheck | None = None) -> None:
        if addresses is None:
            if allow is None:
                raise ValueError("_AllowedSyncBackend: give an allowlist or an address check")
            addresses = functools.partial(allowed_addresses_sync, allow=allow)
        self._addresses = addresses
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = self._addresses(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(_msg(exc)) from None
        error: Exception | None = None
        for address in addresses:
            try:
                return self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None
        raise error

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise EgressRefused("unix sockets are not variant endpoints")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# httpx's own default pool size, for the clients that do not size theirs.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


def _pool_options(verify: bool | ssl.SSLContext, http1: bool, http2: bool, limits: httpx.Limits) -> dict:
    return {
        "ssl_context": httpx.create_ssl_context(verify=verify, trust_env=False),
        "max_connections": limits.max_connections,
        "max_keepalive_connections": limits.max_keepalive_connections,
        "keepalive_expiry": limits.keepalive_expiry,
        "http1": http1,
        "http2": http2,
    }


class AllowedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport on a pool whose connections pass the egress check. httpcore's pool
    takes a network backend; httpx's transport does not pass one on, so the pool it built is
    replaced by the same pool with ours (everything else, errors included, stays httpx's)."""

    def __init__(self, allow: Allowlist, *, verify: bool | ssl.SSLContext, http1: bool = True,
                 http2: bool = False, limits: httpx.Limits = DEFAULT_LIMITS) -> None:  # fmt: skip
        super().__init__(verify=verify, http1=http1, http2=http2, limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            **_pool_options(verify, http1, http2, limits), network_backend=_AllowedBackend(allow)
        )


class AllowedSyncTransport(httpx.HTTPTransport):
    """The blocking twin of AllowedTransport. ``addresses``: another resolve-and-check step
    than the allowlist's (``allow`` is then None), e.g. the rollout webhooks' rule."""

    def __init__(self, allow: Allowlist | None, *, verify: bool | ssl.SSLContext, http1: bool = True,
                 http2: bool = False, limits: httpx.Limits = DEFAULT_LIMITS,
                 addresses: AddressCheck | None = None) -> None:  # fmt: skip
        super().__init__(verify=verify, http1=http1, http2=http2, limits=limits, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            **_pool_options(verify, http1, http2, limits),
            network_backend=_AllowedSyncBackend(allow, addresses),
        )


def tls_verify(verify: bool | str) -> bool | ssl.SSLContext:
    """The ``verify`` argument for httpx. True becomes a context on the system trust store:
    httpx's own default is certifi's bundle, and with ``trust_env=False`` (set so no proxy
    from the environment sits in a measurement) it would also ignore SSL_CERT_FILE. A CA
    bundle path becomes an SSLContext here, since httpx deprecates ``verify=<path>``, and so
    a missing or unreadable bundle fails when the client is built, naming the path, not as a
    CONNECT_ERROR on every request."""
    if verify is True:
        return ssl.create_default_context()
    if verify is False:
        return False
    if not isinstance(verify, str) or not verify:
        raise ValueError(f"verify={verify!r}: must be True, False or the path of a CA bundle (PEM)")
    if not os.path.isfile(verify):
        raise ValueError(f"verify={verify!r}: no such CA bundle file")
    try:
        return ssl.create_default_context(cafile=verify)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"verify={verify!r}: not a readable PEM CA bundle ({exc})") from None


def _msg(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
