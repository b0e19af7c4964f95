"""HTTP/2 (h2c prior knowledge and h2 over TLS) and HTTP/1.1 over TLS, measured end to end.

uvicorn speaks no HTTP/2, so the simulator's ASGI app is served here by hypercorn, behind a
private CA made per test session. A middleware records, per request id, the HTTP version and
the client address the server saw: the protocol and the connection actually used, not the ones
the client was configured for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import threading
import time

import httpx
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config

from simulator.serve import DEFAULT_MODEL, build_server
from streaming.client import Timeouts, VariantClient
from streaming.result import Outcome
from tests.pki import PKI

# --- the simulator on hypercorn ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Seen:
    http_version: str
    client: tuple[str, int]


class Recorder:
    """ASGI middleware: what the server saw of each request, keyed by its x-request-id."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: dict[str, Seen] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            rid = dict(scope["headers"]).get(b"x-request-id", b"").decode()
            self.seen[rid] = Seen(scope["http_version"], tuple(scope["client"]))
        await self.app(scope, receive, send)


@dataclasses.dataclass
class Server:
    url: str
    recorder: Recorder


def _hypercorn(pki: PKI | None):
    # The same app simulator.serve gives uvicorn (profile "fast", the default model).
    recorder = Recorder(build_server("fast").config.app)
    # Bound and listening before the thread starts: clients may connect at once, and the port
    # is never free for anyone else to take. hypercorn adopts the fd (it closes it).
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    if pki is not None:
        config.certfile, config.keyfile = pki.certfile, pki.keyfile
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(recorder, config, shutdown_trigger=stop.wait))
        loop.close()

    thread = threading.Thread(target=run, name=f"hypercorn-{port}", daemon=True)
    thread.start()
    url = f"{'https' if pki else 'http'}://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=pki.ca) if pki else False
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(url + "/health", verify=verify, trust_env=False, timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"hypercorn at {url} did not start")
        time.sleep(0.02)

    def stop_server() -> None:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)

    return Server(url, recorder), stop_server


@pytest.fixture(scope="module")
def plain():
    server, stop = _hypercorn(None)
    yield server
    stop()


@pytest.fixture(scope="module")
def tls(pki):
    server, stop = _hypercorn(pki)
    yield server
    stop()


@pytest.fixture
def servers(request):
    """Looks a server fixture up by name, so the protocol table can name which one."""
    return request.getfixturevalue


# name: (server fixture, http2, HTTP version the server must see)
PROTOCOLS = {
    "h2c": ("plain", True, "2"),
    "h2-tls": ("tls", True, "2"),
    "h1-tls": ("tls", False, "1.1"),
}


def _client(server: Server, pki: PKI, http2: bool, api: str = "chat", **kw) -> VariantClient:
    verify = kw.pop("verify", pki.ca if server.url.startswith("https") else True)
    return VariantClient(server.url + "/v1", DEFAULT_MODEL, api, http2=http2, verify=verify, **kw)


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("proto", sorted(PROTOCOLS))
def test_stream_is_measured_end_to_end_over_the_protocol_the_server_saw(proto, api, servers, pki):
    fixture, http2, version = PROTOCOLS[proto]
    server = servers(fixture)
    rid = f"{proto}-{api}"

    async def go():
        async with _client(server, pki, http2, api) as c:
            # HTTP/1.1 over TLS is measured on the core the plain-http replay and the gateway use
            assert c.transport == ("httpx" if http2 else "h1")
            return await c.stream(rid, "hello", 12)

    r = asyncio.run(go())
    assert r.outcome is Outcome.OK, r.error
    assert server.recorder.seen[rid].http_version == version
    assert r.http_status == 200 and r.new_connection and r.connect_ms is not None
    assert 0 < r.ttfb_ms <= r.first_byte_ms <= r.ttft_event_ms <= r.ttft_ms < r.e2e_ms
    assert r.output_tokens == 12 and r.usage_reported and r.finish_reason == "length"
    assert r.server_first_content_ns > r.start_ns
    assert r.start_ns + r.ttft_ms * 1e6 >= r.server_first_content_ns


@pytest.mark.parametrize("proto", ["h2c", "h2-tls"])
def test_concurrent_http2_streams_share_one_tcp_connection_and_keep_exact_records(proto, servers, pki):
    fixture, _, _ = PROTOCOLS[proto]
    server = servers(fixture)
    rids = [f"{proto}-mux-{i}" for i in range(32)]

    async def go():
        async with _client(server, pki, True) as c:
            return await asyncio.gather(*(c.stream(rid, "hi", 4 + i % 5) for i, rid in enumerate(rids)))

    rs = asyncio.run(go())
    assert all(r.outcome is Outcome.OK for r in rs), [r.error for r in rs if not r.ok]
    assert [r.request_id for r in rs] == rids
    assert [r.output_tokens for r in rs] == [4 + i % 5 for i in range(32)]
    for r in rs:
        assert r.start_ns + r.ttft_ms * 1e6 >= r.server_first_content_ns
    seen = [server.recorder.seen[rid] for rid in rids]
    assert {s.http_version for s in seen} == {"2"}
    assert len({s.client for s in seen}) == 1  # one client port: one TCP connection
    # Exactly one stream opened it, and only that one carries the handshake time.
    assert sum(r.new_connection for r in rs) == 1
    assert sum(r.connect_ms is not None for r in rs) == 1


@pytest.mark.parametrize("bundle", ["other_ca", "default"])
def test_tls_variant_whose_ca_is_not_trusted_fails_fast_as_a_connect_error(bundle, tls, pki, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    verify = pki.other_ca if bundle == "other_ca" else True  # True: the system store
    rid = f"untrusted-{bundle}"

    async def go():
        timeouts = Timeouts(connect_s=2, headers_s=5, total_s=10)
        async with _client(tls, pki, True, verify=verify, timeouts=timeouts) as c:
            return await c.stream(rid, "hi", 4)

    r = asyncio.run(go())
    assert r.outcome is Outcome.CONNECT_ERROR, (r.outcome, r.error)
    assert "CERTIFICATE_VERIFY_FAILED" in r.error and r.http_status == 0
    assert rid not in tls.recorder.seen  # the request never reached the app


@pytest.mark.parametrize("proto", ["h2-tls", "h1-tls"])
def test_verify_true_trusts_the_system_store_where_an_operator_installs_a_company_ca(
    proto, servers, pki, monkeypatch
):
    """SSL_CERT_FILE stands in for the host's store (OpenSSL's default paths read it). The client
    must honour it although it ignores the environment's proxies (trust_env=False)."""
    monkeypatch.setenv("SSL_CERT_FILE", pki.ca)
    name, http2, version = PROTOCOLS[proto]
    server = servers(name)
    rid = f"system-store-{proto}"

    async def go():
        async with _client(server, pki, http2, verify=True) as c:
            return await c.stream(rid, "hi", 3)

    r = asyncio.run(go())
    assert r.outcome is Outcome.OK, (r.outcome, r.error)
    assert r.output_tokens == 3 and server.recorder.seen[rid].http_version == version


def test_verify_false_skips_certificate_checks_for_tests(tls, pki):
    async def go():
        async with _client(tls, pki, True, verify=False) as c:
            return await c.stream("insecure", "hi", 3)

    r = asyncio.run(go())
    assert r.outcome is Outcome.OK and r.output_tokens == 3
    assert tls.recorder.seen["insecure"].http_version == "2"


def test_a_bad_ca_bundle_is_rejected_when_the_client_is_built(tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=str(missing)):
        VariantClient("https://127.0.0.1:1", "m", verify=str(missing))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="not a readable PEM CA bundle"):
        VariantClient("https://127.0.0.1:1", "m", verify=str(garbage))
    with pytest.raises(ValueError, match="path of a CA bundle"):
        VariantClient("https://127.0.0.1:1", "m", verify=None)  # type: ignore[arg-type]
