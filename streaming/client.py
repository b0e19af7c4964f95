"""The replay's client of a variant: stream one request, measure it exactly.

Two stacks carry the bytes; one reader (streaming/response.py) says what they mean:

- HTTP/1.1, plain or TLS: the lean asyncio core (streaming/h1.py), the one the live gateway
  forwards on. Its keep-alive connections stamp every read on arrival (the kernel's receive
  stamp on plain http, the clock read over TLS) and parse it in the read callback.
- HTTP/2 (or ``transport="httpx"``, the baseline the benchmarks compare against): one pooled
  ``httpx.AsyncClient``; the clock is read as soon as each chunk arrives, before any parsing.

The clock (``time.perf_counter_ns``, Linux CLOCK_MONOTONIC) starts just before a connection is
taken or opened and the request written. Every phase has its own deadline (connect, response
headers, first content token, stall between events, total), so no request can hang a worker,
and every way a request can end maps to a distinct ``Outcome``.

Egress (``allow``, streaming/egress.py): with an allowlist, every new connection resolves the
variant's host itself, checks every address it got and dials only those (the core's pool; on
httpx, streaming/transports.py), so the name cannot be rebound between the check and the
connect. TLS still verifies the certificate against the URL's host name (SNI). A refused
connection is our side's decision: CLIENT_ERROR.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from streaming.egress import Allowlist, EgressRefused
from streaming.endpoint import Endpoint
from streaming.h1 import Pool, request_bytes
from streaming.pacing import pacer_for
from streaming.response import ResponseReader, timeout_outcome
from streaming.result import Outcome, StreamCancelled, StreamResult
from streaming.timed_exchange import TimedExchange
from streaming.timing import StreamTimer
from streaming.tls import tls_context, tls_verify
from streaming.trace_context import trace_ids
from streaming.transports import AllowedTransport, error_text

APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# json.dumps(body, separators=(",", ":")), without building an encoder per request
_ENCODE_JSON = json.JSONEncoder(separators=(",", ":")).encode
TRANSPORTS = ("auto", "h1", "httpx")


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
        fingerprint: bool = False,
        keep_text: bool = False,
    ) -> None:
        """transport: "auto" streams HTTP/1.1 variants, plain or TLS, on the lean asyncio core
        (h1.py, as the gateway does) and HTTP/2 variants on httpx; "httpx" forces httpx (the
        baseline the benchmark compares against); "h1" insists on the core.

        verify (TLS variants): True checks the server against the system trust store
        (OpenSSL's default paths, so a company CA installed on the worker host is trusted, and
        SSL_CERT_FILE / SSL_CERT_DIR are honoured); a path trusts exactly the CAs in that PEM
        bundle (variants behind a private CA; ABPLAT_VARIANT_CA_BUNDLE for the replay);
        False checks nothing and is for tests only.

        allow: the variant allowlist every new connection is checked against after name
        resolution (None: no egress policy, for benchmarks and tests of the client itself).
        headers: sent with every request (the variant's Authorization); never logged.
        fingerprint: each answer's fingerprints go into its StreamResult (output_fp, token_fps:
        fidelity/fingerprints.py), for a mirror replay that compares the variants' answers.
        keep_text (with fingerprint): each answer's text too, capped (StreamResult.answer_text),
        for an experiment whose document allows storing answers (fidelity.store_answers)."""
        ep = Endpoint.parse(endpoint)
        if api not in APIS:
            raise ValueError(f"api {api!r}: must be one of {sorted(APIS)}")
        if not model:
            raise ValueError("model: must be a non-empty model name")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: must be one of {TRANSPORTS}")
        if transport == "h1" and http2:
            raise ValueError("transport 'h1': only for HTTP/1.1 variants (http2 is set)")
        if keep_text and not fingerprint:
            raise ValueError(
                "keep_text: answers' texts are kept only with their fingerprints (fingerprint=True)"
            )
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self.api = api
        self.http2 = http2
        self.fingerprint = fingerprint
        self.keep_text = keep_text
        self.timeouts = timeouts or Timeouts()
        self._path = APIS[api]
        self.transport = "h1" if not http2 and transport != "httpx" else "httpx"
        self._default_headers = _checked_headers(headers)
        self._ep = ep
        self._allow = allow
        tls = tls_verify(verify)  # a bad CA bundle fails here, naming its path
        self._client: httpx.AsyncClient | None = None
        # The core's keep-alive connections (streaming/h1.py), the gateway's too.
        self._pool = Pool(ep.host, ep.port, allow=allow, ssl_context=tls_context(tls) if ep.tls else None)
        if self.transport == "httpx":
            self._client = self._httpx_client(ep.root, http2, max_connections, self._default_headers, tls)

    def _httpx_client(
        self,
        base: str,
        http2: bool,
        max_connections: int,
        headers: Mapping[str, str] | None,
        verify: Any,
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
            # Only connect is enforced by httpx; the later phases by the reader's deadlines,
            # which know which phase they are in. pool=None: the pool is sized so nobody waits.
            timeout=httpx.Timeout(connect=t.connect_s, read=None, write=t.headers_s, pool=None),
            limits=limits,
            transport=transport,
            headers=dict(headers or {}),
            trust_env=False,  # never route measurements through an env-configured proxy
        )

    def h1_connections(self) -> list:
        """The core's connections open now (streaming/h1.py), e.g. to read whether their
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
            req_headers.update(_checked_headers(headers))
        result = StreamResult(request_id=request_id, traceparent=traceparent, trace_id=trace_id)
        if self._client is None:
            all_headers = {**self._default_headers, **req_headers}
            return await self._stream_h1(content, all_headers, result)
        return await self._stream_httpx(content, req_headers, result)

    # HTTP/1.1 on the core (h1.py) ----------------------------------------------------------------
    async def _stream_h1(self, content: bytes, headers: dict[str, str], result: StreamResult) -> StreamResult:
        ep = self._ep
        request = request_bytes(ep.host_header, ep.base_path + self._path, headers, content)
        loop = asyncio.get_running_loop()
        t = self.timeouts
        timer = StreamTimer(0, result, fingerprint=self.fingerprint, keep_text=self.keep_text)
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
                        f"connect timeout after {budget}s to {ep.host_header}",
                    )
                except OSError as exc:
                    return timer.finish(time.perf_counter_ns(), Outcome.CONNECT_ERROR, error_text(exc))
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

    # HTTP/2 (or transport="httpx") -----------------------------------------------------------------
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
        timer = StreamTimer(0, result, fingerprint=self.fingerprint, keep_text=self.keep_text)
        reader = ResponseReader(timer, self.timeouts)
        resp: httpx.Response | None = None
        # The clock starts here, just before httpx acquires a connection and writes.
        start = time.perf_counter_ns()
        timer.start_ns = start
        result.start_ns = start

        def due() -> float:  # the reader's deadline on the loop's clock
            return loop.time() + (reader.deadline_ns() - time.perf_counter_ns()) / 1e9

        ended_at = 0  # when [DONE] came: the record ends there, whatever the drain after it does
        try:
            async with asyncio.timeout_at(due()) as cm:
                resp = await self._client.send(request, stream=True)
                now = time.perf_counter_ns()
                if "complete" in conn:
                    timer.connected(conn["started"], conn["complete"])
                if reader.head(now, resp.status_code, resp.headers.get("content-type", "")):
                    return reader.finish(now)
                cm.reschedule(due())
                async for chunk in resp.aiter_raw():
                    if ended_at:
                        # After [DONE]: read the chunked terminator (under the stall deadline)
                        # so httpx can reuse the connection; closing a half-read one drops it.
                        continue
                    now = time.perf_counter_ns()  # first thing: the arrival time of these bytes
                    if reader.body(now, chunk):
                        if reader.outcome is not Outcome.OK:
                            return reader.finish(now)
                        ended_at = now
                    else:
                        cm.reschedule(due())
                if ended_at:
                    return reader.finish(ended_at)
                now = time.perf_counter_ns()
                reader.end(now)
                return reader.finish(now)
        except TimeoutError:
            now = ended_at or time.perf_counter_ns()
            if not reader.timed_out(now):  # fired a hair early on the loop's clock
                reader.decide(*timeout_outcome(reader.phase, reader.timeouts))
            return reader.finish(now)
        except EgressRefused as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.CLIENT_ERROR, f"egress refused: {exc}")
        except httpx.ConnectTimeout as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.CONNECT_TIMEOUT, error_text(exc))
        except httpx.ConnectError as exc:
            return timer.finish(time.perf_counter_ns(), Outcome.CONNECT_ERROR, error_text(exc))
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            if ended_at:  # the connection went after [DONE], with the chunked terminator
                return reader.finish(ended_at)
            return timer.finish(time.perf_counter_ns(), Outcome.DISCONNECT, error_text(exc))
        except httpx.TimeoutException as exc:  # write/pool timeouts: the request never got out
            return timer.finish(time.perf_counter_ns(), Outcome.HEADERS_TIMEOUT, error_text(exc))
        except asyncio.CancelledError:
            res = timer.finish(time.perf_counter_ns(), Outcome.CANCELLED, "cancelled by caller")
            raise StreamCancelled(res) from None
        finally:
            if resp is not None:
                # Closing an unfinished stream drops the connection, so the server sees the
                # client go away (vLLM aborts the request) instead of streaming into the void.
                await resp.aclose()


def _checked_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(headers or {})
    for name, value in out.items():
        if any(c in name or c in value for c in "\r\n\0"):
            # The name only: the value may be a credential.
            raise ValueError(f"headers[{name!r}]: name and value must not contain CR, LF or NUL")
    return out
