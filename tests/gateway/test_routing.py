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
    if experiment == "without-weights":
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
    d = decide("without-weights", "u1", controls={**CONTROLS, "without-weights": "c"}, assign=assign)
    assert (d.variant, d.reason) == ("c", Reason.NOT_RUNNING)
    d = decide("nope", "u1", controls=CONTROLS, assign=assign, default_experiment="fallback")
    assert (d.experiment, d.variant, d.reason, d.requested) == ("fallback", "base", Reason.DEFAULT, "nope")
    with pytest.raises(RequestError) as info:
        decide("nope", "u1", controls=CONTROLS, assign=assign)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


@pytest.mark.parametrize(
    "entries",
    [
        ["x"],
        ["=exp"],
        ["m="],
        ["/v1=exp"],
        ["/healthz=exp"],
        ["/a//b=exp"],
        ["/=exp"],
        ["m=a", "m=b"],
        ["/p=a", "/p/=b"],
        ["m=bad key"],
    ],
)
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


def test_a_tenant_reaches_only_what_the_reach_setting_gives_it_and_learns_nothing_else():
    from gateway.routing import parse_reach

    reach = parse_reach(["acme=exp", "acme=team:search", "ops=*"])
    teams = {"exp": "chat", "other": "search", "secret": "infra"}

    def may(tenant):
        return lambda key: reach.allows(tenant, key, teams[key])

    controls = {"exp": "ctl", "other": "o-ctl", "secret": "s-ctl", "fallback": "base"}
    assert (
        decide("exp", "u1", controls=controls, assign=assign, may_reach=may("acme")).reason is Reason.ASSIGNED
    )
    assert decide("other", "u1", controls=controls, assign=assign, may_reach=may("acme")).variant == "v-u1"
    for tenant, key in [("acme", "secret"), ("beta", "exp")]:  # not given / not listed at all
        with pytest.raises(RequestError) as refused:
            decide(key, "u1", controls=controls, assign=assign, may_reach=may(tenant))
        with pytest.raises(RequestError) as unknown:
            decide("no-such-thing", "u1", controls=controls, assign=assign, may_reach=may(tenant))
        # the same answer as for a name nobody runs: whether it exists is not given away
        assert (refused.value.status, refused.value.code) == (404, "model_not_found")
        assert refused.value.message.replace(key, "X") == unknown.value.message.replace("no-such-thing", "X")
        # ... and with a default experiment, its control serves them
        d = decide(
            key, "u1", controls=controls, assign=assign, may_reach=may(tenant), default_experiment="fallback"
        )
        assert (d.experiment, d.variant, d.reason) == ("fallback", "base", Reason.DEFAULT)
    assert (
        decide("secret", "u1", controls=controls, assign=assign, may_reach=may("ops")).reason
        is Reason.ASSIGNED
    )
    assert parse_reach([]).allows("anyone", "exp", "chat")  # not configured: everyone, as before


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("acme", "TENANT=EXPERIMENT"),
        ("ac me=exp", "TENANT=EXPERIMENT"),
        ("acme=", "not an experiment key"),
        ("acme=team:", "not a team name"),
        ("acme=../etc", "not an experiment key"),
    ],
)
def test_parse_reach_names_the_setting_and_the_entry(entry, why):
    from gateway.routing import parse_reach

    with pytest.raises(ValueError, match="ABPLAT_GATEWAY_REACH") as info:
        parse_reach([entry])
    assert why in str(info.value) and repr(entry) in str(info.value)


def test_json_depth_counts_nesting_and_stops_past_the_limit():
    from gateway.limits import json_depth

    assert json_depth("x", 5) == 0 and json_depth({}, 5) == 1
    assert json_depth({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 10) == 5
    deep: object = []
    for _ in range(100_000):  # far deeper than any recursive walk could go
        deep = [deep]
    assert json_depth(deep, 64) == 65
    wide = {"a": [[[1]]], "b": [{"c": {"d": {"e": [2]}}}]}
    assert json_depth(wide, 10) == 6
