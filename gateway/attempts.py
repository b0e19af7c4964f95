"""The attempts of one routed request: the variant, then (retries on, the variant not the
control, nothing forwarded yet) once more on the control; each attempt recorded as a sample.

``Attempts.forward`` owns the upstream pools (one per endpoint), watches for the user going
away (it cancels whatever the request waits for), and hands each finished StreamResult to the
recorder. An attempt that fails before its first byte lets the next one answer; once a byte is
forwarded, never again. A failure the user sees says only that the model's server could not be
reached or did not answer in time, with the request id: the host, port, egress refusal or
secret name behind it go to the log and the sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from gateway.config import GatewayConfig
from gateway.forwarder import Forwarder, read_error, settle
from gateway.http import DUMPS, Receive, Send, error_body, respond
from gateway.request import RequestContext, estimate_prompt_tokens
from gateway.shadow import ShadowPlan, Shadows
from gateway.upstream import Exchange, Pool, UpstreamError
from gateway.variants import Directory, Target
from streaming.egress import Allowlist
from streaming.endpoint import Endpoint
from streaming.response import ResponseReader
from streaming.result import Outcome, StreamResult
from streaming.timing import StreamTimer
from telemetry.metrics import GatewayMeter

log = logging.getLogger(__name__)
_perf = time.perf_counter_ns


class Recorder(Protocol):
    def start(self) -> None: ...

    def record(
        self,
        result: StreamResult,
        *,
        experiment: str,
        variant: str,
        user_id: str,
        config_revision: int,
        sent_unix_ms: float,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        gateway_ms: float,
        attempt: int = 1,
    ) -> None: ...

    def close(self, timeout: float = 10.0) -> None: ...

    def record_shadow(self, row: dict[str, Any]) -> None: ...


class Attempts:
    def __init__(
        self,
        config: GatewayConfig,
        directory: Directory,
        recorder: Recorder,
        meter: GatewayMeter,
        counts: Counter[str],
        *,
        allow: Allowlist | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.config = config
        self.directory = directory
        self.recorder = recorder
        self.meter = meter
        self.counts = counts  # the gateway's: reasons, outcomes, refusals
        self.allow = allow
        self.ssl_context = ssl_context
        self.pools: dict[Endpoint, Pool] = {}
        # The per-chunk path: arrival from the variant -> handed to the user's socket, summed
        # over every chunk this process forwarded (bench/bench_gateway.py reads it).
        self.forward_ns = 0
        self.forwarded_chunks = 0
        # The answers re-sent to the control after a variant answered (gateway/shadow.py),
        # through these pools: the same egress allowlist, TLS and deadlines as users' requests.
        self.shadows = Shadows(
            directory=directory,
            recorder=recorder,
            meter=meter,
            pool=self.pool,
            deadlines=config.deadlines,
            cap=config.shadows_in_flight,
        )

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def pool(self, endpoint: Endpoint) -> Pool:
        pool = self.pools.get(endpoint)
        if pool is None:
            ctx = self.ssl_context if endpoint.scheme == "https" else None
            if endpoint.scheme == "https" and ctx is None:
                ctx = ssl.create_default_context()
            pool = self.pools[endpoint] = Pool(endpoint, allow=self.allow, ssl_context=ctx)
        return pool

    async def forward(
        self, ctx: RequestContext, target: Target, receive: Receive, send: Send, t_body: int
    ) -> None:
        """Answer the user: ``target``, then the control if retries allow. ``t_body``: when the
        gateway had the whole request body (its own time before the first send counts from it)."""
        cfg = self.config
        decision = ctx.decision
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

        # Sampled for a shadow (gateway/shadow.py): decided before the send, as the live answer
        # keeps its fingerprints only when it is the one compared.
        shadow = self.shadows.plan(ctx, target)
        served: list[StreamResult] = []  # the attempt's result, once recorded
        watcher = asyncio.ensure_future(receive())
        watcher.add_done_callback(on_receive)
        try:
            for attempt, tgt in enumerate(plan, 1):
                last = attempt == len(plan)
                forwarded_any = await self._attempt(
                    ctx, tgt, send, t_body, attempt, last, state, shadow if attempt == 1 else None, served
                )
                if forwarded_any:
                    # The user's response has ended: only now, and only for the variant's own
                    # answer that ended OK, does its shadow start (never on the user's path).
                    if shadow is not None and attempt == 1 and served and served[0].ok and not state["gone"]:
                        self.shadows.launch(shadow, ctx, tgt, served[0])
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

    async def _attempt(
        self,
        ctx: RequestContext,
        tgt: Target,
        send: Send,
        t_body: int,
        attempt: int,
        last: bool,
        state: dict,
        shadow: ShadowPlan | None = None,
        served: list[StreamResult] | None = None,
    ) -> bool:
        """One try on one variant. True: the response (or an error) went to the user; False:
        it failed before its first byte and the next attempt may take over. ``shadow``: this
        request's shadow plan (its live answer fingerprinted when compared as served);
        ``served`` receives the attempt's recorded result."""
        cfg = self.config
        decision, request, request_id, traceparent = (
            ctx.decision,
            ctx.request,
            ctx.request_id,
            ctx.traceparent,
        )
        request["model"] = tgt.model
        content = DUMPS(request).encode()
        up_headers = {
            "content-type": "application/json",
            "accept": ctx.accept,
            "x-request-id": request_id,
            "traceparent": traceparent,
            **ctx.forwarded,
            **tgt.headers,
        }
        result = StreamResult(request_id=request_id, traceparent=traceparent, trace_id=ctx.trace_id)
        timer = StreamTimer(0, result, fingerprint=shadow is not None and shadow.live)
        # A user who asked for a whole answer (stream false) gets one: not an event stream.
        reader = ResponseReader(timer, cfg.deadlines, whole_ok=not ctx.request.get("stream"))
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
            if served is not None:
                served.append(dataclasses.replace(res))  # the shadow's copy, fingerprints and all
                # the sample is the one it would be without shadowing: fingerprints are a mirror
                # run's columns, and the shadow's row (fidelity_shadows) keeps what is compared
                res.token_fps, res.output_fp = [], 0
            self.counts[f"outcome_{res.outcome.value}"] += 1
            self.meter.upstream(decision.experiment, tgt.key, res.outcome.value)
            try:
                self.recorder.record(
                    res,
                    experiment=decision.experiment,
                    variant=tgt.key,
                    user_id=ctx.user_id,
                    config_revision=decision.revision,
                    sent_unix_ms=sent_unix_ms,
                    request_id=request_id,
                    prompt_tokens=res.prompt_tokens
                    if res.usage_reported
                    else estimate_prompt_tokens(request),
                    max_tokens=ctx.max_tokens,
                    gateway_ms=gw_ns / 1e6,
                    attempt=attempt,
                )
            except Exception:  # the recorder must never fail a user's request
                log.exception("gateway: recorder failed")

        ex: Exchange | None = None
        fwd: Forwarder | None = None
        try:
            try:
                if tgt.error:
                    # Nothing to send (its secret is missing, or not bound to this host): handled as a
                    # connection our side refused, so the control takes over or the user gets a 502.
                    raise UpstreamError(Outcome.CLIENT_ERROR, tgt.error)
                fwd = Forwarder(
                    send,
                    reader,
                    [
                        (b"x-abplat-variant", tgt.key.encode()),
                        (b"x-request-id", request_id.encode()),
                        (b"traceparent", traceparent.encode()),
                    ],
                    take_5xx=last,
                    state=state,
                )
                ex = await self.pool(tgt.endpoint).send(
                    ctx.api_path, up_headers, content, cfg.deadlines, fwd.on_head
                )
            except UpstreamError as exc:
                reader.decide(exc.outcome, exc.message)
                record(reader.finish(_perf()), gateway_ns)
                if not last:
                    return False
                timed_out = exc.outcome in (Outcome.CONNECT_TIMEOUT, Outcome.HEADERS_TIMEOUT)
                status = 504 if timed_out else 502
                state["done"] = True
                # The details (host, port, refusals, secret names) are the operator's: in the log
                # and the sample, under the request id the user gets.
                log.warning(
                    "gateway: request %s to %s/%s failed: %s",
                    request_id,
                    decision.experiment,
                    tgt.key,
                    exc.message,
                )
                said = "did not answer in time" if timed_out else "could not be reached"
                await respond(
                    send,
                    status,
                    error_body(
                        status,
                        f"the model's server {said}; request id {request_id}",
                        kind="upstream_error",
                        code="upstream_timeout" if timed_out else "upstream_unavailable",
                    ),
                    variant=tgt.key,
                    request_id=request_id,
                    traceparent=traceparent,
                )
                return True
            fwd.read_head(ex)
            if ex.connected:
                timer.connected(ex.connect_started_ns, ex.connect_done_ns)
            ex.arm(start + int(cfg.deadlines.total_s * 1e9))
            if not fwd.started and ex.status >= 500 and not last:
                # Before the first byte: read the error, record it, let the control answer.
                await read_error(ex, reader)
                record(reader.finish(_perf()), gateway_ns)
                ex.close()
                ex = None
                return False
            if not fwd.started:
                fwd.on_head(ex, force=True)

            def complete() -> None:
                # The variant's body is complete and the user's response is about to end: the
                # sample goes to the recorder first, so a user who saw the end has a sample
                # whatever becomes of this process after (gateway.recording).
                try:
                    fwd.measure()
                    now = _perf()
                    reader.end(now)
                    record(reader.finish(now), gateway_ns)
                except Exception:  # never into the protocol callback that ends the response
                    log.exception("gateway: recording request %s at its end failed", request_id)

            fwd.before_end = complete
            return await self._stream(send, ex, fwd, gateway_ns, record, recorded)
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
            if fwd is not None:
                fwd.before_end = None  # complete() holds the forwarder: no cycle left behind
            if ex is not None:
                ex.close()

    async def _stream(
        self,
        send: Send,
        ex: Exchange,
        fwd: Forwarder,
        gateway_ns: int,
        record: Callable[[StreamResult, int], None],
        recorded: list[bool],
    ) -> bool:
        """The response is under way (the forwarder started it in the read callback): wait for
        its end, then finish the measurement and hand it to the recorder, unless the forwarder
        did as it ended the response (``recorded``: the body was complete)."""
        await ex.finished()
        await fwd.flushed()
        self.forward_ns += fwd.forward_ns
        self.forwarded_chunks += fwd.chunks
        if recorded[0]:
            return True
        fwd.measure()  # the reads whose measuring the loop has not reached yet
        if fwd.send_error is not None and ex.error is None:
            ex.fail(UpstreamError(Outcome.CANCELLED, f"writing to the user failed: {fwd.send_error}"))
        now = _perf()
        reader = fwd.reader
        settle(reader, ex, now)
        res = reader.finish(now)
        # Recorded before the response's end goes out (as complete() does when the body ended)
        record(res, gateway_ns)
        if fwd.send_error is None and not fwd.closed:
            fwd.state["done"] = True  # the disconnect that uvicorn reports next is the response's end
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
