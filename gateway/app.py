"""The live gateway: a raw ASGI app (uvicorn) in front of the variants.

``POST /v1/chat/completions`` and ``/v1/completions`` (streaming or not, also under a
configured path prefix), ``GET /v1/models``, ``GET /healthz``. The gateway's rooms, in the
order a request walks through them:

1. This module, the front door: the API key (its tenant), the body (size, read deadline;
   gateway/request.py parses and checks it), the route: experiment, user, variant
   (gateway/routing.py, pure, on the process's weights router), only to experiments that run
   and the tenant may reach; then the client limits, checked and charged together: the tenant's
   requests in flight, the tenant's and the user's rates (gateway/limits.py in this process, or
   gateway/shared_limits.py in Redis for every process). After the route, so a request for no
   model costs no user a token and leaves no bucket behind. What was decided travels on as one
   ``RequestContext``.
2. gateway/attempts.py: the variant, and once more the control if retries are on and nothing
   was forwarded yet; the body with the variant's model name and Authorization, the request's
   ``X-Request-Id`` and ``traceparent``; the clock starts just before the upstream send, as the
   replay's does (streaming/client.py); each attempt is one sample handed to the recorder,
   which never blocks. A user who goes away cancels the upstream request.
3. gateway/forwarder.py: every byte back as it came, with ``X-Abplat-Variant``,
   ``X-Request-Id`` and ``traceparent`` added; each batch of reads forwarded first and measured
   after, so measuring never delays a byte (gateway/upstream.py: the connection and its reads).
4. This module again: the ASGI lifecycle (start the router, the variants snapshot and the
   recorder; drain and close them) and ``build_default`` from the settings.

A stream keeps the variant it started on: the assignment is made once, before the send.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import math
import ssl
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from gateway.attempts import Attempts, Recorder
from gateway.config import GatewayConfig
from gateway.http import DUMPS, Receive, Scope, Send, error_body, respond
from gateway.limits import Admission, ProcessLimits, Refused
from gateway.request import RequestContext, parse_body, sample_key_for, traceparent_for
from gateway.routing import Decision, RequestError, decide, experiment_for, split_path, user_for
from gateway.shared_limits import SharedLimits, limits_client
from gateway.variants import Directory
from streaming.egress import Allowlist
from telemetry.metrics import GatewayMeter

log = logging.getLogger(__name__)

_perf = time.perf_counter_ns


class AssignmentSource(Protocol):
    def assign(self, experiment_key: str, user_id: str) -> Any: ...


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
        self.refresh_variants = refresh_variants
        self.limits = ProcessLimits(
            user_rate=config.user_rate,
            user_burst=config.user_burst,
            tenant_rate=config.tenant_rate,
            tenant_burst=config.tenant_burst,
            tenant_streams=config.tenant_streams,
        )
        self.counts: Counter[str] = Counter()  # reasons, outcomes, refusals
        self.active = 0
        self.meter = GatewayMeter()  # the same events as Prometheus metrics (docs/metrics.md)
        self.shared_limits = self._shared_limits(config)
        self.attempts = Attempts(
            config, directory, recorder, self.meter, self.counts, allow=allow, ssl_context=ssl_context
        )
        self._started = False

    def _shared_limits(self, config: GatewayConfig) -> SharedLimits | None:
        """The limits in Redis (ABPLAT_GATEWAY_LIMITS_URL) when set and there is a limit at all."""
        if not config.limits_url or not (config.user_rate or config.tenant_rate or config.tenant_streams):
            return None
        return SharedLimits(
            limits_client(config.limits_url),
            self.limits,
            timeout_s=config.limits_timeout_s,
            prefix=config.limits_prefix,
            fallback=self.meter.limit_fallback,
        )

    @property
    def tenant_active(self) -> Counter[str]:
        """Requests in flight per tenant, as this process counted them."""
        return self.limits.active

    @property
    def forward_ns(self) -> int:
        """Arrival from the variant -> handed to the user's socket, summed over every chunk this
        process forwarded (bench/bench_gateway.py reads it)."""
        return self.attempts.forward_ns

    @property
    def forwarded_chunks(self) -> int:
        return self.attempts.forwarded_chunks

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
        self.attempts.close()
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
                if self.shared_limits is not None:
                    self.shared_limits.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    if self.shared_limits is not None:
                        await self.shared_limits.aclose()
                    await self.attempts.shadows.aclose()
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
                return await respond(send, 405, error_body(405, "use GET"), allow=b"GET, HEAD")
            return await respond(send, 200, b'{"status":"ok"}')
        if path == "/v1/models" or (
            path.endswith("/v1/models") and self._is_prefix(path[: -len("/v1/models")])
        ):
            if method != "GET":
                return await respond(send, 405, error_body(405, "use GET"), allow=b"GET")
            return await self._models(scope, send)
        try:
            prefix_experiment, api_path = split_path(path, self.config.routes)
        except RequestError as exc:
            return await respond(send, exc.status, error_body(exc.status, exc.message, code=exc.code))
        if method != "POST":
            self.meter.refused(405)
            return await respond(send, 405, error_body(405, "use POST"), allow=b"POST")
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
            return await respond(send, exc.status, error_body(exc.status, exc.message, code=exc.code))
        routes = self.config.routes
        names = [k for k in self.directory.targets if self._may_reach(tenant, k)]
        names += [m for m, k in routes.models.items() if m not in names and self._may_reach(tenant, k)]
        body = {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "abplat"} for n in names]}
        await respond(send, 200, DUMPS(body).encode())

    def _may_reach(self, tenant: str, experiment: str) -> bool:
        """Whether ``tenant`` may reach a served ``experiment`` (the default one: everyone)."""
        if experiment == self.config.routes.default_experiment:
            return experiment in self.directory.targets
        exp = self.directory.targets.get(experiment)
        return exp is not None and self.config.reach.allows(tenant, experiment, exp.team)

    async def _refuse(self, send: Send, exc: RequestError, retry_after: float = 0.0) -> None:
        self.counts[f"refused_{exc.status}"] += 1
        self.meter.refused(exc.status)
        await respond(
            send,
            exc.status,
            error_body(exc.status, exc.message, kind=exc.kind, param=exc.param, code=exc.code),
            retry_after=str(max(1, math.ceil(retry_after))).encode() if exc.status == 429 else None,
        )

    # the request path -----------------------------------------------------------------------
    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, prefix_experiment: str | None, api_path: str
    ) -> None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers[name] = value  # the last of repeated headers (none of ours may repeat)
        # 1. the client
        try:
            tenant, api_key = self._authenticate(headers)
        except RequestError as exc:
            return await self._refuse(send, exc)
        await self._proxy_for(tenant, api_key, headers, receive, send, prefix_experiment, api_path)

    async def _admit(self, tenant: str, user: str) -> Admission | Refused:
        shared = self.shared_limits
        if shared is not None:
            return await shared.admit(tenant, user)
        return self.limits.admit(tenant, user, time.monotonic())

    async def _release(self, admission: Admission) -> None:
        shared = self.shared_limits
        if shared is not None:
            await shared.release(admission)
        else:
            self.limits.release(admission.tenant)

    def _limit_error(self, refused: Refused) -> RequestError:
        if refused.limit == "streams":
            # A stream's end is unknown: try again in a second.
            return RequestError(
                429,
                f"too many requests in flight for this API key (at most {self.config.tenant_streams} at once)",
                kind="rate_limit_error",
                code="concurrency_limit_exceeded",
            )
        who = "this API key" if refused.limit == "tenant" else "this user"
        return RequestError(
            429, f"rate limit for {who} exceeded", kind="rate_limit_error", code="rate_limit_exceeded"
        )

    async def _proxy_for(
        self,
        tenant: str,
        api_key: str,
        headers: dict[bytes, bytes],
        receive: Receive,
        send: Send,
        prefix_experiment: str | None,
        api_path: str,
    ) -> None:
        cfg = self.config
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                body = await self._read_body(headers, receive)
        except TimeoutError:
            return await self._refuse(
                send,
                RequestError(
                    408,
                    f"the request body did not arrive within {cfg.body_timeout_s:g} s",
                    code="request_timeout",
                ),
            )
        except RequestError as exc:
            return await self._refuse(send, exc)
        except _Cancelled:
            return
        t_body = _perf()
        try:
            request = parse_body(body)
            experiment = experiment_for(request.get("model"), prefix_experiment, cfg.routes)
            header_user = None
            if cfg.user_header:
                raw_user = headers.get(cfg.user_header.encode())
                header_user = raw_user.decode("utf-8", "replace") if raw_user is not None else None
            user_id, _source = user_for(request.get("user"), header_user, api_key or None)
            # 2. the route
            decision = decide(
                experiment,
                user_id,
                controls=self.directory.controls,
                assign=self._assign,
                default_experiment=cfg.routes.default_experiment,
                may_reach=(lambda key: self._may_reach(tenant, key)) if cfg.reach.configured else None,
            )
        except RequestError as exc:
            return await self._refuse(send, exc)
        # 3. the limits, once the request has somewhere to go
        admission = await self._admit(tenant, user_id or "")
        if isinstance(admission, Refused):
            return await self._refuse(send, self._limit_error(admission), admission.retry_after_s)
        try:
            await self._routed(decision, api_path, request, user_id, headers, receive, send, t_body)
        finally:
            await self._release(admission)

    async def _routed(
        self,
        decision: Decision,
        api_path: str,
        request: dict,
        user_id: str | None,
        headers: dict[bytes, bytes],
        receive: Receive,
        send: Send,
        t_body: int,
    ) -> None:
        cfg = self.config
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
                return await respond(
                    send,
                    503,
                    error_body(503, "the experiment's variants are not loaded yet", kind="server_error"),
                )
        # Always the gateway's own id: the recorder keys samples by (run, variant, request id),
        # so a client's id reused would collapse two samples into one.
        request_id = "gw-" + uuid.uuid4().hex
        traceparent, trace_id = traceparent_for(headers.get(b"traceparent"), request_id)
        max_tokens = request.get("max_tokens") or request.get("max_completion_tokens") or 0
        ctx = RequestContext(
            api_path=api_path,
            request=request,
            decision=decision,
            user_id=user_id or "",
            request_id=request_id,
            traceparent=traceparent,
            trace_id=trace_id,
            max_tokens=max_tokens if isinstance(max_tokens, int) else 0,
            forwarded={
                n: headers[n.encode()].decode("latin-1") for n in cfg.forward_headers if n.encode() in headers
            },
            accept=headers.get(b"accept", b"application/json").decode("latin-1"),
            sample_key=sample_key_for(headers.get(b"x-request-id"), request_id),
        )
        await self.attempts.forward(ctx, target, receive, send, t_body)

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


def build_default() -> Gateway:
    """The gateway of ``manage.py gateway`` (and of each uvicorn worker): settings, the
    process's weights router, the variants from the database, the live recorder."""
    import os
    import socket

    from django.conf import settings

    from experiments.checks import variant_allowlist
    from experiments.weights.process import live_router
    from streaming.tls import tls_verify

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
