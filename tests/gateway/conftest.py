"""Fixtures of the gateway tests: the gateway in-process (uvicorn in a thread) against the
simulators, a fake recorder, and etcd for the weight-change tests."""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from experiments import services
from experiments.weights import process
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.limits import parse_keys
from gateway.variants import Directory
from streaming.egress import parse_allowlist

KEY = "sk-test-acme-0123456789abcdef"
OTHER_KEY = "sk-test-beta-0123456789abcdef"
ETCD = ("127.0.0.1", 12379)


class FakeRecorder:
    """Keeps what the gateway hands over (gateway/recording.py's LiveRecorder interface)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.shadows: list[dict] = []  # record_shadow's rows (gateway/shadow.py)
        self.started = self.closed = False
        self._lock = threading.Lock()
        self._shadowed = threading.Condition(self._lock)

    def start(self) -> None:
        self.started = True

    def record(self, result, **fields) -> None:
        with self._lock:
            self.records.append({"result": result, **fields})

    def record_shadow(self, row: dict) -> None:
        with self._shadowed:
            self.shadows.append(row)
            self._shadowed.notify_all()

    def wait_shadows(self, n: int, timeout: float = 10.0) -> list[dict]:
        """The shadow rows once there are at least n (a shadow ends after its request's response);
        woken by record_shadow, no polling."""
        with self._shadowed:
            if not self._shadowed.wait_for(lambda: len(self.shadows) >= n, timeout):
                raise AssertionError(f"timed out waiting for {n} shadow rows, got {len(self.shadows)}")
            return list(self.shadows)

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict]:
        """The records once there are n (the gateway records after the response ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.records) >= n:
                    return list(self.records)
            time.sleep(0.01)
        return list(self.records)


class Served:
    def __init__(self, gateway: Gateway, recorder: FakeRecorder, url: str) -> None:
        self.gateway = gateway
        self.recorder = recorder
        self.url = url

    def client(self, key: str | None = KEY, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kwargs)


def serve(gateway: Gateway, config=None) -> tuple[str, callable]:
    """uvicorn serving ``gateway`` (or ``config``, a uvicorn.Config of any app) in a thread."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = config or uvicorn.Config(
        gateway,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        server_header=False,
        date_header=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture
def make_gateway():
    """make_gateway(**config overrides) -> Served: a gateway on this process's router, with
    the variants read now (in the test's own database transaction)."""
    stops = []

    def make(ssl_context=None, **overrides) -> Served:
        overrides.setdefault("keys", parse_keys(f"acme {KEY}\nbeta {OTHER_KEY}\n"))
        config = GatewayConfig(**overrides)
        directory = Directory(default_experiment=config.routes.default_experiment)
        directory.refresh()
        recorder = FakeRecorder()
        gateway = Gateway(
            config,
            router=process.live_router(),
            directory=directory,
            recorder=recorder,
            allow=parse_allowlist(["127.0.0.0/8"]),
            refresh_variants=False,
            ssl_context=ssl_context,
        )
        url, stop = serve(gateway)
        stops.append(stop)
        return Served(gateway, recorder, url)

    yield make
    for stop in stops:
        stop()


def dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def etcd_weights(settings) -> Iterator[None]:
    """The weights store on the test etcd under a fresh prefix (request before `running`)."""
    from tests.split.conftest import etcd_answers

    if not etcd_answers([ETCD]):
        pytest.fail(f"etcd is not reachable at {ETCD[0]}:{ETCD[1]}; start it with scripts/etcd.sh start")
    settings.ETCD_ENDPOINTS = [ETCD]
    settings.ETCD_PREFIX = f"/abplat-test/gateway-{uuid.uuid4().hex[:8]}/"
    process.reset_for_tests()
    yield
    process.reset_for_tests()


@pytest.fixture
def running_with(db, document, sims, users):
    """running_with(mutate) -> the started experiment of the test document after mutate(doc)."""

    def make(mutate=None):
        doc = copy.deepcopy(document)
        for v in doc["variants"]:
            v["endpoint"] = sims[v["key"]].url + "/v1"
            v["api"] = "chat"
        if mutate is not None:
            mutate(doc)
        experiment = services.apply_document(doc, actor=users["product"]).experiment
        services.transition(experiment, "start", users["product"])
        return experiment

    return make


def user_on(router, experiment: str, variant: str, start: int = 0) -> str:
    for i in range(start, start + 10_000):
        user = f"user-{i}"
        if router.assign(experiment, user).variant == variant:
            return user
    raise AssertionError(f"no user on {variant}")
