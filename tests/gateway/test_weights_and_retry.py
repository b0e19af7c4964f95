"""Weights changed in etcd while the gateway serves; retry on the control; disconnects."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from experiments.weights import process
from experiments.weights.publish import publish_weights
from streaming.result import Outcome
from tests.gateway.conftest import KEY, dead_port, user_on

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def wait_for_revision(router, revision: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while router.snapshot.revision < revision:
        if time.monotonic() > deadline:
            raise AssertionError(f"the router did not reach revision {revision}: {router.snapshot.revision}")
        time.sleep(0.01)


def variant_of(client, user: str) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model="ttft-opt", messages=MESSAGES, user=user, max_tokens=2
    )
    return raw.headers["x-abplat-variant"]


@pytest.mark.services
def test_weights_changed_in_etcd_take_effect_for_new_requests_only(
    etcd_weights, running_with, make_gateway, users
):
    experiment = running_with()
    gw = make_gateway()
    router = process.live_router()
    assert router.store.description.startswith("etcd") or "etcd" in type(router.store).__name__.lower()
    on_awq = [user_on(router, "ttft-opt", "awq", start=i * 1000) for i in range(3)]
    client = gw.client()
    assert {variant_of(client, u) for u in on_awq} == {"awq"}
    # A stream started on awq, read up to its first chunk, then the weights move everyone away.
    stream_user = on_awq[0]
    with client.chat.completions.with_streaming_response.create(
        model="ttft-opt", messages=MESSAGES, user=stream_user, max_tokens=200, stream=True
    ) as response:
        assert response.headers["x-abplat-variant"] == "awq"
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"choices"' in first
        _, revision = publish_weights(
            experiment, {"fp16": 100, "awq": 0, "awq-fa2": 0}, users["sre"], "drain awq"
        )
        wait_for_revision(router, revision)
        # new requests, the same users: the control now
        assert {variant_of(client, u) for u in on_awq} == {"fp16"}
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
    recs = gw.recorder.wait_for(7)
    streamed = [r for r in recs if r["user_id"] == stream_user and r["result"].chunks > 10]
    assert len(streamed) == 1
    assert streamed[0]["variant"] == "awq" and streamed[0]["result"].outcome is Outcome.OK
    assert streamed[0]["config_revision"] < revision
    after = [r for r in recs if r["variant"] == "fp16"]
    assert len(after) == 3 and {r["config_revision"] for r in after} == {revision}


def _awq_dead(doc):
    doc["variants"][1]["endpoint"] = f"http://127.0.0.1:{dead_port()}/v1"


def test_a_variant_failing_before_its_first_byte_is_retried_once_on_the_control(running_with, make_gateway):
    running_with(_awq_dead)
    gw = make_gateway(retry_on_control=frozenset({"ttft-opt"}))
    user = user_on(process.live_router(), "ttft-opt", "awq")
    raw = gw.client().chat.completions.with_raw_response.create(
        model="ttft-opt", messages=MESSAGES, user=user, max_tokens=4, stream=True
    )
    assert raw.headers["x-abplat-variant"] == "fp16"
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    first, second = gw.recorder.wait_for(2)
    assert (first["variant"], first["attempt"], first["result"].outcome) == ("awq", 1, Outcome.CONNECT_ERROR)
    assert (second["variant"], second["attempt"], second["result"].outcome) == ("fp16", 2, Outcome.OK)
    assert first["request_id"] == second["request_id"] == raw.headers["x-request-id"]


def test_a_5xx_before_the_first_byte_is_retried_on_the_control(running_with, make_gateway):
    running_with()
    gw = make_gateway(retry_on_control=frozenset({"*"}), forward_headers=frozenset({"x-abplat-fault"}))
    user = user_on(process.live_router(), "ttft-opt", "awq-fa2")
    # The fault header goes to both attempts: the control fails the same way, and its 500 is
    # what the user gets (one retry, never more).
    with pytest.raises(openai.InternalServerError):
        gw.client().chat.completions.create(
            model="ttft-opt",
            messages=MESSAGES,
            user=user,
            max_tokens=4,
            extra_headers={"x-abplat-fault": "http_error"},
        )
    recs = gw.recorder.wait_for(2)
    assert [(r["variant"], r["attempt"], r["result"].outcome) for r in recs] == [
        ("awq-fa2", 1, Outcome.HTTP_5XX),
        ("fp16", 2, Outcome.HTTP_5XX),
    ]


def test_without_retry_a_dead_variant_is_a_502_with_the_request_id_and_no_internals(
    running_with, make_gateway, caplog
):
    experiment = running_with(_awq_dead)
    dead = experiment.variants.get(key="awq").endpoint.split("//")[1].split("/")[0]  # 127.0.0.1:PORT
    gw = make_gateway()
    user = user_on(process.live_router(), "ttft-opt", "awq")
    with pytest.raises(openai.APIStatusError) as info:
        gw.client().chat.completions.create(model="ttft-opt", messages=MESSAGES, user=user, max_tokens=4)
    assert info.value.status_code == 502 and info.value.code == "upstream_unavailable"
    assert info.value.response.headers["x-abplat-variant"] == "awq"
    request_id = info.value.response.headers["x-request-id"]
    assert request_id in info.value.message and dead not in info.value.message
    assert dead.split(":")[1] not in info.value.response.text  # not even the port
    [rec] = gw.recorder.wait_for(1)
    assert rec["result"].outcome is Outcome.CONNECT_ERROR and rec["attempt"] == 1
    assert rec["request_id"] == request_id
    # the operator reads what happened, under the same id
    assert any(request_id in r.getMessage() and dead in r.getMessage() for r in caplog.records)


def test_the_control_is_never_retried(running_with, make_gateway):
    def control_dead(doc):
        doc["variants"][0]["endpoint"] = f"http://127.0.0.1:{dead_port()}/v1"

    running_with(control_dead)
    gw = make_gateway(retry_on_control=frozenset({"*"}))
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    with pytest.raises(openai.APIStatusError) as info:
        gw.client().chat.completions.create(model="ttft-opt", messages=MESSAGES, user=user, max_tokens=4)
    assert info.value.status_code == 502
    assert len(gw.recorder.wait_for(1)) == 1


def test_a_user_going_away_cancels_the_upstream_request(running_with, make_gateway):
    running_with()
    gw = make_gateway(forward_headers=frozenset({"x-abplat-fault"}))
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    # stall: the simulator sends a token or more, then holds the stream for 45 s.
    body = {"model": "ttft-opt", "messages": MESSAGES, "user": user, "max_tokens": 50, "stream": True}
    headers = {"authorization": f"Bearer {KEY}", "x-abplat-fault": "stall"}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            next(response.iter_raw())
    [rec] = gw.recorder.wait_for(1)
    assert rec["result"].outcome is Outcome.CANCELLED
    assert rec["result"].first_byte_ms is not None
    # the upstream connection was dropped, not kept for reuse
    [pool] = gw.gateway.attempts.pools.values()
    assert not pool._all and not pool._idle


def test_a_user_going_away_before_the_headers_cancels_the_upstream_request(running_with, make_gateway):
    running_with()
    gw = make_gateway(forward_headers=frozenset({"x-abplat-fault"}))
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    # slow_headers: the simulator holds its response headers for 45 s.
    body = {"model": "ttft-opt", "messages": MESSAGES, "user": user, "max_tokens": 5, "stream": True}
    headers = {"authorization": f"Bearer {KEY}", "x-abplat-fault": "slow_headers"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=0.5)
    [rec] = gw.recorder.wait_for(1)
    assert rec["result"].outcome is Outcome.CANCELLED and rec["result"].ttfb_ms is None
    [pool] = gw.gateway.attempts.pools.values()
    assert not pool._all and not pool._idle


def test_a_tls_variant_is_verified_against_the_configured_ca(running_with, make_gateway, pki):
    from simulator.serve import start_in_thread
    from streaming.tls import tls_verify

    tls_sim = start_in_thread("fast", model="tiny-llama", tls=(pki.certfile, pki.keyfile))
    try:

        def on_tls(doc):
            doc["variants"][1]["endpoint"] = tls_sim.url + "/v1"

        running_with(on_tls)
        user = user_on(process.live_router(), "ttft-opt", "awq")
        gw = make_gateway(ssl_context=tls_verify(pki.ca))
        reply = gw.client().chat.completions.with_raw_response.create(
            model="ttft-opt", messages=MESSAGES, user=user, max_tokens=3, stream=True
        )
        assert reply.headers["x-abplat-variant"] == "awq"
        assert "".join(c.choices[0].delta.content or "" for c in reply.parse() if c.choices)
        untrusting = make_gateway(ssl_context=tls_verify(pki.other_ca))
        with pytest.raises(openai.APIStatusError) as info:
            untrusting.client().chat.completions.create(
                model="ttft-opt", messages=MESSAGES, user=user, max_tokens=3
            )
        assert info.value.status_code == 502
        [rec] = untrusting.recorder.wait_for(1)
        assert rec["result"].outcome is Outcome.CONNECT_ERROR and "certificate" in rec["result"].error.lower()
    finally:
        tls_sim.stop()


def test_a_stream_cut_by_the_gateways_own_stop_is_recorded_once(running_with, db):
    # uvicorn cancels the requests its graceful shutdown did not wait out: the task is cancelled
    # while the user is still there. The attempt is recorded once, as cancelled, saying why.
    import asyncio
    import json

    from gateway.app import Gateway
    from gateway.config import GatewayConfig
    from gateway.limits import parse_keys
    from gateway.variants import Directory
    from streaming.egress import parse_allowlist
    from tests.gateway.conftest import KEY, FakeRecorder

    running_with()
    directory = Directory()
    directory.refresh()
    recorder = FakeRecorder()
    gateway = Gateway(
        GatewayConfig(keys=parse_keys(f"acme {KEY}\n"), forward_headers=frozenset({"x-abplat-fault"})),
        router=process.live_router(),
        directory=directory,
        recorder=recorder,
        allow=parse_allowlist(["127.0.0.0/8"]),
        refresh_variants=False,
    )
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    body = json.dumps(
        {"model": "ttft-opt", "messages": MESSAGES, "user": user, "max_tokens": 50, "stream": True}
    ).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [
            (b"authorization", f"Bearer {KEY}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-abplat-fault", b"stall"),
        ],
    }

    async def go():
        sent, first_body = [], asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the user stays: no disconnect ever comes

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                first_body.set()

        task = asyncio.ensure_future(gateway(scope, receive, send))
        await asyncio.wait_for(first_body.wait(), 10)  # a token or more, then the stream stalls
        task.cancel()  # what uvicorn does once its drain timeout is over
        with pytest.raises(asyncio.CancelledError):
            await task
        return sent

    gateway.startup()
    try:
        sent = asyncio.run(go())
    finally:
        gateway.shutdown()
    assert sent[0]["status"] == 200
    [rec] = recorder.records
    assert rec["result"].outcome is Outcome.CANCELLED
    assert rec["result"].error == "the gateway stopped before the response ended"
    assert rec["result"].first_byte_ms is not None
