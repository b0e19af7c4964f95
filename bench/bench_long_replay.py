"""A real-length replay on a real broker: the shipped code trace at speed 1 (57 min)
through two Celery workers on Redis, in bounded window tasks. Prints a table; copy it into
bench/RESULTS.md.

    scripts/services.sh start        # ClickHouse (Redis is the machine's)
    .venv/bin/python bench/bench_long_replay.py                  # 8,819 requests, ~62 min
    .venv/bin/python bench/bench_long_replay.py --quick          # 600 requests at 30x, ~1 min

Everything is the production path: `manage.py replay` queues the run; two `celery worker`
processes (prefork, 2 each) run start_replay (the prompt plan) and one task per (window,
slot); rows go to the ClickHouse server; three `fast` simulators stand in for the variants.
What it reports, from the samples in the store and the shard rows:
- counts: requests planned, samples stored, one per request (exactly);
- schedule lag (actual send - planned send) p50/p99/max over the run, and the same for the
  requests planned within --seam-s of a window seam, against those away from a seam;
- gap or burst at each seam: sends per second in the --seam-s before and after each seam,
  actual against planned (a task starting late would show a gap then a burst);
- tasks: how many, their longest run against the soft time limit, and attempts > 1.

Checks (any failure prints `bench FAILED: <what and where>` and exits 1): Redis and the
ClickHouse server answer; the run ends `done`; the store holds exactly one sample per request.
Lag is a measured result, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from stats.quantiles import nearest_rank  # noqa: E402

TRACE = "data/traces/azure_llm_2023_code.csv"
CLICKHOUSE = os.environ.get(
    "ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench"
)
REDIS = os.environ.get("ABPLAT_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")


def manage(env: dict, *args: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise BenchFailed(f"manage.py {' '.join(args[:2])}: {(done.stderr or done.stdout)[-1500:]}")
    return done.stdout


def start_worker(env: dict, log: pathlib.Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "abplat",
            "worker",
            "--pool",
            "prefork",
            "-c",
            "2",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "INFO",
            "-n",
            f"{name}@%h",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


# The database, the sample store's tables, the experiment and its start: the four commands in one
# Django process (each its own `manage.py` would pay Django's start-up four times).
SETUP = """
from django.core.management import call_command
from experiments import services
from experiments.models import Experiment
call_command("migrate", verbosity=0)
call_command("clickhouse_migrate")
call_command("apply_experiment", {document!r})
services.transition(Experiment.objects.get(), "start")
"""

# `manage.py replay` (queues the run and returns), then the run's state every {poll} s until it
# ends, then its shard rows: one Django process for the whole run instead of one per look. Each
# line a JSON document tagged by what it is.
WATCH = """
import io, json, time
from django.core.management import call_command
from workers.models import ReplayRun, ReplayShard
out = io.StringIO()
call_command(*{replay!r}, stdout=out)
print(json.dumps({{"replay": out.getvalue()}}), flush=True)
while True:
    r = ReplayRun.objects.get()
    print(json.dumps({{"state": {{"status": r.status, "expected": r.expected_samples,
                                 "recorded": r.samples_recorded, "error": r.error, "window_s": r.window_s,
                                 "start": r.start_at_unix, **r.progress()}}}}), flush=True)
    if r.status in ("done", "failed", "cancelled"):
        break
    time.sleep({poll!r})
print(json.dumps({{"shards": [[s.window, s.slot, s.status, s.planned, s.recorded, s.attempts,
                              (s.finished_at - s.started_at).total_seconds() if s.finished_at and s.started_at
                              else None] for s in ReplayShard.objects.order_by("index")]}}), flush=True)
"""


def watch(env: dict, replay: list[str], poll: float, log: pathlib.Path):
    """Run WATCH; yield each document it prints ({"replay": ...}, {"state": ...}, {"shards": ...})."""
    code = WATCH.format(replay=replay, poll=poll)
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "shell", "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                yield json.loads(line)
        if proc.wait() != 0:
            raise BenchFailed(f"manage.py {replay[0]} (and the run's state): {log.read_text()[-1500:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def q(sorted_values: list[float], p: float) -> float:
    return nearest_rank(sorted_values, p) if sorted_values else float("nan")


def run(args) -> None:
    import redis

    from samples.backends.clickhouse import ClickHouseServerBackend
    from simulator.serve import start_in_thread

    try:
        redis.Redis.from_url(REDIS, socket_timeout=2).flushdb()
    except redis.RedisError as exc:
        raise BenchFailed(f"Redis not reachable at {REDIS}: {exc}") from None
    # Named after the given database (abplat_bench_long_... by default), so that whoever gave it
    # (tests/bench) can drop what a killed run left.
    base, given = CLICKHOUSE.rsplit("/", 1)
    database = f"{given}_long_{uuid.uuid4().hex[:8]}"
    url = base + "/" + database
    store = ClickHouseServerBackend(url)
    try:
        store.ensure_database()
    except Exception as exc:
        raise BenchFailed(f"ClickHouse server at {CLICKHOUSE}: {exc}; scripts/services.sh start") from None
    var = pathlib.Path(tempfile.mkdtemp(prefix="abplat-bench-long-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")}
    env = {
        **base,
        "ABPLAT_ENV_FILE": "",
        "ABPLAT_VAR": str(var),
        "ABPLAT_BROKER_URL": REDIS,
        "ABPLAT_CLICKHOUSE_URL": url,
        "ABPLAT_DEBUG": "true",
        "ABPLAT_LOG_LEVEL": "INFO",
        "ABPLAT_REPLAY_WINDOW_S": str(args.window),
        "ABPLAT_TASK_SOFT_TIME_LIMIT_S": str(args.soft_limit),
        "ABPLAT_VISIBILITY_TIMEOUT": str(args.soft_limit * 2),
    }
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    workers: list[subprocess.Popen] = []
    log = var / "workers.log"
    try:
        import yaml

        doc = yaml.safe_load((ROOT / "demo" / "ttft-optimizations.yaml").read_text())
        for variant, sim in zip(doc["variants"], sims):
            variant["endpoint"] = sim.url + "/v1"
        (var / "exp.yaml").write_text(yaml.safe_dump(doc))
        manage(env, "shell", "-c", SETUP.format(document=str(var / "exp.yaml")))
        workers = [start_worker(env, log, "a"), start_worker(env, log, "b")]
        replay = [
            "replay",
            doc["key"],
            "--trace",
            TRACE,
            "--speed",
            str(args.speed),
            "--shards",
            "2",
            "--yes",
        ]
        if args.limit:
            replay += ["--limit", str(args.limit)]
        began = time.monotonic()
        state, shards, looks, wall = None, None, 0, 0.0
        for got in watch(env, replay, args.poll, var / "watch.log"):
            if "replay" in got:
                print(got["replay"].strip().splitlines()[0], flush=True)
            elif "state" in got:
                state, looks, wall = got["state"], looks + 1, time.monotonic() - began
                if looks > 1:  # the first look is right after the replay command returned
                    print(
                        f"  {time.monotonic() - began:7.0f} s  {state['status']:9s} recorded "
                        f"{state['recorded']:>6}/{state['expected']}  shards done {state['shards_done']}/"
                        f"{state['shards']}",
                        flush=True,
                    )
            else:
                shards = got["shards"]
            if any(w.poll() is not None for w in workers):
                raise BenchFailed(f"a worker exited: {log.read_text()[-2000:]}")
        if state is None or shards is None:
            raise BenchFailed(f"the run's state was never read: {(var / 'watch.log').read_text()[-1500:]}")
        if state["status"] != "done":
            raise BenchFailed(f"run ended {state['status']}: {state['error']}")
        report(store, state, shards, wall, args, log)
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGTERM)
                try:
                    w.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(w.pid, signal.SIGKILL)
        for s in sims:
            s.stop()
        try:
            store.execute(f"DROP DATABASE IF EXISTS {database}")
        except Exception:
            pass


def report(store, state: dict, shards: list, wall: float, args, log: pathlib.Path) -> None:
    rows = store.query("SELECT seq, scheduled_offset_ms, sent_unix_ms, schedule_lag_ms, outcome FROM samples")
    per_seq: dict[int, int] = {}
    for seq, *_ in rows:
        per_seq[seq] = per_seq.get(seq, 0) + 1
    expected = state["expected"]
    if len(per_seq) != expected or set(per_seq.values()) != {1}:
        dup = sum(1 for c in per_seq.values() if c > 1)
        raise BenchFailed(
            f"store: {len(rows)} rows for {len(per_seq)} of {expected} requests ({dup} duplicated)"
        )
    window_ms = state["window_s"] * 1000.0
    seam_ms = args.seam_s * 1000.0
    t0_ms = state["start"] * 1000.0
    lags = sorted(r[3] for r in rows)

    def near_seam(offset_ms: float) -> bool:
        k = round(offset_ms / window_ms)
        return k > 0 and abs(offset_ms - k * window_ms) <= seam_ms

    at = sorted(r[3] for r in rows if near_seam(r[1]))
    away = sorted(r[3] for r in rows if not near_seam(r[1]))
    last_ms = max(r[1] for r in rows)
    seams = [k * window_ms for k in range(1, int(last_ms // window_ms) + 1)]
    # Gap or burst: sends per second before and after each seam, actual against planned.
    worst = (0.0, None)
    seam_lines = []
    for s in seams:
        for side, lo, hi in (("before", s - seam_ms, s), ("after", s, s + seam_ms)):
            planned = sum(1 for r in rows if lo <= r[1] < hi)
            actual = sum(1 for r in rows if lo <= r[2] - t0_ms < hi)
            diff = actual - planned
            if abs(diff) > abs(worst[0]):
                worst = (diff, f"seam {s / 1000:.0f} s {side}: planned {planned}, sent {actual}")
            seam_lines.append((s, side, planned, actual))
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r[4]] = outcomes.get(r[4], 0) + 1
    durations = [s[6] for s in shards if s[6] is not None]
    retried = sum(1 for s in shards if s[5] > 1)
    print()
    print(
        f"Long replay: {expected} requests, speed {args.speed:g}, window {state['window_s']:g} s, "
        f"soft limit {args.soft_limit} s, 2 workers x 2 processes, Redis, ClickHouse server"
    )
    print("| figure | value |")
    print("|---|---|")
    print(f"| wall time | {wall / 60:.1f} min (schedule {last_ms / 60000:.1f} min) |")
    print(f"| samples stored / expected | {len(rows)} / {expected} (one per request: yes) |")
    print(f"| outcomes | {', '.join(f'{k}={v}' for k, v in sorted(outcomes.items()))} |")
    print(f"| lag p50 / p99 / max, all | {q(lags, 0.5):.1f} / {q(lags, 0.99):.1f} / {lags[-1]:.1f} ms |")
    print(
        f"| lag p50 / p99 / max, within {args.seam_s:g} s of a seam ({len(at)} requests) | "
        f"{q(at, 0.5):.1f} / {q(at, 0.99):.1f} / {at[-1] if at else float('nan'):.1f} ms |"
    )
    print(
        f"| lag p50 / p99 / max, away from seams ({len(away)} requests) | "
        f"{q(away, 0.5):.1f} / {q(away, 0.99):.1f} / {away[-1] if away else float('nan'):.1f} ms |"
    )
    print(
        f"| seams | {len(seams)}; largest sent-vs-planned difference in {args.seam_s:g} s: "
        f"{worst[0]:+.0f} ({worst[1] or 'none'}) |"
    )
    print(
        f"| tasks | {len(shards)} (windows x slots); longest {max(durations, default=0):.1f} s "
        f"(soft limit {args.soft_limit} s); retried {retried} |"
    )
    soft = log.read_text().count("Soft time limit")
    print(f"| soft time limit reached | {soft} times |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="600 requests at 30x, 3 s windows, 18 s soft limit")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--window", type=int, default=300, help="ABPLAT_REPLAY_WINDOW_S")
    p.add_argument("--soft-limit", type=int, default=1800, help="ABPLAT_TASK_SOFT_TIME_LIMIT_S")
    p.add_argument("--seam-s", type=float, default=2.0, help="how close to a seam counts as at it")
    p.add_argument("--poll", type=float, default=30.0)
    args = p.parse_args(argv)
    if args.quick:
        # The soft limit 6 windows, as the defaults (300 s, 1800 s): a 3 s window's task takes 5-10 s
        # on a loaded machine, and one past the hard limit is killed and its run never ends.
        args.speed, args.limit, args.window, args.soft_limit, args.seam_s, args.poll = (
            30.0,
            600,
            3,
            18,
            0.5,
            2.0,
        )
    return run_checked(run, args)


if __name__ == "__main__":
    sys.exit(main())
