"""The gateway's per-chunk path (gateway.forwarder.Forwarder): every read of a loop pass is forwarded
before any is measured, and the measurement uses the reads' arrival stamps all the same."""

from __future__ import annotations

import asyncio

from gateway.forwarder import Forwarder
from gateway.upstream import Deadlines
from streaming.response import ResponseReader
from streaming.result import Outcome, StreamResult
from streaming.timing import StreamTimer

MS = 1_000_000


def _event(text: str) -> bytes:
    return (
        b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"%s"}]}\n\n' % text.encode()
    )


class _Conn:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def pause(self) -> None:
        raise AssertionError("the user's socket never pauses here")

    resume = pause


class _Exchange:
    status = 200
    headers = [(b"content-type", b"text/event-stream")]
    headers_ns = 0
    defer_reads = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = _Conn(loop)
        self.on_end = None

    def set_sink(self, sink) -> None:
        self.sink = sink


def _stream(loop: asyncio.AbstractEventLoop, log: list) -> tuple[Forwarder, StreamTimer]:
    async def send(message: dict) -> None:  # uvicorn's send when the socket takes the bytes
        log.append(message.get("body", message["type"]))

    timer = StreamTimer(0, StreamResult(request_id="r"))
    reader = ResponseReader(timer, Deadlines(), whole_ok=True)
    fwd = Forwarder(send, reader, [], take_5xx=True, state={"done": False})
    fwd.on_head(_Exchange(loop))  # type: ignore[arg-type]
    return fwd, timer


def test_a_burst_of_reads_is_forwarded_before_any_is_measured_with_its_own_arrival_stamps():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        log: list = []
        streams = [_stream(loop, log) for _ in range(3)]
        # one loop pass: a token for every stream (an engine step), the last one [DONE] too
        for k, (fwd, _timer) in enumerate(streams):
            fwd((k + 1) * MS, _event(f"tok{k}") + (b"data: [DONE]\n\n" if k == 2 else b""))
        # every response started and every read written, in arrival order, before any measuring
        assert [m for m in log if isinstance(m, bytes)] == [_event(f"tok{k}") for k in range(2)] + [
            _event("tok2") + b"data: [DONE]\n\n"
        ]
        assert [t.first_content_seen for _, t in streams] == [False, False, False]
        assert streams[2][0].reader.outcome is None  # its [DONE] not parsed yet
        await asyncio.sleep(0)  # the loop's next pass measures them
        assert [t.first_content_seen for _, t in streams] == [True, True, True]
        assert streams[2][0].reader.outcome is Outcome.OK and streams[0][0].reader.outcome is None
        for k, (_fwd, timer) in enumerate(streams):  # the arrival stamps, not the measuring time
            r = timer.finish(50 * MS, Outcome.OK)
            assert r.ttft_ms == r.first_byte_ms == float(k + 1)

    asyncio.run(run())


def test_measure_catches_up_at_once_and_the_loop_does_not_measure_a_read_twice():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        fwd, timer = _stream(loop, [])
        fwd(2 * MS, _event("a"))
        fwd(3 * MS, _event("b") + b"data: [DONE]\n\n")
        fwd.measure()  # what the request's task does before it reads the figures
        assert fwd.reader.outcome is Outcome.OK
        await asyncio.sleep(0)  # the pass's own call must not feed the same reads again
        r = timer.finish(9 * MS, Outcome.OK)
        assert (r.ttft_ms, r.e2e_ms, r.chunks, r.itl_gaps_us) == (2.0, 3.0, 2, [1000])

    asyncio.run(run())


def test_once_its_first_content_is_measured_a_stream_lets_its_reads_wait_for_the_pass():
    async def run() -> None:
        fwd, _timer = _stream(asyncio.get_running_loop(), [])
        ex = fwd.ex
        role = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        fwd(1 * MS, role)
        fwd.measure()
        assert not ex.defer_reads  # no content yet: its first token must not wait
        fwd(2 * MS, _event("a"))
        assert not ex.defer_reads  # measured at the pass's end, not in the read
        await asyncio.sleep(0)
        assert ex.defer_reads

    asyncio.run(run())
