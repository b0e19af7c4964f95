"""The simulator's /metrics: vLLM's names, labels and buckets through prometheus_client, one
registry per simulator, and server-side phase times consistent with the TTFT it serves.
(That the names, labels and buckets are real vLLM's is checked against real vLLM in
tests/serving/test_real_vllm.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator import metrics as simmetrics
from simulator.latency import KV_BLOCK_TOKENS, Profile, Scheduler, Seq
from simulator.profiles import get_profile
from simulator.serve import start_in_thread
from streaming.client import VariantClient
from streaming.result import Outcome

PHASES = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:e2e_request_latency_seconds",
)


def families(url: str) -> dict:
    r = httpx.get(url + "/metrics", trust_env=False, timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict, family: str, sample: str, **labels) -> float:
    """The sum of a family's samples of that name whose labels include ``labels``."""
    return sum(
        s.value
        for s in fams[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def edges(fams: dict, family: str) -> list[float]:
    les = {s.labels["le"] for s in fams[family].samples if s.name == family + "_bucket"}
    return sorted(float(le) for le in les)


def stream_many(url: str, model: str, n: int, max_tokens: int, prompt: str = "hello there") -> list:
    """n streams at once; returns once the simulator has counted every request it finished. It
    counts one after its response has gone out, so the client may hold the last bytes a moment
    before the simulator's thread gets there, and a scrape then would miss it."""
    finished = threading.Condition()
    count = [0]
    counted = simmetrics.Metrics.request_done  # a test's own spy, if it set one

    def counting(self, engine, **kw):
        counted(self, engine, **kw)
        with finished:
            count[0] += 1
            finished.notify_all()

    async def go():
        async with VariantClient(url, model, "completions") as c:
            return await asyncio.gather(*(c.stream(f"m-{i}", prompt, max_tokens) for i in range(n)))

    simmetrics.Metrics.request_done = counting
    try:
        results = asyncio.run(go())
        ok = sum(r.outcome is Outcome.OK for r in results)
        with finished:
            finished.wait_for(lambda: count[0] >= ok, timeout=10)
    finally:
        simmetrics.Metrics.request_done = counted
    return results


@pytest.fixture
def slow_sim():
    # One sequence at a time and steps of a few ms: concurrent requests queue, visibly.
    prof = dataclasses.replace(get_profile("fast"), name="one-at-a-time", max_num_seqs=1, decode_base_ms=4.0)
    h = start_in_thread(prof, model='odd "model" \\ name', replicas=2)
    yield h
    h.stop()


def test_every_series_abplat_reads_is_there_before_the_first_request_with_vllm_labels():
    h = start_in_thread("fast", replicas=2)
    try:
        fams = families(h.url)
    finally:
        h.stop()
    for name in (*PHASES, "vllm:time_to_first_token_seconds"):
        assert fams[name].type == "histogram"
        assert {frozenset(s.labels) - {"le"} for s in fams[name].samples} == {
            frozenset({"model_name", "engine"})
        }
        assert value(fams, name, name + "_count") == 0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert fams[name].type == "gauge"
        # one series per replica, labelled by its engine index
        assert sorted(s.labels["engine"] for s in fams[name].samples) == ["0", "1"]
    assert fams["vllm:request_success"].type == "counter"
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == set(simmetrics.FINISH_REASONS)
    # vLLM's buckets: request-latency edges for the phases, the TTFT edges (no 0.2 s) for TTFT
    for name in PHASES:
        assert edges(fams, name) == [*simmetrics.REQUEST_LATENCY_BUCKETS, float("inf")]
    ttft = edges(fams, "vllm:time_to_first_token_seconds")
    assert ttft == [*simmetrics.TTFT_BUCKETS, float("inf")] and 0.2 not in ttft and 0.25 in ttft


def test_a_model_name_with_quotes_backslashes_and_newlines_is_escaped(slow_sim):
    model = 'odd "model" \\ name'
    assert [r.outcome for r in stream_many(slow_sim.url, model, 2, 3)] == [Outcome.OK] * 2
    fams = families(slow_sim.url)  # the parser would fail on an unescaped label
    assert {s.labels["model_name"] for s in fams["vllm:generation_tokens"].samples} == {model}
    assert value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 6


def test_queue_and_prefill_never_exceed_the_ttft_the_server_served(slow_sim, monkeypatch):
    seen: list[dict] = []
    real = simmetrics.Metrics.request_done

    def spy(self, engine, **kw):
        seen.append(kw)
        return real(self, engine, **kw)

    monkeypatch.setattr(simmetrics.Metrics, "request_done", spy)
    results = stream_many(slow_sim.url, 'odd "model" \\ name', 12, 6, prompt="word " * 200)
    assert [r.outcome for r in results] == [Outcome.OK] * 12
    assert len(seen) == 12
    for kw in seen:
        assert kw["queue_s"] >= 0 and kw["prefill_s"] > 0 and kw["decode_s"] >= 0
        assert kw["queue_s"] + kw["prefill_s"] <= kw["ttft_s"] <= kw["e2e_s"]
        assert kw["inference_s"] == pytest.approx(kw["prefill_s"] + kw["decode_s"])
    # 12 requests on 2 engines that run one sequence at a time: most of them waited
    assert sum(kw["queue_s"] > 0.005 for kw in seen) >= 6
    fams = families(slow_sim.url)
    for name in PHASES:
        assert value(fams, name, name + "_count") == 12
    queue = value(fams, PHASES[0], PHASES[0] + "_sum")
    prefill = value(fams, PHASES[1], PHASES[1] + "_sum")
    ttft = value(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum")
    assert queue == pytest.approx(sum(kw["queue_s"] for kw in seen))
    assert 0 < queue + prefill <= ttft
    # the two engines share the load and report it under their own index
    per_engine = [value(fams, PHASES[0], PHASES[0] + "_count", engine=e) for e in ("0", "1")]
    assert sum(per_engine) == 12 and min(per_engine) >= 1


def test_each_simulator_has_its_own_registry():
    a, b = start_in_thread("fast"), start_in_thread("fast")
    try:
        stream_many(a.url, "abplat-sim", 3, 4)
        fa, fb = families(a.url), families(b.url)
    finally:
        a.stop()
        b.stop()
    name = "vllm:time_to_first_token_seconds"
    assert value(fa, name, name + "_count") == 3 and value(fb, name, name + "_count") == 0


def test_kv_cache_usage_counts_whole_blocks_of_the_running_sequences():
    prof = Profile("kv", 0.01, 0.1, 1.0, 0.0, kv_cache_tokens=1600)
    sched = Scheduler(prof)
    a, b = Seq(prompt_tokens=17, max_tokens=4), Seq(prompt_tokens=16, max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert sched.kv_cache_usage() == 0.0  # waiting sequences hold no cache
    step = sched.plan(0.0)
    sched.complete(step, step.duration_s)
    # a: 17 prompt + 1 generated = 18 tokens -> 2 blocks; b: 16 + 1 = 17 -> 2 blocks
    assert sched.kv_cache_usage() == pytest.approx(4 * KV_BLOCK_TOKENS / 1600)
    sched.abort(a)
    assert sched.kv_cache_usage() == pytest.approx(2 * KV_BLOCK_TOKENS / 1600)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        Profile("tiny", 0.01, 0.1, 1.0, 0.0, kv_cache_tokens=8)
