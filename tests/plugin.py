"""pytest plugin loaded first (pyproject.toml: -p tests.plugin): a private ABPLAT_VAR per test
session, so tests never touch the developer's var/ (SQLite file, chDB, spool, weights); the
production settings (DEBUG off) with a secret key generated for the session."""

import os
import secrets
import socket
import tempfile
import threading
import urllib.parse

import pytest

if "ABPLAT_VAR" not in os.environ:
    os.environ["ABPLAT_VAR"] = tempfile.mkdtemp(prefix="abplat-test-")

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
