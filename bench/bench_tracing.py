"""What OpenTelemetry tracing (ABPLAT_OTEL_ENABLED) costs the replay, in CPU per request.

    .venv/bin/python bench/bench_tracing.py            # 7 rounds x 2 setups, 10,000 requests each
    .venv/bin/python bench/bench_tracing.py --quick    # smoke run: 2 rounds of 2,000

With tracing on, the replay hands every finished request's sample row to workers/spans.py
``traced``, which builds its span (``span_of``) and records it (telemetry/tracing.py
``record_request_span``); a BatchSpanProcessor thread exports the spans over OTLP/HTTP. This
measures exactly that, on real sample rows (samples.rows.row_from of measured-looking results
with the traceparent the client sends), in one process, the two setups interleaved round by round:

- ``off``: ``traced(put)`` with tracing off (it returns ``put`` itself): the baseline.
- ``on``: tracing on, exporting over OTLP/HTTP to a stand-in collector in its own process (its
  CPU is not counted); the export thread's CPU is (process_time counts every thread), up to the
  flush at the end of the round, as a shard's end flushes.
- ``on, in memory``: the same into the SDK's in-memory exporter: building and recording the
  spans without the OTLP encoding and the POSTs (how the cost divides).

CPU per request = the process's CPU over the round / requests. ``put`` appends to a list (the
replay's BatchSink.put is not what is measured). The figure to hold against the replay's own CPU
per request (bench/bench_observability.py measures that) is "added".

Checks: the collector received every span of every ``on`` round, with the traceparent ids of
its row, and none in an ``off`` round; a failure prints `bench FAILED: ...` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")
os.environ.setdefault("ABPLAT_DEBUG", "true")

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

# A stand-in OTLP/HTTP collector: counts the spans of every POST, and the ids it saw, in a set.
COLLECTOR = r"""
import http.server, json, sys
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
seen = []
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        req = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
        seen.extend(f"00-{s.trace_id.hex()}-{s.span_id.hex()}-01"
                    for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_GET(self):
        body = json.dumps(seen).encode(); seen.clear()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def sample_rows(n: int) -> list:
    from samples.rows import SampleContext, row_from
    from streaming.result import StreamResult
    from streaming.trace_context import trace_ids

    rows = []
    now_ms = time.time() * 1000.0
    for seq in range(n):
        rid = f"bench-tracing-{seq}"
        trace_id, span_id = trace_ids(rid)
        result = StreamResult(
            http_status=200,
            request_id=rid,
            traceparent=f"00-{trace_id}-{span_id}-01",
            trace_id=trace_id,
            ttfb_ms=20.0,
            ttft_ms=48.5 + seq % 7,
            e2e_ms=900.0 + seq % 13,
            output_tokens=64,
            chunks=64,
        )
        rows.append(
            row_from(
                result,
                SampleContext(
                    experiment="bench-tracing",
                    run_id=1,
                    seq=seq,
                    variant=("a", "b", "c")[seq % 3],
                    mode="split",
                    sent_unix_ms=now_ms + seq,
                    request_id=rid,
                ),
            )
        )
    return rows


SETUPS = ("off", "on", "on, in memory")


def one_round(setup: str, rows: list, collector: str) -> float:
    """CPU seconds of one round: every row through traced(put), then the flush."""
    from django.conf import settings
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from telemetry import tracing
    from workers.spans import traced

    settings.OTEL_ENABLED, settings.OTEL_ENDPOINT = setup != "off", collector
    memory = InMemorySpanExporter()
    if setup == "on, in memory":  # traced() keeps a running exporter of the same settings
        tracing.configure(True, collector, settings.OTEL_SERVICE_NAME, exporter=memory)
    kept: list = []
    cpu0 = time.process_time()
    put = traced(kept.append)
    for row in rows:
        put(row)
    tracing.flush()
    cpu = time.process_time() - cpu0
    tracing.configure(False)  # the next round starts its own exporter (as a new shard process would)
    if len(kept) != len(rows):
        raise BenchFailed(f"{setup}: put kept {len(kept)} of {len(rows)} rows")
    if setup == "on, in memory" and len(memory.get_finished_spans()) != len(rows):
        raise BenchFailed(f"{setup}: {len(memory.get_finished_spans())} spans of {len(rows)}")
    return cpu


def received(collector: str) -> list[str]:
    with urllib.request.urlopen(collector + "/", timeout=10) as response:
        return json.loads(response.read())


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 2,000 requests")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=10_000, help="per round; at most MAX_QUEUED_SPANS")
    args = ap.parse_args(argv)
    rounds, n = (2, 2000) if args.quick else (args.rounds, args.requests)
    from telemetry.tracing import MAX_QUEUED_SPANS

    if rounds < 1 or not 1 <= n <= MAX_QUEUED_SPANS:
        raise BenchFailed(
            f"--rounds must be at least 1, --requests in [1, {MAX_QUEUED_SPANS}] (a round's spans wait "
            "in the exporter's queue: more would be dropped, by design)"
        )

    import django

    django.setup()
    rows = sample_rows(n)
    expected = sorted(row["traceparent"] for row in rows)
    proc = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
    try:
        port = proc.stdout.readline().strip()
        if not port.isdigit():
            raise BenchFailed(f"the stand-in collector did not start (exit {proc.poll()})")
        collector = f"http://127.0.0.1:{port}/v1/traces"
        base = f"http://127.0.0.1:{port}"
        cpu: dict[str, list[float]] = {s: [] for s in SETUPS}
        one_round("on", rows[:200], collector)  # warm-up: imports, first connection
        received(base)
        for r in range(rounds):
            for setup in SETUPS if r % 2 == 0 else SETUPS[::-1]:
                cpu[setup].append(one_round(setup, rows, collector))
                got = received(base)
                if setup == "on" and sorted(got) != expected:
                    raise BenchFailed(
                        f"round {r + 1}: the collector received {len(got)} spans of {n}, "
                        "or not the rows' traceparents"
                    )
                if setup != "on" and got:
                    raise BenchFailed(f"round {r + 1}, {setup}: the collector received {len(got)} spans")
    finally:
        proc.terminate()
        proc.wait(10)

    per = {s: [c / n * 1e6 for c in v] for s, v in cpu.items()}
    med = {s: statistics.median(v) for s, v in per.items()}
    print(f"{rounds} rounds x {n} requests, interleaved; CPU microseconds per request (median, min-max)\n")
    print("| setup | CPU us/request | min | max | added vs off |")
    print("|---|---:|---:|---:|---:|")
    for s in SETUPS:
        print(f"| {s} | {med[s]:.2f} | {min(per[s]):.2f} | {max(per[s]):.2f} | {med[s] - med['off']:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(run_checked(run, sys.argv[1:]))
