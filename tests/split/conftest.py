"""Fixtures for the traffic-split tests: a real etcd (scripts/etcd.sh), both weights stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from experiments.weights import process
from experiments.weights.errors import StoreUnavailable
from experiments.weights.factory import parse_endpoints
from experiments.weights.local import LocalWeightsStore
from experiments.weights.store import WeightsStore
from tests.plugin import XDIST_INDEX

ROOT = Path(__file__).resolve().parents[2]
ETCD_SH = ROOT / "scripts" / "etcd.sh"
TEST_ETCD = os.environ.get("ABPLAT_TEST_ETCD_ENDPOINTS", "127.0.0.1:12379")


def etcd_answers(endpoints: list[tuple[str, int]]) -> bool:
    from experiments.weights.etcd import EtcdWeightsStore

    store = EtcdWeightsStore(endpoints, prefix="/abplat-test/probe/", timeout=1.0)
    try:
        store.list_raw()
        return True
    except StoreUnavailable:
        return False
    finally:
        store.close()


def run_etcd_sh(action: str, client_port: int, var_dir: Path | None = None) -> None:
    env = {
        **os.environ,
        "ABPLAT_ETCD_CLIENT_PORT": str(client_port),
        "ABPLAT_ETCD_PEER_PORT": str(client_port + 1),
    }
    if var_dir is not None:
        env["ABPLAT_VAR"] = str(var_dir)
    done = subprocess.run(
        ["bash", str(ETCD_SH), action], env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        pytest.fail(
            f"scripts/etcd.sh {action} (client port {client_port}) failed with exit "
            f"{done.returncode}:\n{done.stdout}\n{done.stderr}"
        )


@pytest.fixture(scope="session")
def etcd_endpoints() -> Iterator[list[tuple[str, int]]]:
    """The shared test etcd (ABPLAT_TEST_ETCD_ENDPOINTS, default 127.0.0.1:12379); started with
    scripts/etcd.sh when it is a loopback address that does not answer."""
    endpoints = parse_endpoints(TEST_ETCD, "ABPLAT_TEST_ETCD_ENDPOINTS")
    started = False
    if not etcd_answers(endpoints):
        host, port = endpoints[0]
        if host not in ("127.0.0.1", "localhost"):
            pytest.fail(
                f"etcd is not reachable at {TEST_ETCD} (ABPLAT_TEST_ETCD_ENDPOINTS); start it, "
                f"e.g. with scripts/etcd.sh start"
            )
        run_etcd_sh("start", port)
        started = True
        if not etcd_answers(endpoints):
            pytest.fail(f"scripts/etcd.sh start ran but etcd does not answer at {TEST_ETCD}")
    yield endpoints
    if started:
        run_etcd_sh("stop", endpoints[0][1])


# Client port of the private etcd (its peer port is the next): one per pytest-xdist worker, so
# two workers' outage tests never share one.
PRIVATE_ETCD_PORT = 12479 + 10 * XDIST_INDEX


@pytest.fixture
def private_etcd(tmp_path) -> Iterator[SimpleNamespace]:
    """A second etcd of our own (client 12479, data under tmp_path) started, stopped and
    restarted through scripts/etcd.sh, so an outage disturbs no other test."""
    from experiments.weights.etcd import EtcdWeightsStore

    var = tmp_path / "var"
    port = PRIVATE_ETCD_PORT
    run_etcd_sh("start", port, var)
    clients: list[EtcdWeightsStore] = []

    def new_client() -> EtcdWeightsStore:
        client = EtcdWeightsStore([("127.0.0.1", port)], prefix="/abplat-test/private/")
        clients.append(client)
        return client

    ctl = SimpleNamespace(
        store=new_client(),
        new_client=new_client,
        start=lambda: run_etcd_sh("start", port, var),
        stop=lambda: run_etcd_sh("stop", port, var),
        restart=lambda: run_etcd_sh("restart", port, var),
    )
    yield ctl
    for client in clients:
        client.close()
    run_etcd_sh("stop", port, var)


@pytest.fixture
def etcd_prefix() -> str:
    return f"/abplat-test/{uuid.uuid4().hex}/"


@pytest.fixture
def etcd_store(etcd_endpoints, etcd_prefix) -> Iterator[WeightsStore]:
    from experiments.weights.etcd import EtcdWeightsStore

    store = EtcdWeightsStore(etcd_endpoints, prefix=etcd_prefix)
    yield store
    for key in list(store.list_raw().values):
        store.delete(key)
    store.close()


@pytest.fixture
def local_store(tmp_path) -> LocalWeightsStore:
    return LocalWeightsStore(tmp_path / "weights")


@pytest.fixture(params=["local", "etcd"])
def store_kind(request) -> str:
    return request.param


@pytest.fixture
def store(request, store_kind) -> WeightsStore:
    """Each store-interface test runs against both implementations."""
    return request.getfixturevalue(f"{store_kind}_store")


@pytest.fixture
def store_config(store, store_kind) -> dict:
    """How another process opens the same store (see spawn())."""
    if store_kind == "local":
        return {"kind": "local", "dir": str(store.directory)}
    return {"kind": "etcd", "endpoints": store.endpoints, "prefix": store.prefix}


# Prepended to code run in another process: open the store described by sys.argv[1] (JSON).
CHILD_PRELUDE = """
import json, sys
from experiments.weights.local import LocalWeightsStore
config = json.loads(sys.argv[1])
if config["kind"] == "local":
    store = LocalWeightsStore(config["dir"])
else:
    from experiments.weights.etcd import EtcdWeightsStore
    store = EtcdWeightsStore([tuple(e) for e in config["endpoints"]], prefix=config["prefix"])
"""


def _spawn(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + code, *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Run code in a fresh interpreter with ``store`` opened from the JSON config in argv[1];
    children still running at teardown are killed."""
    children: list[subprocess.Popen] = []

    def start(code: str, config: dict, *args: str) -> subprocess.Popen:
        child = _spawn(code, json.dumps(config), *args)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for: {what}")
        time.sleep(0.005)


@pytest.fixture
def wait_until() -> Callable[..., None]:
    """Poll for a condition; the bound only stops a broken test, it measures nothing."""
    return _wait_until


@pytest.fixture(params=["local", "etcd"])
def weights_backend(request, settings, tmp_path):
    """Point this process's weights store at a fresh local dir or a fresh etcd prefix."""
    if request.param == "etcd":
        settings.ETCD_ENDPOINTS = request.getfixturevalue("etcd_endpoints")
        settings.ETCD_PREFIX = f"/abplat-test/{uuid.uuid4().hex}/"
    else:
        settings.ETCD_ENDPOINTS = []
    settings.WEIGHTS_DIR = tmp_path / "weights"
    process.reset_for_tests()
    yield request.param
    process.reset_for_tests()
