"""SLA capacity of the demo's three deployments: how many requests per second each
carries alone with 99.2% of first tokens under 200 ms, with confidence, and what a million
requests cost there.

    .venv/bin/python bench/bench_capacity.py            # a finer search than the demo's, ~10 min
    .venv/bin/python bench/bench_capacity.py --quick    # smoke run, the same tables, ~30 s

The deployments exactly as `make demo` deploys them (workers/demo.py): the fp16, awq and
awq-fa2 simulator profiles with 4 engines each, priced by the demo document, searched on the
demo's chat-sized slice of the Azure code trace (twice over, so that a step at a high rate has
the ~1,500 requests a verdict at 99.2% needs after its warm-up) with Poisson arrivals, on the
embedded defaults (SQLite and chDB in a fresh ABPLAT_VAR; --clickhouse-url for a ClickHouse
server). The search is
capacity.service.search_experiment, as `manage.py capacity` runs it: each step a mirror replay
of one variant, stopped by the anytime-valid test (capacity/search.py). The full run starts at
--max-rate and halves down, then bisects until the bracket is within --tolerance; --quick
searches at an 80% target (a step decides in about a hundred judged requests instead of ~1,400)
with steps of at most 200 requests, to prove the path, not to measure.

Checks (else `bench FAILED: ...`, exit 1): the store usable and every simulator healthy before
the search; the search done with a result per variant; every step a mirror run of its variant
alone that ended done or cancelled, every request ok (or cancelled by the step's own stop) and
at least as many samples as the step counted; each capacity the highest rate that met (not
void), below the bracket's upper end; the price per million requests and output tokens equal
to per_hour / (capacity x 3600) (and / the mean output tokens); in the full run, awq-fa2
carrying more than fp16 (the demo's claim). A slow search or a low capacity is a result.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

PROFILES = ("fp16", "awq", "awq-fa2")
# The parts a demo runs without: a bench never reads this shell's services.
SERVICE_SETTINGS = ("ABPLAT_DATABASE_URL", "ABPLAT_BROKER_URL", "ABPLAT_CLICKHOUSE_URL", "ABPLAT_CLICKHOUSE_CLUSTER",
                    "ABPLAT_ETCD_ENDPOINTS", "ABPLAT_CACHE_URL")  # fmt: skip


def setup_django(args: argparse.Namespace) -> None:
    for name in SERVICE_SETTINGS:
        os.environ.pop(name, None)
    os.environ.setdefault("ABPLAT_DEBUG", "true")
    if not os.environ.get("ABPLAT_VAR"):  # a fresh one of its own, gone at exit
        var = tempfile.mkdtemp(prefix="abplat-bench-capacity-")
        atexit.register(shutil.rmtree, var, ignore_errors=True)
        os.environ["ABPLAT_VAR"] = var
    if args.clickhouse_url:
        os.environ["ABPLAT_CLICKHOUSE_URL"] = args.clickhouse_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
    import django

    django.setup()
    from experiments.weights import process

    # atexit runs last-registered first: the weights router stops before its directory goes
    # (it would print a traceback from its watch thread otherwise)
    atexit.register(process.reset_for_tests)


def migrate(args: argparse.Namespace) -> None:
    """The sample store first (the precondition, named), then the database."""
    import logging

    from django.core.management import call_command

    from samples.factory import sample_store
    from samples.store import StoreError

    logging.getLogger("clickhouse_driver").setLevel(logging.CRITICAL)  # its retries' tracebacks
    try:
        sample_store().migrate()
    except StoreError as exc:
        where = f"ClickHouse server at {_safe_url(args.clickhouse_url)}" if args.clickhouse_url else "chDB"
        raise BenchFailed(f"{where} is not usable ({exc})") from None
    call_command("migrate", verbosity=0)


def _safe_url(url: str) -> str:
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    return f"{u.scheme}://{u.hostname}:{u.port or 9000}{u.path}"


def require_healthy(sims, where: str) -> None:
    import urllib.request

    down = []
    for h in sims:
        try:
            with urllib.request.urlopen(h.url + "/health", timeout=2) as r:
                if r.status == 200:
                    continue
                down.append(f"{h.profile} ({h.url}: HTTP {r.status})")
        except OSError as exc:
            down.append(f"{h.profile} ({h.url}: {exc})")
    if down:
        raise BenchFailed(f"{where}: simulator not healthy: {', '.join(down)}")


def options(args: argparse.Namespace, trace: Path, rows: int):
    from capacity.service import Options
    from workers import demo

    return Options(
        trace=str(trace), source_format="azure", variants=PROFILES, arrival="poisson",
        start_rps=args.max_rate, max_rps=args.max_rate, min_rps=demo.CAPACITY_MIN_RPS,
        rel_tol=args.tolerance, max_steps=args.max_steps, step_requests=min(args.step_requests or rows, rows),
        warmup_s=args.warmup, lag_limit_ms=demo.CAPACITY_LAG_LIMIT_MS,
    )  # fmt: skip


def check(record, target: float, quick: bool) -> None:
    """The search's own results: runs, counts, the bracket and the prices (module docstring)."""
    from capacity.search import MEETS
    from workers.models import ReplayRun

    if record.status != "done":
        raise BenchFailed(f"search {record.pk} ended {record.status}: {record.error}")
    if set(record.result) != set(PROFILES):
        raise BenchFailed(
            f"search {record.pk}: results for {sorted(record.result)}, expected {sorted(PROFILES)}"
        )
    lag_limit = record.params["lag_limit_ms"]
    for v, r in record.result.items():
        steps = r["steps"]
        if not steps:
            raise BenchFailed(f"{v}: the search ran no step")
        runs = {run.pk: run for run in ReplayRun.objects.filter(pk__in=[s["run_id"] for s in steps])}
        for s in steps:
            run = runs.get(s["run_id"])
            where = f"{v} at {s['rate_rps']:g} req/s (run {s['run_id']})"
            if run is None:
                raise BenchFailed(f"{where}: no such run")
            if run.mode != "mirror" or run.targets != [v]:
                raise BenchFailed(
                    f"{where}: a {run.mode} run of {run.targets}, expected a mirror run of [{v!r}]"
                )
            if run.status not in ("done", "cancelled"):
                raise BenchFailed(f"{where}: ended {run.status}: {run.error}")
            bad = {k: n for k, n in run.outcomes.items() if k not in ("ok", "cancelled")}
            if bad:
                raise BenchFailed(f"{where}: outcomes {bad}: the deployment failed requests")
            if run.samples_recorded < s["n"]:
                raise BenchFailed(
                    f"{where}: the step counted {s['n']} samples, the run recorded {run.samples_recorded}"
                )
        good = [s["rate_rps"] for s in steps if s["verdict"] == MEETS and not _void(s, lag_limit)]
        cap = r["capacity_rps"]
        if (max(good) if good else None) != cap:
            raise BenchFailed(f"{v}: capacity {cap}, but the rates that met are {good}")
        if cap is not None and r["upper_rps"] is not None and not r["upper_rps"] > cap:
            raise BenchFailed(f"{v}: the bracket [{cap}, {r['upper_rps']}) is empty")
        c = r["cost"]
        if c is None:
            raise BenchFailed(f"{v}: no price: the demo document prices every variant")
        if cap is not None:
            want = c["per_hour"] / (cap * 3600.0) * 1e6
            if not math.isclose(c["per_million_requests"], want, rel_tol=1e-9):
                raise BenchFailed(f"{v}: {c['per_million_requests']} per million requests, expected {want}")
            tokens = next(s["output_tokens_mean"] for s in steps if s["rate_rps"] == cap)
            if tokens and not math.isclose(c["per_million_output_tokens"], want / tokens, rel_tol=1e-9):
                raise BenchFailed(f"{v}: {c['per_million_output_tokens']} per million output tokens, "
                                  f"expected {want / tokens}")  # fmt: skip
    fp16, fa2 = record.result["fp16"]["capacity_rps"], record.result["awq-fa2"]["capacity_rps"]
    if not quick and not (fp16 and fa2 and fa2 > fp16):
        raise BenchFailed(f"awq-fa2 carries {fa2} req/s within the SLA, fp16 {fp16}: the demo's claim "
                          "(awq-fa2 carries more than fp16 at target "
                          f"{target:.2%}) does not hold on this machine now")  # fmt: skip


def _void(step: dict, limit: float) -> bool:
    return step["lag_p99_ms"] is not None and step["lag_p99_ms"] > limit


def _f(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def tables(record, replicas: int, wall_s: float) -> str:
    from capacity.service import ranking

    res, target = record.result, record.params["target"]
    out = [
        f"SLA capacity at {target:.2%} of requests within the SLA, {replicas} engines per deployment "
        f"(search {record.pk}, {wall_s:.0f} s in all; best value first)",
        "",
        "| variant | engines | capacity req/s | bracket req/s | limited by | steps | max lag p99 ms | search s "
        "| price/h | per 1M requests | per 1M output tokens |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in ranking(res):
        r, c = res[v], res[v]["cost"] or {}
        cur = c.get("currency", "")
        lags = [s["lag_p99_ms"] for s in r["steps"] if s["lag_p99_ms"] is not None]
        bracket = f"[{_f(r['capacity_rps'])}, {_f(r['upper_rps'])})"
        out.append(
            f"| {v} | {replicas} | {_f(r['capacity_rps'])} | {bracket} | {r['limited_by']} | {len(r['steps'])} "
            f"| {_f(max(lags) if lags else None, '.1f')} | {r['search_s']:.0f} | {c.get('per_hour', 0):.2f} {cur} "
            f"| {_f(c.get('per_million_requests'), '.2f')} {cur} | {_f(c.get('per_million_output_tokens'), '.2f')} {cur} |"
        )  # fmt: skip
    out += ["", "Steps, in the order run (attainment after the warm-up; CI: the step's anytime-valid sequence):", "",
            "| variant | step | rate req/s | verdict | n | attainment | CI | TTFT p50 ms | TTFT p99 ms | lag p99 ms "
            "| s | run |",
            "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for v in PROFILES:
        for i, s in enumerate(res[v]["steps"], 1):
            att = s["hits"] / s["n"] if s["n"] else None
            ci = f"[{_f(s['attainment_lo'], '.4f')}, {_f(s['attainment_hi'], '.4f')}]"
            out.append(
                f"| {v} | {i} | {s['rate_rps']:.3g} | {s['verdict']} | {s['n']} | {_f(att, '.4f')} | {ci} "
                f"| {_f(s['ttft_p50_ms'], '.1f')} | {_f(s['ttft_p99_ms'], '.1f')} | {_f(s['lag_p99_ms'], '.1f')} "
                f"| {s['seconds']:.1f} | {s['run_id']} |"
            )  # fmt: skip
    out += [""] + [f"- {v}: {res[v]['message']}" for v in ranking(res)]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    setup_django(args)
    migrate(args)
    from capacity.service import search_experiment
    from experiments import services
    from workers import demo

    args.replicas = args.replicas or demo.REPLICAS
    args.step_requests = args.step_requests or demo.CAPACITY_STEP_REQUESTS
    args.repeat = args.repeat or demo.CAPACITY_PASSES
    args.warmup = demo.CAPACITY_WARMUP_S if args.warmup is None else args.warmup
    cut = demo.write_slice(ROOT / demo.TRACE, Path(os.environ["ABPLAT_VAR"]) / "demo")
    trace, rows = demo.repeat_slice(cut, args.repeat), cut.rows * args.repeat
    doc = demo.load_document(args.replicas)
    if args.quick:
        doc["sla"] = {**doc["sla"], "target": 0.8}
    doc["key"] = "bench-capacity"
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if not args.silent else (lambda _: None)
    sims = demo.start_simulators(doc, args.replicas, free_ports=True, say=say)
    try:
        require_healthy(sims, "before the search")
        experiment = services.apply_document(doc).experiment
        if experiment.status != "running":
            services.transition(experiment, "start" if experiment.status == "draft" else "resume", None,
                                reason="bench")  # fmt: skip
        t0 = time.monotonic()
        record = search_experiment(experiment, options(args, trace, rows), say=say)
        wall = time.monotonic() - t0
        require_healthy(sims, "after the search")
    finally:
        for h in sims:
            h.stop()
    check(record, experiment.sla_target, args.quick)
    twice = f", {args.repeat} times over" if args.repeat > 1 else ""
    print(f"{os.cpu_count()} cores; {cut.describe()} of {demo.TRACE}{twice}; Poisson arrivals; start and max "
          f"{args.max_rate:g} req/s, tolerance {args.tolerance:g}, at most {args.max_steps} steps of "
          f"{record.params['step_requests']} requests, warm-up {args.warmup:g} s, lag limit "
          f"{demo.CAPACITY_LAG_LIMIT_MS:g} ms\n")  # fmt: skip
    print(tables(record, args.replicas, wall))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: an 80%% target, small steps, ~30 s")
    ap.add_argument(
        "--clickhouse-url", help="a ClickHouse server for the samples (default: chDB, as make demo)"
    )
    ap.add_argument("--replicas", type=int, help="engines per deployment (default: the demo's)")
    ap.add_argument("--max-rate", type=float, default=256.0, help="first and highest rate tried (req/s)")
    ap.add_argument("--tolerance", type=float, default=0.2, help="stop when the bracket is this close")
    ap.add_argument("--max-steps", type=int, default=6, help="steps per variant at most")
    ap.add_argument("--step-requests", type=int, help="requests per step at most (default: the demo's)")
    ap.add_argument(
        "--repeat", type=int, help="the slice's requests this many times over (default: the demo's)"
    )
    ap.add_argument("--warmup", type=float, help="seconds of each step not judged (default: the demo's)")
    ap.add_argument("--silent", action="store_true", help="no step lines on stderr")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_rate, args.tolerance, args.max_steps = 64.0, 1.0, 2
        args.step_requests, args.warmup, args.repeat = 200, 1.0, 1
    return run_checked(run, args)


if __name__ == "__main__":
    sys.exit(main())
