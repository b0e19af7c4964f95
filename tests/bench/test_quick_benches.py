"""Every bench/bench_*.py in its --quick mode, so a benchmark cannot rot unnoticed.

Each bench checks its own preconditions and results and exits 1 with `bench FAILED: ...` on
stderr when one fails; here each must exit 0 and print its tables. No timing is asserted. The
quick benches run a few at a time (QUICK_PARALLEL, each in its own ClickHouse database), the
longest first: they wait on schedules, servers and etcd restarts more than they compute, so a few
side by side take little longer than one, while all of them at once would starve the tests other
pytest-xdist workers run beside this module. Needs the ClickHouse server and etcd (make services).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid

import pytest

from tests.plugin import SERVER_URL, server_url_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHES = sorted(p.name for p in (ROOT / "bench").glob("bench_*.py"))
ETCD = os.environ.get("ABPLAT_TEST_ETCD_ENDPOINTS", "127.0.0.1:12379")
TIMEOUT_S = 180  # a hang guard, not a timing check: each bench's own, from its start
# Benches running at once; the rest wait for a slot, the longest (wall time alone) started first.
# On 2 cores 3 at once take about as long in all as 4 and a third less than 2; all 14 at once
# starved their neighbours and the ClickHouse server (timeouts, the hang guard's kills).
QUICK_PARALLEL = int(os.environ.get("ABPLAT_TEST_QUICK_BENCHES_PARALLEL") or "3")
LONGEST_FIRST = (
    "bench_long_replay.py",
    "bench_capacity.py",
    "bench_split.py",
    "bench_gateway.py",
    "bench_itl.py",
    "bench_replay_cpu.py",
    "bench_observability.py",
    "bench_replay.py",
    "bench_report.py",
    "bench_sequential.py",
    "bench_server_metrics.py",
)

pytestmark = pytest.mark.services


def bench_env(database: str, var: pathlib.Path) -> dict[str, str]:
    """The test services for a bench: its own fresh ClickHouse database, the test etcd, and its
    own ABPLAT_VAR (never this test session's)."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ABPLAT_VAR": str(var),
        "ABPLAT_BENCH_CLICKHOUSE_URL": server_url_for(database),
        "ABPLAT_TEST_ETCD_ENDPOINTS": ETCD,
    }


def bench_args(name: str, database: str) -> list[str]:
    """The ClickHouse URL on each bench's own command line, where it takes one there."""
    url = server_url_for(database)
    return {
        "bench_replay.py": ["--clickhouse-url", url],
        "bench_insert.py": ["--url", url],
        "bench_observability.py": ["--clickhouse-url", url],
        "bench_gateway.py": ["--clickhouse-url", url, "--floor"],
    }.get(name, [])


def has_table(text: str) -> bool:
    """A header and a row: two consecutive lines split into the same number (>= 3) of cells,
    markdown (| a | b |) or aligned columns (two or more spaces between cells)."""

    def cells(line: str) -> int:
        line = line.strip()
        parts = line.strip("|").split("|") if line.startswith("|") else re.split(r"\s{2,}", line)
        return len([c for c in parts if c.strip()])

    counts = [cells(line) for line in text.splitlines()]
    return any(a == b >= 3 for a, b in zip(counts, counts[1:]))


def drop_database(database: str) -> None:
    """The bench's database and those it named after it (bench_report's `<name>_20000`,
    bench_itl's `<name>_itl_demo`, ...): every name starting with ``database``, unique per run."""
    from clickhouse_driver import Client

    url = urllib.parse.urlsplit(SERVER_URL)
    client = Client(
        url.hostname, port=url.port or 9000, user=url.username or "default", password=url.password or ""
    )
    try:
        names = client.execute(
            "SELECT name FROM system.databases WHERE startsWith(name, %(p)s)", {"p": database}
        )
        for (name,) in names:
            client.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        client.disconnect()


def started_order(names: list[str]) -> list[str]:
    """The benches longest first (LONGEST_FIRST), then any other in name order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """{bench file: (returncode, stdout, stderr, seconds, killed)}: every bench run, at most
    QUICK_PARALLEL at a time. A bench still running TIMEOUT_S after its start is killed with every
    process under it (its servers and workers) and reported as killed by the hang guard."""
    logs = tmp_path_factory.mktemp("quick-benches")
    waiting, running, results = started_order(BENCHES), {}, {}
    databases = []

    def start(name: str) -> None:
        database = f"abplat_bench_quick_{name[6:-3]}_{uuid.uuid4().hex[:8]}"
        databases.append(database)
        env = bench_env(database, tmp_path_factory.mktemp(f"var-{name[:-3]}"))
        # Output to files, not pipes: a bench is never blocked on a full pipe nobody reads yet.
        with (logs / f"{name}.out").open("wb") as out, (logs / f"{name}.err").open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / name), "--quick", *bench_args(name, database)],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        running[name] = (proc, time.monotonic())

    def finish(name: str, killed: bool) -> None:
        proc, t0 = running.pop(name)
        if killed:
            kill_tree(proc)
        seconds = time.monotonic() - t0
        out, err = ((logs / f"{name}.{ext}").read_text(errors="replace") for ext in ("out", "err"))
        results[name] = (proc.returncode, out, err, seconds, killed)

    try:
        while waiting or running:
            while waiting and len(running) < max(1, QUICK_PARALLEL):
                start(waiting.pop(0))
            time.sleep(0.2)
            for name, (proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    finish(name, killed=False)
                elif time.monotonic() - t0 > TIMEOUT_S:
                    finish(name, killed=True)
    finally:
        for proc, _ in running.values():
            kill_tree(proc)
        for database in databases:
            drop_database(database)
    return results


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid``, by parent: a bench starts Celery workers and servers in
    sessions of their own, out of its process group."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue  # gone since listdir
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the bench, every process under it and its process group, then reap the bench: a
    Celery worker left behind would take the next run's tasks from the same Redis database."""
    for pid in (proc.pid, *descendants(proc.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def quick_run(quick_runs, name: str) -> tuple[int, str, str]:
    """A bench's (returncode, stdout, stderr); fails the test at once, saying so, when the hang
    guard killed it."""
    code, out, err, seconds, killed = quick_runs[name]
    if killed:
        pytest.fail(
            f"{name} --quick was killed by the hang guard: still running {TIMEOUT_S} s after it started "
            f"({seconds:.0f} s); its output so far:\n{out[-4000:]}\n{err[-4000:]}"
        )
    return code, out, err


def test_every_bench_has_a_quick_mode():
    assert {"bench_replay.py", "bench_split.py", "bench_streaming.py", "bench_sequential.py"} <= set(BENCHES)
    for name in BENCHES:
        assert "--quick" in (ROOT / "bench" / name).read_text(), f"{name} has no --quick"


@pytest.mark.parametrize("name", BENCHES)
def test_quick_bench_passes_its_own_checks_and_prints_its_tables(quick_runs, name):
    code, out, err = quick_run(quick_runs, name)
    seconds = quick_runs[name][3]
    assert code == 0, f"{name} --quick exited {code} after {seconds:.0f}s:\n{out[-4000:]}\n{err[-4000:]}"
    assert "bench FAILED" not in err
    assert has_table(out), f"{name} printed no table:\n{out}"


def test_quick_bench_replay_prints_every_table_with_exact_sample_counts(quick_runs):
    code, out, err = quick_run(quick_runs, "bench_replay.py")
    assert code == 0, f"bench failed ({code}):\n{out}\n{err}"
    assert "2 cores" in out or "cores" in out.splitlines()[0]
    assert "| run | workers | target/s |" in out
    for label in (
        "| floor | 1 | 50 | 50 |",
        "| no network | 1 | 50 | 50 |",
        "| real | 1 | 50 | 50 |",
        "| real | 2 | 50 | 50 |",
        "| real, prompts prebuilt | 1 | 50 | 50 |",
    ):
        assert label in out, f"missing part 1 row {label!r}:\n{out}"
    assert "highest sustained rate" in out
    # Part 2: the trace's first 60 requests, one sample each (split) and three each (mirror),
    # counted in the store with uniqExact and FINAL and matching the raw row count.
    assert "| split | fast | 60 | 100x |" in out and "| 60 | 60 | 60 | 60 | yes |" in out, out
    assert "| mirror | fast | 60 | 100x |" in out and "| 180 | 180 | 180 | 180 | yes |" in out, out


def test_quick_bench_sequential_prints_false_rollbacks_coverage_and_time_to_detect(quick_runs):
    # The bench fails unless the sequences keep alpha and peeked fixed-horizon tests exceed it.
    code, out, err = quick_run(quick_runs, "bench_sequential.py")
    assert code == 0, f"bench failed ({code}):\n{out}\n{err}"
    for header in (
        "| guardrail (A/A at the limit) | anytime-valid (ours) | fixed-horizon, peeked | fixed / ours |",
        "| quantity | truth | anytime-valid (ours) | fixed-horizon, peeked | fixed / ours |",
        "| step | candidate req/s | rolled back (regressed) | median min |",
        # with users: the clustered guardrails' A/A, the adjustment's time to roll back
        "| guardrail (A/A at the limit) | users: clustered (ours) | requests as independent (before) |",
        "| differences read as | rolled back within the horizon | median requests |",
    ):
        assert header in out, f"missing table {header!r}:\n{out}"
    for step in ("| 1% |", "| 5% |", "| 25% |", "| 50% |"):
        assert step in out, f"no row for step {step}:\n{out}"
    assert (
        "| any of the three: the rollout's false rollback" in out
        and "| users, clustered, adjusted (ours) |" in out
    )


def test_quick_bench_observability_prints_each_setup_side_by_side_with_its_ratio(quick_runs):
    code, out, err = quick_run(quick_runs, "bench_observability.py")
    assert code == 0, f"bench failed ({code}):\n{out}\n{err}"
    assert "| setup | runs | CPU ms/request (median) | min - max | vs off (paired median) |" in out, out
    assert "| 1.000 | 1.000 - 1.000 |" in out, out  # the baseline against itself
    for label in ("off", "metrics", "metrics, dir", "metrics, dir + JSON logs"):
        assert f"| {label} | 1 | " in out, f"missing setup {label!r}:\n{out}"
    assert "| metrics, in-process | " in out and "| metrics, ABPLAT_METRICS_DIR | " in out, out
    assert "| JSON logs (" in out and "target: overhead under 3%" in out, out


def test_quick_bench_capacity_prints_the_demo_deployments_with_their_steps_and_prices(quick_runs):
    # The bench fails unless every step is a mirror run of its variant alone with every request
    # ok, each capacity is the highest rate that met, and the prices follow from it.
    from workers.demo import REPLICAS

    code, out, err = quick_run(quick_runs, "bench_capacity.py")
    assert code == 0, f"bench failed ({code}):\n{out}\n{err}"
    assert (
        "| variant | engines | capacity req/s | bracket req/s | limited by | steps | max lag p99 ms |" in out
    ), out
    assert "| variant | step | rate req/s | verdict | n | attainment | CI |" in out, out
    for variant in ("fp16", "awq", "awq-fa2"):
        assert f"| {variant} | {REPLICAS} | " in out and f"| {variant} | 1 | 64 | " in out, (
            f"no rows for {variant}:\n{out}"
        )
    assert " USD | " in out  # priced by the demo document


def test_quick_bench_replay_cpu_prints_both_clients_per_round_and_their_ratio(quick_runs):
    # The bench fails unless every request of both clients is ok and streams exactly its trace's
    # output tokens, and our reads carry kernel receive stamps.
    code, out, err = quick_run(quick_runs, "bench_replay_cpu.py")
    assert code == 0, f"bench failed ({code}):\n{out}\n{err}"
    assert "| round | client | requests | tokens | CPU s | CPU ms/request | CPU us/token |" in out, out
    for client in ("abplat replay", "abplat replay, asyncio loop", "vllm bench serve"):
        assert f"| 1 | {client} | 100 | " in out, f"no round-1 row for {client!r}:\n{out}"
    summary = "| client | rounds | CPU ms/request, median (min - max) | CPU us/token, median (min - max) |"
    assert summary in out, out
    assert "abplat replay / vllm bench serve per token, paired by round: median " in out, out
    assert "target <= 0.5: " in out, out


def test_quick_bench_gateway_prints_every_path_side_by_side_with_its_bytes_and_recording(quick_runs):
    # The bench fails unless every request through every path is ok with exactly its tokens,
    # every body through the gateway and nginx is the direct body byte for byte, and the
    # gateway recorded one sample per request it forwarded (its LiveRun books, nothing lost).
    code, out, err = quick_run(quick_runs, "bench_gateway.py")
    assert code == 0, f"bench failed ({code}):\n{out}\n{err}"
    assert "| path | request | status | body bytes | same bytes as direct | headers added |" in out, out
    for api in ("/v1/chat/completions", "/v1/completions"):
        for path in ("gateway", "nginx", "relay"):
            assert re.search(rf"\| {path} \| {api} \| 200 \| \d+ \| yes \| ", out), f"{path} {api}:\n{out}"
    assert "| gateway | /v1/chat/completions | 429 | " in out, out  # the upstream's error, passed through
    assert "| yes | traceparent, x-abplat-variant, x-request-id |" in out, out
    header = (
        "| streams | path | requests | TTFT p50 ms | TTFT p99 ms | hop p50 ms | hop p99 ms | "
        "added TTFT p50 ms | added TTFT p99 ms | proxy CPU us/token |"
    )
    assert header in out, out
    for streams in (1, 64):
        assert f"| {streams} | direct | " in out and "| (baseline) | (baseline) | - |" in out, out
        for path in ("gateway", "nginx", "relay"):  # relay: the bare Python hop (--floor)
            assert f"| {streams} | {path} | {streams + 20} | " in out, f"no {path} row at {streams}:\n{out}"
    assert "target (simulator `fast` (its own process)): p99 added TTFT under 1 ms at 64 streams" in out, out
    assert "the bare Python relay (simulator `fast` (its own process)) at 64 streams: added TTFT " in out, out
    assert re.search(
        r"gateway's recording \(.*\): (\d+) samples for \1 requests, .* dropped 0, rejected 0; "
        r"its run closed",
        out,
    ), out


# A broken precondition: each bench exits 1 at once, naming what failed, and prints no table.
DEAD = [
    (
        "bench_replay.py",
        ["--quick", "--clickhouse-url", "clickhouse://default:@127.0.0.1:1/abplat_dead"],
        "ClickHouse server at clickhouse://127.0.0.1:1/abplat_dead is not usable",
    ),
    ("bench_split.py", ["--quick", "--etcd", "127.0.0.1:1"], "etcd at 127.0.0.1:1 not reachable"),
    (
        "bench_observability.py",
        ["--quick", "--clickhouse-url", "clickhouse://default:@127.0.0.1:1/abplat_dead"],
        "ClickHouse server at clickhouse://127.0.0.1:1/abplat_dead is not usable",
    ),
    (
        "bench_capacity.py",
        ["--quick", "--clickhouse-url", "clickhouse://default:@127.0.0.1:1/abplat_dead"],
        "ClickHouse server at clickhouse://127.0.0.1:1/abplat_dead is not usable",
    ),
    (
        "bench_streaming.py",
        ["--skip-sim", "--vllm-url", "http://127.0.0.1:1"],
        "vLLM (--vllm-url) at http://127.0.0.1:1 not healthy",
    ),
    (
        "bench_gateway.py",
        ["--quick", "--clickhouse-url", "clickhouse://default:@127.0.0.1:1/abplat_dead"],
        "ClickHouse server at clickhouse://127.0.0.1:1/abplat_dead is not usable",
    ),
]


@pytest.mark.parametrize("name, args, message", DEAD, ids=[d[0] for d in DEAD])
def test_a_bench_whose_target_is_down_exits_1_naming_it(name, args, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ABPLAT_VAR": str(tmp_path)},
    )
    assert proc.returncode == 1, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert f"bench FAILED: {message}" in proc.stderr, proc.stderr
    assert "\n|" not in proc.stdout  # no table of failures


def _bench_replay():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_replay_under_test", ROOT / "bench" / "bench_replay.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_bench_replay_fails_on_a_simulator_that_is_down_or_requests_that_failed():
    # The original failure: every request of a "real" row was connect_error (its simulators had
    # died) and the bench printed the table as a result.
    bench = _bench_replay()
    with pytest.raises(
        bench.BenchFailed, match=r"before the run: simulator not healthy: b \(http://127.0.0.1:1"
    ):
        bench.require_healthy({"b": "http://127.0.0.1:1"}, "before the run")
    run = {
        "requests": 400,
        "expected": 400,
        "outcomes": {"connect_error": 400},
        "count": 0,
        "final": 0,
        "recorded": 400,
        "run_id": 7,
    }
    with pytest.raises(bench.BenchFailed, match="part 1, real.*outcomes connect_error=400, expected ok=400"):
        bench.check_run(run, "part 1, real, 1 worker(s) at 100 req/s", stored=True)
    run["outcomes"] = {"ok": 400}
    with pytest.raises(bench.BenchFailed, match="count=0 FINAL=0 recorded=400, expected 400"):
        bench.check_run(run, "part 1", stored=True)
    run.update(count=400, final=400)
    bench.check_run(run, "part 1", stored=True)
