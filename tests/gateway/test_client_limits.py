"""What the gateway refuses, and how: API keys, sizes, rates, bad strings, unknown models."""

from __future__ import annotations

import httpx
import openai
import pytest

from experiments.weights import process
from gateway.limits import parse_keys
from gateway.routing import parse_routes
from tests.gateway.conftest import KEY, OTHER_KEY, user_on

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_missing_or_unknown_api_key_is_a_401(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    for key in ("", "sk-not-a-listed-key-000000"):
        with pytest.raises(openai.AuthenticationError) as info:
            gw.client(key=key or None).chat.completions.create(
                model="ttft-opt", messages=MESSAGES, max_tokens=2
            )
        assert info.value.status_code == 401
        assert info.value.code == "invalid_api_key"
    # every tenant's key works
    for key in (KEY, OTHER_KEY):
        assert gw.client(key=key).chat.completions.create(model="ttft-opt", messages=MESSAGES, max_tokens=2)
    assert gw.recorder.wait_for(2) and len(gw.recorder.records) == 2  # refusals are not samples


def test_a_body_over_the_limit_is_a_413_before_it_is_read_whole(running_with, make_gateway):
    running_with()
    gw = make_gateway(max_body_bytes=2048)
    with pytest.raises(openai.APIStatusError) as info:
        gw.client().chat.completions.create(
            model="ttft-opt", messages=[{"role": "user", "content": "x" * 4096}], max_tokens=2
        )
    assert info.value.status_code == 413
    # chunked, without a Content-Length: cut off as it streams in
    body = (b'{"model":"ttft-opt","messages":[{"role":"user","content":"' + b"y" * 1000 for _ in range(5))
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 413


def test_the_per_user_rate_limit_is_a_429_with_retry_after(running_with, make_gateway):
    running_with()
    gw = make_gateway(user_rate=1, user_burst=2)
    client = gw.client()
    for _ in range(2):
        client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="eager", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="eager", max_tokens=2)
    assert int(info.value.response.headers["retry-after"]) >= 1
    # another user is not held back
    client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="patient", max_tokens=2)


@pytest.mark.parametrize(
    ("body", "param", "why"),
    [
        ({"model": 7, "messages": MESSAGES}, "model", "must be a string"),
        ({"model": "", "messages": MESSAGES}, "model", "must not be empty"),
        ({"model": "a\x00b", "messages": MESSAGES}, "model", "control characters"),
        ({"model": "m" * 300, "messages": MESSAGES}, "model", "at most 256"),
        ({"model": "ttft-opt", "messages": MESSAGES, "user": ["x"]}, "user", "must be a string"),
        ({"model": "ttft-opt", "messages": MESSAGES, "user": "u\n"}, "user", "control characters"),
        ({"model": "ttft-opt", "messages": MESSAGES, "stream": "yes"}, "stream", "true or false"),
        ({"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 0}, "max_tokens", "positive integer"),
    ],
)
def test_hostile_fields_are_a_400_naming_the_field(running_with, make_gateway, body, param, why):
    running_with()
    gw = make_gateway()
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and why in error["message"], error


def test_not_json_and_wrong_methods_and_paths(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(gw.url + "/v1/chat/completions", content=b"{nope", headers=auth).status_code == 400
    assert httpx.post(gw.url + "/v1/chat/completions", content=b"[1]", headers=auth).status_code == 400
    assert httpx.get(gw.url + "/v1/chat/completions", headers=auth).status_code == 405
    assert httpx.post(gw.url + "/v1/embeddings", json={}, headers=auth).status_code == 404
    assert httpx.get(gw.url + "/healthz").json() == {"status": "ok"}


def test_an_unknown_model_is_a_404_or_the_default_experiments_control(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"
    gw2 = make_gateway(routes=parse_routes([], "ttft-opt"))
    user = user_on(process.live_router(), "ttft-opt", "awq")
    raw = gw2.client().chat.completions.with_raw_response.create(
        model="gpt-9", messages=MESSAGES, user=user, max_tokens=2
    )
    assert raw.headers["x-abplat-variant"] == "fp16"
    assert gw2.gateway.counts["default"] == 1


def test_routes_by_model_name_and_path_prefix(running_with, make_gateway):
    running_with()
    gw = make_gateway(routes=parse_routes(["llama-chat=ttft-opt", "/team-a=ttft-opt"]))
    user = user_on(process.live_router(), "ttft-opt", "awq")
    client = gw.client()
    raw = client.chat.completions.with_raw_response.create(
        model="llama-chat", messages=MESSAGES, user=user, max_tokens=2
    )
    assert raw.headers["x-abplat-variant"] == "awq"
    prefixed = openai.OpenAI(base_url=gw.url + "/team-a/v1", api_key=KEY, max_retries=0)
    raw = prefixed.chat.completions.with_raw_response.create(
        model="anything", messages=MESSAGES, user=user, max_tokens=2
    )
    assert raw.headers["x-abplat-variant"] == "awq"
    models = {m.id for m in client.models.list()}
    assert {"ttft-opt", "llama-chat"} <= models
    assert [r["experiment"] for r in gw.recorder.wait_for(2)] == ["ttft-opt", "ttft-opt"]


def test_no_user_is_served_by_the_control_and_counted(running_with, make_gateway):
    running_with()
    gw = make_gateway(keys=None)
    raw = gw.client(key=None).chat.completions.with_raw_response.create(
        model="ttft-opt", messages=MESSAGES, max_tokens=2, extra_headers={"authorization": ""}
    )
    assert raw.headers["x-abplat-variant"] == "fp16"
    assert gw.gateway.counts["unassigned"] == 1
    [rec] = gw.recorder.wait_for(1)
    assert rec["user_id"] == "" and rec["config_revision"] == 0


def test_the_user_header_and_the_api_key_name_the_user(running_with, make_gateway):
    running_with()
    gw = make_gateway(user_header="x-end-user")
    client = gw.client()
    client.chat.completions.create(
        model="ttft-opt", messages=MESSAGES, max_tokens=2, extra_headers={"x-end-user": "from-header"}
    )
    client.chat.completions.create(model="ttft-opt", messages=MESSAGES, max_tokens=2)
    a, b = gw.recorder.wait_for(2)
    assert a["user_id"] == "from-header"
    assert b["user_id"].startswith("key-") and KEY not in b["user_id"]
    assert gw.gateway.counts["assigned"] == 2


def test_a_concluded_experiment_is_not_served(running_with, make_gateway, users):
    from experiments import services

    experiment = running_with()
    user = user_on(process.live_router(), "ttft-opt", "awq")
    services.transition(experiment, "conclude", users["product"])
    gw = make_gateway()
    process.live_router().refresh()
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().chat.completions.create(model="ttft-opt", messages=MESSAGES, user=user, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert "ttft-opt" not in {m.id for m in gw.client().models.list()}
    assert not gw.recorder.records


def test_a_paused_experiment_keeps_serving_its_users_variants(running_with, make_gateway, users):
    from experiments import services

    experiment = running_with()
    user = user_on(process.live_router(), "ttft-opt", "awq")
    services.transition(experiment, "pause", users["product"])
    gw = make_gateway()
    process.live_router().refresh()
    raw = gw.client().chat.completions.with_raw_response.create(
        model="ttft-opt", messages=MESSAGES, user=user, max_tokens=2
    )
    assert raw.headers["x-abplat-variant"] == "awq"  # pausing stops replays, not the users' variants
    assert gw.gateway.counts["assigned"] == 1


def test_parse_keys_is_strict_and_never_echoes_a_key():
    keys = parse_keys("# tenants\nacme sk-0123456789abcdef\n\nbeta sk-fedcba9876543210\n")
    assert keys.tenant("sk-0123456789abcdef") == "acme" and keys.tenant("nope") is None
    for text, why in [
        ("acme", "two words"),
        ("acme short", "at least 16"),
        ("ac!me sk-0123456789abcdef", "tenant"),
        ("a sk-0123456789abcdef\nb sk-0123456789abcdef", "listed twice"),
    ]:
        with pytest.raises(ValueError, match=why) as info:
            parse_keys(text)
        assert "sk-0123456789abcdef" not in str(info.value)


def test_a_new_user_past_the_bound_costs_no_scan_of_every_bucket():
    """Past max_keys each new user id drops one bucket, the least recently used: the work of one
    take is counted (lines run in gateway/limits.py), not timed, and does not grow with the table."""
    import sys

    from gateway import limits
    from gateway.limits import TokenBuckets

    def lines_run(buckets: TokenBuckets, key: str, now: float) -> int:
        count = 0

        def trace(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename == limits.__file__:
                count += event == "line"
                return trace
            return None

        sys.settrace(trace)
        try:
            buckets.take(key, now)
        finally:
            sys.settrace(None)
        return count

    for size in (100, 2000):
        b = TokenBuckets(rate=1, burst=5, max_keys=size)
        for i in range(size):
            b.take(f"u{i}", 0.0)  # every bucket recently used, none refilled
        assert len(b) == size
        work = lines_run(b, "newcomer", 0.5)
        assert work < 40, f"{work} lines for one new user past {size} buckets"
        assert len(b) == size  # still bounded: the least recently used one went
        assert b.take("u0", 0.5) == 0.0 and len(b) == size  # u0 was dropped: back full
        assert b.wait("u1", 0.5) == 0.0  # the others keep their place


def test_a_request_for_no_model_costs_its_user_no_token_and_leaves_no_bucket(running_with, make_gateway):
    running_with()
    gw = make_gateway(user_rate=1, user_burst=1)
    client = gw.client()
    for i in range(3):  # fresh user ids asking for a model nobody serves
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-9", messages=MESSAGES, user=f"fresh-{i}", max_tokens=2)
        assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, user="eager", max_tokens=2)
    # the user's one token is still there for a request that has somewhere to go
    client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="eager", max_tokens=2)
    assert len(gw.gateway.limits.users) == 1  # eager's: none for the ids that asked for no model
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="ttft-opt", messages=MESSAGES, user="eager", max_tokens=2)
