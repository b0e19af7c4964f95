"""Running one shard of a replay: send each request on its schedule, measure it, record it.

Pure of Django and Celery: the task wrapper passes in the requests, an assigner (the live
router), one streaming client per variant, a sink for rows and a cancel probe.

1. Convert the run's absolute start (unix time) to this process's monotonic clock once.
2. For each request in schedule order: sleep until its send time, then wait for a slot
   (the concurrency bound); the difference between the actual and the planned send time is
   the schedule lag, recorded per sample.
3. Split mode: the router assigns the user's variant now, so a weight change takes effect
   mid-run and the sample carries the config revision. Mirror mode: every variant at once.
4. Requests whose id is already recorded (a redelivered shard) are not sent again.
5. Every finished request becomes exactly one row; a request cut short by cancellation is
   recorded with outcome "cancelled", never dropped. Once cancelled, nothing new is sent;
   requests in flight get ``cancel_grace_s`` to finish, then are cancelled (and recorded so).
6. What each variant is sent follows its API (replay.shapes): a mismatch the run's options do
   not allow is refused before anything is sent. A request the client cannot even build is
   recorded as ``client_error`` (our fault, never the server's).
7. A resumed shard (attempt > 1) whose first unsent request is overdue keeps the trace's
   spacing: the rest of its sends shift by the delay instead of all going out at once (a
   burst it would then measure itself); their schedule lag still counts from the original
   plan, so the samples say how late they went. ``stats.shift_s`` is the shift.
8. ``budget_s`` (closed loop): stop starting requests after this long, finish those in flight;
   the rest are ``stats.deferred`` for the next task of the shard (they are not sent, and are
   not cancelled).
9. The assigner may raise StopReplay (e.g. the experiment's weights were retired because it
   was concluded): the shard stops sending and ends cancelled, with that reason. Any other
   error of a send task is re-raised after the requests in flight were recorded.
10. The send loop wakes ``SEND_LEAD_S`` before a request's send time and starts its send task
   then; the task waits out the rest on its own timer and sends. A new task's first step runs
   one loop pass after it is made, after every read callback that pass brings: under a few
   hundred streams that pass alone took milliseconds, and it was schedule lag. The task's own
   timer wakes it in the pass the time comes, before the reads. The lag is measured as before,
   when the task begins the request; a request whose time comes after a cancel is not sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
import types
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from replay import shapes
from replay.plan import MIRROR, SPLIT, request_id
from replay.prompts import synth_prompt
from replay.sources import TraceRequest
from samples.rows import SampleContext, row_from
from stats.quantiles import nearest_rank
from streaming.result import Outcome, StreamCancelled, StreamResult
from telemetry import logs

# What a mirror run sends as `temperature`: greedy decoding, so two variants given the same
# prompt give the same answer unless their numerics differ (fidelity/compare.py).
GREEDY_TEMPERATURE = 0


class Streamer(Protocol):
    async def stream(
        self, request_id: str, prompt: Any, max_tokens: int, extra: Mapping[str, Any] | None = None
    ) -> StreamResult: ...


Assigner = Callable[[str], tuple[str, int]]  # user_id -> (variant, config revision)


class StopReplay(Exception):  # noqa: N818 (a signal to stop, not an error of the shard)
    """Raised by an assigner when the run must stop sending (its reason is kept in the stats)."""


@dataclasses.dataclass
class ShardSpec:
    experiment: str
    run_id: int
    mode: str
    requests: Sequence[TraceRequest]
    offsets: Sequence[float] | None  # seconds after start, per request; None: closed loop
    start_at_unix: float
    concurrency: int
    variants: Sequence[str]
    attempt: int = 1
    skip_ids: frozenset[str] = frozenset()
    ignore_eos: bool = True
    # variant -> "chat" | "completions"; None: each client's own ``api`` attribute (chat if none)
    apis: Mapping[str, str] | None = None
    render_chat: str = "reject"  # chat messages for completions variants: reject | plain
    wrap_prompt: bool = False  # prompt lines for chat variants: one user message when True
    budget_s: float | None = None  # closed loop: start no request after this long (see 8.)
    overdue_tolerance_s: float = 1.0  # a resumed shard shifts its sends when later than this
    worker: str = dataclasses.field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    def __post_init__(self):
        if self.mode not in (SPLIT, MIRROR):
            raise ValueError(f"mode must be split or mirror, got {self.mode!r}")
        if self.offsets is not None and len(self.offsets) != len(self.requests):
            raise ValueError("offsets and requests differ in length")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")


@dataclasses.dataclass
class ShardStats:
    planned: int = 0
    sent: int = 0
    skipped_recorded: int = 0
    recorded: int = 0
    not_sent: int = 0  # cancelled before its send time
    deferred: int = 0  # left for the shard's next task (budget_s spent)
    shift_s: float = 0.0  # a resumed shard's sends went this much later than planned
    outcomes: Counter = dataclasses.field(default_factory=Counter)
    lags_ms: list[float] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    stop_reason: str = ""  # why the shard stopped on its own (StopReplay), e.g. weights retired

    def lag_quantile(self, q: float) -> float:
        """The exact q-quantile (nearest rank, the project's one convention) of the schedule
        lags; 0.0 before anything was sent."""
        return nearest_rank(sorted(self.lags_ms), q) if self.lags_ms else 0.0

    def summary(self) -> dict:
        """For the log: counts, outcomes and lag quantiles in ms (not the raw lags)."""
        return {
            "planned": self.planned,
            "sent": self.sent,
            "skipped_recorded": self.skipped_recorded,
            "recorded": self.recorded,
            "not_sent": self.not_sent,
            "deferred": self.deferred,
            "shift_s": round(self.shift_s, 3),
            "outcomes": dict(self.outcomes),
            "lag_p50_ms": round(self.lag_quantile(0.5), 3),
            "lag_p99_ms": round(self.lag_quantile(0.99), 3),
            "lag_max_ms": round(max(self.lags_ms, default=0.0), 3),
            "cancelled": self.cancelled,
            "stop_reason": self.stop_reason,
        }


class ShardRunner:
    # How much before a request's send time the send loop wakes and starts its send task (10.).
    SEND_LEAD_S = 0.003

    def __init__(
        self,
        spec: ShardSpec,
        clients: Mapping[str, Streamer],
        assign: Assigner | None,
        put_row: Callable[[dict], None],
        *,
        should_cancel: Callable[[], bool] | None = None,
        revision: Callable[[], int] | None = None,
        on_progress: Callable[[ShardStats], None] | None = None,
        progress_interval_s: float = 1.0,
        cancel_grace_s: float = 2.0,
    ):
        if spec.mode == SPLIT and assign is None:
            raise ValueError("split mode needs an assigner (the router)")
        missing = [v for v in spec.variants if v not in clients]
        if missing:
            raise ValueError(f"no client for variant(s) {missing}")
        self.spec, self.clients, self.assign, self.put_row = spec, clients, assign, put_row
        self.should_cancel = should_cancel or (lambda: False)
        self.revision = revision or (lambda: 0)
        self.on_progress = on_progress
        self.progress_interval_s = progress_interval_s
        self.cancel_grace_s = cancel_grace_s
        self.apis = (
            dict(spec.apis)
            if spec.apis is not None
            else {v: getattr(clients[v], "api", shapes.CHAT) for v in spec.variants}
        )
        # Decided before anything is sent: every request must fit every variant's API.
        shapes.check(
            spec.requests,
            {v: self.apis[v] for v in spec.variants},
            render_chat=spec.render_chat,
            wrap_prompt=spec.wrap_prompt,
        )
        self.stats = ShardStats(planned=len(spec.requests))
        self._in_flight = 0
        self._cancel = asyncio.Event()
        self._sleeper: asyncio.Future[None] | None = None  # the send loop's wait, woken by _stop
        self._wake_at = 0.0  # loop time of the latest send task's timer (_until)
        self._went: asyncio.Future[None] | None = None  # done once the latest send task's wait is over
        self._error: BaseException | None = None
        self._api_set = tuple(sorted(set(self.apis.values())))
        # One read-only mapping for every request (the clients only read it). A mirror run asks
        # every variant greedily (temperature 0) so their answers can be compared (fidelity).
        extra: dict[str, Any] = {"ignore_eos": True} if spec.ignore_eos else {}
        if spec.mode == MIRROR:
            extra["temperature"] = GREEDY_TEMPERATURE
        self._extra = types.MappingProxyType(extra) if extra else None

    async def run(self) -> ShardStats:
        spec = self.spec
        # 1. One conversion from wall clock to monotonic; every send is planned on the latter.
        start_mono = time.perf_counter() + (spec.start_at_unix - time.time())
        slots = asyncio.Semaphore(spec.concurrency)
        tasks: set[asyncio.Task] = set()
        began = time.perf_counter()
        shift = self._overdue_shift(start_mono)
        self.stats.shift_s = shift
        watcher = asyncio.create_task(self._watch_cancel())
        try:
            for i, req in enumerate(spec.requests):
                if self._cancel.is_set():
                    self.stats.not_sent += len(spec.requests) - i
                    break
                if spec.budget_s is not None and time.perf_counter() - began > spec.budget_s:
                    self.stats.deferred += len(spec.requests) - i
                    break
                # The prompt is built before the wait, so its cost never shows as schedule lag.
                prepared = self._prompt(req)
                planned = start_mono + (spec.offsets[i] if spec.offsets is not None else 0.0)
                due = planned + shift
                # 10. Woken SEND_LEAD_S early: the send task starts then and waits out the rest.
                delay = due - self.SEND_LEAD_S - time.perf_counter()
                if delay > 0 and await self._sleep(delay):  # cancelled while waiting
                    self.stats.not_sent += len(spec.requests) - i
                    break
                if not await self._acquire(slots):  # cancelled while waiting for a slot
                    self.stats.not_sent += len(spec.requests) - i
                    break
                if spec.offsets is None:
                    planned = due = time.perf_counter()  # closed loop: sent when a slot frees
                task = asyncio.create_task(self._send(req, planned, start_mono, prepared, due))
                tasks.add(task)
                task.add_done_callback(lambda t: self._done(t, tasks, slots))
            await self._drain(tasks)
        finally:
            watcher.cancel()
            if self.on_progress:
                await asyncio.to_thread(self.on_progress, self.stats)
        self.stats.cancelled = self._cancel.is_set()
        if self._error is not None:
            raise self._error
        return self.stats

    async def _sleep(self, delay: float) -> bool:
        """Wait ``delay`` seconds, or less if the shard is cancelled meanwhile (True then).

        One future and one timer handle per request, where ``asyncio.wait_for(event.wait(),
        delay)`` cost a task, a timeout scope and a cancellation."""
        if self._cancel.is_set():
            return True
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        self._sleeper = woken
        timer = loop.call_later(delay, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._sleeper = None
        return self._cancel.is_set()

    async def _until(self, due: float) -> None:
        """Wait for the send time ``due`` (perf_counter) on a timer of this task's own, in send
        order: each timer is set strictly after the previous request's, so two requests due at
        the same moment still go in schedule order (equal timers have no order on asyncio's
        loop); and a task whose time has passed when it runs still waits for the one before it,
        whose timer may not have fired yet (uvloop keeps timers in whole milliseconds, so its
        loop time can pass a timer's time a pass before the timer fires)."""
        loop = asyncio.get_running_loop()
        before, went = self._went, loop.create_future()
        self._went = went
        try:
            await self._timer(loop, due)
            if before is not None and not before.done():
                await before
        finally:
            if not went.done():
                went.set_result(None)

    async def _timer(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        wait = due - time.perf_counter()
        if wait <= 0 and self._wake_at <= 0.0:
            return
        at = max(loop.time() + wait, self._wake_at + 1e-6)
        self._wake_at = at
        if at <= loop.time():
            return
        woken: asyncio.Future[None] = loop.create_future()
        timer = loop.call_at(at, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()

    def _stop(self) -> None:
        """Cancel the shard: nothing new is sent (the send loop wakes from its wait at once)."""
        self._cancel.set()
        if self._sleeper is not None:
            _wake(self._sleeper)

    def _ids(self, req: TraceRequest) -> list[str]:
        spec = self.spec
        if spec.mode == SPLIT:
            return [request_id(spec.run_id, req.seq)]
        return [request_id(spec.run_id, req.seq, v) for v in spec.variants]

    def _overdue_shift(self, start_mono: float) -> float:
        """How much later than planned a resumed shard must send the rest to keep the trace's
        spacing (0 on a first attempt, in closed loop, or when it is not late)."""
        spec = self.spec
        if spec.attempt <= 1 or spec.offsets is None:
            return 0.0
        for i, req in enumerate(spec.requests):
            if not all(rid in spec.skip_ids for rid in self._ids(req)):
                late = time.perf_counter() - (start_mono + spec.offsets[i])
                return late if late > spec.overdue_tolerance_s else 0.0
        return 0.0

    async def _acquire(self, slots: asyncio.Semaphore) -> bool:
        """Take a slot: True holding one, False holding none when cancelled first (a full
        closed loop must not keep sending after a cancel just because a slot freed)."""
        if self._cancel.is_set():
            return False
        if not slots.locked():
            await slots.acquire()  # free: returns at once, no task needed on the common path
            return True
        acquire = asyncio.ensure_future(slots.acquire())
        stop = asyncio.ensure_future(self._cancel.wait())
        await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not acquire.done():
            acquire.cancel()
        try:
            held = await acquire
        except asyncio.CancelledError:
            held = False
        if held and self._cancel.is_set():
            slots.release()
            return False
        return bool(held)

    def _done(self, task: asyncio.Task, tasks: set, slots: asyncio.Semaphore) -> None:
        """Every send task's end: free its slot and retrieve its exception (never left for the
        loop to print as "Task exception was never retrieved")."""
        tasks.discard(task)
        slots.release()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, StopReplay):
            self.stats.not_sent += 1  # the request whose assignment stopped the shard
            self.stats.stop_reason = self.stats.stop_reason or str(exc)
        elif self._error is None:
            self._error = exc
        self._stop()

    async def _drain(self, tasks: set[asyncio.Task]) -> None:
        """Wait for the requests in flight; once cancelled, give them ``cancel_grace_s`` and then
        cancel the rest (each is recorded with outcome "cancelled")."""
        while tasks:
            if not self._cancel.is_set():
                cancelled = asyncio.ensure_future(self._cancel.wait())
                await asyncio.wait({*tasks, cancelled}, return_when=asyncio.FIRST_COMPLETED)
                cancelled.cancel()
                continue
            _done, pending = await asyncio.wait(set(tasks), timeout=self.cancel_grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            return

    async def _watch_cancel(self) -> None:
        while True:
            await asyncio.sleep(self.progress_interval_s)
            if await asyncio.to_thread(self.should_cancel):
                self._stop()
            if self.on_progress:
                await asyncio.to_thread(self.on_progress, self.stats)

    async def _send(
        self,
        req: TraceRequest,
        planned: float,
        start_mono: float,
        prepared: tuple[Any, int, bool],
        due: float | None = None,
    ) -> None:
        spec = self.spec
        if due is not None:
            try:
                await self._until(due)
            except asyncio.CancelledError:
                self.stats.not_sent += 1  # cancelled before it was sent
                raise
            if self._cancel.is_set():  # cancelled in the last moment before its send time
                self.stats.not_sent += 1
                return
        if spec.mode == SPLIT:
            variant, revision = self.assign(req.user_id)
            targets = [(variant, request_id(spec.run_id, req.seq))]
        else:
            revision = self.revision()
            targets = [(v, request_id(spec.run_id, req.seq, v)) for v in spec.variants]
        targets = [(v, rid) for v, rid in targets if rid not in spec.skip_ids]
        self.stats.skipped_recorded += (1 if spec.mode == SPLIT else len(spec.variants)) - len(targets)
        if not targets:
            return
        payloads, prompt_tokens, estimated = prepared
        if len(targets) == 1:  # split mode: no gather, so no second task per request
            ((variant, rid),) = targets
            await self._one(
                req,
                variant,
                rid,
                revision,
                planned,
                start_mono,
                payloads.get(self.apis.get(variant)),
                prompt_tokens,
                estimated,
            )
            return
        await asyncio.gather(
            *(
                self._one(
                    req,
                    variant,
                    rid,
                    revision,
                    planned,
                    start_mono,
                    payloads.get(self.apis.get(variant)),
                    prompt_tokens,
                    estimated,
                )
                for variant, rid in targets
            )
        )

    def _prompt(self, req: TraceRequest) -> tuple[dict[str, Any], int, bool]:
        """What each API is sent for ``req`` ({api: payload}, replay.shapes), its prompt token
        count when the replay knows it, and whether that count is an estimate."""
        text, tokens, estimated = None, 0, True
        if req.messages is None and req.prompt is None:
            text, estimated = synth_prompt(req.seq, req.prompt_tokens)
            tokens = req.prompt_tokens
        spec = self.spec
        payloads = {
            api: shapes.payload(req, text, api, render_chat=spec.render_chat, wrap_prompt=spec.wrap_prompt)
            for api in self._api_set
        }
        return payloads, tokens, estimated

    async def _one(self, req, variant, rid, revision, planned, start_mono, prompt, prompt_tokens, estimated):
        spec = self.spec
        in_flight = self._in_flight
        self._in_flight += 1
        sent_mono = time.perf_counter()
        sent_unix_ms = time.time() * 1000.0
        self.stats.sent += 1
        extra = self._extra
        log_fields = logs.bind(variant=variant, request_id=rid)  # what the client logs carries them
        try:
            client = self.clients.get(variant)
            if client is None:
                # The weights document names a variant this experiment does not have: record
                # the request as failed (never drop it) and say exactly why.
                raise LookupError(
                    f"router assigned variant {variant!r}; the experiment has {sorted(self.clients)}"
                )
            result = await client.stream(rid, prompt, req.max_tokens, extra)
        except StreamCancelled as exc:
            result = exc.result
            result.outcome = Outcome.CANCELLED
        except Exception as exc:  # our own failure must still leave a sample, never a gap
            # Not the server's fault: its own class, kept out of the server-fault outcomes.
            result = StreamResult(
                outcome=Outcome.CLIENT_ERROR,
                error=f"client error: {type(exc).__name__}: {exc}",
                request_id=rid,
            )
        finally:
            self._in_flight -= 1
            logs.reset(log_fields)
        # The request's clock may start after the call: a new connection waits its turn in a
        # start burst (streaming/pacing.py). That wait is lateness against the plan too.
        waited_s = max(0.0, result.start_ns / 1e9 - sent_mono) if result.start_ns else 0.0
        sent_unix_ms += waited_s * 1000.0
        lag_ms = max(0.0, (sent_mono + waited_s - planned) * 1000.0)
        self.stats.lags_ms.append(lag_ms)
        row = row_from(
            result,
            SampleContext(
                experiment=spec.experiment,
                run_id=spec.run_id,
                seq=req.seq,
                variant=variant,
                mode=spec.mode,
                sent_unix_ms=sent_unix_ms,
                request_id=rid,
                user_id=req.user_id,
                config_revision=revision,
                scheduled_offset_ms=(planned - start_mono) * 1000.0,
                schedule_lag_ms=lag_ms,
                in_flight=in_flight,
                prompt_tokens=prompt_tokens,
                prompt_tokens_estimated=estimated,
                max_tokens=req.max_tokens,
                worker=spec.worker,
                attempt=min(spec.attempt, 255),
            ),
        )
        self.put_row(row)
        self.stats.recorded += 1
        self.stats.outcomes[str(result.outcome)] += 1


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
