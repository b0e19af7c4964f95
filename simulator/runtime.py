"""The model's scheduler on the real clock: one asyncio task steps the engine for everyone.

Per step, one timer fires; the sequences that got a token are woken through a future each. The
stream coroutines (simulator.app) then write their events, so the per-token cost is one wake,
one ``json.dumps`` of the text and one ``send``: thousands of streams fit on one core.
"""

from __future__ import annotations

import asyncio

from simulator.latency import Profile, Scheduler, Seq


class Request:
    """Runtime state of one admitted sequence."""

    __slots__ = ("seq", "ready", "waiter", "gone")

    def __init__(self, seq: Seq) -> None:
        self.seq = seq
        self.ready = 0  # tokens the engine has produced so far
        self.waiter: asyncio.Future[None] | None = None
        self.gone = False  # the client went away

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait_tokens(self, have: int) -> None:
        while self.ready <= have and not self.gone and not self.seq.finished:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None


class Engine:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.sched = Scheduler(profile)
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.Future[None] | None = None
        self.steps = 0

    def submit(self, seq: Seq) -> Request:
        req = Request(seq)
        seq.handle = req
        seq.arrival = asyncio.get_running_loop().time()
        self.sched.add(seq)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        return req

    def abort(self, req: Request) -> None:
        req.gone = True
        self.sched.abort(req.seq)
        req.wake()

    @property
    def running(self) -> int:
        return len(self.sched.running)

    @property
    def waiting(self) -> int:
        return len(self.sched.waiting)

    def kv_cache_usage(self) -> float:
        return self.sched.kv_cache_usage()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step = self.sched.plan(loop.time())
            if step is None:
                self._idle = loop.create_future()
                await self._idle
                self._idle = None
                continue
            await asyncio.sleep(step.duration_s)
            self.steps += 1
            for seq in self.sched.complete(step, loop.time()):
                req: Request = seq.handle  # type: ignore[assignment]
                req.ready = seq.generated
                req.wake()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
