"""Metrics and logging overhead on the replay's CPU per request (target: under 3%).

    .venv/bin/python bench/bench_observability.py            # 7 rounds x 4 setups, 2,000 requests each, ~8 min
    .venv/bin/python bench/bench_observability.py --quick    # smoke run, the same tables, ~40 s

The same replay, in a fresh process per run (the metrics mode is fixed when a process imports
telemetry.metrics), set up four ways side by side, rounds interleaved so machine noise falls on
every setup alike:

- ``off``: no metric recorded at all (the shard's meter left out, and the store's and spool's
  metric objects replaced by no-ops), text logs: the baseline.
- ``metrics``: the shard's meter as workers/shard.py wires it (telemetry.metrics.ReplayMeter:
  sends, outcomes, schedule lag, written samples) and the store's metrics, in-process registry
  (the embedded default).
- ``metrics, dir``: the same with ABPLAT_METRICS_DIR (prometheus_client's multiprocess mode:
  every update goes to a memory-mapped file), as production runs it.
- ``metrics, dir + JSON logs``: that, with logs in JSON (telemetry.logs.JsonFormatter, as
  ABPLAT_LOG_FORMAT=json configures it) instead of text; the shard logs what workers/shard.py
  logs (its start and its summary, with the run's context on every line).

Each run: ShardRunner (replay/runner.py) sends Poisson arrivals from the Azure code trace's
request shapes, split 34/33/33 over three `fast` simulator subprocesses, with real streaming
HTTP (streaming.client.VariantClient), rows through a BatchSink into the sample store's
SpoolingWriter and the ClickHouse server. CPU = the run process's process_time (every thread:
event loop, client, sample sink) from the first send to the last row stored, per request.

Checks: every simulator healthy, every outcome ok, exactly one sample per request in the store;
a failure prints `bench FAILED: ...` and exits 1. Missing the 3% target is a result, not a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

DEFAULT_URL = os.environ.get(
    "ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench"
)
EXPERIMENT = "bench-observability"
VARIANTS = ("a", "b", "c")
SHARES = (34, 33, 33)
MODEL = "abplat-sim"
WARMUP_PER_VARIANT = 8
WARMUP_RUN_OFFSET = 10**15
# (label, metrics: off | inproc | dir, logs: text | json)
SETUPS = (
    ("off", "off", "text"),
    ("metrics", "inproc", "text"),
    ("metrics, dir", "dir", "text"),
    ("metrics, dir + JSON logs", "dir", "json"),
)


# ---------------------------------------------------------------------------------------------
# One run, in its own process (--child).
# ---------------------------------------------------------------------------------------------


class _NoOp:
    """A metric that records nothing (the ``off`` setup)."""

    def labels(self, *_a, **_k):
        return self

    def inc(self, *_a, **_k) -> None:
        pass

    dec = set = observe = inc


def metrics_off() -> None:
    from prometheus_client import Counter, Gauge, Histogram

    from telemetry import metrics

    for name, value in vars(metrics).copy().items():
        if isinstance(value, Counter | Gauge | Histogram):
            setattr(metrics, name, _NoOp())


def configure_logs(fmt: str, path: str) -> None:
    import logging.config

    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {
                "text": {"()": "telemetry.logs.TextFormatter"},
                "json": {"()": "telemetry.logs.JsonFormatter"},
            },
            "filters": {"context": {"()": "telemetry.logs.ContextFilter"}},
            "handlers": {
                "file": {
                    "class": "logging.FileHandler",
                    "filename": path,
                    "formatter": fmt,
                    "filters": ["context"],
                }
            },
            "root": {"handlers": ["file"], "level": "WARNING"},
            "loggers": {
                name: {"level": "INFO"} for name in ("bench", "replay", "streaming", "samples", "workers")
            },
        }
    )


def child(spec: dict) -> dict:
    import asyncio
    import logging

    from experiments.assignment import allocate, make_assigner
    from replay.arrivals import Arrival
    from replay.runner import ShardRunner, ShardSpec
    from replay.sink import BatchSink
    from samples.backends.clickhouse import ClickHouseServerBackend
    from samples.rows import SampleContext, row_from
    from samples.spool import SpoolingWriter
    from streaming.client import VariantClient
    from telemetry import metrics
    from telemetry.logs import log_context

    if spec["metrics"] == "off":
        metrics_off()
    expected_dir = spec["metrics"] == "dir"
    if bool(metrics.METRICS_DIR) != expected_dir:
        raise BenchFailed(
            f"setup {spec['label']}: metrics dir {metrics.METRICS_DIR!r}, wanted dir={expected_dir}"
        )
    configure_logs(spec["logs"], spec["log_file"])
    log = logging.getLogger("bench.observability")
    trace = load_trace()
    n = spec["requests"]
    requests = [dataclasses.replace(trace[i % len(trace)], seq=i) for i in range(n)]  # the trace's shapes
    offsets = Arrival(mode="poisson", rate=spec["rate"], seed=spec["seed"]).offsets([0.0] * n)
    pick = make_assigner("bench-observability-salt", allocate(dict(zip(VARIANTS, SHARES, strict=True))))
    writer = SpoolingWriter(ClickHouseServerBackend(spec["url"]), spec["spool_dir"])
    meter = metrics.ReplayMeter(EXPERIMENT) if spec["metrics"] != "off" else None

    def write(rows) -> str:
        how = writer.write(rows)
        if meter is not None:
            meter.written(len(rows), "spool" if how == "spooled" else "store")
        return how

    sink = BatchSink(write)

    async def main() -> tuple:
        clients = {v: VariantClient(url, MODEL, "completions") for v, url in spec["urls"].items()}
        if meter is not None:
            clients = {v: meter.wrap_client(v, c) for v, c in clients.items()}
        try:
            warm = [(v, f"warm-{v}-{i}") for v in clients for i in range(WARMUP_PER_VARIANT)]
            results = await asyncio.gather(
                *(clients[v].stream(rid, "warm up", 2, {"ignore_eos": True}) for v, rid in warm)
            )
            for seq, ((v, rid), res) in enumerate(zip(warm, results, strict=True)):
                sink.put(
                    row_from(
                        res,
                        SampleContext(
                            experiment=EXPERIMENT,
                            run_id=spec["run_id"] + WARMUP_RUN_OFFSET,
                            seq=seq,
                            variant=v,
                            mode="split",
                            request_id=rid,
                            sent_unix_ms=time.time() * 1000.0,
                        ),
                    )
                )
            while sink.written < len(warm):
                await asyncio.sleep(0.02)
            put = sink.put if meter is None else meter.put_row(sink.put)
            runner = ShardRunner(
                ShardSpec(
                    experiment=EXPERIMENT,
                    run_id=spec["run_id"],
                    mode="split",
                    requests=requests,
                    offsets=offsets,
                    start_at_unix=time.time() + 0.3,
                    concurrency=512,
                    variants=list(VARIANTS),
                ),
                clients,
                lambda user: (pick(user), 1),
                put,
                revision=lambda: 1,
            )
            cpu0 = time.process_time()
            with log_context(experiment=EXPERIMENT, run=spec["run_id"], shard=0):
                log.info("run %s shard 0 (window 0, slot 0): %d requests", spec["run_id"], n)
                stats = await runner.run()
                log.info("run %s shard 0: %s", spec["run_id"], stats.summary())
            return stats, cpu0
        finally:
            for c in clients.values():
                await c.aclose()

    stats, cpu0 = asyncio.run(main())
    sink.close()  # every row stored before the clock stops
    cpu_s = time.process_time() - cpu0
    logging.shutdown()
    with open(spec["log_file"], "rb") as f:
        log_lines = sum(1 for _ in f)
    return {
        "cpu_s": cpu_s,
        "n": n,
        "outcomes": dict(stats.outcomes),
        "lag_p99_ms": stats.lag_quantile(0.99),
        "log_lines": log_lines,
    }


def load_trace():
    from replay.sources import load_source
    from replay.users import UserPopulation

    trace = ROOT / "data" / "traces" / "azure_llm_2023_code.csv"
    return load_source(str(trace), "azure", population=UserPopulation(seed=0), limit=2000).requests


def micro(iterations: int) -> dict:
    """CPU nanoseconds of the meter's calls for one request, in this process's metrics mode
    (CPU time, not wall time: on a loaded machine a loop's wall time counts the other processes)."""
    from telemetry import metrics

    meter = metrics.ReplayMeter(EXPERIMENT)
    variants = VARIANTS
    t0 = time.process_time_ns()
    for i in range(iterations):
        v = variants[i % 3]
        meter.sent(v)
        meter.in_flight.inc()
        meter.in_flight.dec()
        meter.completed(v, "ok", 0.0012)
    t1 = time.process_time_ns()
    for i in range(iterations):
        v = variants[i % 3]  # the loop alone
    t2 = time.process_time_ns()
    return {"ns_per_request": ((t1 - t0) - (t2 - t1)) / iterations, "log_ns": log_line_ns(iterations // 20)}


def log_line_ns(lines: int) -> dict[str, float]:
    """CPU nanoseconds to log one line of a shard (with its context) to a file, text vs JSON."""
    import logging

    from telemetry.logs import ContextFilter, JsonFormatter, TextFormatter, log_context

    out = {}
    for name, formatter in (("text", TextFormatter()), ("json", JsonFormatter())):
        handler = logging.FileHandler(os.devnull)
        handler.setFormatter(formatter)
        handler.addFilter(ContextFilter())
        log = logging.getLogger(f"bench.observability.lines.{name}")
        log.handlers[:] = [handler]
        log.propagate, log.level = False, logging.INFO
        with log_context(experiment=EXPERIMENT, run=12345, shard=3):
            t0 = time.process_time_ns()
            for i in range(lines):
                log.info("run %s shard %s: %s", 12345, 3, {"planned": i, "sent": i, "outcomes": {"ok": i}})
            out[name] = (time.process_time_ns() - t0) / lines
        handler.close()
    return out


# ---------------------------------------------------------------------------------------------
# Parent: simulators, the store, runs in rounds, the table.
# ---------------------------------------------------------------------------------------------


def run_child(args_list: list[str], env: dict, timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_observability.py"), *args_list],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise BenchFailed(f"a run process failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")
    return json.loads(lines[-1])


def child_env(metrics_mode: str, work: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ABPLAT_METRICS_DIR", "PROMETHEUS_MULTIPROC_DIR")}
    env["PYTHONPATH"] = str(ROOT)
    if metrics_mode == "dir":
        directory = tempfile.mkdtemp(prefix="metrics-", dir=work)
        env["ABPLAT_METRICS_DIR"] = directory
    return env


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 150 requests")
    ap.add_argument("--clickhouse-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    ap.add_argument("--rounds", type=int, default=7, help="runs of each setup, interleaved")
    ap.add_argument("--requests", type=int, default=2000, help="requests per run")
    ap.add_argument("--rate", type=float, default=200.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.micro:
        print(json.dumps(micro(args.micro)), flush=True)
        return 0
    if args.quick:
        args.rounds, args.requests, args.rate = 1, 150, 150.0
    if args.rounds < 1 or args.requests < 10 or args.rate <= 0:
        ap.error("--rounds >= 1, --requests >= 10, --rate > 0")

    from bench.bench_replay import require_healthy, start_simulators
    from samples.backends.clickhouse import ClickHouseServerBackend
    from samples.store import StoreError

    print(
        f"bench_observability: python {sys.version.split()[0]}, {os.cpu_count()} cores, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "command: "
        + shlex.join([".venv/bin/python", "bench/bench_observability.py", *(argv or sys.argv[1:])])
    )
    store = ClickHouseServerBackend(args.clickhouse_url, tries=1)
    try:
        store.ensure_database()
        store.migrate()
    except StoreError as exc:
        raise BenchFailed(f"ClickHouse server at {store.url_safe} is not usable ({exc})") from None
    logs_note = "JSON logs: telemetry.logs.JsonFormatter (ABPLAT_LOG_FORMAT=json)"
    print(
        f"{args.rounds} round(s) x {len(SETUPS)} setups, {args.requests} requests per run at {args.rate:g}/s "
        f"(Poisson), split 34/33/33 over 3 `fast` simulator subprocesses; {logs_note}."
    )
    sims = start_simulators({v: "fast" for v in VARIANTS})
    results: dict[str, list[dict]] = {label: [] for label, _m, _l in SETUPS}
    run_id = int(time.time() * 1000)
    try:
        urls = {v: h.url for v, h in sims.items()}
        with tempfile.TemporaryDirectory(prefix="abplat-bench-obs-") as tmp:
            work = pathlib.Path(tmp)
            for rnd in range(args.rounds):
                for label, metrics_mode, logs in SETUPS:
                    require_healthy(urls, f"before round {rnd + 1} of {label!r}")
                    run_id += 1
                    spec = {
                        "label": label,
                        "metrics": metrics_mode,
                        "logs": logs,
                        "requests": args.requests,
                        "rate": args.rate,
                        "seed": rnd,
                        "urls": urls,
                        "url": args.clickhouse_url,
                        "run_id": run_id,
                        "spool_dir": str(work / f"spool-{run_id}"),
                        "log_file": str(work / f"log-{run_id}.txt"),
                    }
                    r = run_child(["--child", json.dumps(spec)], child_env(metrics_mode, work))
                    if r["outcomes"] != {"ok": args.requests}:
                        raise BenchFailed(
                            f"{label}, round {rnd + 1}: outcomes {r['outcomes']}, expected ok={args.requests}"
                        )
                    stored = store.count(run_id)
                    if stored != args.requests:
                        raise BenchFailed(
                            f"{label}, round {rnd + 1}: {stored} samples in the store, expected {args.requests}"
                        )
                    results[label].append(r)
            loops = "20000" if args.quick else "200000"  # --quick: the same calls, a tenth of the loop
            micro_ns = {
                mode: run_child(["--micro", loops], child_env(mode, work)) for mode in ("inproc", "dir")
            }
    finally:
        for h in sims.values():
            h.stop()

    def per_request_ms(r: dict) -> float:
        return r["cpu_s"] / r["n"] * 1000

    base = statistics.median(per_request_ms(r) for r in results["off"])
    print(
        "\nThe whole replay, CPU per request; `vs off` pairs each run with the `off` run of its round "
        "(machine load drifts between rounds) and gives the median ratio:"
    )
    print(
        "| setup | runs | CPU ms/request (median) | min - max | vs off (paired median) | paired min - max | "
        "log lines/request | lag p99 ms (median) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    paired = {}
    for label, _m, _l in SETUPS:
        per = [per_request_ms(r) for r in results[label]]
        ratios = [
            per_request_ms(r) / per_request_ms(o) for r, o in zip(results[label], results["off"], strict=True)
        ]
        paired[label] = statistics.median(ratios)
        lines = sum(r["log_lines"] for r in results[label]) / sum(r["n"] for r in results[label])
        lag = statistics.median(r["lag_p99_ms"] for r in results[label])
        print(
            f"| {label} | {len(per)} | {statistics.median(per):.3f} | {min(per):.3f} - {max(per):.3f} | "
            f"{paired[label]:.3f} | {min(ratios):.3f} - {max(ratios):.3f} | {lines:.4f} | {lag:.2f} |"
        )
    spread = (
        max(per_request_ms(r) for r in results["off"]) / min(per_request_ms(r) for r in results["off"]) - 1
    )
    json_lines = sum(r["log_lines"] for r in results[SETUPS[-1][0]]) / sum(
        r["n"] for r in results[SETUPS[-1][0]]
    )
    print(
        "\nThe added work measured directly (its cost per request against the `off` median CPU per "
        "request above): the meter's calls for one request (sent, in flight up and down, completed "
        f"with its lag; {int(loops):,} in a loop, CPU time), and JSON instead of text for the log lines a request gets:"
    )
    print("| added work | ns/request | share of the CPU per request |")
    print("|---|---|---|")
    shares = {}
    for mode in ("inproc", "dir"):
        ns = micro_ns[mode]["ns_per_request"]
        shares[mode] = ns / (base * 1e6)
        label = "metrics, in-process" if mode == "inproc" else "metrics, ABPLAT_METRICS_DIR"
        print(f"| {label} | {ns:.0f} | {shares[mode] * 100:.2f}% |")
    log_ns = micro_ns["dir"]["log_ns"]
    json_extra = max(0.0, log_ns["json"] - log_ns["text"]) * json_lines
    shares["json"] = json_extra / (base * 1e6)
    print(
        f"| JSON logs ({log_ns['json']:.0f} ns a line against {log_ns['text']:.0f} as text, "
        f"{json_lines:.4f} lines/request) | {json_extra:.1f} | {shares['json'] * 100:.3f}% |"
    )
    direct = shares["dir"] + shares["json"]
    print(
        f"\ntarget: overhead under 3%. Measured directly (metrics with ABPLAT_METRICS_DIR + JSON logs): "
        f"{direct * 100:.2f}%: {'met' if direct < 0.03 else 'NOT met'}. Whole replay, paired median: "
        f"{(paired[SETUPS[-1][0]] - 1) * 100:+.1f}% (metrics, dir + JSON logs), against a run-to-run spread "
        f"of the `off` runs alone of {spread * 100:.0f}% on this machine now."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


if __name__ == "__main__":
    sys.exit(main())
