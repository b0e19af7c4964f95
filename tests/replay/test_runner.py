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
    return [TraceRequest(seq=i, offset_s=i * gap_s, user_id=f"user-{i % 7}", prompt_tokens=20 + i, max_tokens=4)
            for i in range(n)]  # fmt: skip


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
    return ShardSpec(experiment="exp", run_id=9, mode=mode, requests=reqs,
                     offsets=[r.offset_s for r in reqs], start_at_unix=time.time() + 0.2,
                     concurrency=kw.pop("concurrency", 64), variants=kw.pop("variants", ["a", "b"]), **kw)  # fmt: skip


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
    stats, rows = run(spec_for(reqs), sims, assign=lambda u: ("a", 1),
                      should_cancel=lambda: time.monotonic() - started > 0.8, progress_interval_s=0.1)  # fmt: skip
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
    assert stats.recorded == 4 and {r["outcome"] for r in rows} == {"malformed"}
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
