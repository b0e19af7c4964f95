"""The variants' scraped series in the sample store (samples.schema.SERVER_METRICS_TABLE), on
chDB and on the ClickHouse server: written as the scraper writes them, read back as the report
reads them (analysis.server_metrics), retries and server restarts counted once."""

from __future__ import annotations

import dataclasses

import pytest

from analysis import server_metrics as sm
from analysis.definitions import Filters
from samples import schema
from simulator.metrics import Metrics

QUEUE = "vllm:request_queue_time_seconds"


@dataclasses.dataclass
class FakeEngine:
    running: int = 0
    waiting: int = 0
    usage: float = 0.0

    def kv_cache_usage(self) -> float:
        return self.usage


def observe(m: Metrics, engine: int, queue_s: float, prefill_s: float) -> None:
    m.request_done(
        engine,
        prompt_tokens=10,
        generated=4,
        max_tokens=4,
        ttft_s=queue_s + prefill_s + 0.01,
        e2e_s=1.0,
        queue_s=queue_s,
        prefill_s=prefill_s,
        decode_s=0.5,
        inference_s=prefill_s + 0.5,
    )


def scrape(m: Metrics, t_ms: int, run_id: int = 7, variant: str = "awq") -> list[dict]:
    samples = sm.parse_exposition(m.render().decode())
    return sm.scrape_rows("exp", variant, run_id, t_ms, samples, duration_s=0.004)


T0 = 1_796_000_000_000  # ms


def test_scrapes_are_stored_and_read_back_as_increases_on_both_backends(store):
    engines = [FakeEngine(running=2, waiting=1, usage=0.25), FakeEngine(running=1, waiting=0, usage=0.75)]
    m = Metrics("tiny", engines)
    rows = scrape(m, T0)  # baseline: every series at 0
    observe(m, 0, 0.1, 0.05)
    observe(m, 1, 0.2, 0.05)
    observe(m, 1, 0.9, 0.4)
    second = scrape(m, T0 + 5000)
    rows += second
    assert len(rows) > 500  # two engines, two scrapes: more than one insert chunk
    assert store.insert_server_metrics(rows) == len(rows)
    store.insert_server_metrics(second)  # a retried insert of the same scrape: the same keys
    # a server restart (counters back to 0), then one more request on engine 1 (its count
    # drops from 2 to 1: a restart, increase 1; engine 0's drops to 0: increase 0)
    m2 = Metrics("tiny", engines)
    observe(m2, 1, 0.4, 0.1)
    store.insert_server_metrics(scrape(m2, T0 + 10_000))
    store.insert_server_metrics(
        sm.scrape_rows("exp", "awq", 7, T0 + 15_000, [], duration_s=2.0, error='timeout "after" 2 s')
    )
    store.insert_server_metrics(scrape(Metrics("tiny", engines), T0, run_id=8))  # another run

    got = sm.read(store, Filters("exp", runs=(7,)), ["awq"], bucket_s=10)["awq"]
    q = got["hist"]["queue"]
    assert q["count"] == pytest.approx(4) and q["sum"] == pytest.approx(0.1 + 0.2 + 0.9 + 0.4)
    assert q["buckets"]["0.3"] == pytest.approx(2) and q["buckets"]["+Inf"] == pytest.approx(4)
    assert got["scrapes"] == {
        "ok": 3,
        "failed": 1,
        "last_error": 'timeout "after" 2 s',
        "first_ms": T0,
        "last_ms": T0 + 15_000,
    }
    assert got["counters"]["generation_tokens"] == pytest.approx(16)
    # gauges: per scrape, running summed over the engines, KV usage averaged
    assert got["gauges"]["running"] == [3.0, 3.0, 3.0]
    assert got["gauges"]["kv_cache_usage"] == [0.5, 0.5, 0.5]
    # queue increases by the 10 s bucket of the scrape that saw them
    by_bucket = got["by_bucket"]
    assert by_bucket[T0 // 1000 // 10 * 10]["queue"] == pytest.approx([1.2, 3])
    assert by_bucket[(T0 + 10_000) // 1000 // 10 * 10]["queue"] == pytest.approx([0.4, 1])
    summary = sm.variant_summary(got, {"p50": 80.0})
    assert summary["requests_finished"] == 4 and summary["queue_ms"]["mean_ms"] == pytest.approx(400.0)
    p50, p99 = summary["queue_ms"]["quantiles"]
    # rank 2 of 4 is the last of the [0, 0.3 s) bucket; rank 3.96 lies in [0.8, 1.0 s), which
    # holds increases 2 -> 4 (a restart that leaves a bucket's count as it was goes unseen there,
    # as in Prometheus)
    assert p50["bucket_ms"] == [0.0, 300.0] and p50["value_ms"] == pytest.approx(300.0)
    assert p99["bucket_ms"] == [800.0, 1000.0] and p99["value_ms"] == pytest.approx(800 + 200 * 1.96 / 2)
    assert summary["client_ttft_ms"] == {"p50": 80.0} and summary["running"]["max"] == 3.0


def test_a_bad_row_is_refused_naming_it_and_nothing_is_written(store):
    rows = sm.scrape_rows("exp", "awq", 7, T0, [(QUEUE, QUEUE + "_count", "{}", "", 1.0)], duration_s=0.1)
    rows[1] = {**rows[1], "value": float("nan")}
    with pytest.raises(ValueError, match="row 1 column 'value' must be a finite number"):
        store.insert_server_metrics(rows)
    with pytest.raises(ValueError, match="row 0 has no 'scraped_ms'"):
        store.insert_server_metrics([{k: v for k, v in rows[0].items() if k != "scraped_ms"}])
    assert store.query(f"SELECT count() FROM {schema.SERVER_METRICS_TABLE}") == [(0,)]
