"""pytest plugin loaded first (pyproject.toml: -p tests.plugin): a private ABPLAT_VAR per test
process, so tests never touch the developer's var/ (SQLite file, chDB, spool, weights) nor each
other's when pytest-xdist runs them in several processes; the production settings (DEBUG off)
with a secret key generated for the session."""

import os
import secrets
import socket
import tempfile
import threading
import urllib.parse

import pytest

# A developer's development settings file (.env, `make dev-env`: debug on, say) must not change
# what the tests see: this session and the processes it starts read none (abplat/env.py).
# Helpers that start a process without this session's ABPLAT_* settings keep this one
# (tests/cli.py, own_env).
os.environ["ABPLAT_ENV_FILE"] = ""

# pytest-xdist's worker id ("gw0", "gw1", ...) in a worker process, "" otherwise. Workers
# inherit the controller's environment, so what must not be shared is derived per worker here,
# before Django or any test module reads it: the var directory (chDB allows one process per data
# directory; the SQLite file, spool and weights are the process' own) and the Redis database
# (tests empty theirs with FLUSHDB). PostgreSQL test databases get the suffix from pytest-django,
# ClickHouse databases carry a unique name per test or per worker (tests/conftest.py).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
XDIST_INDEX = int(XDIST_WORKER.removeprefix("gw") or 0)  # offsets fixed ports per worker
if "ABPLAT_VAR" not in os.environ:
    os.environ["ABPLAT_VAR"] = tempfile.mkdtemp(prefix="abplat-test-")
if XDIST_WORKER:
    os.environ["ABPLAT_VAR"] = os.path.join(os.environ["ABPLAT_VAR"], XDIST_WORKER)
    os.makedirs(os.environ["ABPLAT_VAR"], exist_ok=True)
    _redis = urllib.parse.urlsplit(os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"))
    _db = int(_redis.path.strip("/") or 0) - XDIST_INDEX
    if _db < 0:
        raise pytest.UsageError(
            f"ABPLAT_TEST_REDIS_URL: no Redis database left for xdist worker {XDIST_WORKER}"
        )
    os.environ["ABPLAT_TEST_REDIS_URL"] = urllib.parse.urlunsplit(_redis._replace(path=f"/{_db}"))

# Tests run as production does, DEBUG off, so they need a key: one for this session, which the
# subprocesses they start inherit (tests.workers.background.manage passes it on explicitly).
# Plain HTTP on loopback: no redirect to HTTPS, cookies sent without TLS.
TEST_SECRET_KEY = os.environ.setdefault("ABPLAT_SECRET_KEY", "test-" + secrets.token_urlsafe(48))
os.environ.setdefault("ABPLAT_SSL_REDIRECT", "false")
os.environ.setdefault("ABPLAT_SECURE_COOKIES", "false")
# Static files as named (no collectstatic before the suite): the manifest storage of production
# is tested with a real server in tests/foundation/test_production_server.py.
os.environ.setdefault("ABPLAT_STATIC_STORAGE", "plain")
# WhiteNoise warns about a missing STATIC_ROOT on every request handler it starts.
os.makedirs(
    os.environ.get("ABPLAT_STATIC_ROOT") or os.path.join(os.environ["ABPLAT_VAR"], "static"), exist_ok=True
)

SERVER_URL = os.environ.get("ABPLAT_TEST_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_test")


def server_url_for(database: str, url: str = SERVER_URL) -> str:
    """The test ClickHouse server URL with another database."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + database))


class FlakyProxy:
    """A TCP proxy to the ClickHouse server that can be switched off and on: "the store went
    down and came back" for one backend object, without stopping the shared server."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            if self._listener is not None:
                # shutdown() wakes the thread blocked in accept(); close() alone would not, and
                # the kernel would keep accepting on the "closed" socket.
                try:
                    self._listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._listener.close()
                self._listener = None
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(autouse=True)
def _fresh_request_rates():
    """Rate counters (abplat.api) start at zero in every test: a user id reused by the next
    test must not inherit this one's requests."""
    yield
    from django.core.cache import caches

    caches["throttle"].clear()


# ---- marks derived from what a test uses, and the in-process inner loop (`make test-fast`) ----
# A test that takes one of these fixtures, or runs with one of these parameters (a store "kind"),
# reaches a real service started by `make services`: it is marked `services`.
SERVICE_FIXTURES = frozenset(
    {
        "clickhouse_server",
        "etcd_endpoints",
        "etcd_store",
        "private_etcd",
        "etcd_weights",
        "broker_env",
        "flaky_server",
        "cluster_urls",
    }
)
SERVICE_PARAMS = frozenset({"server", "etcd"})

# `make test-fast` sets ABPLAT_TEST_FAST=1 and deselects the tests marked services, process, slow,
# vllm and browser. What a selected test does is checked, not trusted to its marks: connecting to a
# service's port or starting a child process fails the test, naming the mark it lacks, so the
# inner loop stays in-process and runs on a machine with no service installed.
FAST = os.environ.get("ABPLAT_TEST_FAST", "") not in ("", "0")


def _service_ports() -> frozenset[int]:
    urls = [
        os.environ.get("TEST_POSTGRES_URL", "postgres://127.0.0.1:5432/x"),
        os.environ.get("ABPLAT_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
        SERVER_URL,
        *os.environ.get("ABPLAT_TEST_CLICKHOUSE_CLUSTER_URLS", "").split(","),
        *("etcd://" + e for e in os.environ.get("ABPLAT_TEST_ETCD_ENDPOINTS", "127.0.0.1:12379").split(",")),
        "amqp://127.0.0.1:5672",
    ]
    return frozenset(p for u in urls if u.strip() and (p := urllib.parse.urlsplit(u.strip()).port))


# The PostgreSQL pass (make test) runs the engine-marked tests once, with the stores production
# pairs PostgreSQL with (the ClickHouse server, etcd): their embedded twins (chDB, the local
# weights store) behave the same whatever the Django database is, and run in the SQLite pass.
EMBEDDED_PARAMS = frozenset({"chdb", "local"})
# Tests that start processes, servers or threads against the database last longest: a test file
# holding one is handed to a pytest-xdist process first, so no long file starts last.
LONG_MARKS = ("process", "vllm", "browser", "services")


def _transactional(item) -> bool:
    """A test whose database is really committed (threads, tasks or servers use it beside the test)."""
    marker = item.get_closest_marker("django_db")
    return bool(
        {"transactional_db", "live_server"} & set(getattr(item, "fixturenames", ()))
        or (marker is not None and marker.kwargs.get("transaction"))
    )


def _on_postgresql() -> bool:
    return os.environ.get("ABPLAT_DATABASE_URL", "").startswith(("postgres:", "postgresql:", "pgsql:"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if SERVICE_FIXTURES & set(getattr(item, "fixturenames", ())) or any(
            isinstance(v, str) and v in SERVICE_PARAMS for v in params.values()
        ):
            item.add_marker(pytest.mark.services)
        if _transactional(item):
            item.add_marker(pytest.mark.slow)  # replays, searches, tasks in threads: seconds each
    if _on_postgresql():
        embedded = [
            item
            for item in items
            if any(
                isinstance(v, str) and v in EMBEDDED_PARAMS
                for v in getattr(getattr(item, "callspec", None), "params", {}).values()
            )
        ]
        if embedded:
            config.hook.pytest_deselected(items=embedded)
            dropped = set(map(id, embedded))
            items[:] = [item for item in items if id(item) not in dropped]
    long_files = {
        item.path
        for item in items
        if _transactional(item) or any(item.get_closest_marker(m) for m in LONG_MARKS)
    }
    items.sort(key=lambda item: item.path not in long_files)  # stable: file order kept otherwise


if FAST:
    import subprocess

    _SERVICE_PORTS = _service_ports()
    _connect = socket.socket.connect
    _connect_ex = socket.socket.connect_ex
    _popen_init = subprocess.Popen.__init__

    def _check_address(address) -> None:
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in _SERVICE_PORTS:
            raise pytest.fail.Exception(
                f"make test-fast: this test connects to a service at {address[0]}:{address[1]}; "
                "mark it services (pytest.mark.services) or give it an in-process stand-in"
            )

    def _guarded_connect(self, address):
        _check_address(address)
        return _connect(self, address)

    def _guarded_connect_ex(self, address):
        _check_address(address)
        return _connect_ex(self, address)

    def _guarded_popen(self, args, *rest, **kw):
        raise pytest.fail.Exception(
            f"make test-fast: this test starts a process ({args!r:.120}); mark it process "
            "(pytest.mark.process) or call the code in-process"
        )

    @pytest.fixture(autouse=True)
    def _in_process_only():
        socket.socket.connect, socket.socket.connect_ex = _guarded_connect, _guarded_connect_ex
        subprocess.Popen.__init__ = _guarded_popen
        try:
            yield
        finally:
            socket.socket.connect, socket.socket.connect_ex = _connect, _connect_ex
            subprocess.Popen.__init__ = _popen_init
