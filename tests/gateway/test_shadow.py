"""Shadowing live answers to the control (gateway/shadow.py, fidelity/shadow.py): which requests
are sampled, what is re-sent, what each row says against the simulator's own truth, and that the
user's response is the same with or without it. Rows go to the gateway's recorder (here the
tests' FakeRecorder; the store and its spool: test_shadow_recording.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading

import httpx
import pytest

from experiments.models import Experiment
from experiments.weights import process
from fidelity.shadow import SHADOW_SEED, is_greedy, sampled, shadow_body
from gateway.request import RequestContext
from gateway.routing import Decision, Reason
from gateway.upstream import Deadlines
from simulator.profiles import get_profile
from tests.gateway.conftest import KEY, dead_port, user_on
from tests.gateway.test_gateway_metrics import value, wait_for

pytestmark = pytest.mark.django_db(transaction=False)

EXPERIMENT = "ttft-opt"
PROMPTS = [f"Tell me about the sea, take {i}" for i in range(10)]


def _recording_sim(profile, seen: list[dict]):
    """A simulator in a thread that keeps the JSON body of every request it gets."""
    from simulator import serve

    server_factory = serve.build_server

    def build(*args, **kwargs):
        server = server_factory(*args, **kwargs)
        inner = server.config.app

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return await inner(scope, receive, send)
            parts: list[bytes] = []

            async def keeping():
                message = await receive()
                if message["type"] == "http.request":
                    parts.append(message.get("body", b""))
                    if not message.get("more_body") and scope["method"] == "POST":
                        seen.append(json.loads(b"".join(parts)))
                return message

            await inner(scope, keeping, send)

        server.config.app = app
        return server

    serve.build_server = build
    try:
        return serve.start_in_thread(profile, model="tiny-llama")
    finally:
        serve.build_server = server_factory


@pytest.fixture
def seen():
    return {"fp16": [], "awq": [], "awq-fa2": []}


@pytest.fixture
def sims(seen):
    """The test document's variants on fast simulators; awq departs from fp16's answer on half of
    the prompts (the simulator's truth: usage.abplat.diverged_at)."""
    fast = get_profile("fast")
    awq = dataclasses.replace(fast, name="fast-awq", seed=11, divergence_rate=0.5)
    handles = {
        "fp16": _recording_sim(fast, seen["fp16"]),
        "awq": _recording_sim(awq, seen["awq"]),
        "awq-fa2": _recording_sim(fast, seen["awq-fa2"]),
    }
    yield handles
    for h in handles.values():
        h.stop()


def with_share(share: float, control_endpoint: str | None = None):
    def mutate(doc):
        doc["fidelity"] = {"shadow_share": share}
        if control_endpoint is not None:
            doc["variants"][0]["endpoint"] = control_endpoint

    return mutate


def post(gw, body: dict, **headers) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY}", **headers},
        timeout=30,
    )


def events(raw: bytes) -> list[dict]:
    out = []
    for line in raw.decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def diverged_at(raw: bytes) -> int | None:
    """The simulator's truth for the answer in a streamed body (its usage event)."""
    [usage] = [e["usage"] for e in events(raw) if e.get("usage")]
    return usage["abplat"]["diverged_at"]


def idle(gw) -> None:
    """Until every request handler of the gateway returned (a shadow is launched before)."""
    wait_for(lambda: gw.gateway.active == 0, "the gateway's handlers to return")


def chat(prompt: str, user: str, *, max_tokens: int = 16, **over) -> dict:
    body = {
        "model": EXPERIMENT,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "user": user,
    }
    body.update(over)
    return body


def test_a_greedy_live_answer_is_compared_as_served_with_the_control_s_and_matches_the_truth(
    running_with, make_gateway, seen
):
    running_with(with_share(1.0))
    gw = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    ok_before = value("abplat_gateway_shadow_requests_total", experiment=EXPERIMENT, outcome="ok")
    truths = []
    for prompt in PROMPTS:
        resp = post(gw, chat(prompt, user, temperature=0))
        assert resp.status_code == 200 and resp.headers["x-abplat-variant"] == "awq"
        truths.append((resp.headers["x-request-id"], diverged_at(resp.content)))
    rows = gw.recorder.wait_shadows(len(PROMPTS))
    by_id = {r["request_id"]: r for r in rows}
    assert {t is None for _rid, t in truths} == {True, False}  # both kinds among the prompts
    for rid, truth in truths:
        row = by_id[rid]
        assert (row["experiment"], row["variant"], row["control"]) == (EXPERIMENT, "awq", "fp16")
        assert row["compared"] == "live" and row["outcome"] == "ok" and row["error"] == ""
        assert row["identical"] == int(truth is None)
        assert row["first_divergence"] == (-1 if truth is None else truth)
        assert row["unit"] == "token"  # the simulator sends one token an event
        assert row["variant_tokens"] == row["control_tokens"] == 16
        assert (row["variant_fp"] == row["control_fp"]) == (truth is None) and row["variant_fp"] != 0
        assert row["user_id"] == user and row["config_revision"] > 0
    # compared as served: the variant got each request once, the control once more, greedily
    assert len(seen["awq"]) == len(PROMPTS)
    assert len(seen["fp16"]) == len(PROMPTS)
    shadow = seen["fp16"][0]
    assert shadow["temperature"] == 0 and shadow["seed"] == SHADOW_SEED and shadow["stream"] is True
    assert shadow["model"] == "tiny-llama" and shadow["max_tokens"] == 16
    assert shadow["messages"] == [{"role": "user", "content": PROMPTS[0]}]
    # the shadows are no samples: one per user request, and each as without shadowing
    assert len(gw.recorder.records) == len(PROMPTS)
    assert all(r["result"].output_fp == 0 and r["result"].token_fps == [] for r in gw.recorder.records)
    ok_after = value("abplat_gateway_shadow_requests_total", experiment=EXPERIMENT, outcome="ok")
    assert ok_after - ok_before == len(PROMPTS)


def test_a_sampling_request_is_compared_as_a_greedy_pair(running_with, make_gateway, sims, seen):
    running_with(with_share(1.0))
    gw = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    truths = {}
    for prompt in PROMPTS[:6]:
        resp = post(gw, chat(prompt, user, temperature=0.8, top_p=0.9, n=1))
        assert resp.status_code == 200
        # the truth for the greedy answer, from the variant's own server
        greedy = httpx.post(
            sims["awq"].url + "/v1/chat/completions",
            json=chat(prompt, "x", temperature=0, model="tiny-llama"),
            timeout=30,
        )
        truths[resp.headers["x-request-id"]] = diverged_at(greedy.content)
    rows = gw.recorder.wait_shadows(6)
    assert {t is None for t in truths.values()} == {True, False}
    for row in rows:
        truth = truths[row["request_id"]]
        assert row["compared"] == "greedy_pair" and row["outcome"] == "ok"
        assert row["identical"] == int(truth is None)
        assert row["first_divergence"] == (-1 if truth is None else truth)
    # the variant: the user's request, its greedy shadow, and the test's own; no top_p re-sent
    shadows = [b for b in seen["awq"] if b.get("seed") == SHADOW_SEED]
    assert len(shadows) == 6 and all(b["temperature"] == 0 and "top_p" not in b for b in shadows)


def test_share_zero_sends_nothing_and_a_user_on_the_control_is_never_shadowed(
    running_with, make_gateway, seen
):
    running_with(with_share(0.0))
    gw = make_gateway()
    router = process.live_router()
    resp = post(gw, chat(PROMPTS[0], user_on(router, EXPERIMENT, "awq"), temperature=0))
    assert resp.status_code == 200
    idle(gw)
    assert not gw.gateway.attempts.shadows.tasks and not gw.gateway.attempts.shadows.counts
    assert seen["fp16"] == [] and gw.recorder.shadows == []

    Experiment.objects.filter(key=EXPERIMENT).update(fidelity_shadow_share=1.0)
    gw = make_gateway()
    resp = post(gw, chat(PROMPTS[0], user_on(router, EXPERIMENT, "fp16"), temperature=0))
    assert resp.status_code == 200 and resp.headers["x-abplat-variant"] == "fp16"
    idle(gw)
    assert len(seen["fp16"]) == 1 and gw.recorder.shadows == []  # the user's own request only


def context(request_id: str, sample_key: str | None = None, **request) -> RequestContext:
    return RequestContext(
        api_path="/v1/chat/completions",
        request={"model": EXPERIMENT, "stream": True, **request},
        decision=Decision(EXPERIMENT, "awq", 1, Reason.ASSIGNED, EXPERIMENT),
        user_id="u",
        request_id=request_id,
        traceparent="",
        trace_id="",
        max_tokens=0,
        forwarded={},
        accept="text/event-stream",
        sample_key=sample_key or request_id,
    )


def test_sampling_picks_the_share_by_request_id_alike_on_two_gateway_instances(running_with, make_gateway):
    running_with(with_share(0.3))
    first, second = make_gateway(), make_gateway()
    ids = [f"gw-{i:032x}" for i in range(5000)]

    def picked(gw):
        shadows = gw.gateway.attempts.shadows
        target = gw.gateway.directory.target(EXPERIMENT, "awq")
        return {rid for rid in ids if shadows.plan(context(rid), target) is not None}

    on_first = picked(first)
    assert on_first == picked(second)
    assert abs(len(on_first) / len(ids) - 0.3) < 0.02
    # the control's own answers are never shadowed
    control = first.gateway.directory.target(EXPERIMENT, "fp16")
    assert all(first.gateway.attempts.shadows.plan(context(rid), control) is None for rid in ids[:200])
    # a cap of 0 turns shadowing off in that process, whatever the share
    assert picked(make_gateway(shadows_in_flight=0)) == set()


def test_the_sampling_hash_is_pinned_and_a_client_s_request_id_samples_its_retries_alike():
    # version 1's golden vectors: a change of the rule must be a new version
    assert [sampled(f"req-{i}", 0.5) for i in range(8)] == [
        sampled(f"req-{i}", 0.5, version=1) for i in range(8)
    ]
    assert [sampled(f"req-{i}", 0.5) for i in range(8)] == GOLDEN
    assert sampled("anything", 1.0) and not sampled("anything", 0.0)
    # monotone in the share: a request sampled at 0.1 is sampled at 0.3
    assert all(sampled(f"r{i}", 0.3) for i in range(2000) if sampled(f"r{i}", 0.1))
    from gateway.request import sample_key_for

    assert sample_key_for(b"client-retry-7", "gw-1") == sample_key_for(b"client-retry-7", "gw-2")
    assert sample_key_for(None, "gw-1") == "gw-1" and sample_key_for(b"x" * 300, "gw-1") == "gw-1"


GOLDEN = [True, False, True, False, False, True, True, False]


def test_which_live_requests_are_greedy_and_what_the_shadow_body_keeps():
    assert is_greedy({"temperature": 0}) and is_greedy({"temperature": 0.0, "top_p": 0.5, "seed": 3})
    assert is_greedy({"temperature": 0, "logit_bias": {"5": 1}, "n": 1, "frequency_penalty": 0.5})
    assert not is_greedy({})  # absent: the default 1.0
    assert not is_greedy({"temperature": 0.7}) and not is_greedy({"temperature": "0"})
    assert not is_greedy({"temperature": 0, "n": 2}) and not is_greedy({"temperature": 0, "best_of": 3})
    assert not is_greedy({"temperature": 0, "use_beam_search": True})
    body = shadow_body(
        {
            "model": "x",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9,
            "temperature": 0.9,
            "top_p": 0.5,
            "n": 3,
            "logprobs": True,
            "stop": ["\n"],
            "logit_bias": {"7": -100},
            "stream": False,
        },
        "served-model",
    )
    assert body == {
        "model": "served-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "stop": ["\n"],
        "logit_bias": {"7": -100},
        "temperature": 0,
        "seed": SHADOW_SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _normalized(raw: bytes) -> bytes:
    """A streamed body without what the variant writes differently for each request: its id,
    creation time and the simulator's clock readings in its usage event."""
    raw = re.sub(rb'"id":"[^"]*"', b'"id":""', raw)
    return re.sub(
        rb'"(created|server_ttft_ms|first_content_ns|received_ns|queue_ms)": ?[0-9.e+-]+', rb'"\1":0', raw
    )


def test_the_user_s_stream_is_the_same_with_and_without_shadowing(running_with, make_gateway):
    running_with(with_share(0.0))
    without = make_gateway()
    Experiment.objects.filter(key=EXPERIMENT).update(fidelity_shadow_share=1.0)
    with_shadows = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    for over in ({"temperature": 0}, {"temperature": 0.5, "seed": 4}):
        body = chat(PROMPTS[3], user, **over)
        a, b = post(without, body), post(with_shadows, body)
        assert a.status_code == b.status_code == 200
        assert _normalized(a.content) == _normalized(b.content) and len(events(a.content)) > 16
        skip = {"x-request-id", "traceparent", "date"}
        assert [(k, v) for k, v in a.headers.items() if k not in skip] == [
            (k, v) for k, v in b.headers.items() if k not in skip
        ]
    assert len(with_shadows.recorder.wait_shadows(2)) == 2
    assert without.recorder.shadows == []


class HeldServer:
    """Accepts connections and answers none until released (then closes them)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.accepted = threading.Semaphore(0)
        self.release = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.release()

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


def test_over_the_cap_a_shadow_is_skipped_and_counted_never_queued(running_with, make_gateway):
    held = HeldServer()
    try:
        running_with(with_share(1.0, control_endpoint=held.url))
        gw = make_gateway(shadows_in_flight=1)
        user = user_on(process.live_router(), EXPERIMENT, "awq")
        before = value("abplat_gateway_shadow_requests_total", experiment=EXPERIMENT, outcome="skipped_busy")
        assert post(gw, chat(PROMPTS[0], user, temperature=0)).status_code == 200
        assert held.accepted.acquire(timeout=10)  # the first shadow waits on the control
        for prompt in PROMPTS[1:4]:
            resp = post(gw, chat(prompt, user, temperature=0))
            assert resp.status_code == 200 and diverged_at(resp.content) in (None, *range(16))
        idle(gw)
        shadows = gw.gateway.attempts.shadows
        assert len(shadows.tasks) == 1 and shadows.counts["skipped_busy"] == 3
        after = value("abplat_gateway_shadow_requests_total", experiment=EXPERIMENT, outcome="skipped_busy")
        assert after - before == 3
        assert gw.recorder.shadows == []  # a skipped shadow has no row
        held.close()  # the control closes without answering: the one shadow in flight fails
        [row] = gw.recorder.wait_shadows(1)
        assert row["outcome"] == "control_error" and "control:" in row["error"]
        assert row["identical"] == 0 and row["first_divergence"] == -1 and row["control_fp"] == 0
    finally:
        held.close()


def test_a_control_that_is_down_leaves_a_control_error_row_and_the_user_unaffected(
    running_with, make_gateway
):
    running_with(with_share(1.0, control_endpoint=f"http://127.0.0.1:{dead_port()}/v1"))
    gw = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    resp = post(gw, chat(PROMPTS[0], user, temperature=0))
    assert resp.status_code == 200 and len(events(resp.content)) > 16
    [row] = gw.recorder.wait_shadows(1)
    assert row["outcome"] == "control_error" and "connect_error" in row["error"]
    assert row["compared"] == "live" and row["variant"] == "awq"
    assert gw.recorder.records[0]["result"].ok  # the user's own sample: served OK


def test_a_control_that_does_not_answer_in_time_leaves_a_timeout_row(running_with, make_gateway):
    held = HeldServer()
    try:
        running_with(with_share(1.0, control_endpoint=held.url))
        gw = make_gateway(deadlines=Deadlines(connect_s=2, headers_s=0.2, stall_s=5, total_s=10))
        user = user_on(process.live_router(), EXPERIMENT, "awq")
        assert post(gw, chat(PROMPTS[0], user, temperature=0.3)).status_code == 200
        [row] = gw.recorder.wait_shadows(1)
        assert row["outcome"] == "timeout" and "headers_timeout" in row["error"]
        assert row["compared"] == "greedy_pair"
    finally:
        held.close()


def test_a_failed_user_request_is_not_shadowed(running_with, make_gateway):
    def variant_down(doc):
        with_share(1.0)(doc)
        doc["variants"][1]["endpoint"] = f"http://127.0.0.1:{dead_port()}/v1"

    running_with(variant_down)
    gw = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    assert post(gw, chat(PROMPTS[0], user, temperature=0)).status_code == 502
    idle(gw)
    assert not gw.gateway.attempts.shadows.tasks and gw.recorder.shadows == []


def test_a_shadow_obeys_the_gateway_s_egress_allowlist(running_with, make_gateway, settings):
    # the document may name 10.0.0.0/8 here, the gateway's allowlist (tests/gateway/conftest.py)
    # is 127.0.0.0/8: a control elsewhere is never dialled by a shadow, as for a user
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.0/8", "10.0.0.0/8"]
    running_with(with_share(1.0, control_endpoint="http://10.255.255.1:8000/v1"))
    gw = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    assert post(gw, chat(PROMPTS[0], user, temperature=0)).status_code == 200
    [row] = gw.recorder.wait_shadows(1)
    assert row["outcome"] == "control_error" and "egress refused" in row["error"]


@pytest.mark.parametrize("raw", ["-1", "many", "10001"])
def test_the_cap_setting_is_parsed_strictly(raw, tmp_path):
    from django.core.exceptions import ImproperlyConfigured

    from abplat.config import settings_from

    env = {"ABPLAT_VAR": str(tmp_path)}
    assert settings_from(env)["GATEWAY_SHADOWS_IN_FLIGHT"] == 8
    assert settings_from({**env, "ABPLAT_GATEWAY_SHADOWS_IN_FLIGHT": "0"})["GATEWAY_SHADOWS_IN_FLIGHT"] == 0
    with pytest.raises(ImproperlyConfigured, match="ABPLAT_GATEWAY_SHADOWS_IN_FLIGHT"):
        settings_from({**env, "ABPLAT_GATEWAY_SHADOWS_IN_FLIGHT": raw})


def test_a_client_s_retries_under_its_own_request_id_are_sampled_alike(running_with, make_gateway):
    running_with(with_share(0.5))
    gw = make_gateway()
    user = user_on(process.live_router(), EXPERIMENT, "awq")
    names = [f"client-req-{i}" for i in range(40)]
    yes = next(n for n in names if sampled(n, 0.5))
    no = next(n for n in names if not sampled(n, 0.5))
    sent = {}
    for client_id in (yes, no, yes, no):
        resp = post(gw, chat(PROMPTS[0], user, temperature=0), **{"x-request-id": client_id})
        assert resp.status_code == 200
        sent.setdefault(client_id, []).append(resp.headers["x-request-id"])  # the gateway's own
    gw.recorder.wait_shadows(2)
    idle(gw)
    assert not gw.gateway.attempts.shadows.tasks
    # both of the sampled id's requests (each its own gateway id), none of the other's
    assert sorted(r["request_id"] for r in gw.recorder.shadows) == sorted(sent[yes])
    assert len(set(sent[yes])) == 2
