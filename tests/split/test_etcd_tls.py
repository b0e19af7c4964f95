"""The etcd weights store against an etcd of our own that demands TLS client certificates and
a user and password: everything works with the right credentials, and
each wrong one fails at once with an error that says which.

The etcd is started here, on free ports, from the same Debian ``etcd`` the project's
scripts/etcd.sh runs (installed by it when missing); certificates come from tests/pki.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.weights.document import build_document
from experiments.weights.errors import ConflictError, StoreAuthError, StoreUnavailable, WatchCompacted
from experiments.weights.etcd import EtcdWeightsStore
from experiments.weights.factory import store_from_config
from experiments.weights.router import Router
from tests.pki import EtcdPKI, make_etcd_pki

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/abplat-tls/experiments/"  # the abplat user's role may read and write here only
ROOT_PASSWORD = "root-secret"
PASSWORD = "abplat-secret"


def _binaries() -> tuple[str, str]:
    """etcd and etcdctl; scripts/etcd.sh installs them when missing. Never a skip: in CI a
    missing etcd is a failure."""
    if not (shutil.which("etcd") and shutil.which("etcdctl")):
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "etcd.sh"), "install"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.fail(f"etcd is not installed and scripts/etcd.sh install failed:\n{done.stderr}")
    etcd, etcdctl = shutil.which("etcd"), shutil.which("etcdctl")
    if not (etcd and etcdctl):
        pytest.fail("etcd/etcdctl not on PATH after scripts/etcd.sh install")
    return etcd, etcdctl


def _free_ports(n: int) -> list[int]:
    sockets = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class SecureEtcd:
    """One etcd: https client URL with --client-cert-auth, simple auth tokens, auth enabled
    with a root user and a user ``abplat`` whose role reads and writes PREFIX only."""

    def __init__(self, directory: Path, pki: EtcdPKI, token_ttl: int | None = None):
        self.etcd, self.etcdctl = _binaries()
        self.dir = directory
        self.pki = pki
        self.token_ttl = token_ttl
        self.port, self.peer_port = _free_ports(2)
        self.url = f"https://127.0.0.1:{self.port}"
        self.endpoints = f"127.0.0.1:{self.port}"
        self.log = directory / "etcd.log"
        self.process: subprocess.Popen | None = None
        # Our subprocesses must not see ETCD_* / ETCDCTL_* variables: etcd reads them as flags.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "ETCDCTL_"))}
        self.env["ETCDCTL_API"] = "3"

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.etcd,
            "--name=abplat-tls",
            f"--data-dir={self.dir / 'data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=abplat-tls={peer}",
            f"--cert-file={self.pki.server_cert}",
            f"--key-file={self.pki.server_key}",
            f"--trusted-ca-file={self.pki.ca}",
            "--client-cert-auth",
            "--auth-token=simple",
            "--log-level=warn",
        ]
        if self.token_ttl is not None:
            args.append(f"--auth-token-ttl={self.token_ttl}")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=self.env
            )
        deadline = time.monotonic() + 20
        while self.ctl("endpoint", "health", user=None, check=False).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                pytest.fail(f"the TLS etcd on {self.url} did not become healthy; its log:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def ctl(self, *args: str, user: str | None = f"root:{ROOT_PASSWORD}", check: bool = True):
        command = [
            self.etcdctl,
            f"--endpoints={self.url}",
            f"--cacert={self.pki.ca}",
            f"--cert={self.pki.client_cert}",
            f"--key={self.pki.client_key}",
            "--dial-timeout=2s",
            "--command-timeout=5s",
        ]
        if user:
            command.append(f"--user={user}")
        done = subprocess.run([*command, *args], capture_output=True, text=True, env=self.env, timeout=30)
        if check and done.returncode != 0:
            pytest.fail(f"etcdctl {' '.join(args)} failed ({done.returncode}): {done.stderr}")
        return done

    def enable_auth(self) -> None:
        self.ctl("user", "add", f"root:{ROOT_PASSWORD}", "--interactive=false", user=None)
        self.ctl("role", "add", "root", user=None)
        self.ctl("user", "grant-role", "root", "root", user=None)
        self.ctl("role", "add", "abplat-weights", user=None)
        self.ctl(
            "role", "grant-permission", "abplat-weights", "--prefix=true", "readwrite", PREFIX, user=None
        )
        self.ctl("user", "add", f"abplat:{PASSWORD}", "--interactive=false", user=None)
        self.ctl("user", "grant-role", "abplat", "abplat-weights", user=None)
        self.ctl("auth", "enable", user=None)
        # From here on, a request without a valid user is refused.
        assert "permission denied" in self.ctl("get", PREFIX, user=None, check=False).stderr


def _secure_etcd(directory: Path, token_ttl: int | None = None) -> SecureEtcd:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pki").mkdir(exist_ok=True)
    etcd = SecureEtcd(directory, make_etcd_pki(directory / "pki"), token_ttl=token_ttl)
    etcd.start()
    try:
        etcd.enable_auth()
    except BaseException:
        etcd.stop()
        raise
    return etcd


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory) -> Iterator[SecureEtcd]:
    etcd = _secure_etcd(tmp_path_factory.mktemp("secure-etcd"))
    yield etcd
    etcd.stop()


@pytest.fixture
def short_token_etcd(tmp_path) -> Iterator[SecureEtcd]:
    """Its own etcd whose simple tokens die after 2 idle seconds."""
    etcd = _secure_etcd(tmp_path / "etcd", token_ttl=2)
    yield etcd
    etcd.stop()


@pytest.fixture
def open_store(request) -> Iterator:
    """open_store(etcd, **overrides) -> the store as the factory builds it from the settings
    values: TLS with the client certificate, user abplat; each override replaces one."""
    stores: list[EtcdWeightsStore] = []

    def open_(etcd: SecureEtcd, prefix: str = PREFIX, **overrides: str) -> EtcdWeightsStore:
        config = {
            "ca_cert": etcd.pki.ca,
            "cert": etcd.pki.client_cert,
            "key": etcd.pki.client_key,
            "user": "abplat",
            "password": PASSWORD,
            **overrides,
        }
        store = store_from_config(etcd.endpoints, prefix, "/nonexistent", **config)
        assert isinstance(store, EtcdWeightsStore)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close()


@pytest.fixture
def clean_prefix(secure_etcd) -> Iterator[None]:
    yield
    secure_etcd.ctl("del", "--prefix", PREFIX)


def doc(weights=None, previous=None, reason="start"):
    return build_document(
        "ttft-opt",
        weights or {"fp16": 50, "awq": 50},
        salt="salt-1",
        control="fp16",
        actor="sam",
        reason=reason,
        previous=previous,
    )


def _wait_until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout} s waiting for: {what}")
        time.sleep(0.01)


# With the right credentials everything works ---------------------------------------------------


def test_tls_and_password_publish_read_and_compare_and_set(secure_etcd, open_store, clean_prefix):
    store = open_store(secure_etcd)
    assert store.tls and store.user == "abplat"
    assert store.description.startswith(f"etcd https://127.0.0.1:{secure_etcd.port} prefix")
    first = doc()
    r1 = store.put("ttft-opt", first, expected_revision=0)
    assert store.get("ttft-opt") == (first, r1)
    with pytest.raises(ConflictError):
        store.put("ttft-opt", doc(reason="second create"), 0)
    second = doc({"fp16": 90, "awq": 10}, previous=first, reason="ramp")
    r2 = store.put("ttft-opt", second, r1)
    with pytest.raises(ConflictError, match=f"expected revision {r1}, but it is now at revision {r2}"):
        store.put("ttft-opt", doc({"fp16": 10, "awq": 90}, previous=first), r1)
    # Another client (its own token) sees the same, and etcdctl as root agrees.
    assert open_store(secure_etcd).get("ttft-opt") == (second, r2)
    assert '"fp16":90' in secure_etcd.ctl("get", PREFIX + "ttft-opt", "--print-value-only").stdout
    assert set(store.list_all()) == {"ttft-opt"}
    store.delete("ttft-opt")
    assert store.get("ttft-opt") is None


def test_a_router_hot_reloads_over_tls_with_a_token(secure_etcd, open_store, clean_prefix):
    writer = open_store(secure_etcd)
    first = doc()
    revision = writer.put("ttft-opt", first, 0)
    router = Router(open_store(secure_etcd))
    try:
        assert router.start(wait=10)
        assert router.assign("ttft-opt", "u").revision == revision
        changed = writer.put("ttft-opt", doc({"fp16": 10, "awq": 90}, previous=first), revision)
        _wait_until(lambda: router.assign("ttft-opt", "u").revision == changed, "the watched change")
        assert router.metrics["watch_errors"] == 0
    finally:
        router.stop()


def test_the_settings_reach_the_process_store(secure_etcd, settings, clean_prefix):
    from experiments.weights import process

    settings.ETCD_ENDPOINTS = secure_etcd.endpoints
    settings.ETCD_PREFIX = PREFIX
    settings.ETCD_CA_CERT = secure_etcd.pki.ca
    settings.ETCD_CERT = secure_etcd.pki.client_cert
    settings.ETCD_KEY = secure_etcd.pki.client_key
    settings.ETCD_USER = "abplat"
    settings.ETCD_PASSWORD = PASSWORD
    process.reset_for_tests()
    try:
        store = process.weights_store()
        assert isinstance(store, EtcdWeightsStore) and store.tls and store.user == "abplat"
        revision = store.put("ttft-opt", doc(), 0)
        assert process.live_router(wait=10).assign("ttft-opt", "u").revision == revision
    finally:
        process.reset_for_tests()


def test_a_watch_from_a_compacted_revision_still_says_so(secure_etcd, open_store, clean_prefix):
    store = open_store(secure_etcd)
    first = store.put("ttft-opt", doc(), 0)
    last = store.put("ttft-opt", doc({"fp16": 1, "awq": 99}), first)
    secure_etcd.ctl("compact", str(last))
    with pytest.raises(WatchCompacted) as info:
        for _ in store.watch(first, threading.Event()):
            pass
    assert info.value.compacted_revision == last


# Each wrong credential fails at once, saying which ---------------------------------------------


def test_without_a_client_certificate_etcd_refuses_the_connection(secure_etcd, open_store):
    store = open_store(secure_etcd, cert="", key="")
    with pytest.raises(StoreUnavailable, match=r"list failed after 3 tries: .*\(TLS failed: "):
        store.list_raw()


def test_a_client_certificate_from_another_ca_is_refused(secure_etcd, open_store):
    store = open_store(secure_etcd, cert=secure_etcd.pki.stranger_cert, key=secure_etcd.pki.stranger_key)
    with pytest.raises(StoreUnavailable, match=r"\(TLS failed: "):
        store.get_raw("ttft-opt")


def test_plain_grpc_to_a_tls_etcd_fails_and_says_it_may_expect_tls(secure_etcd):
    store = EtcdWeightsStore([("127.0.0.1", secure_etcd.port)], prefix=PREFIX)
    try:
        with pytest.raises(StoreUnavailable, match="does it expect TLS"):
            store.list_raw()
    finally:
        store.close()


def test_a_wrong_password_is_an_authentication_error_without_retries(secure_etcd, open_store, monkeypatch):
    store = open_store(secure_etcd, password="not-the-password")
    attempts = []
    authenticate = store._authenticate
    monkeypatch.setattr(store, "_authenticate", lambda *a: attempts.append(a) or authenticate(*a))
    with pytest.raises(
        StoreAuthError, match="authentication as 'abplat' failed: .*invalid user ID or password"
    ) as info:
        store.list_raw()
    assert len(attempts) == 1  # raised at once: retrying cannot help
    assert "not-the-password" not in str(info.value)
    with pytest.raises(StoreAuthError, match="authentication as 'abplat' failed"):
        store.put("ttft-opt", doc(), 0)
    with pytest.raises(StoreAuthError, match="authentication as 'abplat' failed"):
        next(iter(store.watch(1, threading.Event())))


def test_a_certificate_without_a_user_is_refused_naming_the_missing_user(secure_etcd, open_store):
    store = open_store(secure_etcd, user="", password="")
    with pytest.raises(StoreAuthError, match="permission denied; a client without a user"):
        store.list_raw()
    with pytest.raises(StoreAuthError, match="permission denied; a client without a user"):
        next(iter(store.watch(1, threading.Event())))


def test_a_prefix_outside_the_users_role_is_refused_naming_the_prefix(secure_etcd, open_store):
    store = open_store(secure_etcd, prefix="/somewhere-else/")
    with pytest.raises(
        StoreAuthError, match="user 'abplat' needs a role with readwrite on the prefix '/somewhere-else/'"
    ):
        store.put("ttft-opt", doc(), 0)
    with pytest.raises(
        StoreAuthError, match="needs a role with read access to the prefix '/somewhere-else/'"
    ):
        next(iter(store.watch(1, threading.Event())))


def test_a_user_for_an_etcd_with_auth_off_works_and_warns(etcd_endpoints, caplog):
    # The order etcd's docs give: users first, clients with credentials, then `auth enable`.
    host, port = etcd_endpoints[0]
    store = store_from_config(f"{host}:{port}", "/abplat-test/auth-off/", "/x", user="abplat", password="pw")
    try:
        with caplog.at_level(logging.WARNING, logger="experiments.weights.etcd"):
            assert store.list_raw().values == {}
        assert "etcd has authentication disabled, so the user and password protect nothing" in caplog.text
    finally:
        store.close()


# Tokens die; the store gets a new one --------------------------------------------------------


def test_an_expired_token_is_renewed_for_reads_writes_and_watches(short_token_etcd, open_store):
    etcd = short_token_etcd
    store = open_store(etcd)
    first = doc()
    revision = store.put("ttft-opt", first, 0)
    assert store.authentications == 1
    time.sleep(etcd.token_ttl + 2)  # idle past the TTL: etcd forgets the token
    assert store.get("ttft-opt") == (first, revision)  # "invalid auth token", renewed, repeated
    assert store.authentications == 2
    time.sleep(etcd.token_ttl + 2)
    revision = store.put("ttft-opt", doc({"fp16": 1, "awq": 99}, previous=first), revision)
    assert store.authentications == 3
    time.sleep(etcd.token_ttl + 2)
    # A watch registered with a dead token: etcd cancels it at once; we renew and register again.
    batches = store.watch(1, threading.Event())
    assert next(batches) == []
    assert store.authentications == 4
    events = []
    while not events:
        events = next(batches)
    assert events[0].key == "ttft-opt"


def test_a_router_rides_out_token_expiry_and_an_etcd_restart(short_token_etcd, open_store):
    etcd = short_token_etcd
    writer, watched = open_store(etcd), open_store(etcd)
    current = doc()
    revision = writer.put("ttft-opt", current, 0)
    router = Router(watched, backoff_max=0.2)
    try:
        assert router.start(wait=10)
        # 1. The open watch outlives its token: etcd checks it when the watch is created.
        time.sleep(etcd.token_ttl + 2)
        current = doc({"fp16": 20, "awq": 80}, previous=current, reason="after expiry")
        revision = writer.put("ttft-opt", current, revision)
        _wait_until(lambda: router.assign("ttft-opt", "u").revision == revision, "change after expiry")
        assert router.metrics["watch_errors"] == 0
        # 2. A restart drops the watch and every simple token; the router's new watch needs a
        # new token, and the change made meanwhile still arrives.
        etcd.restart()
        current = doc({"fp16": 30, "awq": 70}, previous=current, reason="after restart")
        revision = writer.put("ttft-opt", current, revision)
        _wait_until(lambda: router.assign("ttft-opt", "u").revision == revision, "change after restart")
        assert watched.authentications >= 2
    finally:
        router.stop()
