"""What shadow sampling costs a live request that is not shadowed, and one that is.

    .venv/bin/python bench/bench_shadow.py            # --quick: a tenth of the calls, for the tests

1. The decision on the request path (gateway/shadow.py ``Shadows.plan``): an experiment with no
   ``shadow_share`` (a lookup), one with a share whose hash does not pick the request (the hash),
   and a request that is picked.
2. The live answer's reader (streaming/timing.py StreamTimer) over a 256-token streamed answer,
   with and without the token chunks' fingerprints: only a sampled request that is compared as
   served keeps them; every other request reads its answer exactly as without shadowing.

Printed as a table with each row's ratio to its baseline (the decision with no share; the answer
read without fingerprints). Checks: the unsampled request's timer is the one without fingerprints (its result has none),
and the sampled one's has one fingerprint a token. Any failure prints `bench FAILED: <what>`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import timeit
from collections.abc import Callable
from types import MappingProxyType

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

import django  # noqa: E402

django.setup()

from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from gateway.request import RequestContext  # noqa: E402
from gateway.routing import Decision, Reason  # noqa: E402
from gateway.shadow import Shadows  # noqa: E402
from gateway.upstream import Deadlines  # noqa: E402
from gateway.variants import Directory, ExperimentTargets, Target  # noqa: E402
from streaming.endpoint import Endpoint  # noqa: E402
from streaming.result import Outcome  # noqa: E402
from streaming.timing import StreamTimer  # noqa: E402
from telemetry.metrics import GatewayMeter  # noqa: E402

TOKENS = 256


def _shadows(share: float) -> tuple[Shadows, Target]:
    ep = Endpoint.parse("http://127.0.0.1:1/v1")
    variants = {"fp16": Target("e", "fp16", True, ep, "m", {}), "awq": Target("e", "awq", False, ep, "m", {})}
    exp = ExperimentTargets("e", "running", "fp16", MappingProxyType(variants), shadow_share=share)
    directory = Directory({"e": exp})
    shadows = Shadows(
        directory=directory, recorder=None, meter=GatewayMeter(), pool=None, deadlines=Deadlines(), cap=8
    )
    return shadows, variants["awq"]


def _context(request_id: str) -> RequestContext:
    return RequestContext(
        api_path="/v1/chat/completions",
        request={"stream": True, "temperature": 0},
        decision=Decision("e", "awq", 1, Reason.ASSIGNED, "e"),
        user_id="u",
        request_id=request_id,
        traceparent="",
        trace_id="",
        max_tokens=0,
        forwarded={},
        accept="text/event-stream",
        sample_key=request_id,
    )


def _reader(fingerprint: bool) -> Callable[[], int]:
    """A reading of the same 256-token answer; it returns the fingerprints kept."""
    events = [
        json.dumps(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [
                    {"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None, "finish_reason": None}
                ],
            }
        )
        for i in range(TOKENS)
    ]

    def read() -> int:
        timer = StreamTimer(0, fingerprint=fingerprint)
        for i, data in enumerate(events):
            timer.event(i, data)
        timer.event(TOKENS, "[DONE]")
        return len(timer.finish(TOKENS + 1, Outcome.OK).token_fps)

    return read


def _per_call_ns(call: Callable[[], object], n: int) -> float:
    return min(timeit.repeat(call, number=n, repeat=5)) / n * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tenth of the calls (the tests' run)")
    args = ap.parse_args()
    calls, reads = (10_000, 20) if args.quick else (100_000, 200)
    ids = [f"gw-{i:032x}" for i in range(4000)]
    none, target = _shadows(0.0)
    some, _ = _shadows(0.3)
    unsampled = _context(next(r for r in ids if some.plan(_context(r), target) is None))
    picked = _context(next(r for r in ids if some.plan(_context(r), target) is not None))
    plain, fingerprinted = _reader(False), _reader(True)
    if plain() != 0 or fingerprinted() != TOKENS:
        raise BenchFailed("the reader kept fingerprints it should not, or not one a token")
    # (what, ns per call, the row it is compared with)
    base_plan = "plan(): share 0"
    base_read = f"{TOKENS}-token answer read, no fingerprints"
    rows = [
        (base_plan, _per_call_ns(lambda: none.plan(unsampled, target), calls), base_plan),
        (
            "plan(): share 0.3, not sampled",
            _per_call_ns(lambda: some.plan(unsampled, target), calls),
            base_plan,
        ),
        ("plan(): share 0.3, sampled", _per_call_ns(lambda: some.plan(picked, target), calls), base_plan),
        (base_read, _per_call_ns(plain, reads), base_read),
        (f"{TOKENS}-token answer read, fingerprinted", _per_call_ns(fingerprinted, reads), base_read),
    ]
    ns_of = {name: ns for name, ns, _base in rows}
    print("| what | us per call | vs baseline |")
    print("|---|---:|---:|")
    for name, ns, base in rows:
        ratio = "1.00x (baseline)" if base == name else f"{ns / ns_of[base]:.2f}x"
        print(f"| {name} | {ns / 1000:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(run_checked(main))
