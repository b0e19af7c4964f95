"""The gateway process (`manage.py gateway --with-web`, the command's own uvicorn config) against
hostile clients: slow headers, huge headers, huge web request bodies, forged X-Forwarded-*.
Each client speaks over a raw socket, so what it sends and what the server answers are exact."""

from __future__ import annotations

import select
import socket
import time
from urllib.parse import urlsplit

import pytest

from abplat.proxy import parse_proxies
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.limits import parse_keys
from gateway.management.commands.gateway import server_config
from gateway.variants import Directory
from gateway.with_web import GatewayAndWeb
from tests.gateway.conftest import KEY, FakeRecorder, serve

PATIENCE_S = 5.0  # a socket read that waits longer than this has no answer coming


class NoRouter:
    def assign(self, experiment_key: str, user_id: str):
        raise AssertionError("no request here reaches a variant")


@pytest.fixture
def with_web(settings):
    """with_web(**setting overrides) -> the URL of the gateway and the web app in one process,
    served with the command's uvicorn config; header deadline 0.5 s unless overridden."""
    stops = []

    def start(**overrides) -> str:
        settings.GATEWAY_CLIENT_HEADERS_TIMEOUT_S = 0.5
        for name, value in overrides.items():
            setattr(settings, name, value)
        from django.core.asgi import get_asgi_application

        gateway = Gateway(
            GatewayConfig(keys=parse_keys(f"acme {KEY}\n")),
            router=NoRouter(),
            directory=Directory(default_experiment=""),
            recorder=FakeRecorder(),
            refresh_variants=False,
        )
        app = GatewayAndWeb(gateway, get_asgi_application())
        url, stop = serve(gateway, server_config(app, log_level="warning"))
        stops.append(stop)
        return url

    yield start
    for stop in stops:
        stop()


# ---- a raw HTTP/1.1 client ----------------------------------------------------------------------


def connect(url: str) -> socket.socket:
    where = urlsplit(url)
    return socket.create_connection((where.hostname, where.port), timeout=PATIENCE_S)


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response whose length is its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection closed before a response's headers: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed(sock: socket.socket) -> bool:
    """The server closed the connection (what is left to read ends in EOF or a reset)."""
    try:
        while chunk := sock.recv(65536):
            del chunk
    except ConnectionResetError:
        pass
    return True


def request(url: str, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""):
    with connect(url) as sock:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        sock.sendall(head.encode() + b"\r\n" + body)
        return read_response(sock)


def send_until_answered(sock: socket.socket, pieces, pause_s: float = 0.0) -> int:
    """Send pieces one after another (``pause_s`` apart) until the server answers or closes;
    -> how many were sent."""
    sent = 0
    for piece in pieces:
        if answered(sock):
            break
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += 1
        if pause_s:
            time.sleep(pause_s)
    return sent


# ---- 1. slow headers ----------------------------------------------------------------------------


def test_clients_sending_headers_slowly_are_closed_at_the_deadline_and_free_the_cap(with_web):
    url = with_web(GATEWAY_MAX_CONNECTIONS=4)
    slow = [connect(url) for _ in range(4)]
    for sock in slow:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    # one header line every 0.2 s, 25 planned (5 s of them): the 0.5 s deadline ends each early
    lines = (b"X-Slow-%d: y\r\n" % i for i in range(25))
    sent = send_until_answered(slow[0], lines, pause_s=0.2)
    assert sent < 25
    for sock in slow:
        status, headers, body = read_response(sock)
        assert (status, headers["connection"]) == (408, "close")
        assert b"did not arrive within 0.5 s" in body
        assert closed(sock)
        sock.close()
    # the cap's places are free again: the gateway's and the web app's paths answer
    assert request(url, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert request(url, "GET", "/admin/login/")[0] == 200


def test_connections_past_the_cap_are_a_503_until_one_is_freed(with_web):
    url = with_web(GATEWAY_MAX_CONNECTIONS=4, GATEWAY_CLIENT_HEADERS_TIMEOUT_S=30)
    held = [connect(url) for _ in range(3)]
    for sock in held:
        sock.sendall(b"GET /admin/login/ HTTP/1.1\r\n")
    assert request(url, "GET", "/admin/login/")[0] == 503  # the 4th connection is this one
    for sock in held:
        sock.close()
    assert request(url, "GET", "/admin/login/")[0] == 200


def test_the_command_serves_with_the_bounded_protocol_and_no_proxy_headers_of_uvicorns():
    config = server_config("gateway.asgi:application")
    assert config.http == "gateway.http_protocol:BoundedHttpToolsProtocol"
    assert config.proxy_headers is False
    assert config.timeout_keep_alive == 30


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline_without_an_answer(with_web):
    url = with_web()
    with connect(url) as sock:
        assert sock.recv(65536) == b""


def test_on_keep_alive_the_deadline_runs_from_the_next_requests_first_byte(with_web):
    url = with_web()
    with connect(url) as sock:
        sock.sendall(b"GET /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock)[0] == 200
        # idle longer than the header deadline: the keep-alive timeout (30 s) governs the wait
        time.sleep(0.8)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sent = send_until_answered(sock, (b"X-Slow-%d: y\r\n" % i for i in range(25)), pause_s=0.2)
        assert sent < 25
        assert read_response(sock)[0] == 408
        assert closed(sock)


# ---- 2. header size ----------------------------------------------------------------------------


def test_an_unfinished_header_over_the_bound_is_a_431_and_nothing_more_is_read(with_web):
    url = with_web()  # GATEWAY_MAX_HEADER_BYTES: 64 KiB
    with connect(url) as sock:
        sock.sendall(b"GET /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        send_until_answered(sock, [b"a" * 16384] * 64)  # 1 MiB of one header value
        status, headers, body = read_response(sock)
        assert (status, headers["connection"]) == (431, "close")
        assert body == b"request headers over 65536 bytes"
        assert closed(sock)


def test_a_whole_header_block_over_the_bound_in_one_piece_is_a_431(with_web):
    url = with_web(GATEWAY_MAX_HEADER_BYTES=16384)
    with connect(url) as sock:
        big = b"".join(b"X-Field-%d: %s\r\n" % (i, b"b" * 1000) for i in range(20))
        sock.sendall(b"GET /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n" + big + b"\r\n")
        assert read_response(sock)[0] == 431
        assert closed(sock)


def test_headers_under_the_bound_are_served_as_before(with_web):
    url = with_web(GATEWAY_MAX_HEADER_BYTES=16384)
    fields = {f"X-Field-{i}": "c" * 1000 for i in range(14)}
    assert request(url, "GET", "/admin/login/", fields)[0] == 200
    with connect(url) as sock:  # two requests in one read, each under the bound
        one = b"GET /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"d" * 12000 + b"\r\n\r\n"
        sock.sendall(one + one)
        assert read_response(sock)[0] == 200
        assert read_response(sock)[0] == 200


# ---- 3. the web app's request bodies -----------------------------------------------------------


def test_a_web_body_declared_over_the_cap_is_a_413_before_it_is_read(with_web):
    url = with_web()
    with connect(url) as sock:
        sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 314572800\r\n\r\n")
        status, headers, body = read_response(sock)  # not one byte of the body was sent
        assert (status, headers["connection"]) == (413, "close")
        assert b"over 2621440 bytes" in body  # Django's DATA_UPLOAD_MAX_MEMORY_SIZE
        assert closed(sock)


def test_a_chunked_web_body_is_cut_off_with_a_413_at_the_cap(with_web):
    url = with_web(DATA_UPLOAD_MAX_MEMORY_SIZE=256 * 1024)
    with connect(url) as sock:
        sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (65536, b"e" * 65536)
        send_until_answered(sock, [chunk] * 64)  # 4 MiB planned
        status, headers, body = read_response(sock)
        assert (status, headers["connection"]) == (413, "close")
        assert b"over 262144 bytes" in body
        assert closed(sock)


def test_a_slow_web_body_is_a_408_at_the_body_deadline_but_a_trace_upload_is_not(with_web):
    url = with_web(GATEWAY_BODY_TIMEOUT_S=0.5)
    with connect(url) as sock:
        sock.sendall(b"POST /api/experiments/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
        sent = send_until_answered(sock, [b"g" * 10] * 100, pause_s=0.2)  # 20 s planned
        assert sent < 100
        status, headers, body = read_response(sock)
        assert (status, headers["connection"]) == (408, "close")
        assert b"did not arrive within 0.5 s" in body
        assert closed(sock)
    # an upload may take longer than the deadline: the view answers it (here: a stranger's)
    with connect(url) as sock:
        sock.sendall(b"POST /api/traces/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 81920\r\n\r\n")
        assert send_until_answered(sock, [b"h" * 8192] * 10, pause_s=0.1) == 10
        assert read_response(sock)[0] in (401, 403)


def test_a_trace_upload_is_capped_at_the_trace_cap_and_others_at_djangos(with_web):
    url = with_web(TRACE_MAX_BYTES=1024 * 1024, DATA_UPLOAD_MAX_MEMORY_SIZE=64 * 1024)
    from traces.uploads import MULTIPART_SLACK

    cap = 1024 * 1024 + MULTIPART_SLACK
    for path in ("/api/traces/", "/admin/traces/trace/upload/"):
        with connect(url) as sock:
            sock.sendall(
                b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), cap + 1)
            )
            status, _, body = read_response(sock)
            assert status == 413 and f"over {cap} bytes".encode() in body, path
    # under the trace cap but over Django's: an upload's body reaches the view (which refuses a
    # stranger), another path's does not
    body = b"f" * (200 * 1024)
    assert request(url, "POST", "/api/traces/", body=body)[0] in (401, 403)
    assert request(url, "POST", "/api/experiments/", body=body)[0] == 413


# ---- 4. forwarded headers ----------------------------------------------------------------------


def _login_attempts(url: str, forwarded_for) -> list[int]:
    """15 failed admin sign-ins (a wrong password), each with its X-Forwarded-For."""
    token = "t" * 32  # the CSRF cookie and the form's token, as a browser holding the form sends
    form = f"username=admin&password=wrong&csrfmiddlewaretoken={token}".encode()
    headers = {"Content-Type": "application/x-www-form-urlencoded", "Cookie": f"csrftoken={token}"}
    return [
        request(url, "POST", "/admin/login/", {**headers, "X-Forwarded-For": forwarded_for(i)}, form)[0]
        for i in range(15)
    ]


@pytest.fixture
def fresh_login_counts(db):
    from django.core.cache import caches

    from abplat.api import RATE_CACHE

    caches[RATE_CACHE].clear()
    yield
    caches[RATE_CACHE].clear()


def test_forged_forwarded_for_from_loopback_does_not_dodge_the_login_limit(with_web, fresh_login_counts):
    url = with_web(TRUSTED_PROXY_NETWORKS=(), API_THROTTLE_LOGIN="10/min")
    statuses = _login_attempts(url, lambda i: f"203.0.113.{i + 1}")
    assert statuses == [200] * 10 + [429] * 5


def test_a_listed_proxys_forwarded_for_names_the_client(with_web, fresh_login_counts):
    url = with_web(TRUSTED_PROXY_NETWORKS=parse_proxies(["127.0.0.1"]), API_THROTTLE_LOGIN="10/min")
    statuses = _login_attempts(url, lambda i: "203.0.113.7" if i < 11 else f"203.0.113.{100 + i}")
    assert statuses == [200] * 10 + [429] + [200] * 4  # one client limited, the others not


@pytest.mark.parametrize(("proxies", "status"), [((), 301), (parse_proxies(["127.0.0.1"]), 200)])
def test_forwarded_proto_is_believed_from_a_listed_proxy_only(with_web, proxies, status):
    url = with_web(
        TRUSTED_PROXY_NETWORKS=proxies,
        SECURE_SSL_REDIRECT=True,
        SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"),
    )
    assert request(url, "GET", "/admin/login/", {"X-Forwarded-Proto": "https"})[0] == status
