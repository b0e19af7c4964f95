"""The live gateway's own Prometheus metrics (telemetry/metrics.py, "live gateway requests"),
driven through real HTTP against the simulators: how each request was routed, what the gateway
refused and with which status, each variant's outcomes, requests in flight. Deltas of this
process's registry (the gateway runs in a thread of the test process), so other tests'
requests do not matter."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from experiments.weights import process
from gateway.limits import parse_keys
from telemetry import metrics
from tests.gateway.conftest import KEY, user_on

pytestmark = pytest.mark.django_db(transaction=False)

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]
REQUESTS = "abplat_gateway_requests_total"
REFUSED = "abplat_gateway_refused_requests_total"
UPSTREAM = "abplat_gateway_upstream_requests_total"
IN_FLIGHT = "abplat_gateway_requests_in_flight"


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


class Deltas:
    """Every gateway series now; ``delta(name, **labels)`` is its change since."""

    def __init__(self) -> None:
        self.before = self._all()

    @staticmethod
    def _all() -> dict[tuple[str, tuple], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.REGISTRY.collect()
            if family.name.startswith("abplat_gateway_")
            for s in family.samples
            if not s.name.endswith("_created")
        }

    def delta(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return value(name, **labels) - self.before.get(key, 0.0)

    def changed(self) -> dict[tuple[str, tuple], float]:
        """Every series that moved, with its change, once the requests left the gateway (the
        client may have its answer a moment before the gateway's handler returns)."""
        wait_for(lambda: self.delta(IN_FLIGHT) == 0, "the requests to leave the in-flight gauge")
        now = self._all()
        return {k: v - self.before.get(k, 0.0) for k, v in now.items() if v != self.before.get(k, 0.0)}


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_routed_stream_counts_its_route_and_its_variants_outcome(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    user = user_on(process.live_router(), "ttft-opt", "awq")
    d = Deltas()
    stream = gw.client().chat.completions.create(
        model="ttft-opt", messages=MESSAGES, stream=True, user=user, max_tokens=12
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    gw.recorder.wait_for(1)
    assert d.changed() == {
        (REQUESTS, (("experiment", "ttft-opt"), ("route", "assigned"))): 1,
        (UPSTREAM, (("experiment", "ttft-opt"), ("outcome", "ok"), ("variant", "awq"))): 1,
    }
    assert gw.gateway.counts["assigned"] == 1 and gw.gateway.counts["outcome_ok"] == 1  # kept as they were


def test_requests_without_a_user_are_counted_unassigned_under_the_experiment(running_with, make_gateway):
    running_with()
    gw = make_gateway(keys=None)  # no API key, no user: nothing to assign by
    d = Deltas()
    r = httpx.post(
        gw.url + "/v1/chat/completions", json={"model": "ttft-opt", "messages": MESSAGES, "max_tokens": 3}
    )
    assert r.status_code == 200 and r.headers["x-abplat-variant"] == "fp16"
    gw.recorder.wait_for(1)
    assert d.delta(REQUESTS, experiment="ttft-opt", route="unassigned") == 1
    assert d.delta(UPSTREAM, experiment="ttft-opt", variant="fp16", outcome="ok") == 1
    assert d.delta(REQUESTS, experiment="ttft-opt", route="assigned") == 0


def test_an_unknown_api_key_is_a_refusal_with_its_status_and_no_experiment(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    d = Deltas()
    with pytest.raises(openai.AuthenticationError):
        gw.client(key="sk-not-a-listed-key-000000").chat.completions.create(
            model="ttft-opt", messages=MESSAGES, max_tokens=2
        )
    assert d.changed() == {
        (REFUSED, (("status", "401"),)): 1,
        (REQUESTS, (("experiment", ""), ("route", "refused"))): 1,
    }


def test_an_oversize_body_is_a_413_refusal(running_with, make_gateway):
    running_with()
    gw = make_gateway(max_body_bytes=2048)
    d = Deltas()
    with pytest.raises(openai.APIStatusError) as info:
        gw.client().chat.completions.create(
            model="ttft-opt", messages=[{"role": "user", "content": "x" * 4096}], max_tokens=2
        )
    assert info.value.status_code == 413
    assert d.changed() == {
        (REFUSED, (("status", "413"),)): 1,
        (REQUESTS, (("experiment", ""), ("route", "refused"))): 1,
    }


def test_a_model_that_is_no_experiment_never_becomes_a_label(running_with, make_gateway):
    running_with()
    gw = make_gateway()
    d = Deltas()
    with pytest.raises(openai.NotFoundError):
        gw.client().chat.completions.create(model="client-made-up-model", messages=MESSAGES, max_tokens=2)
    assert d.changed() == {
        (REFUSED, (("status", "404"),)): 1,
        (REQUESTS, (("experiment", ""), ("route", "refused"))): 1,
    }
    exposed = metrics.exposition()[0].decode()
    assert "client-made-up-model" not in exposed


def test_an_upstream_error_is_counted_for_its_variant(running_with, make_gateway):
    running_with()
    gw = make_gateway(forward_headers=frozenset({"x-abplat-fault"}))
    user = user_on(process.live_router(), "ttft-opt", "awq-fa2")
    d = Deltas()
    with pytest.raises(openai.InternalServerError):
        gw.client().chat.completions.create(
            model="ttft-opt",
            messages=MESSAGES,
            user=user,
            max_tokens=4,
            extra_headers={"x-abplat-fault": "http_error"},
        )
    gw.recorder.wait_for(1)
    assert d.changed() == {
        (REQUESTS, (("experiment", "ttft-opt"), ("route", "assigned"))): 1,
        (UPSTREAM, (("experiment", "ttft-opt"), ("outcome", "http_5xx"), ("variant", "awq-fa2"))): 1,
    }  # the gateway passed the variant's 500 on: not a refusal of its own


def test_a_request_is_in_flight_while_the_gateway_holds_it(running_with, make_gateway):
    running_with()
    gw = make_gateway(keys=parse_keys(f"acme {KEY}\n"))
    d = Deltas()
    release = threading.Event()

    def body():  # the client sends its body in two parts, the second when the test says
        yield b'{"model":"ttft-opt","max_tokens":2,'
        release.wait(10)
        yield b'"messages":[{"role":"user","content":"Hi"}],"user":"u-flight"}'

    answers: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                gw.url + "/v1/chat/completions",
                content=body(),
                headers={"authorization": f"Bearer {KEY}"},
                timeout=30,
            )
        )
    )
    sender.start()
    try:
        wait_for(lambda: d.delta(IN_FLIGHT) == 1, "the request in flight")
    finally:
        release.set()
        sender.join(30)
    assert answers and answers[0].status_code == 200
    wait_for(lambda: d.delta(IN_FLIGHT) == 0, "the request to leave the in-flight gauge")
    assert d.delta(REQUESTS, experiment="ttft-opt", route="assigned") == 1


def test_a_failing_metric_never_fails_the_users_request(running_with, make_gateway, monkeypatch, caplog):
    running_with()
    gw = make_gateway()

    class Broken:
        def labels(self, *values):
            raise OSError(28, "No space left on device")  # a full ABPLAT_METRICS_DIR

        inc = dec = labels

    for name in ("GATEWAY_REQUESTS", "GATEWAY_REFUSED", "GATEWAY_UPSTREAM", "GATEWAY_IN_FLIGHT"):
        monkeypatch.setattr(metrics, name, Broken())
    reply = gw.client().chat.completions.create(model="ttft-opt", messages=MESSAGES, user="u-1", max_tokens=3)
    assert reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        gw.client(key="sk-not-a-listed-key-000000").chat.completions.create(
            model="ttft-opt", messages=MESSAGES, max_tokens=2
        )
    assert gw.recorder.wait_for(1)[0]["result"].outcome.value == "ok"
    warnings = [r for r in caplog.records if "gateway metric update failed" in r.getMessage()]
    assert len(warnings) == 1  # the first failure is logged, not every one
