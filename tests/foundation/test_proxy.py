"""The client's address behind a TLS proxy (ABPLAT_TRUSTED_PROXIES, abplat/proxy.py): only the
X-Forwarded-For entries our own proxies wrote are believed, so per-address limits count clients,
not the proxy, and a client cannot pick the address it is counted as."""

from __future__ import annotations

import pytest

from abplat.proxy import client_address, parse_proxies

PROXIES = parse_proxies(["127.0.0.1", "10.0.0.0/8", "::1"])


@pytest.mark.parametrize(
    "peer, forwarded_for, client",
    [
        ("127.0.0.1", "203.0.113.9", "203.0.113.9"),  # nginx on the same host
        ("10.1.2.3", "203.0.113.9, 10.0.0.7", "203.0.113.9"),  # two of our proxies
        ("127.0.0.1", "6.6.6.6, 203.0.113.9", "203.0.113.9"),  # the client wrote 6.6.6.6 itself
        ("127.0.0.1", "", "127.0.0.1"),  # no header: the proxy's own request
        ("127.0.0.1", "10.0.0.5, 10.0.0.7", "10.0.0.5"),  # every hop ours: the first one
        ("127.0.0.1", "not-an-ip, 10.0.0.7", "10.0.0.7"),  # garbage ends the believed chain
        ("127.0.0.1", "2001:db8::1", "2001:db8::1"),
        ("::1", "203.0.113.9", "203.0.113.9"),
        ("198.51.100.4", "203.0.113.9", "198.51.100.4"),  # not from a proxy: the header is ignored
    ],
)
def test_the_client_is_the_last_address_no_proxy_of_ours_wrote(peer, forwarded_for, client):
    assert client_address(peer, forwarded_for, PROXIES) == client


def test_without_listed_proxies_the_header_is_never_read():
    assert client_address("127.0.0.1", "203.0.113.9", ()) == "127.0.0.1"


@pytest.mark.parametrize("item", ["10.0.0.0/33", "proxy.internal", "", "1.2.3"])
def test_a_bad_proxy_item_is_named(item):
    with pytest.raises(ValueError, match=f"ABPLAT_TRUSTED_PROXIES item {item!r}"):
        parse_proxies(["127.0.0.1", item])


@pytest.mark.django_db
def test_login_attempts_are_limited_per_client_behind_the_proxy(client, settings):
    """Behind a listed proxy, one client's failed logins do not lock out another client."""
    settings.TRUSTED_PROXY_NETWORKS = PROXIES
    settings.API_THROTTLE_LOGIN = "2/day"
    attempt = {"username": "nobody", "password": "wrong"}

    def login(address: str) -> int:
        return client.post(
            "/admin/login/", attempt, REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=address
        ).status_code

    assert [login("203.0.113.9") for _ in range(3)] == [200, 200, 429]
    assert login("203.0.113.10") == 200  # another user behind the same proxy
    settings.TRUSTED_PROXY_NETWORKS = ()
    assert login("203.0.113.11") == 200 and login("203.0.113.12") == 200
    assert login("203.0.113.13") == 429  # without the setting: everyone is 127.0.0.1


@pytest.mark.django_db
def test_a_form_posted_under_the_proxys_public_name_needs_that_origin_trusted(settings, users):
    """Behind TLS the browser's Origin is the public name, the Host what the proxy passes on:
    Django refuses the form (403) until ABPLAT_CSRF_TRUSTED_ORIGINS lists that origin."""
    from django.test import Client

    def login() -> int:
        browser = Client(enforce_csrf_checks=True)  # a new one: the CSRF middleware keeps its origins
        behind = {"HTTP_HOST": "127.0.0.1:8000", "HTTP_X_FORWARDED_PROTO": "https"}
        token = browser.get("/admin/login/", **behind).cookies["csrftoken"].value
        form = {"username": "root", "password": "pw-root", "csrfmiddlewaretoken": token}
        return browser.post(
            "/admin/login/", form, HTTP_ORIGIN="https://abplat.example.com", **behind
        ).status_code

    settings.CSRF_TRUSTED_ORIGINS = []
    assert login() == 403
    settings.CSRF_TRUSTED_ORIGINS = ["https://abplat.example.com"]
    assert login() == 302  # signed in, redirected


@pytest.mark.django_db
def test_x_forwarded_proto_is_believed_only_from_a_listed_proxy(settings):
    """With debug off, Django redirects plain HTTP and trusts X-Forwarded-Proto for "this came
    over TLS": a client that writes the header itself must not be believed."""
    from django.test import Client

    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_SSL_REDIRECT = True
    settings.TRUSTED_PROXY_NETWORKS = parse_proxies(["10.0.0.0/8"])
    claim = {"HTTP_X_FORWARDED_PROTO": "https"}
    direct = Client(REMOTE_ADDR="198.51.100.4").get("/healthz", **claim)
    assert direct.status_code == 301 and direct["Location"].startswith("https://")  # the claim is dropped
    proxied = Client(REMOTE_ADDR="10.0.0.7").get("/healthz", **claim)
    assert proxied.status_code == 200  # our proxy terminated TLS
    settings.TRUSTED_PROXY_NETWORKS = ()
    assert Client(REMOTE_ADDR="10.0.0.7").get("/healthz", **claim).status_code == 301  # nothing listed
