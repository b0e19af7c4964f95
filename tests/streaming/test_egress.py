"""Where variant requests may go: the allowlist rules, the connect-time check after
name resolution on both client paths, the probe, and the named secrets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import pytest

from simulator import serve
from simulator.serve import DEFAULT_MODEL
from streaming.client import VariantClient
from streaming.egress import (
    EgressError,
    EgressRefused,
    SecretError,
    check_addresses,
    check_url,
    parse_allowlist,
    read_secret,
)
from streaming.probe import token_counter
from streaming.result import Outcome
from tests.streaming.test_http2_tls import _hypercorn

DEFAULT = parse_allowlist(["localhost", "127.0.0.0/8", "::1/128"])
TOKEN = "sk-test-0123456789abcdef"


# --- the allowlist ----------------------------------------------------------------------------


def test_allowlist_entries_are_names_suffix_patterns_and_networks():
    allow = parse_allowlist(["vLLM-A.internal.", "*.serving.internal", "10.20.0.0/16", "192.0.2.7", "::1"])
    assert allow.allows_name("vllm-a.internal") and allow.allows_name("VLLM-A.INTERNAL.")
    assert allow.allows_name("x.serving.internal") and allow.allows_name("a.b.serving.internal")
    assert not allow.allows_name("serving.internal") and not allow.allows_name("evil-serving.internal")
    assert allow.allows_address("10.20.3.4") and not allow.allows_address("10.21.0.1")
    assert allow.allows_address("192.0.2.7") and not allow.allows_address("192.0.2.8")
    assert allow.allows_address("::1") and not allow.allows_address("::2")


def test_an_ipv4_mapped_ipv6_address_is_judged_as_its_ipv4_address():
    assert DEFAULT.allows_address("::ffff:127.0.0.1")
    assert not DEFAULT.allows_address("::ffff:10.0.0.1")


def test_every_bad_allowlist_entry_is_named():
    with pytest.raises(EgressError) as info:
        parse_allowlist(["localhost", "10.0.0.1/8", "bad name", "*.com", " ", "*"])
    message = str(info.value)
    assert message.startswith("ABPLAT_VARIANT_ALLOWED_HOSTS: ")
    for entry in ("'10.0.0.1/8'", "'bad name'", "'*.com'", "empty entry", "'*'"):
        assert entry in message, entry
    assert "'localhost'" not in message


# --- validation: check_url --------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://user:hunter2@127.0.0.1:8000/v1", "https://:hunter2@localhost/v1", "http://tok@localhost/v1"],
)
def test_credentials_in_the_url_are_refused_without_repeating_them(url):
    with pytest.raises(EgressError, match="must not carry credentials") as info:
        check_url(url, DEFAULT)
    assert "hunter2" not in str(info.value) and "tok" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.5:8000/v1",
        "http://169.254.169.254/latest/meta-data",  # cloud metadata
        "http://[fd00::1]:8000/v1",
        "http://0.0.0.0:8000/v1",
        "http://[::ffff:10.0.0.1]/v1",
    ],
)
def test_an_ip_literal_outside_the_allowlist_is_refused(url):
    with pytest.raises(EgressError, match="not in the variant allowlist"):
        check_url(url, DEFAULT)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://localhost:8000/v1", "http://[::1]:9/v1"])
def test_the_embedded_default_allows_loopback(url):
    assert check_url(url, DEFAULT).port in (8000, 9)


def test_a_name_off_the_list_is_judged_by_what_it_resolves_to():
    answers = {"sim.test": ["127.0.0.2"], "db.corp": ["10.1.2.3"], "half.test": ["127.0.0.1", "10.0.0.1"]}

    def resolve(host):
        return answers.get(host, [])

    assert check_url("http://sim.test:8000/v1", DEFAULT, resolve).host == "sim.test"
    with pytest.raises(EgressError, match="resolves to 10.1.2.3"):
        check_url("http://db.corp/v1", DEFAULT, resolve)
    with pytest.raises(EgressError, match="resolves to 10.0.0.1"):
        check_url("http://half.test/v1", DEFAULT, resolve)  # every address must be allowed
    with pytest.raises(EgressError, match="does not resolve"):
        check_url("http://nowhere.test/v1", DEFAULT, resolve)
    with pytest.raises(EgressError, match="not in the variant allowlist"):
        check_url("http://sim.test:8000/v1", DEFAULT)  # no resolver: only listed names


def test_a_listed_name_may_resolve_anywhere_an_unlisted_one_only_inside_the_networks():
    allow = parse_allowlist(["vllm.internal", "127.0.0.0/8"])
    assert check_addresses("vllm.internal", ["10.9.9.9"], allow) == ["10.9.9.9"]
    assert check_addresses("other.test", ["127.0.0.5"], allow) == ["127.0.0.5"]
    with pytest.raises(EgressRefused, match="10.9.9.9"):
        check_addresses("other.test", ["127.0.0.5", "10.9.9.9"], allow)
    with pytest.raises(EgressRefused, match="outside the variant allowlist"):
        check_addresses("10.9.9.9", ["10.9.9.9"], allow)


# --- connect time: both client paths -------------------------------------------------------------


@pytest.fixture(scope="module")
def sim():
    handle = serve.start_in_thread("fast")
    yield handle
    handle.stop()


def _resolve_to(loop: asyncio.AbstractEventLoop, *hosts: str) -> list[str]:
    """Make this loop's getaddrinfo answer every name with ``hosts``; returns the names asked."""
    asked: list[str] = []

    async def getaddrinfo(host, port, **kw):
        asked.append(host)
        out = []
        for h in hosts:
            fam = socket.AF_INET6 if ":" in h else socket.AF_INET
            addr = (h, port, 0, 0) if fam == socket.AF_INET6 else (h, port)
            out.append((fam, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr))
        return out

    loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]
    return asked


@contextlib.contextmanager
def _listener(host: str):
    """A socket listening on ``host`` (any 127/8 address is local on Linux); yields (port,
    accepted), where accepted() says whether anyone connected."""
    sock = socket.create_server((host, 0))
    sock.setblocking(False)

    def accepted() -> bool:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True

    try:
        yield sock.getsockname()[1], accepted
    finally:
        sock.close()


@pytest.mark.parametrize("transport", ["h1", "httpx"])
def test_a_name_resolving_outside_the_allowlist_is_refused_before_connecting(transport):
    allow = parse_allowlist(["127.0.0.1/32"])  # loopback by network only: no name is listed
    with _listener("127.0.0.2") as (port, accepted):

        async def go():
            asked = _resolve_to(asyncio.get_running_loop(), "127.0.0.2")
            async with VariantClient(
                f"http://variant.test:{port}/v1", "m", "chat", transport=transport, allow=allow
            ) as c:
                return await c.stream("r", "hi", 4), asked

        result, asked = asyncio.run(go())
        assert asked == ["variant.test"]  # resolved by the client itself, once
        assert result.outcome is Outcome.CLIENT_ERROR  # our refusal, never the server's fault
        assert "egress refused" in result.error and "127.0.0.2" in result.error
        assert not accepted()  # nothing was dialled


@pytest.mark.parametrize("transport", ["h1", "httpx"])
def test_a_name_is_dialled_only_at_the_addresses_that_were_checked(sim, transport):
    port = int(sim.url.rsplit(":", 1)[1])
    allow = parse_allowlist(["127.0.0.1/32"])

    async def go():
        _resolve_to(asyncio.get_running_loop(), "127.0.0.1")
        async with VariantClient(
            f"http://variant.test:{port}/v1", DEFAULT_MODEL, "chat", transport=transport, allow=allow
        ) as c:
            return await c.stream("r", "hi", 4)

    result = asyncio.run(go())
    assert result.outcome is Outcome.OK, result.error


@pytest.mark.parametrize("transport", ["h1", "httpx"])
def test_one_address_outside_the_allowlist_refuses_the_whole_name(sim, transport):
    """DNS that mixes an allowed and an internal address (a rebinding setup) gets nothing."""
    port = int(sim.url.rsplit(":", 1)[1])

    async def go():
        _resolve_to(asyncio.get_running_loop(), "127.0.0.1", "10.0.0.1")
        async with VariantClient(
            f"http://variant.test:{port}/v1", DEFAULT_MODEL, "chat", transport=transport, allow=DEFAULT
        ) as c:
            return await c.stream("r", "hi", 4)

    result = asyncio.run(go())
    assert result.outcome is Outcome.CLIENT_ERROR and "10.0.0.1" in result.error


def test_an_ip_literal_outside_the_allowlist_is_refused_at_connect_time():
    async def go():
        async with VariantClient("http://10.255.255.1:9/v1", "m", "chat", allow=DEFAULT) as c:
            return await c.stream("r", "hi", 4)

    result = asyncio.run(go())
    assert result.outcome is Outcome.CLIENT_ERROR and "outside the variant allowlist" in result.error


@pytest.fixture(scope="module")
def tls_sim(pki):
    handle = serve.start_in_thread("fast", tls=(pki.certfile, pki.keyfile))
    yield handle
    handle.stop()


def test_tls_to_a_pinned_name_still_verifies_the_certificate_for_that_name(tls_sim, pki):
    """The connection goes to the checked address, the certificate is checked for the URL's
    name: 'localhost' is in the test certificate, 'variant.test' is not."""
    port = int(tls_sim.url.rsplit(":", 1)[1])
    allow = parse_allowlist(["127.0.0.0/8"])

    async def go(name):
        _resolve_to(asyncio.get_running_loop(), "127.0.0.1")
        async with VariantClient(
            f"https://{name}:{port}/v1", DEFAULT_MODEL, "chat", verify=pki.ca, allow=allow
        ) as c:
            return await c.stream("r", "hi", 4)

    ok = asyncio.run(go("localhost"))
    assert ok.outcome is Outcome.OK, ok.error
    wrong = asyncio.run(go("variant.test"))
    assert wrong.outcome is Outcome.CONNECT_ERROR and "CERTIFICATE_VERIFY_FAILED" in wrong.error


@pytest.fixture(scope="module")
def h2_tls(pki):
    server, stop = _hypercorn(pki)
    yield server
    stop()


def test_http2_over_tls_is_negotiated_through_the_checked_connection(h2_tls, pki):
    port = int(h2_tls.url.rsplit(":", 1)[1])

    async def go():
        async with VariantClient(
            f"https://localhost:{port}/v1", DEFAULT_MODEL, "chat", http2=True, verify=pki.ca, allow=DEFAULT
        ) as c:
            return await c.stream("h2-egress", "hi", 4)

    result = asyncio.run(go())
    assert result.outcome is Outcome.OK, result.error
    assert h2_tls.recorder.seen["h2-egress"].http_version == "2"


def test_the_tokenize_probe_is_refused_like_the_client(sim):
    port = int(sim.url.rsplit(":", 1)[1])

    async def go():
        _resolve_to(asyncio.get_running_loop(), "10.0.0.1")
        return await token_counter(f"http://variant.test:{port}/v1", DEFAULT_MODEL, "chat", allow=DEFAULT)

    counter, why = asyncio.run(go())
    assert counter is None and "EgressRefused" in why and "10.0.0.1" in why


def test_the_client_refuses_credentials_in_its_endpoint():
    with pytest.raises(ValueError, match="must not carry credentials") as info:
        VariantClient("http://u:hunter2@127.0.0.1:1/v1", "m")
    assert "hunter2" not in str(info.value)


# --- the token reaches the server, on both paths -------------------------------------------------


@pytest.fixture
def recording_sim(monkeypatch):
    """The fast simulator, recording the Authorization header of every request it gets."""
    seen: list[str] = []
    build = serve.build_server

    def recording(*args, **kwargs):
        server = build(*args, **kwargs)
        inner = server.config.app

        async def app(scope, receive, send):
            if scope["type"] == "http":
                seen.append(dict(scope["headers"]).get(b"authorization", b"").decode())
            await inner(scope, receive, send)

        server.config.app = app
        return server

    with monkeypatch.context() as patch:
        patch.setattr(serve, "build_server", recording)
        handle = serve.start_in_thread("fast")
    yield handle, seen
    handle.stop()


@pytest.mark.parametrize("transport", ["h1", "httpx"])
def test_the_secret_reaches_the_server_as_a_bearer_token(recording_sim, tmp_path, transport):
    sim, seen = recording_sim
    (tmp_path / "vllm-key").write_text(TOKEN + "\n")
    headers = {"Authorization": f"Bearer {read_secret(str(tmp_path), 'vllm-key')}"}

    async def go():
        async with VariantClient(
            sim.url + "/v1", DEFAULT_MODEL, "chat", transport=transport, allow=DEFAULT, headers=headers
        ) as c:
            return await c.stream("r", "hi", 4)

    result = asyncio.run(go())
    assert result.outcome is Outcome.OK, result.error
    assert seen == [f"Bearer {TOKEN}"]


# --- named secrets ------------------------------------------------------------------------------


def test_a_secret_file_holds_one_token(tmp_path):
    (tmp_path / "vllm-key").write_text(f"  {TOKEN}\n")
    assert read_secret(str(tmp_path), "vllm-key") == TOKEN


def test_a_symlink_to_a_regular_file_is_a_secret_as_kubernetes_mounts_them(tmp_path):
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "vllm-key").write_text(TOKEN)
    (tmp_path / "vllm-key").symlink_to(tmp_path / "..data" / "vllm-key")
    assert read_secret(str(tmp_path), "vllm-key") == TOKEN


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("missing", None, "is not configured"),
        ("dir", "<dir>", "not a regular file"),
        ("fifo", "<fifo>", "not a regular file"),
        ("empty", "\n", "is empty"),
        ("two-lines", f"{TOKEN}\nX-Evil: 1\n", "one token of printable characters"),
        ("blank", f"Basic {TOKEN}", "one token of printable characters"),
        ("huge", TOKEN * 1000, "larger than"),
        ("binary", b"\xff" + TOKEN.encode(), "not ASCII"),
    ],
)
def test_an_unusable_secret_is_named_and_its_value_never_shown(tmp_path, name, content, says):
    path = tmp_path / name
    if content == "<dir>":
        path.mkdir()
    elif content == "<fifo>":
        os.mkfifo(path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SecretError, match=says) as info:
        read_secret(str(tmp_path), name)
    assert repr(name) in str(info.value)
    assert TOKEN not in str(info.value) and "sk-" not in str(info.value)


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "../etc/passwd", "", "x" * 65])
def test_a_secret_name_cannot_leave_the_secrets_directory(tmp_path, name):
    with pytest.raises(SecretError, match="a secret name is"):
        read_secret(str(tmp_path), name)


def test_no_secrets_directory_names_the_setting():
    with pytest.raises(SecretError, match="ABPLAT_VARIANT_SECRETS_DIR"):
        read_secret("", "vllm-key")
