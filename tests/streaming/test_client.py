"""The streaming client against the simulator: every Outcome, forced per request."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from simulator.latency import Faults
from simulator.profiles import get_profile
from simulator.serve import start_in_thread
from streaming.client import Timeouts, VariantClient, trace_ids
from streaming.result import Outcome, StreamCancelled

MODEL = "abplat-sim"
TRANSPORT = "h1"


@pytest.fixture(autouse=True, params=["h1", "httpx"])
def transport(request):
    """Every test runs on both paths: the lean HTTP/1.1 one (h1.py) and httpx (HTTP/2, TLS)."""
    global TRANSPORT
    TRANSPORT = request.param
    yield request.param


@pytest.fixture(scope="module")
def slow():
    # Prefill ~400 ms and 100 ms per decode step: room for first-token, stall, total timeouts.
    prof = dataclasses.replace(
        get_profile("fast"),
        name="slow",
        prefill_base_ms=400.0,
        decode_base_ms=100.0,
        faults=Faults(stall_ms=1500.0, slow_headers_ms=1500.0),
    )
    handle = start_in_thread(prof)
    yield handle
    handle.stop()


def run(url: str, api: str = "chat", timeouts: Timeouts | None = None, fault: str = "", **kw):
    async def go():
        async with VariantClient(url, MODEL, api, timeouts=timeouts, transport=TRANSPORT) as c:
            headers = {"x-abplat-fault": fault} if fault else {}
            headers.update(kw.pop("headers", {}))
            return await c.stream(
                kw.pop("rid", "req-1"),
                kw.pop("prompt", "hello"),
                kw.pop("max_tokens", 8),
                headers=headers,
                **kw,
            )

    return asyncio.run(go())


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_ok_stream_records_every_phase_and_the_usage_count(fast, api):
    r = run(fast.url + "/v1", api, max_tokens=12)
    assert r.outcome is Outcome.OK, r.error
    assert r.http_status == 200 and r.new_connection and r.connect_ms is not None
    assert 0 < r.ttfb_ms <= r.first_byte_ms <= r.ttft_event_ms <= r.ttft_ms < r.e2e_ms
    assert r.output_tokens == 12 and r.usage_reported and r.prompt_tokens > 0
    assert r.finish_reason == "length"
    assert r.itl_p50_ms is not None and r.itl_max_ms >= r.itl_p99_ms >= r.itl_p50_ms
    assert r.tpot_ms is not None
    # the simulator's ground truth came back, on the same monotonic clock
    assert r.server_ttft_ms is not None and r.server_first_content_ns > r.start_ns


def test_measured_ttft_is_never_before_the_server_wrote_the_first_token(fast):
    r = run(fast.url, max_tokens=4)
    measured_ns = r.start_ns + r.ttft_ms * 1e6
    assert measured_ns >= r.server_first_content_ns


def test_request_id_and_traceparent_are_sent_and_kept(fast):
    r = run(fast.url, rid="exp-1/42", max_tokens=2)
    trace_id, span_id = trace_ids("exp-1/42")
    assert r.request_id == "exp-1/42" and r.trace_id == trace_id
    assert r.traceparent == f"00-{trace_id}-{span_id}-01"
    assert len(trace_id) == 32 and len(span_id) == 16


def test_unknown_model_is_http_4xx_with_the_servers_message(fast):
    async def go():
        async with VariantClient(fast.url, "no-such-model", transport=TRANSPORT) as c:
            return await c.stream("r", "hi", 4)

    r = asyncio.run(go())
    assert r.outcome is Outcome.HTTP_4XX and r.http_status == 404
    assert "does not exist" in r.error


def test_server_error_is_http_5xx(fast):
    r = run(fast.url, fault="http_error")
    assert r.outcome is Outcome.HTTP_5XX and r.http_status == 500


def test_in_stream_engine_error_is_distinct_from_http_errors(fast):
    r = run(fast.url, fault="engine_error", max_tokens=16)
    assert r.outcome is Outcome.ENGINE_ERROR and r.http_status == 200
    assert "EngineCore" in r.error


def test_disconnect_mid_stream(fast):
    r = run(fast.url, fault="disconnect", max_tokens=16)
    assert r.outcome is Outcome.DISCONNECT and r.http_status == 200


def test_malformed_event(fast):
    r = run(fast.url, fault="malformed", max_tokens=16)
    assert r.outcome is Outcome.MALFORMED and "not JSON" in r.error


def test_utf8_split_across_writes_still_streams_ok(fast):
    r = run(fast.url, fault="split_utf8", max_tokens=6)
    assert r.outcome is Outcome.OK and r.output_tokens == 6


def test_connect_refused_is_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: refused
        r = run(f"http://127.0.0.1:{port}")
    assert r.outcome is Outcome.CONNECT_ERROR and r.http_status == 0


def test_connect_timeout_when_the_listen_queue_is_full():
    # A listener that never accepts, with its accept queue filled: the SYN is dropped.
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(0)
    port = lsn.getsockname()[1]
    fillers = []
    for _ in range(4):
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", port))
        fillers.append(f)
    try:
        r = run(f"http://127.0.0.1:{port}", timeouts=Timeouts(connect_s=0.3, headers_s=5))
    finally:
        for f in fillers:
            f.close()
        lsn.close()
    assert r.outcome is Outcome.CONNECT_TIMEOUT


def test_slow_headers_is_headers_timeout(slow):
    r = run(slow.url, fault="slow_headers", timeouts=Timeouts(headers_s=0.3))
    assert r.outcome is Outcome.HEADERS_TIMEOUT and r.ttfb_ms is None


def test_slow_prefill_is_first_token_timeout(slow):
    r = run(slow.url, timeouts=Timeouts(first_token_s=0.2))
    assert r.outcome is Outcome.FIRST_TOKEN_TIMEOUT
    assert r.http_status == 200 and r.ttft_ms is None


def test_pause_between_tokens_is_a_stall(slow):
    r = run(slow.url, fault="stall", timeouts=Timeouts(stall_s=0.5), max_tokens=6)
    assert r.outcome is Outcome.STALL and r.ttft_ms is not None


def test_total_deadline_caps_a_slow_but_steady_stream(slow):
    r = run(slow.url, timeouts=Timeouts(total_s=0.9), max_tokens=50)
    assert r.outcome is Outcome.TOTAL_TIMEOUT and r.ttft_ms is not None


def test_cancelling_returns_the_partial_record_and_the_server_aborts(slow):
    async def go():
        async with VariantClient(slow.url, MODEL, transport=TRANSPORT) as c:
            task = asyncio.create_task(c.stream("cancel-me", "hi", 50))
            await asyncio.sleep(0.7)  # past the first token, mid-decode
            task.cancel()
            with pytest.raises(StreamCancelled) as info:
                await task
            return info.value.result

    r = asyncio.run(go())
    assert r.outcome is Outcome.CANCELLED and r.ttft_ms is not None
    import httpx

    metrics = httpx.get(slow.url + "/metrics", trust_env=False).text
    aborted = [ln for ln in metrics.splitlines() if 'finished_reason="abort"' in ln]
    assert aborted and float(aborted[0].rsplit(" ", 1)[1]) >= 1.0


def test_every_outcome_is_covered_by_a_test_above():
    names = {
        "OK",
        "HTTP_4XX",
        "HTTP_5XX",
        "CONNECT_ERROR",
        "CONNECT_TIMEOUT",
        "HEADERS_TIMEOUT",
        "FIRST_TOKEN_TIMEOUT",
        "STALL",
        "DISCONNECT",
        "MALFORMED",
        "ENGINE_ERROR",
        "TOTAL_TIMEOUT",
        "CANCELLED",
    }
    # CLIENT_ERROR is the replay's own failure, never the client's outcome of a request it sent:
    # tests/replay/test_runner.py covers it (a variant the experiment lacks).
    assert {o.name for o in Outcome} == names | {"CLIENT_ERROR"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"endpoint": "ftp://x"}, "http:// or https://"),
        ({"api": "embeddings"}, "must be one of"),
        ({"model": ""}, "non-empty model"),
    ],
)
def test_bad_client_configuration_names_the_field(kwargs, message):
    args = {"endpoint": "http://127.0.0.1:1", "model": "m", "api": "chat", **kwargs}
    with pytest.raises(ValueError, match=message):
        VariantClient(args.pop("endpoint"), args.pop("model"), args.pop("api"))


def test_bad_timeouts_and_bodies_are_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="stall_s"):
        Timeouts(stall_s=0)
    c = VariantClient("http://127.0.0.1:1", "m", "completions")
    with pytest.raises(ValueError, match="max_tokens"):
        c.build_body("x", 0)
    with pytest.raises(ValueError, match="completions takes a string"):
        c.build_body([{"role": "user", "content": "x"}], 1)
    with pytest.raises(ValueError, match="set by the client"):
        c.build_body("x", 1, {"stream": False})
    asyncio.run(c.aclose())


def test_http2_variant_uses_prior_knowledge_on_plain_http():
    c = VariantClient("http://127.0.0.1:1/v1", "m", http2=True)
    pool = c._client._transport._pool  # type: ignore[attr-defined]
    assert pool._http2 and not pool._http1
    asyncio.run(c.aclose())


def test_sequential_requests_reuse_one_keep_alive_connection(fast):
    async def go():
        async with VariantClient(fast.url, MODEL, "completions", transport=TRANSPORT) as c:
            return [await c.stream(f"k{i}", "hi", 4) for i in range(3)]

    rs = asyncio.run(go())
    assert [r.outcome for r in rs] == [Outcome.OK] * 3
    assert [r.new_connection for r in rs] == [True, False, False]
    assert all(r.connect_ms is None for r in rs[1:])


def test_concurrent_streams_each_get_their_own_exact_record(fast):
    async def go():
        async with VariantClient(fast.url, MODEL, "chat", transport=TRANSPORT) as c:
            return await asyncio.gather(*(c.stream(f"c{i}", "hi", 5 + i % 3) for i in range(40)))

    rs = asyncio.run(go())
    assert all(r.outcome is Outcome.OK for r in rs), [r.error for r in rs if not r.ok]
    assert [r.output_tokens for r in rs] == [5 + i % 3 for i in range(40)]
    for r in rs:
        assert r.start_ns + r.ttft_ms * 1e6 >= r.server_first_content_ns


def test_auto_transport_takes_the_core_for_http1_plain_or_tls_and_httpx_for_http2():
    assert VariantClient("http://127.0.0.1:1", "m").transport == "h1"
    assert VariantClient("https://127.0.0.1:1", "m", verify=False).transport == "h1"
    assert VariantClient("http://127.0.0.1:1", "m", http2=True).transport == "httpx"
    assert VariantClient("https://127.0.0.1:1", "m", http2=True, verify=False).transport == "httpx"
    assert VariantClient("https://127.0.0.1:1", "m", transport="httpx", verify=False).transport == "httpx"
    with pytest.raises(ValueError, match="transport 'h1'"):
        VariantClient("https://127.0.0.1:1", "m", http2=True, transport="h1")
    with pytest.raises(ValueError, match="must be one of"):
        VariantClient("http://127.0.0.1:1", "m", transport="curl")


def test_header_injection_is_rejected_with_the_header_named(fast):
    with pytest.raises(ValueError, match="x-evil"):
        run(fast.url, headers={"x-evil": "a\r\nx-injected: 1"})
