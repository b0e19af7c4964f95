"""Replay benchmark (issue 5). Prints tables; copy them into bench/RESULTS.md.

    .venv/bin/python bench/bench_replay.py              # parts 1-3, ~10 minutes
    .venv/bin/python bench/bench_replay.py --part 1     # one part
    .venv/bin/python bench/bench_replay.py --quick      # smoke run, ~20 s

The shard core (workers.replay.runner.ShardRunner) runs in worker processes exactly as
workers/shard.py drives it from a Celery task, minus the Django rows: VariantClient per variant,
the live assigner (experiments.assignment, 34/33/33), rows through samples' SpoolingWriter in a
BatchSink into the ClickHouse server. Simulators run in their own processes, one per variant.

1. Throughput: Poisson arrivals at increasing rates (request shapes from the Azure code trace),
   one worker process running every shard, then two processes with half the shards each. A rate
   is sustained when schedule lag p99 < 5 ms, every request got a sample in the store and every
   outcome is ok. Scaling ratio = best sustained rate with 2 workers / with 1.
2. The whole Azure code trace (8,819 requests) at 20x through three `fast` simulators, split
   and mirror: wall time, lag, and the samples counted in the store (uniqExact and FINAL).
3. A slice of the trace through the realistic fp16/awq/awq-fa2 profiles at a speed they sustain,
   with per-variant TTFT from the store.

The row-by-row vs batched insert comparison is bench/bench_insert.py.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import math
import multiprocessing as mp
import os
import pathlib
import shlex
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.replay.arrivals import Arrival  # noqa: E402
from workers.replay.plan import MIRROR, SPLIT, Shard, expected_samples  # noqa: E402
from workers.replay.sources import TraceRequest, load_source  # noqa: E402
from workers.replay.users import UserPopulation  # noqa: E402

TRACE = ROOT / "data" / "traces" / "azure_llm_2023_code.csv"
DEFAULT_URL = "clickhouse://default:@127.0.0.1:19000/abplat_bench"
EXPERIMENT = "bench-replay"
SALT = "bench-replay-salt"
WEIGHTS = {"a": 34, "b": 33, "c": 33}
LAG_LIMIT_MS = 5.0
MODEL = "abplat-sim"


def nearest_rank(ordered: list[float], q: float) -> float:
    # Same quantile as ShardStats.lag_quantile, so figures match what runs record.
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------
# Worker process: one or more shards, one event loop, one sink (as one Celery worker process).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WorkerJob:
    run_id: int
    mode: str
    shards: list[int]
    shard_count: int
    requests: list[TraceRequest]  # this worker's requests, all its shards
    offsets: list[float]  # per request, seconds after the run start
    variants: dict[str, str]  # variant -> simulator URL
    clickhouse_url: str
    spool_dir: str
    concurrency: int = 512


def worker_main(conn, job: WorkerJob) -> None:
    try:
        conn.send(("done", _worker(conn, job)))
    except BaseException as exc:  # the parent reports it; never hang the bench
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _worker(conn, job: WorkerJob) -> dict:
    from experiments.assignment import allocate, make_assigner
    from samples.spool import SpoolingWriter
    from samples.store import ClickHouseServerBackend
    from workers.replay.runner import ShardRunner, ShardSpec
    from workers.replay.sink import BatchSink
    from workers.streaming.client import VariantClient

    writer = SpoolingWriter(ClickHouseServerBackend(job.clickhouse_url), job.spool_dir)
    spooled = [0]

    def write(rows) -> str:
        how = writer.write(rows)
        spooled[0] += len(rows) if how == "spooled" else 0
        return how

    sink = BatchSink(write)
    pick = make_assigner(SALT, allocate(WEIGHTS))

    def assign(user_id: str) -> tuple[str, int]:
        return pick(user_id), 1

    async def main() -> dict:
        clients = {v: VariantClient(url, MODEL, "completions") for v, url in job.variants.items()}
        try:
            # Warm connections and code paths; the measured run starts when the parent says so.
            await asyncio.gather(*(c.stream(f"warm-{v}-{i}", "warm up", 2, {"ignore_eos": True})
                                   for v, c in clients.items() for i in range(8)))  # fmt: skip
            conn.send(("ready", os.getpid()))
            start_at = await asyncio.to_thread(conn.recv)
            runners = []
            for index in job.shards:
                part = Shard(index, job.shard_count)
                mine = [i for i, r in enumerate(job.requests) if part.owns(r.seq)]
                spec = ShardSpec(
                    experiment=EXPERIMENT, run_id=job.run_id, mode=job.mode,
                    requests=[job.requests[i] for i in mine], offsets=[job.offsets[i] for i in mine],
                    start_at_unix=start_at, concurrency=job.concurrency, variants=list(job.variants),
                )  # fmt: skip
                runners.append(ShardRunner(spec, clients, assign if job.mode == SPLIT else None,
                                           sink.put, revision=lambda: 1))  # fmt: skip
            cpu0 = time.process_time()
            stats = await asyncio.gather(*(r.run() for r in runners))
            return {"stats": stats, "cpu_s": time.process_time() - cpu0, "end_unix": time.time()}
        finally:
            for c in clients.values():
                await c.aclose()

    try:
        out = asyncio.run(main())
    finally:
        written = sink.close()  # every row durable (stored or spooled) before we report
    lags = [lag for s in out["stats"] for lag in s.lags_ms]
    outcomes: dict[str, int] = {}
    for s in out["stats"]:
        for k, n in s.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + n
    return {
        "pid": os.getpid(), "lags_ms": lags, "outcomes": outcomes, "cpu_s": out["cpu_s"],
        "end_unix": out["end_unix"], "end_durable_unix": time.time(), "written": written,
        "batches": sink.batches, "spooled": spooled[0],
        "sent": sum(s.sent for s in out["stats"]), "recorded": sum(s.recorded for s in out["stats"]),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Parent: simulators, the store, runs split across worker processes, counting in the store.
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, clickhouse_url: str, spool_dir: str) -> None:
        from samples.store import ClickHouseServerBackend, StoreError

        self.url, self.spool_dir = clickhouse_url, spool_dir
        self.store = ClickHouseServerBackend(clickhouse_url, tries=1)
        try:
            self.store.ensure_database()
            self.store.migrate()
        except StoreError as exc:
            raise SystemExit(
                f"bench_replay: ClickHouse server at {self.store.url_safe} is not usable ({exc}). "
                "Start it with: scripts/clickhouse.sh start"
            ) from None
        # Unique run ids per invocation: the bench database keeps earlier runs' samples.
        self._next_run = int(time.time() * 1000)
        self.ctx = mp.get_context("spawn")  # never fork a process with threads and sockets

    def run_id(self) -> int:
        self._next_run += 1
        return self._next_run

    def replay(self, *, mode: str, requests: list[TraceRequest], offsets: list[float],
               variants: dict[str, str], workers: int, shard_count: int,
               concurrency: int = 512) -> dict:  # fmt: skip
        run_id = self.run_id()
        jobs = []
        for w in range(workers):
            mine = [s for s in range(shard_count) if s % workers == w]
            idx = [i for i, r in enumerate(requests) if r.seq % shard_count in mine]
            jobs.append(WorkerJob(run_id, mode, mine, shard_count, [requests[i] for i in idx],
                                  [offsets[i] for i in idx], variants, self.url, self.spool_dir,
                                  concurrency))  # fmt: skip
        procs, conns = [], []
        for job in jobs:
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=worker_main, args=(child, job), daemon=True)
            p.start()
            procs.append(p)
            conns.append(parent)
        try:
            for c in conns:  # 1. every worker imported, connected and warmed up
                kind, value = self._recv(c, 60)
                if kind != "ready":
                    raise RuntimeError(f"worker failed before the start: {value}")
            start_at = time.time() + 0.3
            for c in conns:  # 2. one absolute start for all shards
                c.send(start_at)
            budget = (offsets[-1] if offsets else 0) + 120
            results = []
            for c in conns:
                kind, value = self._recv(c, budget)
                if kind != "done":
                    raise RuntimeError(f"worker failed: {value}")
                results.append(value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return self._summarize(run_id, mode, requests, offsets, variants, start_at, results)

    @staticmethod
    def _recv(conn, timeout_s: float):
        if not conn.poll(timeout_s):
            raise RuntimeError(f"worker sent nothing for {timeout_s:.0f}s")
        return conn.recv()

    def _summarize(self, run_id, mode, requests, offsets, variants, start_at, results) -> dict:
        from samples.schema import SAMPLES_TABLE

        lags = sorted(lag for r in results for lag in r["lags_ms"])
        outcomes: dict[str, int] = {}
        for r in results:
            for k, n in r["outcomes"].items():
                outcomes[k] = outcomes.get(k, 0) + n
        final = self.store.query(
            f"SELECT count() FROM {SAMPLES_TABLE} FINAL WHERE run_id = %(r)s", {"r": run_id}
        )[0][0]
        raw = self.store.query(f"SELECT count() FROM {SAMPLES_TABLE} WHERE run_id = %(r)s", {"r": run_id})
        end = max(r["end_unix"] for r in results)
        return {
            "run_id": run_id, "mode": mode, "requests": len(requests),
            "expected": expected_samples(len(requests), mode, len(variants)),
            "span_s": offsets[-1] if offsets else 0.0, "wall_s": end - start_at,
            "durable_s": max(r["end_durable_unix"] for r in results) - start_at,
            "lag_p50": nearest_rank(lags, 0.50), "lag_p99": nearest_rank(lags, 0.99),
            "lag_max": lags[-1] if lags else 0.0, "outcomes": outcomes,
            "sent": sum(r["sent"] for r in results), "recorded": sum(r["recorded"] for r in results),
            "count": self.store.count(run_id), "final": int(final), "raw": int(raw[0][0]),
            "spooled": sum(r["spooled"] for r in results), "batches": sum(r["batches"] for r in results),
            "cpu": [r["cpu_s"] / max(end - start_at, 1e-9) for r in results],
        }  # fmt: skip


def start_simulators(profiles: dict[str, str]) -> dict[str, object]:
    from simulator.serve import start_subprocess

    with concurrent.futures.ThreadPoolExecutor(len(profiles)) as pool:
        futures = {v: pool.submit(start_subprocess, p, 0, MODEL) for v, p in profiles.items()}
        return {v: f.result() for v, f in futures.items()}


def load_trace(limit: int | None = None) -> list[TraceRequest]:
    loaded = load_source(TRACE, "azure", population=UserPopulation(seed=0), limit=limit)
    return loaded.requests


def shaped(trace: list[TraceRequest], n: int) -> list[TraceRequest]:
    """n requests with the trace's prompt/output sizes and users (cycled), seq 0..n-1."""
    return [dataclasses.replace(trace[i % len(trace)], seq=i) for i in range(n)]


def fmt_outcomes(outcomes: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "-"


# ---------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------


def part1(bench: Bench, sims: dict, args) -> None:
    trace = load_trace()
    urls = {v: h.url for v, h in sims.items()}
    print(f"\nPart 1: replay throughput, Poisson arrivals, split mode, {args.seconds:g} s per rate,"
          f" {args.shards} shards, concurrency 512/shard, 3 x `fast` simulator subprocesses,"
          f" request shapes from the Azure code trace (prompt mean 2,048 tokens, output mean 28)")  # fmt: skip
    head = (f"| workers | target/s | requests | sent/s | lag p50 ms | lag p99 ms | lag max ms | "
            f"outcomes | in store | worker CPU | sustained |")  # fmt: skip
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    best: dict[int, float] = {}
    for workers in (1, 2):
        best[workers] = 0.0
        for rate in args.rates:
            n = max(1, int(rate * args.seconds))
            reqs = shaped(trace, n)
            offsets = Arrival(mode="poisson", rate=rate, seed=int(rate)).offsets([0.0] * n)
            r = bench.replay(mode=SPLIT, requests=reqs, offsets=offsets, variants=urls,
                             workers=workers, shard_count=args.shards)  # fmt: skip
            all_ok = r["outcomes"] == {"ok": n}
            ok = r["lag_p99"] < LAG_LIMIT_MS and r["count"] == n and all_ok
            if ok:
                best[workers] = max(best[workers], rate)
            sent_rate = (n - 1) / r["span_s"] if r["span_s"] else float(n)
            cpu = "+".join(f"{c * 100:.0f}%" for c in r["cpu"])
            print(f"| {workers} | {rate:g} | {n} | {sent_rate:.0f} | {r['lag_p50']:.2f} | "
                  f"{r['lag_p99']:.2f} | {r['lag_max']:.1f} | {fmt_outcomes(r['outcomes'])} | "
                  f"{r['count']} | {cpu} | {'yes' if ok else 'NO'} |", flush=True)  # fmt: skip
            if not ok and r["lag_p99"] > 4 * LAG_LIMIT_MS:
                break  # far past the knee: higher rates only take time
    ratio = best[2] / best[1] if best[1] else float("nan")
    print(f"\nhighest sustained rate (lag p99 < {LAG_LIMIT_MS:g} ms, every sample stored, all ok): "
          f"1 worker {best[1]:g} req/s, 2 workers {best[2]:g} req/s, scaling ratio {ratio:.2f}x")  # fmt: skip


def part2(bench: Bench, sims: dict, args, profile: str) -> None:
    trace = load_trace(args.limit)
    urls = {v: h.url for v, h in sims.items()}
    offsets = Arrival(mode="recorded", speed=args.speed).offsets([r.offset_s for r in trace])
    which = "whole" if args.limit is None else f"first {len(trace)} requests of the"
    print(f"\nPart 2: the {which} Azure code trace at {args.speed:g}x, 3 x `{profile}` simulator "
          f"subprocesses, {args.trace_workers} worker process(es), {args.shards} shards, "
          f"concurrency 512/shard; counts from the ClickHouse server")  # fmt: skip
    table_runs(bench, urls, trace, offsets, args, [SPLIT, MIRROR], profile)


def table_runs(bench, urls, trace, offsets, args, modes, profile) -> list[dict]:
    head = ("| mode | profile | requests | speed | schedule s | wall s | lag p50 ms | lag p99 ms | "
            "lag max ms | outcomes | count | FINAL | raw rows | expected | exact |")  # fmt: skip
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    out = []
    for mode in modes:
        r = bench.replay(mode=mode, requests=trace, offsets=offsets, variants=urls,
                         workers=args.trace_workers, shard_count=args.shards)  # fmt: skip
        exact = r["count"] == r["final"] == r["expected"] == r["recorded"]
        print(f"| {mode} | {profile} | {r['requests']} | {args.speed:g}x | {r['span_s']:.1f} | "
              f"{r['wall_s']:.1f} | {r['lag_p50']:.2f} | {r['lag_p99']:.2f} | {r['lag_max']:.1f} | "
              f"{fmt_outcomes(r['outcomes'])} | {r['count']} | {r['final']} | {r['raw']} | "
              f"{r['expected']} | {'yes' if exact else 'NO'} |", flush=True)  # fmt: skip
        if r["spooled"]:
            print(f"  ({r['spooled']} rows went through the spool)")
        out.append(r)
    return out


def part3(bench: Bench, args) -> None:
    from samples.schema import SAMPLES_TABLE

    profiles = {"fp16": "fp16", "awq": "awq", "awq-fa2": "awq-fa2"}
    sims = start_simulators(profiles)
    try:
        urls = {v: h.url for v, h in sims.items()}
        trace = load_trace(args.realistic_limit)
        offsets = Arrival(mode="recorded", speed=args.realistic_speed).offsets([r.offset_s for r in trace])
        print(f"\nPart 3: realistic profiles (fp16 / awq / awq-fa2 simulators), first {len(trace)} "
              f"requests of the trace at {args.realistic_speed:g}x, split 34/33/33")  # fmt: skip
        sub = argparse.Namespace(**{**vars(args), "speed": args.realistic_speed})
        (r,) = table_runs(bench, urls, trace, offsets, sub, [SPLIT], "fp16/awq/awq-fa2")
        rows = bench.store.query(
            f"SELECT variant, count(), countIf(outcome = 'ok'), quantileExact(0.5)(ttft_ms), "
            f"quantileExact(0.99)(ttft_ms), countIf(ttft_ms < 200) / count() "
            f"FROM {SAMPLES_TABLE} FINAL WHERE run_id = %(r)s GROUP BY variant ORDER BY variant",
            {"r": r["run_id"]},
        )
        print("| variant | samples | ok | TTFT p50 ms | TTFT p99 ms | TTFT < 200 ms |")
        print("|---------|---------|----|-------------|-------------|---------------|")
        for v, n, ok, p50, p99, under in rows:
            print(f"| {v} | {n} | {ok} | {p50:.1f} | {p99:.1f} | {under * 100:.1f}% |")
    finally:
        for h in sims.values():
            h.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, parts 1 and 2")
    ap.add_argument("--part", type=int, choices=(1, 2, 3), action="append",
                    help="run only this part (repeatable); default all")  # fmt: skip
    ap.add_argument("--clickhouse-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    ap.add_argument("--rates", default="50,100,200,300,400,600,800", help="part 1 req/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=4.0, help="part 1 schedule length per rate")
    ap.add_argument("--shards", type=int, default=2, help="shards per run (split over the workers)")
    ap.add_argument("--speed", type=float, default=20.0, help="part 2 trace speed")
    ap.add_argument("--limit", type=int, default=None, help="part 2: first N trace requests")
    ap.add_argument("--trace-workers", type=int, default=1, help="part 2/3 worker processes")
    ap.add_argument("--trace-profile", default="fast", help="part 2 simulator profile")
    ap.add_argument("--realistic-speed", type=float, default=4.0)
    ap.add_argument("--realistic-limit", type=int, default=150)
    args = ap.parse_args(argv)
    try:
        args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rates {args.rates!r}: expected comma-separated numbers, e.g. 50,100,200")
    if args.shards < 1 or args.trace_workers < 1 or args.trace_workers > args.shards:
        ap.error("--shards must be >= 1 and --trace-workers within [1, --shards]")
    parts = sorted(set(args.part or [1, 2, 3]))
    if args.quick:
        args.rates, args.seconds = [50.0, 200.0], 1.0
        args.limit, args.speed = args.limit or 60, 100.0
        parts = [p for p in parts if p != 3]

    print(f"bench_replay: python {sys.version.split()[0]}, {os.cpu_count()} cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print("command: " + shlex.join([".venv/bin/python", "bench/bench_replay.py", *(argv or sys.argv[1:])]))
    print(f"{os.cpu_count()} cores shared by the worker process(es), 3 simulator processes and the "
          "ClickHouse server: every figure is a whole-machine figure, not one worker's ceiling.")
    with tempfile.TemporaryDirectory(prefix="abplat-bench-spool-") as spool:
        bench = Bench(args.clickhouse_url, spool)
        print(f"store: {bench.store.describe()}")
        t0 = time.perf_counter()
        if 1 in parts or 2 in parts:
            profile = args.trace_profile
            sims = start_simulators({v: "fast" for v in WEIGHTS})
            try:
                if 1 in parts:
                    part1(bench, sims, args)
                if 2 in parts:
                    if profile != "fast":
                        for h in sims.values():
                            h.stop()
                        sims = start_simulators({v: profile for v in WEIGHTS})
                    part2(bench, sims, args, profile)
            finally:
                for h in sims.values():
                    h.stop()
        if 3 in parts:
            part3(bench, args)
        print(f"\nbench_replay: done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
