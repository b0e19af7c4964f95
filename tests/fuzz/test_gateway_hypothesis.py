"""Hypothesis at the gateway's front door, in-process (the ASGI app called directly, no server):
whatever path, headers and body a client sends, the answer is never a 500, an error names what
was wrong, and a failure behind the gateway tells the client the request id, never the host,
port or secret name behind it.

The variant is a port nothing listens on, so every request that passes the checks ends in the
gateway's own 502: the one 5xx allowed, with its generic message.
"""

from __future__ import annotations

import asyncio
import json
from types import MappingProxyType, SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.limits import parse_keys
from gateway.routing import parse_reach, parse_routes
from gateway.upstream import Endpoint
from gateway.variants import Directory, ExperimentTargets, Target
from tests.gateway.conftest import KEY, dead_port

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DEAD = dead_port()
SECRET_NAME = "vllm-secret-name"


class _Router:
    def assign(self, experiment: str, user_id: str):
        if experiment != "exp":
            raise LookupError(experiment)
        return SimpleNamespace(variant="cand" if hash(user_id) % 2 else "ctl", revision=3)


class _Recorder:
    def __init__(self) -> None:
        self.records: list = []

    def start(self) -> None: ...

    def record(self, result, **fields) -> None:
        self.records.append((result, fields))

    def close(self, timeout: float = 10.0) -> None: ...


def _gateway() -> Gateway:
    endpoint = Endpoint.parse(f"http://127.0.0.1:{DEAD}/v1")
    variants = {
        "ctl": Target("exp", "ctl", True, endpoint, "m", MappingProxyType({})),
        # a variant whose secret cannot be sent: the error names the secret, for the operator
        "cand": Target(
            "exp",
            "cand",
            False,
            endpoint,
            "m",
            MappingProxyType({}),
            error=f"secret {SECRET_NAME!r} is not bound to host '127.0.0.1'",
        ),
    }
    targets = {"exp": ExperimentTargets("exp", "running", "ctl", MappingProxyType(variants), team="t")}
    config = GatewayConfig(
        keys=parse_keys(f"acme {KEY}\n"),
        routes=parse_routes(["alias=exp", "/team=exp"]),
        reach=parse_reach(["acme=team:t"]),
        retry_on_control=frozenset({"exp"}),
        user_rate=1000,
        tenant_rate=1000,
        tenant_burst=1000,
        tenant_streams=8,
        body_timeout_s=5,
    )
    return Gateway(
        config, router=_Router(), directory=Directory(targets), recorder=_Recorder(), refresh_variants=False
    )


GATEWAY = _gateway()


async def _call(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, bytes]:
    sent: list[dict] = []
    done = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await done.wait()  # the client stays until the response has ended
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    await asyncio.wait_for(GATEWAY(scope, receive, send), 10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["exp", "alias", "nope", "", "exp\x00"])
        | st.text(max_size=10)
        | json_values,
        "messages": st.just([{"role": "user", "content": "hi"}]) | json_values,
        "user": st.text(max_size=12) | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-2, 10) | json_values,
        "x": json_values,
    },
)
raw_bodies = st.one_of(
    bodies.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=64),
    st.integers(1, 5000).map(lambda n: b'{"model":"exp","x":' + b"[" * n + b"]" * n + b"}"),
)
paths = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/team/v1/chat/completions",
        "/v1/models",
        "/healthz",
        "/v1/embeddings",
        "/team/v1/models",
        "/../v1/completions",
    ]
)
auths = st.sampled_from([f"Bearer {KEY}".encode(), b"Bearer sk-wrong-key-000000000000", b"", b"Basic x"])


def _check(status: int, text: bytes) -> None:
    assert status != 500, text
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], text
    if status >= 500:  # only the gateway's own answer for a variant it could not reach
        assert status in (502, 503), text
        assert str(DEAD) not in text.decode() and SECRET_NAME not in text.decode(), text
        assert "request id gw-" in text.decode(), text


@FUZZ
@given(
    method=st.sampled_from(["POST", "GET", "PUT"]),
    path=paths,
    auth=auths,
    body=raw_bodies,
    length=st.sampled_from([None, "abc", "-1", "99999999999"]),
)
def test_no_request_is_a_500_whatever_its_method_path_key_and_length(method, path, auth, body, length):
    headers = [(b"authorization", auth), (b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", length.encode()))
    _check(*asyncio.run(_call(method, path, headers, body)))


routable = st.fixed_dictionaries(
    {"model": st.sampled_from(["exp", "alias"]), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={
        "user": st.text(max_size=12),
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 10),
        "x": json_values,
    },
).map(lambda b: json.dumps(b).encode())


@FUZZ
@given(
    body=st.one_of(raw_bodies, routable),
    path=st.sampled_from(["/v1/chat/completions", "/team/v1/completions"]),
)
def test_an_authenticated_request_is_never_a_500_and_a_variant_failure_hides_the_internals(body, path):
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    _check(*asyncio.run(_call("POST", path, headers, body)))
