"""gateway/routing.py and gateway/limits.py: the pure decisions, without a server."""

from __future__ import annotations

import pytest

from gateway.limits import TokenBuckets
from gateway.routing import (
    Reason,
    RequestError,
    UserSource,
    decide,
    experiment_for,
    key_user,
    parse_routes,
    split_path,
    user_for,
)

CONTROLS = {"exp": "ctl", "fallback": "base"}


def assign(experiment, user):
    if experiment == "paused-or-concluded":
        raise LookupError(experiment)
    return f"v-{user}", 7


def test_the_model_is_the_experiment_unless_a_route_says_otherwise():
    routes = parse_routes(["gpt-4o=exp", "/team-a=fallback", "/team-a/deep=exp"])
    assert experiment_for("other", None, routes) == "other"
    assert experiment_for("gpt-4o", None, routes) == "exp"
    assert split_path("/team-a/v1/chat/completions", routes) == ("fallback", "/v1/chat/completions")
    assert split_path("/team-a/deep/v1/completions", routes) == ("exp", "/v1/completions")  # longest first
    assert split_path("/v1/completions", routes) == (None, "/v1/completions")
    # a model route beats a path prefix
    assert experiment_for("gpt-4o", "fallback", routes) == "exp"
    assert experiment_for("anything", "fallback", routes) == "fallback"
    with pytest.raises(RequestError) as info:
        split_path("/team-b/v1/chat/completions", routes)
    assert info.value.status == 404


def test_the_user_comes_from_the_body_then_the_header_then_the_key():
    assert user_for("alice", "hdr", "key") == ("alice", UserSource.BODY)
    assert user_for(None, "hdr", "key") == ("hdr", UserSource.HEADER)
    assert user_for(None, None, "sk-123") == (key_user("sk-123"), UserSource.API_KEY)
    assert user_for(None, None, None) == (None, UserSource.NONE)
    assert key_user("sk-123") == key_user("sk-123") != key_user("sk-124")
    assert "sk-123" not in key_user("sk-123")


@pytest.mark.parametrize("bad", [3, "", "x" * 257, "tab\there", "nul\x00", ["list"], {"d": 1}])
def test_every_client_string_is_checked(bad):
    with pytest.raises(RequestError) as info:
        user_for(bad, None, None)
    assert info.value.status == 400 and info.value.param == "user"
    with pytest.raises(RequestError):
        experiment_for(bad, None, parse_routes([]))


def test_decisions():
    d = decide("exp", "u1", controls=CONTROLS, assign=assign)
    assert (d.experiment, d.variant, d.revision, d.reason) == ("exp", "v-u1", 7, Reason.ASSIGNED)
    d = decide("exp", None, controls=CONTROLS, assign=assign)
    assert (d.variant, d.revision, d.reason) == ("ctl", 0, Reason.UNASSIGNED)
    d = decide("paused-or-concluded", "u1", controls={**CONTROLS, "paused-or-concluded": "c"}, assign=assign)
    assert (d.variant, d.reason) == ("c", Reason.NOT_RUNNING)
    d = decide("nope", "u1", controls=CONTROLS, assign=assign, default_experiment="fallback")
    assert (d.experiment, d.variant, d.reason, d.requested) == ("fallback", "base", Reason.DEFAULT, "nope")
    with pytest.raises(RequestError) as info:
        decide("nope", "u1", controls=CONTROLS, assign=assign)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


@pytest.mark.parametrize(
    "entries",
    [["x"], ["=exp"], ["m="], ["/v1=exp"], ["/healthz=exp"], ["/a//b=exp"], ["/=exp"], ["m=a", "m=b"],
     ["/p=a", "/p/=b"], ["m=bad key"]],
)  # fmt: skip
def test_bad_routes_name_the_setting(entries):
    with pytest.raises(ValueError, match="ABPLAT_GATEWAY_ROUTES"):
        parse_routes(entries)


def test_token_buckets_allow_the_burst_then_the_rate():
    b = TokenBuckets(rate=2, burst=3)
    assert [b.take("u", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("u", 0.0) == pytest.approx(0.5)
    assert b.take("other", 0.0) == 0.0  # per key
    assert b.take("u", 0.5) == 0.0  # one token back after 1/rate
    assert b.take("u", 0.5) > 0


def test_token_buckets_stay_bounded():
    b = TokenBuckets(rate=1, burst=1, max_keys=100)
    for i in range(1000):
        b.take(f"u{i}", float(i) / 1000)
    assert len(b) <= 100
    with pytest.raises(ValueError):
        TokenBuckets(rate=0, burst=1)
