"""Shadowing live answers to the control: after a variant's answer reached its user, the same
request, greedily, to the experiment's control; the two answers compared by their fingerprints.

What is decided (which requests, the body, the comparison) is fidelity/shadow.py's, pure; this
module is its glue on the gateway's event loop (docs/gateway.md, "Shadowing answers to the
control"):

1. ``plan`` (before the first send, on the request path): nothing unless the experiment's
   ``shadow_share`` is above 0, the variant is not the control and the request id is sampled
   (fidelity.shadow.sampled). A sampled request that was itself greedy and streamed is compared
   as served (``compared='live'``): only then does its own reader keep the token chunks'
   fingerprints (gateway/attempts.py). Any other sampled one is compared as a greedy pair: the
   variant's greedy answer against the control's (``'greedy_pair'``).
2. ``launch`` (after the user's response ended, its attempt OK): a task of its own, never
   awaited by the request. At most ``cap`` shadows in flight per process: over it the shadow is
   skipped and counted (``skipped_busy``), never queued.
3. The task sends through the attempts' pools (the same egress allowlist, TLS and keep-alive)
   under the gateway's upstream deadlines, with the variant's endpoint, model name and secret as
   the gateway uses them for users; the control first, then (a greedy pair) the variant. Its
   latencies are no sample: the shadow is not user traffic.
4. One row per shadow through the recorder (``record_shadow``: the queue file, the host's
   recorder, the store or the spool while the store is down) and one count in
   ``abplat_gateway_shadow_requests_total{experiment, outcome}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fidelity.shadow import (
    COMPARED_LIVE,
    COMPARED_PAIR,
    NOT_COMPARED,
    Answer,
    compare,
    is_greedy,
    sampled,
    shadow_body,
)
from gateway.forwarder import settle
from gateway.http import DUMPS
from gateway.request import RequestContext
from gateway.upstream import Deadlines, Exchange, Pool, UpstreamError
from gateway.variants import Directory, Target
from streaming.endpoint import Endpoint
from streaming.response import ResponseReader
from streaming.result import Outcome, StreamResult
from streaming.timing import StreamTimer
from telemetry.metrics import GatewayMeter

log = logging.getLogger(__name__)
_perf = time.perf_counter_ns
_TIMEOUTS = frozenset(
    {
        Outcome.CONNECT_TIMEOUT,
        Outcome.HEADERS_TIMEOUT,
        Outcome.FIRST_TOKEN_TIMEOUT,
        Outcome.STALL,
        Outcome.TOTAL_TIMEOUT,
    }
)


class ShadowRecorder(Protocol):
    def record_shadow(self, row: dict[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class ShadowPlan:
    compared: str  # fidelity.shadow.COMPARED_LIVE or COMPARED_PAIR

    @property
    def live(self) -> bool:
        """The live answer is compared as served: its reader keeps the fingerprints."""
        return self.compared == COMPARED_LIVE


class _Failed(Exception):
    def __init__(self, outcome: str, error: str) -> None:
        super().__init__(error)
        self.outcome, self.error = outcome, error


class Shadows:
    """The process's shadows (module docstring). ``pool(endpoint)``: the attempts' pool for an
    endpoint; ``cap``: shadows in flight at most (0: none are sent)."""

    def __init__(
        self,
        *,
        directory: Directory,
        recorder: ShadowRecorder,
        meter: GatewayMeter,
        pool: Callable[[Endpoint], Pool],
        deadlines: Deadlines,
        cap: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.recorder = recorder
        self.meter = meter
        self.pool = pool
        self.deadlines = deadlines
        self.cap = cap
        self.clock = clock
        self.tasks: set[asyncio.Task] = set()
        self.counts: Counter[str] = Counter()  # outcome -> shadows, skipped_busy included

    # 1. on the request path ----------------------------------------------------------------------
    def plan(self, ctx: RequestContext, target: Target) -> ShadowPlan | None:
        if target.control or self.cap <= 0:
            return None
        exp = self.directory.targets.get(ctx.decision.experiment)
        key = ctx.sample_key or ctx.request_id
        if exp is None or exp.shadow_share <= 0.0 or not sampled(key, exp.shadow_share):
            return None
        live = ctx.request.get("stream") is True and is_greedy(ctx.request)
        return ShadowPlan(COMPARED_LIVE if live else COMPARED_PAIR)

    # 2. after the user's response ended -----------------------------------------------------------
    def launch(self, plan: ShadowPlan, ctx: RequestContext, variant: Target, served: StreamResult) -> None:
        """Start the shadow of a request whose response ended OK (``served``: its result)."""
        experiment = ctx.decision.experiment
        if len(self.tasks) >= self.cap:
            self._count(experiment, "skipped_busy")
            return
        task = asyncio.ensure_future(self._shadow(plan, ctx, variant, served))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """The gateway stops: cancel the shadows in flight and wait (``timeout_s``) for each to
        record its row as cancelled, before the recorder closes."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def _count(self, experiment: str, outcome: str) -> None:
        self.counts[outcome] += 1
        self.meter.shadow(experiment, outcome)

    # 3. the shadow's task ---------------------------------------------------------------------------
    async def _shadow(
        self, plan: ShadowPlan, ctx: RequestContext, variant: Target, served: StreamResult
    ) -> None:
        decision = ctx.decision
        control_key = self.directory.controls.get(decision.experiment, "")
        sent_at = int(self.clock())
        outcome, error, comparison = "ok", "", NOT_COMPARED
        try:
            control = self.directory.target(decision.experiment, control_key)
            if control is None:
                raise _Failed("control_error", "control: not loaded")
            theirs = await self._answer("control", control, ctx)
            ours = served if plan.live else await self._answer("variant", variant, ctx)
            comparison = compare(_answer(ours), _answer(theirs))
        except _Failed as exc:
            outcome, error = exc.outcome, exc.error
        except asyncio.CancelledError:
            outcome, error = "cancelled", "the gateway stopped before the shadow ended"
        except Exception as exc:  # a bug here must not go unrecorded, nor reach the loop
            log.exception("gateway: shadow of request %s failed", ctx.request_id)
            outcome, error = "gateway_error", f"{type(exc).__name__}: {exc}"
        row = {
            "experiment": decision.experiment,
            "variant": variant.key,
            "control": control_key,
            "request_id": ctx.request_id,
            "user_id": ctx.user_id,
            "config_revision": decision.revision,
            "sent_at": sent_at,
            "compared": plan.compared,
            "outcome": outcome,
            "error": error[:500],
            **comparison._asdict(),
        }
        self._count(decision.experiment, outcome)
        try:
            self.recorder.record_shadow(row)
        except Exception:  # the recorder never raises; a bug must not reach the loop either
            log.exception("gateway: recording the shadow of request %s failed", ctx.request_id)

    async def _answer(self, side: str, tgt: Target, ctx: RequestContext) -> StreamResult:
        """One greedy answer of ``tgt`` to the request, fingerprinted; _Failed unless OK."""
        result = StreamResult(request_id=ctx.request_id, traceparent=ctx.traceparent, trace_id=ctx.trace_id)
        timer = StreamTimer(0, result, fingerprint=True)
        reader = ResponseReader(timer, self.deadlines)
        start = timer.start_ns = result.start_ns = _perf()
        ex: Exchange | None = None
        try:
            if tgt.error:  # its secret is missing or not bound here: nothing to send
                raise UpstreamError(Outcome.CLIENT_ERROR, tgt.error)
            body = DUMPS(shadow_body(ctx.request, tgt.model)).encode()
            headers = {
                "content-type": "application/json",
                "accept": "text/event-stream",
                "x-request-id": ctx.request_id,
                "traceparent": ctx.traceparent,
                **ctx.forwarded,
                **tgt.headers,
            }
            ex = await self.pool(tgt.endpoint).send(ctx.api_path, headers, body, self.deadlines)
            ctype = next((v for k, v in ex.headers if k == b"content-type"), b"")
            reader.head(ex.headers_ns, ex.status, ctype)
            ex.arm(start + int(self.deadlines.total_s * 1e9))
            # to the body's end (past [DONE]: the connection goes back to the pool)
            while batch := await ex.chunks():
                for t_ns, data in batch:
                    reader.body(t_ns, data)
            if not reader.done:
                settle(reader, ex, _perf())
        except UpstreamError as exc:
            reader.decide(exc.outcome, exc.message)
        except asyncio.CancelledError:
            if ex is not None:
                ex.abort()
            raise
        finally:
            if ex is not None:
                ex.close()
        res = reader.finish(_perf())
        if res.outcome is not Outcome.OK:
            kind = "timeout" if res.outcome in _TIMEOUTS else f"{side}_error"
            raise _Failed(kind, f"{side}: {res.outcome.value}: {res.error}")
        return res


def _answer(result: StreamResult) -> Answer:
    return Answer(result.token_fps, result.output_fp, result.output_tokens, result.usage_reported)
