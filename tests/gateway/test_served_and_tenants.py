"""What the gateway serves, to whom, and how much: drafts are never served, a tenant reaches
only what ABPLAT_GATEWAY_REACH gives it, per-tenant rate and concurrency limits, hostile
bodies (deep nesting, a body that never arrives)."""

from __future__ import annotations

import copy
import json
import socket

import httpx
import openai
import pytest

from experiments import services
from experiments.weights import process
from gateway.routing import parse_reach, parse_routes
from tests.gateway.conftest import KEY, OTHER_KEY, user_on
from tests.workers.background import wait_for

MESSAGES = [{"role": "user", "content": "Hi"}]
AUTH = {"authorization": f"Bearer {KEY}"}


def _read_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length (its head and body may come apart)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
        data.lower().split(b"content-length: ")[1].split(b"\r\n")[0]
    ):
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    return data


def _draft(document, sims, users, key: str):
    """A draft of the test document under ``key``, its variants on the simulators."""
    doc = copy.deepcopy(document)
    doc["key"] = key
    for v in doc["variants"]:
        v["endpoint"] = sims[v["key"]].url + "/v1"
        v["api"] = "chat"
    return services.apply_document(doc, actor=users["product"]).experiment


def test_a_draft_is_never_served_and_cannot_take_over_a_model_name(
    running_with, make_gateway, document, sims, users
):
    running_with()
    _draft(document, sims, users, "gpt-house")
    gw = make_gateway()
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().chat.completions.create(model="gpt-house", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as unknown:
        gw.client().chat.completions.create(model="gpt-nobody", messages=MESSAGES, max_tokens=2)
    # a draft is answered exactly as a name nobody uses
    assert info.value.message.replace("gpt-house", "X") == unknown.value.message.replace("gpt-nobody", "X")
    assert {m.id for m in gw.client().models.list()} == {"ttft-opt"}
    # With a default experiment, the draft's name goes to the default's control, not the draft.
    gw2 = make_gateway(routes=parse_routes([], "ttft-opt"))
    raw = gw2.client().chat.completions.with_raw_response.create(
        model="gpt-house",
        messages=MESSAGES,
        user=user_on(process.live_router(), "ttft-opt", "awq"),
        max_tokens=2,
    )
    assert raw.headers["x-abplat-variant"] == "fp16"
    [rec] = gw2.recorder.wait_for(1)
    assert rec["experiment"] == "ttft-opt" and gw2.gateway.counts["default"] == 1
    assert "gpt-house" not in gw2.gateway.directory.targets


def test_the_default_experiment_is_served_whatever_its_status(make_gateway, document, sims, users):
    _draft(document, sims, users, "house-default")
    gw = make_gateway(routes=parse_routes([], "house-default"))
    raw = gw.client().chat.completions.with_raw_response.create(
        model="any-model", messages=MESSAGES, max_tokens=2
    )
    assert raw.headers["x-abplat-variant"] == "fp16"  # the operator named it: its control serves


def test_a_tenant_reaches_only_the_experiments_it_is_given(running_with, make_gateway):
    running_with()
    # acme: the team's experiments; beta: nothing listed, so nothing but the default
    gw = make_gateway(reach=parse_reach(["acme=team:default"]))
    acme, beta = gw.client(), gw.client(key=OTHER_KEY)
    assert acme.chat.completions.create(model="ttft-opt", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as info:
        beta.chat.completions.create(model="ttft-opt", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert {m.id for m in acme.models.list()} == {"ttft-opt"}
    assert {m.id for m in beta.models.list()} == set()
    # a route to the experiment does not get around it
    routed = make_gateway(reach=parse_reach(["acme=team:default"]), routes=parse_routes(["llama=ttft-opt"]))
    with pytest.raises(openai.NotFoundError):
        routed.client(key=OTHER_KEY).chat.completions.create(model="llama", messages=MESSAGES, max_tokens=2)
    assert len(gw.recorder.wait_for(1)) == 1  # acme's, and nothing of beta's reached a variant


def test_a_tenants_rate_holds_whatever_user_ids_it_sends(running_with, make_gateway):
    running_with()
    gw = make_gateway(tenant_rate=1, tenant_burst=3, user_rate=1000, user_burst=1000)
    codes = []
    for i in range(5):  # a new user id each time: the per-user limit alone would let all through
        body = {"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 2, "user": f"rotating-{i}"}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH)
        codes.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
            assert "API key" in r.json()["error"]["message"]
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    other = httpx.post(  # another tenant has its own bucket
        gw.url + "/v1/chat/completions",
        json={"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 2},
        headers={"authorization": f"Bearer {OTHER_KEY}"},
    )
    assert other.status_code == 200
    assert gw.gateway.counts["refused_429"] == 2


def test_a_tenants_concurrent_requests_are_capped_and_freed_when_they_end(running_with, make_gateway):
    running_with()
    gw = make_gateway(tenant_streams=1, forward_headers=frozenset({"x-abplat-fault"}))
    quick = {"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 2, "user": "u2"}
    held = json.dumps(
        {"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 5, "user": "u1", "stream": True}
    )
    held = held.encode()
    port = int(gw.url.rsplit(":", 1)[1])
    # slow_headers: the simulator holds its response headers, so the request stays in flight
    # until this client goes away.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nx-abplat-fault: slow_headers\r\n"
            b"Content-Length: " + str(len(held)).encode() + b"\r\n\r\n" + held
        )
        wait_for(lambda: gw.gateway.tenant_active.get("acme") == 1, timeout=10)
        r = httpx.post(gw.url + "/v1/chat/completions", json=quick, headers=AUTH)
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded", r.text
        assert r.headers["retry-after"] == "1"
        other = httpx.post(
            gw.url + "/v1/chat/completions", json=quick, headers={"authorization": f"Bearer {OTHER_KEY}"}
        )
        assert other.status_code == 200  # the cap is the tenant's, not the gateway's
    wait_for(lambda: not gw.gateway.tenant_active, timeout=10)  # the client went away: its slot is free
    assert httpx.post(gw.url + "/v1/chat/completions", json=quick, headers=AUTH).status_code == 200
    outcomes = sorted(r["result"].outcome.value for r in gw.recorder.wait_for(3))
    assert outcomes == ["cancelled", "ok", "ok"]  # the held one recorded as the user going away


def test_a_deeply_nested_body_is_a_400_not_a_500(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    for depth in (65, 100_000):  # past the limit; past the parser's own recursion limit
        body = b'{"model":"ttft-opt","messages":' + b"[" * depth + b"]" * depth + b"}"
        r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert "nested deeper than 64" in r.json()["error"]["message"]
    ok = (
        b'{"model":"ttft-opt","max_tokens":2,"messages":[{"role":"user","content":"Hi"}],"x":'
        + b"[" * 60
        + b"]" * 60
        + b"}"
    )
    assert httpx.post(gw.url + "/v1/chat/completions", content=ok, headers=AUTH).status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_frees_its_slot(running_with, make_gateway):
    running_with()
    gw = make_gateway(body_timeout_s=0.3, tenant_streams=1)
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"model":'
        )  # and nothing more
        reply = _read_response(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"did not arrive within 0.3 s" in reply
    assert (
        httpx.post(
            gw.url + "/v1/chat/completions",
            json={**{"model": "ttft-opt"}, "messages": MESSAGES, "max_tokens": 2},
            headers=AUTH,
        ).status_code
        == 200
    )
