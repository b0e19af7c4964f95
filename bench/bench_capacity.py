"""SLA capacity of the demo's three deployments: how many requests per second each
carries alone with 99.2% of first tokens under 200 ms, with confidence, and what a million
requests cost there.

    .venv/bin/python bench/bench_capacity.py            # a finer search than the demo's, ~10 min
    .venv/bin/python bench/bench_capacity.py --quick    # smoke run, the same tables, ~30 s
    .venv/bin/python bench/bench_capacity.py --edge     # a known edge, both lag policies, ~10-15 min

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

--edge: a deployment whose SLA capacity is known, searched as `manage.py capacity KEY --arrival
poisson --start-rate 30 --max-rate 120` would (the command's defaults otherwise: tolerance 5%,
12 steps of 2,000 requests, warm-up 5 s), once per lag policy (--lag-policy old,new): "old" is
the search before the lag policy changed (the lag p99 of the whole run, warm-up included, as
its shards report it; a fixed 5 ms limit; the first void step is the generator's limit),
"new" the search as it is. The deployment: the simulator's "saturating" profile with 4 engines
in a process of its own (one request at a time per engine, 25 ms a token, 2 tokens a request,
each request to the engine with the fewest outstanding); the SLA 95% of first tokens within
200 ms. The truth: the rate where that deployment's long-run attainment crosses 95%, on a
virtual clock (``jsq_attainment``) with the engines' step as measured in the searches' own
low-rate steps (about 69 req/s). Printed: each search's capacity against the truth and their
ratio, whether it is within 10% (or that the generator limited it: the target holds for every
capacity the generator sustains), and every step with its lag over the judged requests and
over the whole run, beside what other processes took of the machine meanwhile and how long
this process waited for a core. Checks: every step a mirror run of the variant alone that
ended done or cancelled, every request ok or cancelled by the step's stop.
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
SERVICE_SETTINGS = (
    "ABPLAT_DATABASE_URL",
    "ABPLAT_BROKER_URL",
    "ABPLAT_CLICKHOUSE_URL",
    "ABPLAT_CLICKHOUSE_CLUSTER",
    "ABPLAT_ETCD_ENDPOINTS",
    "ABPLAT_CACHE_URL",
)


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
        trace=str(trace),
        source_format="azure",
        variants=PROFILES,
        arrival="poisson",
        start_rps=args.max_rate,
        max_rps=args.max_rate,
        min_rps=demo.CAPACITY_MIN_RPS,
        rel_tol=args.tolerance,
        max_steps=args.max_steps,
        step_requests=min(args.step_requests or rows, rows),
        warmup_s=args.warmup,
        lag_limit_ms=demo.CAPACITY_LAG_LIMIT_MS,
    )


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
            check_step_run(runs.get(s["run_id"]), s, v, f"{v} at {s['rate_rps']:g} req/s (run {s['run_id']})")
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
                raise BenchFailed(
                    f"{v}: {c['per_million_output_tokens']} per million output tokens, "
                    f"expected {want / tokens}"
                )
    fp16, fa2 = record.result["fp16"]["capacity_rps"], record.result["awq-fa2"]["capacity_rps"]
    if not quick and not (fp16 and fa2 and fa2 > fp16):
        raise BenchFailed(
            f"awq-fa2 carries {fa2} req/s within the SLA, fp16 {fp16}: the demo's claim "
            "(awq-fa2 carries more than fp16 at target "
            f"{target:.2%}) does not hold on this machine now"
        )


def check_step_run(run, step: dict, variant: str, where: str) -> None:
    """A search step's run: a mirror run of ``variant`` alone, ended done or cancelled (the
    search's stop), every request it did not cancel answered, and at least the samples the step
    judged recorded."""
    if run is None:
        raise BenchFailed(f"{where}: no such run")
    if run.mode != "mirror" or run.targets != [variant]:
        raise BenchFailed(
            f"{where}: a {run.mode} run of {run.targets}, expected a mirror run of [{variant!r}]"
        )
    if run.status not in ("done", "cancelled"):
        raise BenchFailed(f"{where}: ended {run.status}: {run.error}")
    bad = {k: n for k, n in run.outcomes.items() if k not in ("ok", "cancelled")}
    if bad:
        raise BenchFailed(f"{where}: outcomes {bad}: the deployment failed requests")
    if run.samples_recorded < step["n"]:
        raise BenchFailed(
            f"{where}: the step counted {step['n']} samples, the run recorded {run.samples_recorded}"
        )


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
        )
    out += [
        "",
        "Steps, in the order run (attainment after the warm-up; CI: the step's anytime-valid sequence):",
        "",
        "| variant | step | rate req/s | verdict | n | attainment | CI | TTFT p50 ms | TTFT p99 ms | lag p99 ms "
        "| s | run |",
        "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for v in PROFILES:
        for i, s in enumerate(res[v]["steps"], 1):
            att = s["hits"] / s["n"] if s["n"] else None
            ci = f"[{_f(s['attainment_lo'], '.4f')}, {_f(s['attainment_hi'], '.4f')}]"
            out.append(
                f"| {v} | {i} | {s['rate_rps']:.3g} | {s['verdict']} | {s['n']} | {_f(att, '.4f')} | {ci} "
                f"| {_f(s['ttft_p50_ms'], '.1f')} | {_f(s['ttft_p99_ms'], '.1f')} | {_f(s['lag_p99_ms'], '.1f')} "
                f"| {s['seconds']:.1f} | {s['run_id']} |"
            )
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
            services.transition(
                experiment, "start" if experiment.status == "draft" else "resume", None, reason="bench"
            )
        t0 = time.monotonic()
        record = search_experiment(experiment, options(args, trace, rows), say=say)
        wall = time.monotonic() - t0
        require_healthy(sims, "after the search")
    finally:
        for h in sims:
            h.stop()
    check(record, experiment.sla_target, args.quick)
    twice = f", {args.repeat} times over" if args.repeat > 1 else ""
    print(
        f"{os.cpu_count()} cores; {cut.describe()} of {demo.TRACE}{twice}; Poisson arrivals; start and max "
        f"{args.max_rate:g} req/s, tolerance {args.tolerance:g}, at most {args.max_steps} steps of "
        f"{record.params['step_requests']} requests, warm-up {args.warmup:g} s, lag limit "
        f"{demo.CAPACITY_LAG_LIMIT_MS:g} ms\n"
    )
    print(tables(record, args.replicas, wall))
    return 0


# --- --edge: a deployment whose SLA capacity is known, searched under both lag policies ---------

EDGE_PROFILE = "saturating"  # one request at a time per engine, 25 ms a token (simulator/profiles.py)
EDGE_TOKENS = 2  # max_tokens of every request: a first token after one step, the last after two
EDGE_SLA_MS = 200.0
# The lag policies compared: "old" as the search was (the run's whole schedule lag, warm-up
# included, as its shards report it; a fixed 5 ms; a void step ends the search at its rate),
# "new" as manage.py capacity runs it now (capacity/search.py, capacity/steps.py).
POLICIES = ("old", "new")
OLD_LAG_LIMIT_MS = 5.0


def jsq_attainment(rate: float, engines: int, step_ms: float, overhead_ms: float, unit_gaps) -> float:
    """Long-run share of first tokens within EDGE_SLA_MS, on a virtual clock: Poisson arrivals at
    ``rate`` (``unit_gaps``: exponential gaps of mean 1, scaled), each sent to the engine with
    the fewest requests outstanding (simulator.app, lowest index first), each engine serving one
    request at a time in EDGE_TOKENS steps of ``step_ms`` (first-come, first-served); a first
    token comes one step after the request starts, plus ``overhead_ms`` (the client's side)."""
    from collections import deque

    step, t = step_ms / 1000.0, 0.0
    free = [0.0] * engines
    out: list[deque] = [deque() for _ in range(engines)]
    warm = 5.0  # seconds not judged, as the searches' steps
    hits = n = 0
    limit = (EDGE_SLA_MS - overhead_ms) / 1000.0
    for gap in unit_gaps:
        t += gap / rate
        best = 0
        for e in range(engines):
            q = out[e]
            while q and q[0] <= t:
                q.popleft()
            if len(q) < len(out[best]):
                best = e
        start = max(t, free[best])
        free[best] = start + EDGE_TOKENS * step
        out[best].append(free[best])
        if t >= warm:
            n += 1
            hits += start + step - t < limit
    return hits / n


def edge_truth(engines: int, step_ms: float, overhead_ms: float, target: float) -> tuple[float, dict]:
    """The rate where the model's long-run attainment (jsq_attainment, 2 x 100,000 requests,
    the same draws at every rate) crosses ``target``, by bisection; and the attainment at 90%,
    100% and 110% of it."""
    import numpy as np

    draws = [np.random.default_rng(seed).exponential(1.0, 100_000).tolist() for seed in (1, 2)]

    def att(rate: float) -> float:
        return sum(jsq_attainment(rate, engines, step_ms, overhead_ms, d) for d in draws) / len(draws)

    lo, hi = 1.0, engines * 1000.0 / (EDGE_TOKENS * step_ms)  # the engines' throughput: saturated
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if att(mid) >= target else (lo, mid)
    truth = (lo + hi) / 2
    return truth, {f: att(truth * f) for f in (0.9, 1.0, 1.1)}


class CpuMonitor:
    """The machine's CPU use every half second (Linux /proc): all processes, this one and the
    simulator's, and how long this process's threads waited for a core (schedstat: runnable,
    not running), so that each step's lag can be read against what other processes took (this
    machine is shared; a generator that waits for a core lags whatever the code does)."""

    def __init__(self, sim_pid: int | None) -> None:
        import threading

        self.sim_pid, self.samples, self._stop = sim_pid, [], threading.Event()
        self._waits: dict[str, int] = {}  # thread id -> its run-queue wait (ns) last read
        self._waited_ns = 0  # the sum of every thread's increases
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)
        self._thread.start()

    def _wait_ns(self) -> int:
        """This process's threads' run-queue wait so far (ns), threads gone included."""
        for task in Path("/proc/self/task").iterdir():
            try:
                waited = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
            self._waited_ns += max(0, waited - self._waits.get(task.name, 0))
            self._waits[task.name] = waited
        return self._waited_ns

    @staticmethod
    def _proc(pid: int | str) -> int:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            total, idle = sum(cpu[:8]), cpu[3] + cpu[4]
            own = self._proc("self") + (self._proc(self.sim_pid) if self.sim_pid else 0)
            self.samples.append((time.time(), total, total - idle, own, self._wait_ns()))
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def during(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        """In [t0, t1]: the share of the machine's CPU (all cores) other processes used, and the
        ms per second this process's threads waited for a core."""
        inside = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(inside) < 2:
            return None, None
        (w0, tot0, busy0, own0, wait0), (w1, tot1, busy1, own1, wait1) = inside[0], inside[-1]
        others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (tot1 - tot0)) if tot1 > tot0 else None
        return others, (wait1 - wait0) / 1e6 / (w1 - w0) if w1 > w0 else None


def edge_options(args: argparse.Namespace, trace: Path):
    from capacity.service import Options

    return Options(
        trace=str(trace),
        source_format="jsonl",
        variants=["edge"],
        arrival="poisson",
        start_rps=args.start_rate,
        max_rps=args.max_rate,
        min_rps=args.start_rate / 8,
        rel_tol=args.tolerance,
        max_steps=args.max_steps,
        step_requests=args.step_requests,
        warmup_s=args.warmup,
    )


def whole_run_lag(run_id: int) -> float | None:
    """The run's schedule lag p99 as its shards report it: every request, warm-up included."""
    from workers.models import ReplayRun

    lags = [
        x
        for x in ReplayRun.objects.get(pk=run_id).shards.values_list("lag_p99_ms", flat=True)
        if x is not None
    ]
    return max(lags) if lags else None


def search_old(experiment, opts, say) -> dict:
    """The search as it was before this bench's change: each step's lag the run's whole (its
    shards'), the limit 5 ms, a void step the generator's limit at once (void_retries 0)."""
    import dataclasses

    from capacity.search import run_search
    from capacity.service import search_spec, step_plan
    from capacity.steps import run_step

    spec = dataclasses.replace(search_spec(experiment, opts), lag_limit_ms=OLD_LAG_LIMIT_MS, void_retries=0)
    plan = step_plan(experiment, opts, spec)
    judged: dict[int, float | None] = {}

    def probe(rate: float):
        step = run_step(plan, "edge", rate, first=not judged)
        judged[step.run_id] = step.lag_p99_ms
        say(
            f"old: {rate:.3g} req/s {step.verdict} ({step.n} judged, lag p99 {_f(step.lag_p99_ms, '.2f')} ms "
            f"judged, {_f(whole_run_lag(step.run_id), '.2f')} ms the whole run, run {step.run_id})"
        )
        return dataclasses.replace(step, lag_p99_ms=whole_run_lag(step.run_id))

    t0 = time.monotonic()
    cap = run_search(spec, probe)
    out = {**cap.as_dict(), "search_s": time.monotonic() - t0}
    for st in out["steps"]:
        st["lag_judged_ms"], st["lag_whole_ms"] = judged[st["run_id"]], st["lag_p99_ms"]
    return out


def search_new(experiment, opts, say) -> dict:
    """The search as `manage.py capacity` runs it."""
    from capacity.service import search_experiment

    record = search_experiment(experiment, opts, say=lambda line: say(f"new: {line}"))
    if record.status != "done":
        raise BenchFailed(f"search {record.pk} ended {record.status}: {record.error}")
    out = record.result["edge"]
    for st in out["steps"]:
        st["lag_judged_ms"], st["lag_whole_ms"] = st["lag_p99_ms"], whole_run_lag(st["run_id"])
    return out


def others_during_steps(results: dict[str, dict], monitor: CpuMonitor) -> None:
    """Each step's ``others_busy`` and ``waited_ms_per_s`` (CpuMonitor.during) while it ran."""
    from workers.models import ReplayRun

    for r in results.values():
        runs = {run.pk: run for run in ReplayRun.objects.filter(pk__in=[s["run_id"] for s in r["steps"]])}
        for s in r["steps"]:
            run = runs[s["run_id"]]
            t0 = run.start_at_unix or run.started_at.timestamp()
            s["others_busy"], s["waited_ms_per_s"] = (
                monitor.during(t0, run.finished_at.timestamp()) if run.finished_at else (None, None)
            )


def check_edge(results: dict[str, dict]) -> None:
    """Every step a mirror run of the one variant that ended done or cancelled, every request
    ok (or cancelled by the step's stop), at least as many samples as the step judged."""
    from workers.models import ReplayRun

    for policy, r in results.items():
        runs = {run.pk: run for run in ReplayRun.objects.filter(pk__in=[s["run_id"] for s in r["steps"]])}
        for s in r["steps"]:
            where = f"{policy} at {s['rate_rps']:g} req/s (run {s['run_id']})"
            check_step_run(runs.get(s["run_id"]), s, "edge", where)


def measured_engine(results: dict[str, dict], below_rps: float) -> tuple[float, float]:
    """The engines' step as they ran on this machine, from the steps at rates below ``below_rps``
    (where most requests find an idle engine): the median server TTFT (the simulator's own clock,
    one step plus its loop's wake-up), and the median client TTFT over it (the client's side)."""
    import statistics

    from samples.factory import sample_store

    runs = sorted({s["run_id"] for r in results.values() for s in r["steps"] if s["rate_rps"] < below_rps})
    if not runs:
        raise BenchFailed(f"no step ran below {below_rps:g} req/s to measure the engines' step on")
    rows = sample_store().query(
        f"SELECT server_ttft_ms, ttft_ms FROM samples WHERE run_id IN ({', '.join(str(int(r)) for r in runs)}) "
        "AND outcome = 'ok' AND server_ttft_ms IS NOT NULL"
    )
    if len(rows) < 100:
        raise BenchFailed(
            f"{len(rows)} samples with a server TTFT in runs {runs}: too few to measure the step"
        )
    return statistics.median(r[0] for r in rows), statistics.median(r[1] - r[0] for r in rows)


def edge_tables(
    args, results: dict[str, dict], truth: float, at: dict, step_ms: float, overhead_ms: float
) -> str:
    top = (
        f"{args.engines} engines of simulator profile {EDGE_PROFILE!r} ({EDGE_TOKENS} tokens a request, one "
        f"request at a time per engine, least outstanding first); SLA: {args.target:.0%} of first tokens "
        f"within {EDGE_SLA_MS:g} ms; Poisson arrivals, start {args.start_rate:g}, max {args.max_rate:g} req/s, "
        f"tolerance {args.tolerance:g}, at most {args.max_steps} steps of {args.step_requests} requests, "
        f"warm-up {args.warmup:g} s"
    )
    truth_line = (
        f"Truth: the long-run edge of those engines on a virtual clock with the step measured here "
        f"({step_ms:.2f} ms: the median server TTFT below {args.start_rate * 1.5:g} req/s; client side "
        f"{overhead_ms:.2f} ms): {truth:.1f} req/s (model attainment {at[0.9]:.2%} at 90% of it, "
        f"{at[1.0]:.2%} at it, {at[1.1]:.2%} at 110%)"
    )
    out = [
        top,
        "",
        truth_line,
        "",
        "| lag policy | lag p99 over | lag limit ms | void step | capacity req/s | bracket req/s | truth req/s "
        "| capacity / truth | within 10% | limited by | steps | search s |",
        "|---|---|---:|---|---:|---|---:|---:|---|---|---:|---:|",
    ]
    for policy, r in results.items():
        cap = r["capacity_rps"]
        ratio = cap / truth if cap else None
        within = "yes" if ratio and abs(ratio - 1) <= 0.10 else "NO"
        if within == "NO" and r["limited_by"] == "generator":  # the target is for what it sustains
            within = f"NO: the generator lagged at {_f(r['upper_rps'])}"
        over = "the whole run" if policy == "old" else "the judged requests"
        again = "ends the search" if policy == "old" else "run once more"
        out.append(
            f"| {policy} | {over} | {r['lag_limit_ms']:g} | {again} | {_f(cap)} | [{_f(cap)}, {_f(r['upper_rps'])}) "
            f"| {truth:.1f} | {_f(ratio, '.3f')} | {within} | {r['limited_by']} | {len(r['steps'])} | {r['search_s']:.0f} |"
        )
    out += [
        "",
        "Steps, in the order run (others' CPU: the share of the machine's cores other processes took while the "
        "step ran, this bench and its simulator aside; waited: ms per second this bench's threads were ready to run "
        "and had no core, /proc schedstat):",
        "",
        "| lag policy | step | rate req/s | verdict | n | attainment | lag p99 judged ms | lag p99 whole run ms "
        "| counted | others' CPU | waited ms/s | s | run |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for policy, r in results.items():
        for i, s in enumerate(r["steps"], 1):
            att = s["hits"] / s["n"] if s["n"] else None
            void = s["lag_p99_ms"] is not None and s["lag_p99_ms"] > r["lag_limit_ms"]
            counted = "no (run again)" if not s.get("counted", True) else "void" if void else "yes"
            out.append(
                f"| {policy} | {i} | {s['rate_rps']:.3g} | {s['verdict']} | {s['n']} | {_f(att, '.4f')} "
                f"| {_f(s['lag_judged_ms'], '.2f')} | {_f(s['lag_whole_ms'], '.2f')} | {counted} "
                f"| {_f(s.get('others_busy'), '.0%')} | {_f(s.get('waited_ms_per_s'), '.0f')} | {s['seconds']:.1f} "
                f"| {s['run_id']} |"
            )
    out += [""] + [f"- {policy}: {r['message']}" for policy, r in results.items()]
    return "\n".join(out)


def run_edge(args: argparse.Namespace) -> int:
    import json

    setup_django(args)
    migrate(args)
    from experiments import services
    from simulator.serve import start_subprocess

    say = (lambda text: print(text, file=sys.stderr, flush=True)) if not args.silent else (lambda _: None)
    trace = Path(os.environ["ABPLAT_VAR"]) / "edge.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i * 0.01, "prompt": "Say two words.", "max_tokens": EDGE_TOKENS}) + "\n"
            for i in range(args.step_requests)
        )
    )
    sim = start_subprocess(EDGE_PROFILE, replicas=args.engines, model="tiny-llama")
    monitor = CpuMonitor(sim.pid)
    try:
        require_healthy([sim], "before the searches")
        doc = {
            "key": "bench-capacity-edge",
            "name": "capacity against a known edge",
            "sla": {"ttft_ms": EDGE_SLA_MS, "target": args.target},
            "variants": [
                {
                    "key": "edge",
                    "control": True,
                    "weight": 100,
                    "endpoint": sim.url + "/v1",
                    "model": "tiny-llama",
                    "api": "completions",
                },
                {
                    "key": "other",
                    "weight": 0,
                    "endpoint": sim.url + "/v1",
                    "model": "tiny-llama",
                    "api": "completions",
                },
            ],
        }
        experiment = services.apply_document(doc).experiment
        services.transition(experiment, "start", None, reason="bench")
        opts = edge_options(args, trace)
        results = {}
        for policy in args.lag_policy:
            results[policy] = (search_old if policy == "old" else search_new)(experiment, opts, say)
        require_healthy([sim], "after the searches")
    finally:
        monitor.stop()
        sim.stop()
    check_edge(results)
    others_during_steps(results, monitor)
    step_ms, overhead_ms = measured_engine(results, below_rps=args.start_rate * 1.5)
    truth, at = edge_truth(args.engines, step_ms, overhead_ms, args.target)
    print(
        f"{os.cpu_count()} cores; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end\n"
    )
    print(edge_tables(args, results, truth, at, step_ms, overhead_ms))
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
    ap.add_argument(
        "--edge",
        action="store_true",
        help="search a simulator with a known SLA capacity under both lag policies instead",
    )
    ap.add_argument(
        "--lag-policy",
        type=lambda t: [p for p in t.split(",") if p],
        default=list(POLICIES),
        help="--edge: old, new or old,new (the default)",
    )
    ap.add_argument("--engines", type=int, default=4, help="--edge: the simulator's engines")
    ap.add_argument("--target", type=float, default=0.95, help="--edge: the SLA target")
    ap.add_argument("--start-rate", type=float, default=30.0, help="--edge: the first rate tried")
    args = ap.parse_args(argv)
    if args.edge:
        bad = [p for p in args.lag_policy if p not in POLICIES]
        if bad or args.quick:
            ap.error(
                f"--edge: --lag-policy takes {' or '.join(POLICIES)}, got {bad}"
                if bad
                else "--edge has no --quick"
            )
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        defaults = {
            "--max-rate": ("max_rate", 120.0),
            "--tolerance": ("tolerance", 0.05),
            "--max-steps": ("max_steps", 12),
            "--step-requests": ("step_requests", 2000),
            "--warmup": ("warmup", 5.0),
        }
        for flag, (name, value) in defaults.items():  # the command's own defaults, not the demo's
            if flag not in given:
                setattr(args, name, value)
        return run_checked(run_edge, args)
    if args.quick:
        args.max_rate, args.tolerance, args.max_steps = 64.0, 1.0, 2
        args.step_requests, args.warmup, args.repeat = 200, 1.0, 1
    return run_checked(run, args)


if __name__ == "__main__":
    sys.exit(main())
