"""Webhooks resolve their host once per connection, check those addresses and dial one of them:
a name whose DNS answers differently between the check and the connect (rebinding) cannot
steer the POST to another address. TLS still checks the certificate for the URL's name.

No real DNS: the name's answers come from a resolver the test controls (socket.getaddrinfo for
that name only, or the resolver handed to the look)."""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import threading

import pytest

from experiments import services
from rollouts import controller as c
from rollouts import service
from rollouts.webhooks import Webhooks

pytestmark = [pytest.mark.django_db, pytest.mark.engine]

KEY = "rollout-demo"
NAME = "hooks.rebind.test"


class Listener:
    """An HTTP(S) server on ``host``:``port`` recording each POST's path and body, and the SNI
    of each TLS handshake."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.server_names: list[str | None] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                length = int(self.headers.get("Content-Length") or 0)
                outer.paths.append(self.path)
                outer.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listeners():
    made: list[Listener] = []

    def make(*args, **kwargs) -> Listener:
        made.append(Listener(*args, **kwargs))
        return made[-1]

    yield make
    for listener in made:
        listener.close()


class Answers:
    """socket.getaddrinfo for NAME: the queued answers in turn, then the last one again; every
    other name goes to the real resolver (the test's own 127.0.0.x addresses)."""

    def __init__(self, monkeypatch, first: str) -> None:
        self.queue = [first]
        self.asked = 0
        real = socket.getaddrinfo

        def getaddrinfo(host, port, *args, **kwargs):
            if host != NAME:
                return real(host, port, *args, **kwargs)
            self.asked += 1
            address = self.queue.pop(0) if len(self.queue) > 1 else self.queue[0]
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port or 0))]

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def then(self, *addresses: str) -> None:
        self.queue = list(addresses)
        self.asked = 0


def start(doc, notify: list[str]) -> None:
    doc["rollout"]["notify"] = notify
    experiment = services.apply_document(doc).experiment
    services.transition(experiment, "start")


def test_a_name_that_rebinds_after_the_check_is_posted_to_the_checked_address(
    rollout_document, settings, monkeypatch, listeners
):
    """The name resolves into the allowlist for the check, then to another address: the POST
    still goes to the checked one, and the name is looked up once."""
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.1/32"]
    checked = listeners("127.0.0.1")
    elsewhere = listeners("127.0.0.2", checked.port)  # the address a second lookup would give
    answers = Answers(monkeypatch, "127.0.0.1")
    start(rollout_document, [f"http://{NAME}:{checked.port}/hook"])

    answers.then("127.0.0.1", "127.0.0.2")
    r = service.look(KEY, interval_s=0)

    assert r.decision.action == c.START
    assert r.notified[0].get("status") == 200, r.notified
    assert [b["action"] for b in checked.bodies] == ["start"]
    assert elsewhere.bodies == []
    assert answers.asked == 1


def test_a_name_that_resolves_outside_first_is_refused_whatever_it_answers_next(
    rollout_document, settings, monkeypatch, listeners
):
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.1/32"]
    inside = listeners("127.0.0.1")
    outside = listeners("127.0.0.2", inside.port)
    answers = Answers(monkeypatch, "127.0.0.1")
    start(rollout_document, [f"http://{NAME}:{inside.port}/hook"])

    answers.then("127.0.0.2", "127.0.0.1")
    r = service.look(KEY, interval_s=0)

    assert r.decision.action == c.START
    assert "refused by the egress rules" in r.notified[0]["error"]
    assert "outside the variant allowlist" in r.notified[0]["error"]
    assert inside.bodies == [] and outside.bodies == []
    assert answers.asked == 1


def test_the_look_uses_the_resolver_it_is_given_once_per_webhook(
    rollout_document, settings, monkeypatch, listeners
):
    receiver = listeners("127.0.0.1")
    settings.VARIANT_ALLOWED_HOSTS = [NAME, "127.0.0.1/32"]  # by name: applying it resolves nothing
    start(rollout_document, [f"http://{NAME}:{receiver.port}/hook"])
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.1/32"]  # now judged by its addresses
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        assert host != NAME, "the system resolver was asked"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    asked: list[str] = []

    def resolve(host: str) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"] if len(asked) == 1 else ["127.0.0.2"]

    r = service.look(KEY, interval_s=0, webhooks=Webhooks(resolve=resolve))

    assert r.notified[0].get("status") == 200, r.notified
    assert asked == [NAME] and len(receiver.bodies) == 1


def test_tls_to_the_checked_address_verifies_the_certificate_for_the_name(
    rollout_document, settings, pki, listeners
):
    """Dialled at the resolved address, the TLS handshake still names the URL's host (SNI) and
    checks the certificate for it: 'localhost' is in the test certificate, 'webhook.test' is
    not, though both resolve to the same address."""
    settings.VARIANT_ALLOWED_HOSTS = ["127.0.0.0/8"]
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki.certfile, pki.keyfile)
    server = listeners("127.0.0.1", tls=tls)
    start(
        rollout_document,
        [f"https://localhost:{server.port}/hook", f"https://webhook.test:{server.port}/hook"],
    )

    r = service.look(KEY, interval_s=0, webhooks=Webhooks(resolve=lambda host: ["127.0.0.1"], verify=pki.ca))

    assert r.notified[0].get("status") == 200, r.notified
    assert "CERTIFICATE_VERIFY_FAILED" in r.notified[1]["error"]
    assert [b["action"] for b in server.bodies] == ["start"]
    assert sorted(server.server_names) == ["localhost", "webhook.test"]
