"""The gateway through the official openai client, against the simulators."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from django.core.management import call_command

from experiments.weights import process
from streaming.result import Outcome
from tests.gateway.conftest import KEY, user_on

pytestmark = pytest.mark.django_db(transaction=False)

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def test_streaming_chat_goes_to_the_users_variant_and_is_measured(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    router = process.live_router()
    user = user_on(router, "ttft-opt", "awq")
    raw = gw.client().chat.completions.with_raw_response.create(
        model="ttft-opt", messages=MESSAGES, stream=True, user=user, max_tokens=12
    )
    assert raw.headers["x-abplat-variant"] == "awq"
    assert raw.headers["x-request-id"]
    assert raw.headers["traceparent"].startswith("00-")
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    [rec] = gw.recorder.wait_for(1)
    assert rec["variant"] == "awq" and rec["experiment"] == "ttft-opt" and rec["user_id"] == user
    # no usage event asked for: the gateway's estimate, 4 bytes a token of "Tell me about the sea"
    assert not rec["result"].usage_reported and rec["prompt_tokens"] == 6
    assert rec["attempt"] == 1 and rec["request_id"] == raw.headers["x-request-id"]
    assert rec["config_revision"] == router.assign("ttft-opt", user).revision
    result = rec["result"]
    assert result.outcome is Outcome.OK, result.error
    assert result.http_status == 200
    assert result.ttft_ms is not None and result.ttft_ms > 0
    assert result.e2e_ms >= result.ttft_ms
    assert result.chunks >= 2
    assert rec["gateway_ms"] >= 0


def test_streaming_completions_and_the_variants_model_name(running_with, make_gateway):
    def rename(doc):
        doc["variants"][1]["model"] = "tiny-llama"

    running_with(rename)
    gw = make_gateway()
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    stream = gw.client().completions.create(
        model="ttft-opt",
        prompt="Once upon",
        stream=True,
        user=user,
        max_tokens=10,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts if p.choices)
    # the variant's model name replaced the client's
    assert {p.model for p in parts} == {"tiny-llama"}
    [rec] = gw.recorder.wait_for(1)
    assert rec["result"].outcome is Outcome.OK
    assert rec["result"].usage_reported and rec["result"].output_tokens == 10
    assert rec["prompt_tokens"] > 0 and rec["max_tokens"] == 10


def test_non_streaming_chat_and_completions(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    client = gw.client()
    chat = client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="u-1", max_tokens=5)
    assert chat.choices[0].message.content
    comp = client.completions.create(model="ttft-opt", prompt="Hello", user="u-2", max_tokens=5)
    assert comp.choices[0].text
    recs = gw.recorder.wait_for(2)
    assert [r["result"].outcome for r in recs] == [Outcome.OK, Outcome.OK]
    for r in recs:
        assert r["result"].output_tokens == 5 and r["result"].usage_reported
        assert r["result"].ttft_ms == r["result"].e2e_ms


def test_the_stream_is_forwarded_byte_for_byte(running_with, make_gateway, sims):
    running_with()
    gw = make_gateway()
    user = user_on(process.live_router(), "ttft-opt", "fp16")
    body = {"model": "ttft-opt", "messages": MESSAGES, "stream": True, "max_tokens": 16, "user": user}
    through = httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
    )
    # The simulator's text follows the request id: ask it directly with the one the gateway sent.
    rid = through.headers["x-request-id"]
    direct = httpx.post(
        sims["fp16"].url + "/v1/chat/completions",
        json={**body, "model": "tiny-llama"},
        headers={"x-request-id": rid},
    )
    assert through.status_code == direct.status_code == 200

    def without_created(data: bytes) -> bytes:  # the one field that is the wall clock
        import re

        return re.sub(rb'"created":\d+', b'"created":0', data)

    assert without_created(through.content) == without_created(direct.content)
    assert through.headers["content-type"] == direct.headers["content-type"]


def test_upstream_errors_pass_through_with_their_status(running_with, make_gateway):
    running_with()
    gw = make_gateway(forward_headers=frozenset({"x-abplat-fault"}))
    client = gw.client()
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model="ttft-opt",
            messages=MESSAGES,
            user="u-1",
            max_tokens=5,
            extra_headers={"x-abplat-fault": "http_error"},
        )
    assert info.value.status_code == 500
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(
            model="ttft-opt",
            messages=MESSAGES,
            user="u-1",
            max_tokens=5,
            extra_headers={"x-abplat-fault": "rate_limited"},
        )
    assert info.value.status_code == 429
    with pytest.raises(openai.BadRequestError) as info:  # the simulator refuses it, not the gateway
        client.chat.completions.create(model="ttft-opt", messages=[], user="u-1", max_tokens=5)
    assert info.value.status_code == 400
    recs = gw.recorder.wait_for(3)
    assert [r["result"].outcome for r in recs] == [Outcome.HTTP_5XX, Outcome.HTTP_4XX, Outcome.HTTP_4XX]


def test_sticky_assignment_per_user_matches_manage_py_assign(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    users = [f"sticky-{i}" for i in range(24)]
    out = io.StringIO()
    call_command("assign", "ttft-opt", stdin=io.StringIO("\n".join(users) + "\n"), stdout=out)
    expected = dict(line.split("\t") for line in out.getvalue().splitlines())
    client = gw.client()
    got = {}
    for user in users:
        for _ in range(2):  # the same answer every time
            raw = client.chat.completions.with_raw_response.create(
                model="ttft-opt", messages=MESSAGES, user=user, max_tokens=2
            )
            got.setdefault(user, set()).add(raw.headers["x-abplat-variant"])
    assert {u: v.pop() for u, v in got.items() if len(v) == 1} == expected
    assert len(set(expected.values())) == 3  # every variant served someone


def test_a_finished_request_leaves_no_reference_cycle_of_the_gateways_behind(running_with, make_gateway):
    """Per-request cycles are left for the cyclic collector, whose passes pause the event loop
    under load (bench/RESULTS.md, "Gateway overhead"): a finished request's exchange and
    forwarder must be freed by reference counting alone."""
    import gc

    from gateway.forwarder import Forwarder
    from gateway.upstream import Exchange

    running_with()
    gw = make_gateway()
    client = gw.client()
    client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="warm", max_tokens=4)  # warm
    gw.recorder.wait_for(1)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(6):
            list(
                client.chat.completions.create(
                    model="ttft-opt", messages=MESSAGES, stream=True, user=f"u{i}", max_tokens=8
                )
            )
            client.completions.create(model="ttft-opt", prompt="Once upon", user=f"u{i}", max_tokens=4)
        assert len(gw.recorder.wait_for(13)) == 13
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, (Exchange, Forwarder))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    assert left == []
