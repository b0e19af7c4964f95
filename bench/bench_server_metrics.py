"""What scraping the variants' /metrics costs: the worker's CPU per scrape, and the
report's time to read a run's scrapes, on the ClickHouse server.

    .venv/bin/python bench/bench_server_metrics.py            # 1 h of scrapes, 3 rounds (~1 min)
    .venv/bin/python bench/bench_server_metrics.py --quick    # 2 min of scrapes, 1 round (~10 s)

1. Per scrape, in the worker (workers/server_metrics.py): parse one exposition
   (analysis.server_metrics.parse_exposition, prometheus_client's parser) and build its rows
   (scrape_rows). Expositions: the simulator's after traffic, with 1 and with 4 engines (real
   vLLM serves one engine's series per engine, the same families). The baseline side by side is
   the scrape interval's share of one core: "share" = CPU per scrape / 5 s (the default).
2. The report's read of a run's scrapes (analysis.server_metrics.read): 3 variants scraped every
   5 s for the run's length (rows written by SampleStore.insert_server_metrics), against the
   baseline of the same rows counted by one plain scan (SELECT count() of the run's rows).

Checks: the parse keeps every histogram series; the read's queue count equals the requests
observed. A failure prints `bench FAILED: ...` and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

DEFAULT_URL = os.environ.get(
    "ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench"
)
INTERVAL_S = 5


@dataclasses.dataclass
class _Engine:
    running: int = 3
    waiting: int = 1

    def kv_cache_usage(self) -> float:
        return 0.4


def exposition(engines: int, requests: int) -> tuple[object, str]:
    from simulator.metrics import Metrics

    m = Metrics("tiny-llama", [_Engine() for _ in range(engines)])
    for i in range(requests):
        m.request_done(
            i % engines,
            prompt_tokens=100,
            generated=20,
            max_tokens=20,
            ttft_s=0.05 + (i % 7) * 0.03,
            e2e_s=0.8,
            queue_s=0.01 * (i % 5),
            prefill_s=0.03,
            decode_s=0.7,
            inference_s=0.73,
        )
    return m, m.render().decode()


def bench_parse(rounds: int, reps: int) -> None:
    from analysis import server_metrics as sm

    print(
        f"\n1. worker CPU per scrape (parse + rows), best of {rounds} x {reps}; share of one core at {INTERVAL_S} s"
    )
    print(f"{'engines':>8} {'bytes':>8} {'rows':>6} {'ms/scrape':>10} {'share':>9}")
    for engines in (1, 4):
        _m, text = exposition(engines, 500)
        best = float("inf")
        rows: list = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(reps):
                rows = sm.scrape_rows("e", "v", 1, 0, sm.parse_exposition(text), duration_s=0.01)
            best = min(best, (time.process_time() - t0) / reps)
        hist_rows = sum(1 for r in rows if r["metric"] in sm.HISTOGRAMS)
        # per engine: TTFT's 22 buckets + Inf + sum + count, five phase histograms of 21 + 3
        if hist_rows != engines * (25 + 5 * 24):
            raise BenchFailed(f"the parse kept {hist_rows} histogram samples of {engines} engine(s)")
        print(f"{engines:>8} {len(text):>8} {len(rows):>6} {best * 1000:>10.3f} {best / INTERVAL_S:>9.4%}")


def bench_read(url: str, hours: float, rounds: int) -> None:
    from analysis import server_metrics as sm
    from analysis.definitions import Filters
    from samples.backends.clickhouse import ClickHouseServerBackend
    from simulator.metrics import Metrics

    # Named after the given database (abplat_bench_sm_... by default), so that whoever gave it
    # (tests/bench) can drop what a killed run left.
    base, given = url.rsplit("/", 1)
    database = f"{given}_sm_{uuid.uuid4().hex[:8]}"
    store = ClickHouseServerBackend(f"{base}/{database}")
    try:
        store.migrate()
        scrapes = int(hours * 3600 / INTERVAL_S)
        t0_ms, observed = 1_796_000_000_000, 0
        for variant in ("a", "b", "c"):
            m = Metrics("tiny-llama", [_Engine()])
            batch: list = []
            for k in range(scrapes):
                for _ in range(3):
                    m.request_done(
                        0,
                        prompt_tokens=10,
                        generated=5,
                        max_tokens=5,
                        ttft_s=0.05,
                        e2e_s=0.3,
                        queue_s=0.01,
                        prefill_s=0.03,
                        decode_s=0.2,
                        inference_s=0.23,
                    )
                text = m.render().decode()
                batch += sm.scrape_rows(
                    "bench",
                    variant,
                    1,
                    t0_ms + k * INTERVAL_S * 1000,
                    sm.parse_exposition(text),
                    duration_s=0.01,
                )
                if len(batch) > 20_000:
                    store.insert_server_metrics(batch)
                    batch = []
            store.insert_server_metrics(batch)
            observed = 3 * (scrapes - 1)  # increases start at the first scrape
        rows = store.query("SELECT count() FROM server_metrics")[0][0]
        f = Filters("bench", run_id=1)
        read_s, scan_s = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            got = sm.read(store, f, [], bucket_s=60)
            read_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            store.query("SELECT count() FROM server_metrics WHERE experiment = 'bench' AND run_id = 1")
            scan_s.append(time.perf_counter() - t)
        counts = {v: a["hist"]["queue"]["count"] for v, a in got.items()}
        if counts != {v: float(observed) for v in ("a", "b", "c")}:
            raise BenchFailed(f"read counted {counts}, expected {observed} per variant")
        r, s = statistics.median(read_s), statistics.median(scan_s)
        print(
            f"\n2. report read of one run's scrapes: 3 variants, {hours:g} h at {INTERVAL_S} s ({rows} rows), "
            f"median of {rounds}"
        )
        print(f"{'read (s)':>10} {'count scan (s)':>15} {'ratio':>7}")
        print(f"{r:>10.3f} {s:>15.3f} {r / s:>7.1f}")
    finally:
        store.execute(f"DROP DATABASE IF EXISTS {database}")
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 min of scrapes, 1 round (~10 s)")
    ap.add_argument("--url", default=DEFAULT_URL)
    args = ap.parse_args()
    bench_parse(rounds=1 if args.quick else 3, reps=20 if args.quick else 100)
    # --quick: 2 min of scrapes, still a few dozen inserts (the server parses each: its CPU, not ours)
    bench_read(args.url, hours=1 / 30 if args.quick else 1.0, rounds=1 if args.quick else 3)
    return 0


if __name__ == "__main__":
    sys.exit(run_checked(main))
