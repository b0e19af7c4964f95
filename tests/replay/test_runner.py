"""The shard runner against a real simulator: schedule, lag, split and mirror, resume, cancel."""

import asyncio
import time

import pytest

from replay.plan import request_id
from replay.runner import ShardRunner, ShardSpec
from replay.sources import TraceRequest
from simulator.serve import start_in_thread
from streaming.client import VariantClient


@pytest.fixture(scope="module")
def sims():
    handles = {name: start_in_thread("fast") for name in ("a", "b")}
    yield handles
    for h in handles.values():
        h.stop()


def requests(n, gap_s=0.01):
    return [
        TraceRequest(seq=i, offset_s=i * gap_s, user_id=f"user-{i % 7}", prompt_tokens=20 + i, max_tokens=4)
        for i in range(n)
    ]


def run(spec, sims, **kw):
    rows = []

    async def main():
        clients = {k: VariantClient(sims[k].url + "/v1", sims[k].model, "chat") for k in spec.variants}
        try:
            runner = ShardRunner(spec, clients, put_row=rows.append, **kw)
            return await runner.run()
        finally:
            for c in clients.values():
                await c.aclose()

    return asyncio.run(main()), rows


def spec_for(reqs, mode="split", **kw):
    return ShardSpec(
        experiment="exp",
        run_id=9,
        mode=mode,
        requests=reqs,
        offsets=[r.offset_s for r in reqs],
        start_at_unix=time.time() + 0.2,
        concurrency=kw.pop("concurrency", 64),
        variants=kw.pop("variants", ["a", "b"]),
        **kw,
    )


def test_split_sends_each_request_once_to_its_assigned_variant(sims):
    reqs = requests(40)
    assign = lambda user: ("a" if user < "user-3" else "b", 17)  # noqa: E731
    stats, rows = run(spec_for(reqs), sims, assign=assign)
    assert stats.recorded == 40 and stats.outcomes == {"ok": 40}
    assert sorted(r["request_id"] for r in rows) == sorted(request_id(9, i) for i in range(40))
    for r in rows:
        assert r["variant"] == assign(r["user_id"])[0] and r["config_revision"] == 17
        assert r["ttft_ms"] is not None and r["output_tokens"] == 4 and r["prompt_tokens"] >= 20 + r["seq"]
        assert r["scheduled_offset_ms"] == pytest.approx(r["seq"] * 10, abs=0.5)
    assert all(r["schedule_lag_ms"] >= 0 for r in rows) and len(stats.lags_ms) == 40


def test_mirror_sends_every_request_to_every_variant(sims):
    stats, rows = run(spec_for(requests(15), mode="mirror"), sims, assign=None, revision=lambda: 3)
    assert stats.recorded == 30
    assert {(r["seq"], r["variant"]) for r in rows} == {(i, v) for i in range(15) for v in "ab"}
    planned = {}
    for r in rows:
        planned.setdefault(r["seq"], set()).add(r["scheduled_offset_ms"])
    assert all(len(p) == 1 for p in planned.values())  # both variants on the same planned moment
    assert {r["config_revision"] for r in rows} == {3}


def test_resumed_shard_skips_what_is_recorded(sims):
    reqs = requests(10)
    done = frozenset(request_id(9, i) for i in range(0, 10, 2))
    stats, rows = run(spec_for(reqs, skip_ids=done), sims, assign=lambda u: ("a", 1))
    assert sorted(r["seq"] for r in rows) == [1, 3, 5, 7, 9]
    assert stats.skipped_recorded == 5


def test_closed_loop_keeps_concurrency(sims):
    reqs = requests(30)
    spec = spec_for(reqs, concurrency=4)
    spec.offsets = None
    stats, rows = run(spec, sims, assign=lambda u: ("b", 1))
    assert stats.recorded == 30 and max(r["in_flight"] for r in rows) <= 3


def test_cancel_stops_sending_and_keeps_what_was_sent(sims):
    reqs = requests(200, gap_s=0.02)  # 4 s of schedule
    started = time.monotonic()
    stats, rows = run(
        spec_for(reqs),
        sims,
        assign=lambda u: ("a", 1),
        should_cancel=lambda: time.monotonic() - started > 0.8,
        progress_interval_s=0.1,
    )
    assert stats.cancelled and 0 < stats.recorded < 200
    assert stats.recorded + stats.not_sent == 200 and len(rows) == stats.recorded


def test_unreachable_variant_is_recorded_as_an_error_not_dropped():
    reqs = requests(3)
    spec = spec_for(reqs)
    spec.variants = ["a"]
    rows = []

    async def main():
        client = VariantClient("http://127.0.0.1:9/v1", "tiny", "chat")
        try:
            return await ShardRunner(spec, {"a": client}, lambda u: ("a", 1), rows.append).run()
        finally:
            await client.aclose()

    stats = asyncio.run(main())
    assert stats.recorded == 3 and {r["outcome"] for r in rows} == {"connect_error"}


def test_bad_specs_rejected():
    with pytest.raises(ValueError, match="mode must be"):
        spec_for(requests(1), mode="shadow")
    with pytest.raises(ValueError, match="concurrency"):
        spec_for(requests(1), concurrency=0)
    with pytest.raises(ValueError, match="needs an assigner"):
        ShardRunner(spec_for(requests(1)), {"a": None, "b": None}, None, lambda r: None)


def test_a_variant_the_experiment_lacks_is_recorded_with_the_reason(sims):
    stats, rows = run(spec_for(requests(4)), sims, assign=lambda u: ("ghost", 2))
    # our own failure: client_error, never a server-fault class like malformed
    assert stats.recorded == 4 and {r["outcome"] for r in rows} == {"client_error"}
    assert "router assigned variant 'ghost'" in rows[0]["error"]


class _ClockStartsLate:
    """A client whose request clock starts 50 ms after the call, as when a new connection
    waits its turn in a start burst (streaming/pacing.py)."""

    model = "m"

    async def stream(self, rid, prompt, max_tokens, extra=None):
        from streaming.result import Outcome, StreamResult

        start = time.perf_counter_ns() + 50_000_000
        return StreamResult(outcome=Outcome.OK, request_id=rid, start_ns=start, ttft_ms=1.0, e2e_ms=2.0)

    async def aclose(self):
        pass


def test_a_wait_before_the_request_clock_starts_counts_as_schedule_lag():
    reqs = requests(5, gap_s=0.0)
    spec = spec_for(reqs, mode="mirror", variants=["a"])
    rows = []

    async def main():
        return await ShardRunner(spec, {"a": _ClockStartsLate()}, None, rows.append).run()

    stats = asyncio.run(main())
    assert stats.recorded == 5 and min(stats.lags_ms) >= 50.0
    for r in rows:
        assert r["schedule_lag_ms"] >= 50.0
        planned_unix_ms = spec.start_at_unix * 1000.0 + r["scheduled_offset_ms"]
        assert r["sent_unix_ms"] - planned_unix_ms >= 49.0  # the send time is when the clock started


class _Recorder:
    """A client that records what it was sent; ``hold`` makes each request wait that long (and
    report a cancelled record when cancelled, as streaming.client does)."""

    def __init__(self, api="chat", hold=0.0):
        self.api, self.hold, self.sent = api, hold, []

    async def stream(self, rid, prompt, max_tokens, extra=None):
        from streaming.result import Outcome, StreamCancelled, StreamResult

        self.sent.append(prompt)
        try:
            await asyncio.sleep(self.hold)
        except asyncio.CancelledError:
            raise StreamCancelled(StreamResult(outcome=Outcome.CANCELLED, request_id=rid)) from None
        return StreamResult(outcome=Outcome.OK, request_id=rid, ttft_ms=1.0, e2e_ms=2.0)


def run_fake(spec, clients, assign=None, **kw):
    rows, unretrieved = [], []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        runner = ShardRunner(spec, clients, assign, rows.append, **kw)
        try:
            return await runner.run()
        finally:
            import gc

            gc.collect()  # unretrieved task exceptions are reported when the task is collected
            await asyncio.sleep(0)

    return asyncio.run(main()), rows, unretrieved


def test_mirror_sends_each_variant_the_shape_of_its_api():
    from replay.shapes import render_plain

    msgs = ({"role": "user", "content": "hi"},)
    reqs = [TraceRequest(0, 0.0, "u", 0, 4, messages=msgs), TraceRequest(1, 0.0, "u", 12, 4)]
    chat, comp = _Recorder("chat"), _Recorder("completions")
    spec = spec_for(reqs, mode="mirror", render_chat="plain")
    stats, rows, _ = run_fake(spec, {"a": chat, "b": comp})
    assert stats.recorded == 4 and stats.outcomes == {"ok": 4}
    assert chat.sent[0] == [{"role": "user", "content": "hi"}] and comp.sent[0] == render_plain(msgs)
    assert isinstance(comp.sent[1], str) and chat.sent[1] == [{"role": "user", "content": comp.sent[1]}]


def test_a_shape_mismatch_is_refused_before_anything_is_sent():
    """Chat messages to a completions variant were sent, failed in the client
    and were recorded as malformed (a server fault); now nothing is sent."""
    from replay.shapes import ShapeError

    reqs = [
        TraceRequest(i, 0.0, "u", 0, 4, messages=({"role": "user", "content": "x"},), line=i + 1)
        for i in range(3)
    ]
    comp = _Recorder("completions")
    with pytest.raises(ShapeError, match=r"3 line\(s\) \(1, 2, 3\).*variant\(s\) b take completions"):
        ShardRunner(spec_for(reqs, mode="mirror"), {"a": _Recorder(), "b": comp}, None, lambda r: None)
    assert comp.sent == []


def test_a_stop_from_the_router_stops_sending_and_leaves_no_unretrieved_task_exception():
    """Concluding mid-run made every assignment raise UnknownExperiment in its
    own task (89 "Task exception was never retrieved") while the schedule kept sending."""
    from replay.runner import StopReplay

    reqs = requests(100, gap_s=0.01)
    calls = []

    def assign(user):
        calls.append(user)
        if len(calls) > 10:
            raise StopReplay("experiment 'exp' has no weights any more")
        return "a", 1

    stats, rows, unretrieved = run_fake(spec_for(reqs, variants=["a"]), {"a": _Recorder()}, assign)
    assert stats.cancelled and stats.stop_reason == "experiment 'exp' has no weights any more"
    assert stats.recorded == len(rows) == 10 and stats.recorded + stats.not_sent == 100
    assert len(calls) <= 12 and unretrieved == []


def test_an_error_of_a_send_task_is_raised_once_after_the_rest_was_recorded():
    reqs = requests(50, gap_s=0.005)

    def assign(user):
        if user == "user-3":
            raise KeyError("router broke")
        return "a", 1

    rows, unretrieved = [], []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        runner = ShardRunner(spec_for(reqs, variants=["a"]), {"a": _Recorder(hold=0.02)}, assign, rows.append)
        with pytest.raises(KeyError, match="router broke"):
            await runner.run()
        return runner.stats

    stats = asyncio.run(main())
    assert rows and len(rows) == stats.recorded < 50 and unretrieved == []


def test_after_a_cancel_requests_in_flight_get_a_grace_then_are_recorded_cancelled():
    """In-flight requests finish or are cancelled and recorded as such."""
    reqs = requests(6, gap_s=0.0)
    started = time.monotonic()
    t0 = time.monotonic()
    stats, rows, _ = run_fake(
        spec_for(reqs, variants=["a"]),
        {"a": _Recorder(hold=30.0)},
        lambda u: ("a", 1),
        should_cancel=lambda: time.monotonic() - started > 0.3,
        progress_interval_s=0.05,
        cancel_grace_s=0.2,
    )
    assert time.monotonic() - t0 < 5.0
    assert stats.cancelled and stats.recorded == stats.sent == 6 == len(rows)
    assert {r["outcome"] for r in rows} == {"cancelled"}


def test_a_full_closed_loop_stops_at_a_cancel_instead_of_sending_when_a_slot_frees():
    reqs = requests(40)
    spec = spec_for(reqs, variants=["a"], concurrency=2)
    spec.offsets = None
    started = time.monotonic()
    stats, rows, _ = run_fake(
        spec,
        {"a": _Recorder(hold=0.1)},
        lambda u: ("a", 1),
        should_cancel=lambda: time.monotonic() - started > 0.35,
        progress_interval_s=0.05,
        cancel_grace_s=5.0,
    )
    assert stats.cancelled and stats.recorded + stats.not_sent == 40 and stats.recorded < 20
    assert {r["outcome"] for r in rows} == {"ok"}  # in flight within the grace: they finished


def test_a_resumed_late_shard_keeps_the_trace_spacing_and_counts_lag_from_the_plan(sims):
    # A shard redelivered 2 s after its schedule began: half of it is recorded, the rest must
    # not go out at once (a burst it would measure itself) but keep their 50 ms spacing.
    reqs = requests(10, gap_s=0.05)
    done = frozenset(request_id(9, i) for i in range(5))
    spec = spec_for(reqs, skip_ids=done, attempt=2)
    spec.start_at_unix = time.time() - 2.0
    stats, rows = run(spec, sims, assign=lambda u: ("a", 1))
    assert sorted(r["seq"] for r in rows) == [5, 6, 7, 8, 9]
    assert stats.shift_s > 1.5
    sent = sorted((r["seq"], r["sent_unix_ms"]) for r in rows)
    gaps = [b[1] - a[1] for a, b in zip(sent, sent[1:])]
    assert all(40 <= g <= 150 for g in gaps), gaps  # spaced as the trace, not all at once
    assert all(r["schedule_lag_ms"] > 1500 for r in rows)  # and marked late against the plan


def test_a_first_attempt_that_is_late_is_not_shifted(sims):
    spec = spec_for(requests(4, gap_s=0.0))
    spec.start_at_unix = time.time() - 2.0
    stats, rows = run(spec, sims, assign=lambda u: ("a", 1))
    assert stats.shift_s == 0.0 and len(rows) == 4


def test_a_budget_stops_starting_requests_and_defers_the_rest(sims):
    reqs = requests(30, gap_s=0.05)  # 1.5 s of schedule
    stats, rows = run(spec_for(reqs, budget_s=0.5), sims, assign=lambda u: ("a", 1))
    assert 0 < stats.recorded < 30 and stats.deferred == 30 - stats.recorded == 30 - len(rows)
    assert stats.not_sent == 0 and not stats.cancelled
    assert sorted(r["seq"] for r in rows) == list(range(len(rows)))  # the first ones, in order


def test_a_cancel_wakes_the_send_loop_from_a_long_wait_at_once():
    # The send loop waits for each request's send time on one future and one timer handle
    # (ShardRunner._sleep): a cancel must end that wait now, not when the request was due.
    reqs = requests(3, gap_s=30.0)  # the second request is due in 30 s
    started = time.monotonic()
    stats, rows, unretrieved = run_fake(
        spec_for(reqs, variants=["a"]),
        {"a": _Recorder()},
        lambda u: ("a", 1),
        should_cancel=lambda: time.monotonic() - started > 0.3,
        progress_interval_s=0.05,
    )
    assert time.monotonic() - started < 5.0
    assert stats.cancelled and stats.recorded == 1 and stats.not_sent == 2
    assert not unretrieved


def test_every_request_gets_the_same_read_only_extra_options():
    seen = []

    class Extra(_Recorder):
        async def stream(self, rid, prompt, max_tokens, extra=None):
            seen.append(extra)
            return await super().stream(rid, prompt, max_tokens, extra)

    stats, _, _ = run_fake(spec_for(requests(3), variants=["a"]), {"a": Extra()}, lambda u: ("a", 1))
    assert stats.recorded == 3 and all(dict(e) == {"ignore_eos": True} for e in seen)
    with pytest.raises(TypeError):
        seen[0]["ignore_eos"] = False  # shared by every request: nobody may change it


@pytest.mark.parametrize("loop_name", ["uvloop", "asyncio"])
def test_requests_due_together_or_within_the_send_lead_go_in_schedule_order(loop_name):
    """Each send task waits out its last SEND_LEAD_S on a timer of its own (runner step 10):
    requests due at the same moment, or closer together than the lead, still start in schedule
    order on either loop."""
    from streaming import loop as streaming_loop

    n = 60
    reqs = [TraceRequest(i, 0.0, f"u{i}", 4, 2) for i in range(n)]
    spec = spec_for(reqs, variants=["a"])
    spec.offsets = [0.0] * 20 + [0.001 * i / 40 for i in range(40)]  # 20 at once, 40 within 1 ms
    started = []

    class Order:
        api = "chat"

        async def stream(self, rid, prompt, max_tokens, extra=None):
            from streaming.result import Outcome, StreamResult

            started.append(int(rid.rsplit("-", 1)[-1]))
            return StreamResult(outcome=Outcome.OK, request_id=rid)

    async def main():
        runner = ShardRunner(spec, {"a": Order()}, lambda user: ("a", 1), lambda row: None)
        return await runner.run()

    stats = streaming_loop.run(main(), loop_name)
    assert stats.sent == n and stats.not_sent == 0
    assert started == sorted(started) and len(started) == n


def test_a_send_whose_time_passed_before_its_task_ran_still_waits_for_the_one_before_it():
    # The earlier request's timer fires late (a busy loop; on uvloop, whole milliseconds) and
    # the later request's time has passed by the time its task runs: it still goes second.
    spec = spec_for([TraceRequest(i, 0.0, f"u{i}", 4, 2) for i in range(2)], variants=["a"])
    order = []

    async def main():
        runner = ShardRunner(spec, {"a": object()}, lambda user: ("a", 1), lambda row: None)
        loop = asyncio.get_running_loop()
        real = loop.call_at

        def late(when, callback, *args, **kw):  # the first timer set fires 30 ms after its time
            loop.call_at = real
            return real(when + 0.03, callback, *args, **kw)

        async def send(i, due):
            await runner._until(due)
            order.append(i)

        now = time.perf_counter()
        loop.call_at = late
        first = asyncio.create_task(send(0, now + 0.002))
        await asyncio.sleep(0)  # the first task runs and sets its timer
        await asyncio.sleep(0.01)  # the second request's time passes meanwhile
        await asyncio.gather(first, asyncio.create_task(send(1, now + 0.0021)))

    asyncio.run(main())
    assert order == [0, 1]
