"""The live gateway: a raw ASGI app (uvicorn) in front of the variants.

``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not, also under a
configured path prefix), ``GET /v1/models``, ``GET /healthz``. One request:

1. Check the client: API key (its tenant), the tenant's concurrent requests, body size and
   read deadline, JSON body (nesting depth too), every string in it (gateway/routing.py), the
   tenant's and the user's rate limits.
2. Route: experiment, user, variant (gateway/routing.py on the process's weights router; the
   variant's endpoint, model and secret from gateway/variants.py), only to experiments that run
   and the tenant may reach (ABPLAT_GATEWAY_REACH).
3. Forward: the body with the variant's model name, the variant's Authorization, the request's
   ``X-Request-Id`` and ``traceparent``; the clock starts just before the upstream send, as the
   replay's does (streaming/client.py).
4. If the variant fails before the first byte of its response is forwarded (no connection, no
   headers, a 5xx) and retries are on for the experiment, once more on the control; both
   attempts are recorded. Once a byte is forwarded, never again.
5. Stream back every byte as it came, with ``X-Abplat-Variant``, ``X-Request-Id`` and
   ``traceparent`` added. Each batch of reads is forwarded first and measured after
   (streaming.sse + streaming.timing.StreamTimer on the reads' arrival stamps), so measuring
   never delays a byte. A user who goes away cancels the upstream request.
6. Hand the StreamResult and the gateway's own time before the send (body received ->
   upstream request written: auth, limits, routing, body rewrite) to the recorder, which
   never blocks. Each chunk's arrival-to-forward time is summed in ``forward_ns``.

A stream keeps the variant it started on: the assignment is made once, before the send.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import logging
import math
import re
import ssl
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from gateway.config import GatewayConfig
from gateway.limits import TokenBuckets, json_depth
from gateway.routing import Decision, RequestError, decide, experiment_for, split_path, user_for
from gateway.upstream import Endpoint, Exchange, Pool, UpstreamError
from gateway.variants import Directory, Target
from streaming.client import trace_ids
from streaming.egress import Allowlist
from streaming.result import Outcome, StreamResult
from streaming.sse import SSEParser
from streaming.timing import StreamProtocolError, StreamTimer
from telemetry.metrics import GatewayMeter

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_perf = time.perf_counter_ns
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_TRACEPARENT_RE = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
# Response headers not passed on: hop-by-hop (RFC 9110 7.6.1) and the framing uvicorn redoes.
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                  b"proxy-authenticate", b"proxy-connection", b"x-abplat-variant", b"x-request-id",
                  b"traceparent"})  # fmt: skip
_PARSE_LIMIT = 1 << 20  # a non-streamed body is parsed (for usage) up to this size
_ERROR_BODY_LIMIT = 2048


class Recorder(Protocol):
    def start(self) -> None: ...

    def record(self, result: StreamResult, *, experiment: str, variant: str, user_id: str,
               config_revision: int, sent_unix_ms: float, request_id: str, prompt_tokens: int,
               max_tokens: int, gateway_ms: float, attempt: int = 1) -> None: ...  # fmt: skip

    def close(self, timeout: float = 10.0) -> None: ...


class AssignmentSource(Protocol):
    def assign(self, experiment_key: str, user_id: str) -> Any: ...


def _error_body(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> bytes:  # fmt: skip
    return _DUMPS({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class _Cancelled(Exception):
    """The user went away while the request was in flight."""


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        router: AssignmentSource | Callable[[], AssignmentSource],
        directory: Directory,
        recorder: Recorder,
        allow: Allowlist | None = None,
        ssl_context: ssl.SSLContext | None = None,
        refresh_variants: bool = True,
    ) -> None:
        """router: the weights router, or a callable that returns it (started at lifespan
        startup, in a thread: the first load may wait for the store)."""
        self.config = config
        self._router_factory = router if callable(router) and not hasattr(router, "assign") else None
        self.router: AssignmentSource | None = None if self._router_factory else router  # type: ignore[assignment]
        self.directory = directory
        self.recorder = recorder
        self.allow = allow
        self.ssl_context = ssl_context
        self.refresh_variants = refresh_variants
        self.buckets = TokenBuckets(config.user_rate, config.user_burst) if config.user_rate else None
        self.tenant_buckets = (
            TokenBuckets(config.tenant_rate, config.tenant_burst) if config.tenant_rate else None
        )
        self.tenant_active: Counter[str] = Counter()  # requests in flight per tenant
        self._pools: dict[Endpoint, Pool] = {}
        self.counts: Counter[str] = Counter()  # reasons, outcomes, refusals
        self.active = 0
        self.meter = GatewayMeter()  # the same events as Prometheus metrics (docs/metrics.md)
        # The per-chunk path: arrival from the variant -> handed to the user's socket, summed
        # over every chunk this process forwarded (bench/bench_gateway.py reads it).
        self.forward_ns = 0
        self.forwarded_chunks = 0
        self._started = False

    # lifecycle ------------------------------------------------------------------------------
    def startup(self) -> None:
        """Blocking: router, variants, recorder (call from a thread or before serving)."""
        if self._started:
            return
        if self._router_factory is not None:
            self.router = self._router_factory()
        if self.refresh_variants:
            self.directory.refresh()
            self.directory.start(self.config.variants_refresh_s)
        self.recorder.start()
        # uvicorn skips the lifespan shutdown when it is forced out (a second SIGINT during the
        # drain: "CTRL+C to force quit"); the samples in the recorder's memory would go with the
        # process and its live run would stay open. A second SIGTERM does not force it (uvicorn
        # 0.54 forces on SIGINT only; with --workers the master sends each worker one SIGTERM).
        atexit.register(self._close_at_exit)
        # Everything loaded so far (Django, the router, the variants) lives as long as the
        # process: take it out of the cyclic collector's view, or each full collection walks
        # the whole heap on the event loop (pauses of tens of ms in the middle of streams).
        gc.collect()
        gc.freeze()
        self._started = True

    def shutdown(self) -> None:
        atexit.unregister(self._close_at_exit)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self.directory.stop()
        self.recorder.close()
        self._started = False

    def _close_at_exit(self) -> None:
        if not self._started:
            return
        log.warning("gateway: exiting without the lifespan shutdown (forced); closing the recorder")
        try:
            self.recorder.close()  # writes what it holds (store, else spool) and closes the live run
        except Exception:
            log.exception("gateway: closing the recorder at exit failed")
        self._started = False

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await asyncio.to_thread(self.startup)
                except Exception as exc:
                    log.exception("gateway: startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await asyncio.to_thread(self.shutdown)
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    # ASGI -------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            self.active += 1
            self.meter.entered()
            try:
                await self._http(scope, receive, send)
            finally:
                self.active -= 1
                self.meter.left()
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/healthz":
            if method not in ("GET", "HEAD"):
                return await _respond(send, 405, _error_body(405, "use GET"), allow=b"GET, HEAD")
            return await _respond(send, 200, b'{"status":"ok"}')
        if path == "/v1/models" or (
            path.endswith("/v1/models") and self._is_prefix(path[: -len("/v1/models")])
        ):
            if method != "GET":
                return await _respond(send, 405, _error_body(405, "use GET"), allow=b"GET")
            return await self._models(scope, send)
        try:
            prefix_experiment, api_path = split_path(path, self.config.routes)
        except RequestError as exc:
            return await _respond(send, exc.status, _error_body(exc.status, exc.message, code=exc.code))
        if method != "POST":
            self.meter.refused(405)
            return await _respond(send, 405, _error_body(405, "use POST"), allow=b"POST")
        await self._proxy(scope, receive, send, prefix_experiment, api_path)

    def _is_prefix(self, prefix: str) -> bool:
        return any(p == prefix for p, _ in self.config.routes.prefixes)

    def _authenticate(self, headers: dict[bytes, bytes]) -> tuple[str, str]:
        """(tenant, api key); RequestError 401 when keys are checked and this one is not listed."""
        raw = headers.get(b"authorization", b"")
        key = ""
        if raw[:7].lower() == b"bearer ":
            key = raw[7:].strip().decode("latin-1")
        keys = self.config.keys
        if keys is None:
            return "", key
        tenant = keys.tenant(key) if key else None
        if tenant is None:
            raise RequestError(
                401, "missing or unknown API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return tenant, key

    async def _models(self, scope: Scope, send: Send) -> None:
        headers = dict(scope["headers"])
        try:
            tenant, _ = self._authenticate(headers)
        except RequestError as exc:
            return await _respond(send, exc.status, _error_body(exc.status, exc.message, code=exc.code))
        routes = self.config.routes
        names = [k for k in self.directory.targets if self._may_reach(tenant, k)]
        names += [m for m, k in routes.models.items() if m not in names and self._may_reach(tenant, k)]
        body = {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "abplat"} for n in names]}
        await _respond(send, 200, _DUMPS(body).encode())

    def _may_reach(self, tenant: str, experiment: str) -> bool:
        """Whether ``tenant`` may reach a served ``experiment`` (the default one: everyone)."""
        if experiment == self.config.routes.default_experiment:
            return experiment in self.directory.targets
        exp = self.directory.targets.get(experiment)
        return exp is not None and self.config.reach.allows(tenant, experiment, exp.team)

    async def _refuse(self, send: Send, exc: RequestError, retry_after: float = 0.0) -> None:
        self.counts[f"refused_{exc.status}"] += 1
        self.meter.refused(exc.status)
        await _respond(
            send, exc.status, _error_body(exc.status, exc.message, kind=exc.kind, param=exc.param, code=exc.code),
            retry_after=str(max(1, math.ceil(retry_after))).encode() if exc.status == 429 else None,
        )  # fmt: skip

    # the request path -----------------------------------------------------------------------
    async def _proxy(self, scope: Scope, receive: Receive, send: Send, prefix_experiment: str | None,
                     api_path: str) -> None:  # fmt: skip
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers[name] = value  # the last of repeated headers (none of ours may repeat)
        # 1. the client
        try:
            tenant, api_key = self._authenticate(headers)
        except RequestError as exc:
            return await self._refuse(send, exc)
        cap = self.config.tenant_streams
        if cap and self.tenant_active[tenant] >= cap:
            # A stream's end is unknown: try again in a second.
            return await self._refuse(send, RequestError(
                429, f"too many requests in flight for this API key (at most {cap} at once)",
                kind="rate_limit_error", code="concurrency_limit_exceeded",
            ), 1.0)  # fmt: skip
        self.tenant_active[tenant] += 1
        try:
            await self._proxy_for(tenant, api_key, headers, receive, send, prefix_experiment, api_path)
        finally:
            self.tenant_active[tenant] -= 1
            if not self.tenant_active[tenant]:
                del self.tenant_active[tenant]

    async def _proxy_for(self, tenant: str, api_key: str, headers: dict[bytes, bytes], receive: Receive,
                         send: Send, prefix_experiment: str | None, api_path: str) -> None:  # fmt: skip
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                body = await self._read_body(headers, receive)
        except TimeoutError:
            return await self._refuse(send, RequestError(
                408, f"the request body did not arrive within {cfg.body_timeout_s:g} s", code="request_timeout"
            ))  # fmt: skip
        except RequestError as exc:
            return await self._refuse(send, exc)
        except _Cancelled:
            return
        t_body = _perf()
        try:
            request = _parse_body(body)
            experiment = experiment_for(request.get("model"), prefix_experiment, cfg.routes)
            header_user = None
            if cfg.user_header:
                raw_user = headers.get(cfg.user_header.encode())
                header_user = raw_user.decode("utf-8", "replace") if raw_user is not None else None
            user_id, _source = user_for(request.get("user"), header_user, api_key or None)
            now = time.monotonic()
            if self.tenant_buckets is not None:
                wait = self.tenant_buckets.take(tenant, now)
                if wait > 0:
                    return await self._refuse(send, RequestError(
                        429, "rate limit for this API key exceeded", kind="rate_limit_error",
                        code="rate_limit_exceeded",
                    ), wait)  # fmt: skip
            if self.buckets is not None:
                wait = self.buckets.take(f"{tenant}\0{user_id or ''}", now)
                if wait > 0:
                    return await self._refuse(send, RequestError(
                        429, "rate limit for this user exceeded", kind="rate_limit_error",
                        code="rate_limit_exceeded",
                    ), wait)  # fmt: skip
            # 2. the route
            decision = decide(
                experiment, user_id, controls=self.directory.controls, assign=self._assign,
                default_experiment=cfg.routes.default_experiment,
                may_reach=(lambda key: self._may_reach(tenant, key)) if cfg.reach.configured else None,
            )  # fmt: skip
        except RequestError as exc:
            return await self._refuse(send, exc)
        self.counts[decision.reason.value] += 1
        # decision.experiment, not the client's model name: an experiment the database knows.
        self.meter.routed(decision.experiment, decision.reason.value)
        target = self.directory.target(decision.experiment, decision.variant)
        if target is None:
            # The router holds a variant the variants snapshot does not yet: the control now.
            self.directory.kick()
            self.counts["variant_not_loaded"] += 1
            control = self.directory.controls.get(decision.experiment)
            target = self.directory.target(decision.experiment, control) if control else None
            if target is None:
                self.meter.refused(503, routed=True)
                return await _respond(send, 503, _error_body(503, "the experiment's variants are not loaded yet",
                                                             kind="server_error"))  # fmt: skip
        # Always the gateway's own id: the recorder keys samples by (run, variant, request id),
        # so a client's id reused would collapse two samples into one.
        request_id = "gw-" + uuid.uuid4().hex
        traceparent, trace_id = _traceparent(headers.get(b"traceparent"), request_id)
        max_tokens = request.get("max_tokens") or request.get("max_completion_tokens") or 0
        forwarded = {
            n: headers[n.encode()].decode("latin-1") for n in cfg.forward_headers if n.encode() in headers
        }
        accept = headers.get(b"accept", b"application/json").decode("latin-1")
        await self._forward(
            receive, send, api_path, request, decision, target, user_id or "", request_id, traceparent,
            trace_id, max_tokens if isinstance(max_tokens, int) else 0, forwarded, accept, t_body,
        )  # fmt: skip

    def _assign(self, experiment: str, user_id: str) -> tuple[str, int]:
        router = self.router
        if router is None:
            raise LookupError("the weights router has not started")
        a = router.assign(experiment, user_id)  # UnknownExperiment is a LookupError
        return a.variant, a.revision

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError(400, "Content-Length: not a number")
            if int(declared) > limit:
                raise RequestError(413, f"request body over {limit} bytes", code="request_too_large")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Cancelled()
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise RequestError(413, f"request body over {limit} bytes", code="request_too_large")
                parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts) if len(parts) != 1 else parts[0]

    def _pool(self, endpoint: Endpoint) -> Pool:
        pool = self._pools.get(endpoint)
        if pool is None:
            ctx = self.ssl_context if endpoint.scheme == "https" else None
            if endpoint.scheme == "https" and ctx is None:
                ctx = ssl.create_default_context()
            pool = self._pools[endpoint] = Pool(endpoint, allow=self.allow, ssl_context=ctx)
        return pool

    async def _forward(self, receive: Receive, send: Send, api_path: str, request: dict, decision: Decision,
                       target: Target, user_id: str, request_id: str, traceparent: str, trace_id: str,
                       max_tokens: int, forwarded: dict[str, str], accept: str, t_body: int) -> None:  # fmt: skip
        cfg = self.config
        plan = [target]
        if cfg.retries(decision.experiment) and not target.control:
            control = self.directory.target(
                decision.experiment, self.directory.controls.get(decision.experiment, "")
            )
            if control is not None:
                plan.append(control)
        # The user going away cancels whatever this request is waiting for (upstream headers,
        # the next chunk, a write): one task that waits for http.disconnect.
        task = asyncio.current_task()
        state = {"done": False, "gone": False}

        def on_receive(fut: asyncio.Future) -> None:
            if fut.cancelled() or fut.exception() is not None or state["done"]:
                return
            if fut.result().get("type") == "http.disconnect":
                state["gone"] = True
                if task is not None:
                    task.cancel()

        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(on_receive)
        try:
            for attempt, tgt in enumerate(plan, 1):
                last = attempt == len(plan)
                forwarded_any = await self._attempt(
                    send, api_path, request, decision, tgt, user_id, request_id, traceparent, trace_id,
                    max_tokens, forwarded, accept, t_body, attempt, last, state,
                )  # fmt: skip
                if forwarded_any:
                    return
                t_body = _perf()  # the retry's own time starts where the failed attempt ended
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            if task is not None:
                task.uncancel()
        finally:
            state["done"] = True
            watcher.cancel()

    async def _attempt(self, send: Send, api_path: str, request: dict, decision: Decision, tgt: Target,
                       user_id: str, request_id: str, traceparent: str, trace_id: str, max_tokens: int,
                       forwarded: dict[str, str], accept: str, t_body: int, attempt: int, last: bool,
                       state: dict) -> bool:  # fmt: skip
        """One try on one variant. True: the response (or an error) went to the user; False:
        it failed before its first byte and the next attempt may take over."""
        cfg = self.config
        request["model"] = tgt.model
        content = _DUMPS(request).encode()
        up_headers = {"content-type": "application/json", "accept": accept, "x-request-id": request_id,
                      "traceparent": traceparent, **forwarded, **tgt.headers}  # fmt: skip
        result = StreamResult(request_id=request_id, traceparent=traceparent, trace_id=trace_id)
        timer = StreamTimer(0, result)
        start = _perf()  # the clock: just before the upstream send, as the replay's
        timer.start_ns = result.start_ns = start
        sent_unix_ms = time.time() * 1000.0
        # The gateway's own time before the send: from the body read (attempt 1) or from the
        # failed attempt's end (the retry's decision).
        gateway_ns = start - t_body

        recorded = [False]  # one sample per attempt, whatever ends it

        def record(res: StreamResult, gw_ns: int) -> None:
            if recorded[0]:
                return
            recorded[0] = True
            self.counts[f"outcome_{res.outcome.value}"] += 1
            self.meter.upstream(decision.experiment, tgt.key, res.outcome.value)
            try:
                self.recorder.record(
                    res, experiment=decision.experiment, variant=tgt.key, user_id=user_id,
                    config_revision=decision.revision, sent_unix_ms=sent_unix_ms, request_id=request_id,
                    prompt_tokens=res.prompt_tokens if res.usage_reported else _estimate_prompt_tokens(request),
                    max_tokens=max_tokens, gateway_ms=gw_ns / 1e6,
                    attempt=attempt,
                )  # fmt: skip
            except Exception:  # the recorder must never fail a user's request
                log.exception("gateway: recorder failed")

        ex: Exchange | None = None
        fwd: _Forwarder | None = None
        try:
            try:
                if tgt.error:
                    # Nothing to send (its secret is missing, or not bound to this host): handled as a
                    # connection our side refused, so the control takes over or the user gets a 502.
                    raise UpstreamError(Outcome.CLIENT_ERROR, tgt.error)
                fwd = _Forwarder(send, timer, [(b"x-abplat-variant", tgt.key.encode()),
                                               (b"x-request-id", request_id.encode()),
                                               (b"traceparent", traceparent.encode())], take_5xx=last,
                                 state=state)  # fmt: skip
                ex = await self._pool(tgt.endpoint).send(
                    api_path, up_headers, content, cfg.deadlines, fwd.on_head
                )
            except UpstreamError as exc:
                record(timer.finish(_perf(), exc.outcome, exc.message), gateway_ns)
                if not last:
                    return False
                timed_out = exc.outcome in (Outcome.CONNECT_TIMEOUT, Outcome.HEADERS_TIMEOUT)
                status = 504 if timed_out else 502
                state["done"] = True
                # The details (host, port, refusals, secret names) are the operator's: in the log
                # and the sample, under the request id the user gets.
                log.warning("gateway: request %s to %s/%s failed: %s", request_id, decision.experiment, tgt.key,
                            exc.message)  # fmt: skip
                said = "did not answer in time" if timed_out else "could not be reached"
                await _respond(
                    send, status, _error_body(
                        status, f"the model's server {said}; request id {request_id}", kind="upstream_error",
                        code="upstream_timeout" if timed_out else "upstream_unavailable",
                    ), variant=tgt.key, request_id=request_id, traceparent=traceparent,
                )  # fmt: skip
                return True
            timer.headers(ex.headers_ns, ex.status)
            if ex.connected:
                timer.connected(ex.connect_started_ns, ex.connect_done_ns)
            ex.arm(start + int(cfg.deadlines.total_s * 1e9))
            if not fwd.started and ex.status >= 500 and not last:
                # Before the first byte: read the error, record it, let the control answer.
                detail = await _read_some(ex)
                res = timer.finish(_perf(), Outcome.HTTP_5XX, f"HTTP {ex.status}: {detail}")
                record(res, gateway_ns)
                ex.close()
                ex = None
                return False
            if not fwd.started:
                fwd.on_head(ex, force=True)
            return await self._stream(send, ex, timer, fwd, gateway_ns, record)
        except asyncio.CancelledError:
            if ex is not None:
                ex.abort()
            # The user going away, or the gateway's own stop cutting a stream its drain did not
            # wait out (uvicorn cancels it): either way a user saw this request end unanswered.
            why = "the user went away" if state["gone"] else "the gateway stopped before the response ended"
            if fwd is not None:
                fwd.measure()
            record(timer.finish(_perf(), Outcome.CANCELLED, why), gateway_ns)
            raise
        finally:
            if ex is not None:
                ex.close()

    async def _stream(self, send: Send, ex: Exchange, timer: StreamTimer, fwd: _Forwarder, gateway_ns: int,
                      record: Callable[[StreamResult, int], None]) -> bool:  # fmt: skip
        """The response is under way (the forwarder started it in the read callback): wait for
        its end, then finish the measurement and hand it to the recorder."""
        await ex.finished()
        await fwd.flushed()
        fwd.measure()  # the reads whose measuring the loop has not reached yet
        self.forward_ns += fwd.forward_ns
        self.forwarded_chunks += fwd.chunks
        parser, ended, error, body = fwd.parser, fwd.ended, fwd.error, fwd.body
        if fwd.send_error is not None and ex.error is None:
            ex.fail(UpstreamError(Outcome.CANCELLED, f"writing to the user failed: {fwd.send_error}"))
        now = _perf()
        if ex.error is not None and ended is None:
            outcome, error = ex.error.outcome, ex.error.message
        elif parser is not None:
            if ended is None:
                for ev in parser.finish():
                    try:
                        status = timer.event(now, ev.data)
                    except StreamProtocolError as exc:
                        ended, error = Outcome.MALFORMED, str(exc)
                        break
                    if status == StreamTimer.DONE:
                        ended = Outcome.OK
                    elif status == StreamTimer.ENGINE_ERROR:
                        ended = Outcome.ENGINE_ERROR
            outcome = ended if ended is not None else Outcome.DISCONNECT
            if ended is None:
                error = "stream ended before [DONE]"
        elif ex.status >= 400:
            outcome = Outcome.HTTP_4XX if ex.status < 500 else Outcome.HTTP_5XX
            error = f"HTTP {ex.status}: " + bytes(body[:_ERROR_BODY_LIMIT]).decode("utf-8", "replace").strip()
        else:
            outcome, error = _whole_response(timer, bytes(body), now)
        res = timer.finish(now, outcome, error)
        if parser is None and outcome is Outcome.OK:
            # Not streamed: the user's first token is the whole answer.
            res.ttft_ms = res.ttft_event_ms = res.e2e_ms
        if fwd.send_error is None and not fwd.closed:
            fwd.state["done"] = True  # the disconnect that uvicorn reports next is the response's end
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        record(res, gateway_ns)
        return True


class _Forwarder:
    """The per-chunk path, run inside the upstream connection's read callback
    (gateway/upstream.py: ``Exchange.on_head``, ``Exchange.set_sink``), so no byte waits for
    the request's task to wake up:

    1. The variant's headers complete: the response starts at once with them (hop-by-hop ones
       dropped, ours added), unless it is a 5xx that the control may still answer.
    2. Each read: forwarded first. uvicorn's ``send`` only awaits when the user's socket is
       write-paused (a slow reader); otherwise it writes and returns at its first step. So the
       coroutine is stepped here, at once; only when it does suspend is it finished in a task,
       with reading from the variant paused and later reads joined into one write after it.
    3. Then measured, after every read of this loop pass is forwarded: the read's arrival
       stamp (taken in data_received, so the figures are the same) and its bytes are kept, and
       one ``call_soon`` per pass feeds them to the SSE parser and the StreamTimer (a
       non-streamed body is kept, up to _PARSE_LIMIT, for its usage). An engine emits a token
       for every running request in one step, so reads come in bursts of one per stream: the
       last stream's bytes wait for the burst's forwarding only, not for its measuring too.
       ``measure()`` catches up at once; whoever reads the figures calls it first. Once the
       first content is measured, the exchange defers this stream's reads to the end of the
       pass (gateway/upstream.py, point 4): other streams' first tokens go out before them.
    """

    __slots__ = ("send", "timer", "added", "take_5xx", "ex", "parser", "started", "ended", "error", "body",
                 "forward_ns", "chunks", "send_error", "closed", "_pending", "_backlog", "_first",
                 "_close_after", "state", "_unmeasured", "_measure_due")  # fmt: skip

    def __init__(self, send: Send, timer: StreamTimer, added: list[tuple[bytes, bytes]], *, take_5xx: bool,
                 state: dict) -> None:  # fmt: skip
        self.send = send
        self.state = state  # the request's: "done" tells the disconnect watcher the end is ours
        self.timer = timer
        self.added = added
        self.take_5xx = take_5xx
        self.ex: Exchange | None = None
        self.parser: SSEParser | None = None
        self.started = False
        self.ended: Outcome | None = None  # what the events said: [DONE] -> OK, engine error, malformed
        self.error = ""
        self.body = bytearray()
        self.forward_ns = 0
        self.chunks = 0
        self.send_error: BaseException | None = None
        self.closed = False  # the response's last message is handed to uvicorn
        self._pending: asyncio.Task | None = None
        self._backlog: list[bytes] = []
        self._first = True
        self._close_after = False
        self._unmeasured: list[tuple[int, bytes]] = []  # reads forwarded, not yet measured
        self._measure_due: asyncio.Handle | None = None

    def on_head(self, ex: Exchange, force: bool = False) -> None:
        if self.started or (ex.status >= 500 and not self.take_5xx and not force):
            return
        t0 = _perf()
        self.ex = ex
        self.started = True
        try:
            headers = [(k, v) for k, v in ex.headers if k not in _HOP]
            headers += self.added
            ctype = next((v for k, v in ex.headers if k == b"content-type"), b"")
            if ex.status == 200 and ctype.startswith(b"text/event-stream"):
                self.parser = SSEParser()
            self._step({"type": "http.response.start", "status": ex.status, "headers": headers})
        except Exception as exc:  # never into the protocol callback
            self.send_error = exc
            ex.abort()
            return
        ex.set_sink(self)
        ex.on_end = self.end
        self.forward_ns += _perf() - t0

    def end(self) -> None:
        """The variant's body is complete: end the user's response now (the client may reuse
        its connection at once), not when the request's task wakes up."""
        if self.send_error is not None or self.closed:
            return
        if self._pending is not None:
            self._close_after = True
            return
        self.closed = True
        # uvicorn answers the watcher's receive() with http.disconnect once the response is
        # complete: that one is not the user going away.
        self.state["done"] = True
        self._step({"type": "http.response.body", "body": b"", "more_body": False})

    def __call__(self, t_ns: int, data: bytes) -> None:
        # 2. forward
        if self._pending is not None:
            self._backlog.append(data)
        elif self.send_error is None:
            self._step({"type": "http.response.body", "body": data, "more_body": True})
        self.forward_ns += _perf() - t_ns
        self.chunks += 1
        # 3. measure, once this loop pass has forwarded every read it has
        self._unmeasured.append((t_ns, data))
        if self._measure_due is None:
            assert self.ex is not None
            self._measure_due = self.ex.conn.loop.call_soon(self.measure)

    def measure(self) -> None:
        """Every read forwarded so far into the parser and the timer, in arrival order."""
        if self._measure_due is not None:
            self._measure_due.cancel()
            self._measure_due = None
        reads, self._unmeasured = self._unmeasured, []
        for t_ns, data in reads:
            self._measure(t_ns, data)
        ex = self.ex
        if ex is not None and not ex.defer_reads and self.timer.first_content_seen:
            ex.defer_reads = True  # the user has the first token: its next reads may wait their turn

    def _measure(self, t_ns: int, data: bytes) -> None:
        if self._first:
            self._first = False
            self.timer.body_bytes(t_ns)
        parser = self.parser
        if parser is None:
            if len(self.body) < _PARSE_LIMIT:
                self.body += data
            return
        if self.ended is not None:
            return
        timer = self.timer
        try:
            for event in parser.feed_data(data):
                status = timer.event(t_ns, event)
                if status == StreamTimer.DONE:
                    self.ended = Outcome.OK
                    return
                if status == StreamTimer.ENGINE_ERROR:
                    self.ended = Outcome.ENGINE_ERROR
                    return
        except StreamProtocolError as exc:
            self.ended, self.error = Outcome.MALFORMED, str(exc)

    def _step(self, message: dict) -> None:
        coro = self.send(message)
        try:
            awaiting = coro.send(None)
        except StopIteration:
            return
        except Exception as exc:  # uvicorn refused the message: stop forwarding, end the request
            self.send_error = exc
            assert self.ex is not None
            self.ex.abort()
            return
        # The user's socket is write-paused: finish this send in a task, hold the variant.
        assert self.ex is not None
        self.ex.conn.pause()
        self._pending = asyncio.ensure_future(_resume(coro, awaiting))
        self._pending.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._pending = None
        if task.cancelled():
            return
        exc = task.exception()
        assert self.ex is not None
        if exc is not None:
            self.send_error = exc
            self.ex.abort()
            return
        if self._backlog:
            data = b"".join(self._backlog)
            self._backlog.clear()
            self._step({"type": "http.response.body", "body": data, "more_body": True})
        if self._pending is None and self._close_after:
            self._close_after = False
            self.end()
        if self._pending is None:
            self.ex.conn.resume()

    async def flushed(self) -> None:
        """Until every forwarded byte is handed to uvicorn (a paused send, its backlog)."""
        while self._pending is not None:
            try:
                await asyncio.shield(self._pending)
            except asyncio.CancelledError:
                if self._pending is not None:
                    self._pending.cancel()
                raise
            except Exception:
                return


async def _resume(coro: Any, awaiting: Any) -> None:
    """Run a coroutine that was stepped by hand and suspended on ``awaiting``, to its end."""
    while True:
        await awaiting
        try:
            awaiting = coro.send(None)
        except StopIteration:
            return


def _whole_response(timer: StreamTimer, body: bytes, now: int) -> tuple[Outcome, str]:
    """A non-streamed 2xx answer: its usage and finish reason into the timer's result."""
    try:
        obj = json.loads(body)
    except ValueError:
        return Outcome.MALFORMED, "the response is not JSON"
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        return Outcome.MALFORMED, "the response has no 'choices' list"
    r = timer.r
    usage = obj.get("usage")
    if isinstance(usage, dict):
        try:
            r.output_tokens = int(usage.get("completion_tokens") or 0)
            r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            r.usage_reported = True
        except (TypeError, ValueError):
            return Outcome.MALFORMED, "usage counts are not integers"
    choices = obj["choices"]
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        r.finish_reason = str(choices[0]["finish_reason"])
    return Outcome.OK, ""


async def _read_some(ex: Exchange) -> str:
    buf = b""
    while len(buf) < _ERROR_BODY_LIMIT:
        batch = await ex.chunks()
        if not batch:
            break
        buf += b"".join(d for _, d in batch)
    return buf[:_ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()


def _estimate_prompt_tokens(request: dict) -> int:
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


def _parse_body(raw: bytes) -> dict:
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


def _traceparent(raw: bytes | None, request_id: str) -> tuple[str, str]:
    """The client's W3C traceparent when valid, else one derived from the request id."""
    if raw is not None:
        value = raw.decode("latin-1").strip().lower()
        if _TRACEPARENT_RE.match(value):
            return value, value[3:35]
    trace_id, span_id = trace_ids(request_id)
    return f"00-{trace_id}-{span_id}-01", trace_id


async def _respond(send: Send, status: int, body: bytes, *, allow: bytes | None = None,
                   retry_after: bytes | None = None, variant: str = "", request_id: str = "",
                   traceparent: str = "") -> None:  # fmt: skip
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


def build_default() -> Gateway:
    """The gateway of ``manage.py gateway`` (and of each uvicorn worker): settings, the
    process's weights router, the variants from the database, the live recorder."""
    import os
    import socket

    from django.conf import settings

    from experiments.checks import variant_allowlist
    from experiments.weights.process import live_router
    from streaming.client import tls_verify

    config = GatewayConfig.from_settings()
    verify = tls_verify(settings.VARIANT_CA_BUNDLE or True)
    ssl_context = verify if isinstance(verify, ssl.SSLContext) else None
    worker = f"{socket.gethostname()}:{os.getpid()}"
    return Gateway(
        config,
        router=live_router,
        directory=Directory(default_experiment=config.routes.default_experiment),
        recorder=_recorder(worker),
        allow=variant_allowlist(),
        ssl_context=ssl_context,
    )


def _recorder(worker: str) -> Recorder:
    from gateway.recording import LiveRecorder

    return LiveRecorder(worker=worker)
