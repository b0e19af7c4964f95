"""OpenTelemetry (telemetry/tracing.py, workers/spans.py): with ABPLAT_OTEL_ENABLED the replay
exports the parent span its traceparent named, one per request, so a variant's server spans
join it; off (the default), nothing is exported and opentelemetry is not even imported."""

import gzip
import http.server
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from django.core.management import call_command
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from samples.backends.clickhouse import ClickHouseServerBackend
from samples.rows import SampleContext, row_from
from simulator.serve import start_in_thread
from streaming.result import Outcome, StreamResult
from streaming.trace_context import trace_ids
from telemetry import tracing
from tests.plugin import server_url_for
from tests.workers.background import ROOT, manage, start_demo_experiment
from workers.models import ReplayRun
from workers.spans import span_of, traced

TRACE = "data/traces/azure_llm_2023_code.csv"
COLUMNS = "request_id, traceparent, trace_id, variant, outcome, ttft_ms, http_status, sent_unix_ms, e2e_ms"


@pytest.fixture
def memory_spans(settings):
    """Tracing on, into the SDK's in-memory exporter (the settings' OTLP one is never built)."""
    exporter = InMemorySpanExporter()
    settings.OTEL_ENABLED = True
    tracing.configure(True, settings.OTEL_ENDPOINT, settings.OTEL_SERVICE_NAME, exporter=exporter)
    yield exporter
    tracing.shutdown()


def samples_of(store, run_id: int) -> dict[str, dict]:
    names = [c.strip() for c in COLUMNS.split(",")]
    rows = store.query(f"SELECT {COLUMNS} FROM samples FINAL WHERE run_id = %(r)s", {"r": run_id})
    return {r[0]: dict(zip(names, r)) for r in rows}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sample_store", ["chdb"], indirect=True)
@pytest.mark.engine
def test_a_replay_exports_the_parent_span_of_every_request_it_sent(running, sample_store, memory_spans):
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, "--limit", "40", "--speed", "200", stdout=out)
    run = ReplayRun.objects.get()
    assert run.status == "done", (run.error, out.getvalue())
    samples = samples_of(sample_store, run.pk)
    spans = memory_spans.get_finished_spans()  # flushed at the shard's end: nothing to wait for
    assert len(samples) == 40 and len(spans) == 40
    by_request = {s.attributes["abplat.request_id"]: s for s in spans}
    assert by_request.keys() == samples.keys()  # exactly one span per request
    started, finished = run.started_at.timestamp() * 1e9, run.finished_at.timestamp() * 1e9
    for rid, sample in samples.items():
        span = by_request[rid]
        # the very ids of the traceparent the request carried (and the sample recorded)
        assert f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01" == sample["traceparent"]
        assert f"{span.context.trace_id:032x}" == sample["trace_id"] == trace_ids(rid)[0]
        assert span.parent is None and span.kind is SpanKind.CLIENT and span.name == tracing.SPAN_NAME
        assert span.status.status_code is StatusCode.UNSET
        assert dict(span.attributes) == {
            "abplat.experiment": "ttft-opt",
            "abplat.run": run.pk,
            "abplat.variant": sample["variant"],
            "abplat.request_id": rid,
            "abplat.mode": "split",
            "abplat.outcome": "ok",
            "abplat.ttft_ms": sample["ttft_ms"],
            "http.response.status_code": 200,
        }
        # start and end of the request, on the wall clock of the sample's send time
        assert abs(span.start_time - sample["sent_unix_ms"] * 1e6) <= 1000  # to the microsecond
        assert abs(span.end_time - span.start_time - sample["e2e_ms"] * 1e6) <= 1
        assert started - 1e9 <= span.start_time < span.end_time <= finished
    assert {s.resource.attributes["service.name"] for s in spans} == {"abplat-replay"}
    # roots only: no span of the replay is the parent of another
    assert not {s.context.span_id for s in spans} & {s.parent.span_id for s in spans if s.parent}


def failed_row(**result):
    rid = "run-7-seq-3"
    trace_id, span_id = trace_ids(rid)
    r = StreamResult(request_id=rid, traceparent=f"00-{trace_id}-{span_id}-01", trace_id=trace_id, **result)
    return row_from(
        r,
        SampleContext(
            experiment="e",
            run_id=7,
            seq=3,
            variant="awq",
            mode="split",
            sent_unix_ms=1796122481000.25,
            request_id=rid,
        ),
    )


def test_a_failed_request_s_span_has_status_error_and_its_http_status(memory_spans):
    row = failed_row(outcome=Outcome.HTTP_5XX, http_status=503, error="HTTP 503: overloaded", e2e_ms=12.5)
    tracing.record_request_span(**span_of(row))
    # a request the client never measured ends when it was recorded
    unmeasured = failed_row(outcome=Outcome.CONNECT_ERROR, error="connection refused")
    tracing.record_request_span(**span_of(unmeasured))
    assert tracing.flush()
    failed, refused = memory_spans.get_finished_spans()
    assert (
        failed.status.status_code is StatusCode.ERROR and failed.status.description == "HTTP 503: overloaded"
    )
    assert (
        failed.attributes["http.response.status_code"] == 503
        and failed.attributes["abplat.outcome"] == "http_5xx"
    )
    assert "abplat.ttft_ms" not in failed.attributes  # no first token: no value, not a zero
    assert (failed.start_time, failed.end_time) == (1796122481000250000, 1796122481012750000)
    assert (
        refused.status.status_code is StatusCode.ERROR
        and "http.response.status_code" not in refused.attributes
    )
    assert refused.end_time == row_recorded_ns(unmeasured) and refused.end_time >= refused.start_time


def row_recorded_ns(row) -> int:
    return max(1796122481000250000, row["recorded_ms"] * 1_000_000)


def test_a_cancelled_request_is_not_an_error():
    assert span_of(failed_row(outcome=Outcome.CANCELLED, e2e_ms=1.0))["error"] is None
    assert span_of(failed_row(outcome=Outcome.CLIENT_ERROR, error="client error: boom"))["error"] == (
        "client error: boom"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"trace_id": "0" * 32}, "all zeros"),
        ({"trace_id": "ABC" + "0" * 29}, "32 lowercase hex"),
        ({"span_id": "1234"}, "16 lowercase hex"),
        ({"end_ns": 10}, "ends"),
    ],
)
def test_a_badly_described_span_is_refused(memory_spans, kwargs, message):
    good = {"trace_id": "1" * 32, "span_id": "2" * 16, "start_ns": 100, "end_ns": 200, "attributes": {}}
    with pytest.raises(tracing.TracingError, match=message):
        tracing.record_request_span(**{**good, **kwargs})
    assert memory_spans.get_finished_spans() == ()


def test_off_every_call_is_a_no_op():
    tracing.configure(False)
    assert not tracing.enabled()
    tracing.record_request_span(trace_id="bad", span_id="bad", start_ns=2, end_ns=1, attributes={})
    assert tracing.flush()


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("https://collector:4318/", "https://collector:4318/v1/traces"),
        ("http://collector:4318/otlp/v1/traces", "http://collector:4318/otlp/v1/traces"),
    ],
)
def test_a_collector_base_url_gets_the_traces_path(endpoint, url):
    assert tracing.traces_url(endpoint) == url


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("ABPLAT_OTEL_ENABLED", "maybe", "ABPLAT_OTEL_ENABLED='maybe': use one of"),
        ("ABPLAT_OTEL_ENDPOINT", "grpc://collector:4317", "ABPLAT_OTEL_ENDPOINT='grpc://collector:4317'"),
        ("ABPLAT_OTEL_ENDPOINT", "http:///v1/traces", "the URL names no host"),
        ("ABPLAT_OTEL_SERVICE_NAME", "a\tb", "ABPLAT_OTEL_SERVICE_NAME='a\\tb'"),
    ],
)
@pytest.mark.process
def test_a_bad_tracing_setting_stops_the_process_naming_it(name, value, message):
    env = {**os.environ, name: value}
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and message in done.stderr + done.stdout, done.stderr


# end to end: a replay process, a real OTLP/HTTP export to a receiver started here ---------------


class Receiver(http.server.ThreadingHTTPServer):
    """A stand-in collector: keeps every POST (path, content type, decoded protobuf)."""

    def __init__(self):
        self.posts: list[tuple[str, str, ExportTraceServiceRequest]] = []
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def spans(self) -> list:
        return [
            (rs.resource, span)
            for _path, _ctype, req in self.posts
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]


class ReceiverHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.posts.append(
            (self.path, self.headers["Content-Type"], ExportTraceServiceRequest.FromString(body))
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def replay_env(tmp_path_factory, clickhouse_server):
    """A demo experiment on three simulators in a ClickHouse server database: the replay
    processes of these tests run `manage.py` against it."""
    tmp = tmp_path_factory.mktemp("otel")
    database = f"abplat_test_{uuid.uuid4().hex[:10]}"
    url = server_url_for(database, clickhouse_server)
    sims = [start_in_thread("fast", model="tiny-llama") for _ in range(3)]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ABPLAT_", "OTEL_"))}
    env = {**base, "ABPLAT_VAR": str(tmp), "ABPLAT_CLICKHOUSE_URL": url, "ABPLAT_LOG_LEVEL": "WARNING"}
    start_demo_experiment(env, tmp, sims)
    yield env
    for s in sims:
        s.stop()
    ClickHouseServerBackend(url).execute(f"DROP DATABASE IF EXISTS {database}")


# Runs one replay in a manage.py process and prints its run id, and which modules of the
# OpenTelemetry tracing SDK and exporters the process loaded, as JSON on the last line. (Not
# opentelemetry as a whole: redis-py 8 imports opentelemetry.sdk.metrics whenever it is installed.)
REPLAY = """
import json, sys
from django.core.management import call_command
from workers.models import ReplayRun
call_command("replay", "ttft-optimizations", "--trace", "TRACE", "--limit", "30", "--speed", "200")
run = ReplayRun.objects.latest("pk")
print(json.dumps({"run": run.pk, "status": run.status,
                  "otel": sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace",
                                                                          "opentelemetry.exporter")))}))
""".replace("TRACE", TRACE)


def replay_process(env: dict) -> dict:
    return json.loads(manage(env, "shell", "-c", REPLAY).strip().splitlines()[-1])


@pytest.mark.process
def test_off_our_tracing_code_imports_no_opentelemetry_at_all():
    code = (
        "import sys; from telemetry import tracing; tracing.configure(False, 'http://x:4318', 'abplat-replay')\n"
        "tracing.record_request_span(trace_id='1' * 32, span_id='2' * 16, start_ns=1, end_ns=2, attributes={})\n"
        "tracing.flush(); print([m for m in sys.modules if m.startswith('opentelemetry')])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_off_a_replay_exports_nothing_and_never_imports_the_tracing_sdk(replay_env):
    receiver = Receiver()
    try:
        # the endpoint is set, the switch is not: off is off
        out = replay_process({**replay_env, "ABPLAT_OTEL_ENDPOINT": receiver.url})
    finally:
        receiver.shutdown()
    assert out["status"] == "done" and out["otel"] == []
    assert receiver.posts == []


def test_on_a_replay_exports_its_spans_over_otlp_http(replay_env):
    receiver = Receiver()
    try:
        out = replay_process(
            {
                **replay_env,
                "ABPLAT_OTEL_ENABLED": "true",
                "ABPLAT_OTEL_ENDPOINT": receiver.url,
                "ABPLAT_OTEL_SERVICE_NAME": "replay-under-test",
            }
        )
    finally:
        receiver.shutdown()
    assert out["status"] == "done"
    assert receiver.posts, "no OTLP export reached the receiver"
    assert {(path, ctype) for path, ctype, _req in receiver.posts} == {
        ("/v1/traces", "application/x-protobuf")
    }
    store = ClickHouseServerBackend(replay_env["ABPLAT_CLICKHOUSE_URL"])
    samples = samples_of(store, out["run"])
    spans = receiver.spans()
    assert len(samples) == 30 == len(spans)
    seen = {}
    for resource, span in spans:
        attrs = {a.key: a.value for a in span.attributes}
        services = [a.value.string_value for a in resource.attributes if a.key == "service.name"]
        assert services == ["replay-under-test"]
        rid = attrs["abplat.request_id"].string_value
        seen[rid] = f"00-{span.trace_id.hex()}-{span.span_id.hex()}-01"
        assert span.parent_span_id == b"" and span.kind == span.SPAN_KIND_CLIENT
        assert attrs["abplat.run"].int_value == out["run"]
        assert attrs["abplat.variant"].string_value == samples[rid]["variant"]
    assert seen == {rid: s["traceparent"] for rid, s in samples.items()}


def test_a_collector_that_is_down_costs_spans_never_the_replay(replay_env):
    receiver = Receiver()
    closed = receiver.url
    receiver.shutdown()
    receiver.server_close()  # nothing listens there any more: every export is refused
    out = replay_process({**replay_env, "ABPLAT_OTEL_ENABLED": "true", "ABPLAT_OTEL_ENDPOINT": closed})
    assert out["status"] == "done"
    store = ClickHouseServerBackend(replay_env["ABPLAT_CLICKHOUSE_URL"])
    samples = samples_of(store, out["run"])
    assert len(samples) == 30 and {s["outcome"] for s in samples.values()} == {"ok"}


def test_a_span_that_cannot_be_recorded_never_fails_the_replay(memory_spans, caplog):
    kept = []
    put = traced(kept.append)
    good = failed_row(outcome=Outcome.OK, http_status=200, e2e_ms=5.0)
    broken = [good.as_dict() for _ in range(2)]
    for b in broken:
        b["traceparent"] = "00-not-a-trace-01"
    with caplog.at_level(logging.WARNING, logger="workers.spans"):
        for row in (broken[0], good, broken[1]):
            put(row)
    assert len(kept) == 3  # every sample kept
    assert tracing.flush() and len(memory_spans.get_finished_spans()) == 1
    [warning] = [r for r in caplog.records if r.name == "workers.spans"]  # once per shard
    assert "its span was not recorded" in warning.getMessage() and "not a version 00" in caplog.text


# real vLLM: its server spans join the trace of the span the replay exports ----------------------


@pytest.mark.vllm
def test_real_vllm_s_server_spans_are_children_of_the_replay_s_span(tmp_path):
    """vLLM started as an operator would (--otlp-traces-endpoint on its command line: not an
    engine flag a variant may set) on the same collector as the replay's spans."""
    import asyncio

    from serving.children import free_port
    from serving.vllm import CPU_ENGINE_ARGS, cpu_launcher, ensure_cpu_install, start
    from streaming.client import VariantClient

    receiver = Receiver()
    collector = receiver.url + "/v1/traces"
    try:
        venv, model = ensure_cpu_install()
    except RuntimeError as exc:
        pytest.fail(f"could not install real vLLM ({exc}); run scripts/vllm_cpu.sh to see the failing step")
    server = start(
        [*cpu_launcher(venv), "--otlp-traces-endpoint", collector],
        str(model),
        free_port(),
        engine_args=CPU_ENGINE_ARGS,
        served_model_name="tiny-llama",
        log_path=tmp_path / "vllm.log",
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    )
    tracing.configure(True, collector, "abplat-replay")
    try:

        async def send() -> list:
            async with VariantClient(server.url + "/v1", "tiny-llama", "chat") as client:
                return [await client.stream(f"vllm-otel-{i}", "Say something.", 4) for i in range(3)]

        for seq, result in enumerate(asyncio.run(send())):
            assert result.outcome is Outcome.OK, result.error
            row = row_from(
                result,
                SampleContext(
                    experiment="e",
                    run_id=1,
                    seq=seq,
                    variant="v",
                    mode="split",
                    sent_unix_ms=time.time() * 1000 - result.e2e_ms,
                    request_id=result.request_id,
                ),
            )
            tracing.record_request_span(**span_of(row))  # as workers/spans.py traced does
        assert tracing.flush()
        ours = {s.trace_id.hex(): s for r, s in receiver.spans() if service(r) == "abplat-replay"}
        assert len(ours) == 3
        # vLLM exports on its own schedule (a batch every few seconds)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            theirs = [
                s for r, s in receiver.spans() if service(r) != "abplat-replay" and s.trace_id.hex() in ours
            ]
            if {s.trace_id.hex() for s in theirs} == ours.keys():
                break
            time.sleep(0.5)
        assert {s.trace_id.hex() for s in theirs} == ours.keys(), server.log_path.read_text()[-3000:]
        for span in theirs:
            assert span.parent_span_id == ours[span.trace_id.hex()].span_id  # a child of the replay's span
    finally:
        tracing.shutdown()
        server.stop()
        receiver.shutdown()


def service(resource) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")
