"""The simulator as a server: routes, metrics, startup handles (its CLI and management command:
tests/serving/test_commands.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import httpx
import pytest

from simulator.profiles import get_profile
from simulator.serve import start_in_thread, start_subprocess
from streaming.client import VariantClient
from streaming.result import Outcome


@pytest.fixture(scope="module")
def sim():
    handle = start_in_thread("fast")
    yield handle
    handle.stop()


def test_health_models_and_unknown_routes(sim):
    with httpx.Client(base_url=sim.url, trust_env=False, timeout=5) as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "abplat-sim"
        assert c.get("/nope").status_code == 404
        assert c.get("/v1/completions").status_code == 405


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "abplat-sim", "messages": []}', 400, "messages"),
        (
            b'{"model": "abplat-sim", "messages": [{"role":"user","content":"x"}], "max_tokens": 0}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "abplat-sim", "messages": [{"role":"user","content":"x"}], "max_tokens": 99999}',
            400,
            "maximum context length",
        ),
        (b'{"model": "other", "messages": [{"role":"user","content":"x"}]}', 404, "does not exist"),
    ],
)
def test_bad_requests_get_vllm_style_errors(sim, body, status, message):
    r = httpx.post(sim.url + "/v1/chat/completions", content=body, trust_env=False)
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_unknown_forced_fault_is_a_400_naming_the_known_ones(sim):
    r = httpx.post(
        sim.url + "/v1/completions",
        json={"model": "abplat-sim", "prompt": "x", "stream": True},
        headers={"x-abplat-fault": "meteor"},
        trust_env=False,
    )
    assert r.status_code == 400 and "stall" in r.json()["error"]["message"]


def test_non_streaming_completion_returns_usage(sim):
    r = httpx.post(
        sim.url + "/v1/completions",
        json={"model": "abplat-sim", "prompt": "x", "max_tokens": 5},
        trust_env=False,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_metrics_use_vllm_names_and_count_tokens(sim):
    async def go():
        async with VariantClient(sim.url, "abplat-sim", "completions") as c:
            await asyncio.gather(*(c.stream(f"m{i}", "hello", 7) for i in range(5)))

    asyncio.run(go())
    text = httpx.get(sim.url + "/metrics", trust_env=False).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in text
    gen = next(ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total"))
    assert float(gen.rsplit(" ", 1)[1]) >= 35
    assert 'le="0.25"' in text and 'le="0.2"' not in text  # vLLM's TTFT buckets


def test_same_request_id_draws_the_same_fault_and_text():
    # chaos profile: which requests fault depends only on the seed and the request id.
    chaos = get_profile("chaos")
    quick = dataclasses.replace(chaos.faults, stall_ms=20.0, slow_headers_ms=20.0, slow_first_token_ms=20.0)
    h = start_in_thread(dataclasses.replace(chaos, faults=quick))
    try:

        async def go():
            async with VariantClient(h.url, "abplat-sim", "completions") as c:
                return [(await c.stream(f"r{i}", "x", 4)).outcome for i in range(60)]

        first, second = asyncio.run(go()), asyncio.run(go())
    finally:
        h.stop()
    assert first == second
    assert len(set(first)) > 1  # some faults did fire


def test_a_thousand_concurrent_streams_all_complete(sim):
    async def go():
        async with VariantClient(sim.url, "abplat-sim", "completions") as c:
            return await asyncio.gather(*(c.stream(f"k{i}", "x", 2) for i in range(1000)))

    results = asyncio.run(go())
    assert all(r.outcome is Outcome.OK for r in results)


@pytest.mark.process
def test_subprocess_handle_is_ready_when_returned_and_stops():
    h = start_subprocess("awq")
    try:
        assert urllib.request.urlopen(h.url + "/health", timeout=2).status == 200
    finally:
        h.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(h.url + "/health", timeout=2)


def test_replicas_share_the_load_so_queueing_falls():
    """Two engines behind one endpoint take twice the load: the same burst waits less."""
    import asyncio

    import httpx

    from simulator.serve import start_in_thread

    async def burst(url: str) -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def one(i: int) -> float:
                body = {
                    "model": "abplat-sim",
                    "prompt": "x " * 2000,
                    "max_tokens": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    text = b"".join([c async for c in r.aiter_bytes()]).decode()
                marker = '"server_ttft_ms":'
                return float(text.split(marker, 1)[1].split(",", 1)[0].split("}", 1)[0])

            return await asyncio.gather(*(one(i) for i in range(16)))

    one_engine = start_in_thread("fp16", replicas=1)
    two_engines = start_in_thread("fp16", replicas=2)
    try:
        single = sorted(asyncio.run(burst(one_engine.url)))
        double = sorted(asyncio.run(burst(two_engines.url)))
    finally:
        one_engine.stop()
        two_engines.stop()
    # The simulator's own ground truth (receipt to first token), not the client's clock.
    assert sum(double) < 0.75 * sum(single)
