"""How we check a variant's TLS certificate: one rule for every outbound path (the replay on
either stack, the gateway's upstream pools, the probe, the scrape, the preflight, webhooks)."""

from __future__ import annotations

import os
import ssl


def tls_verify(verify: bool | str) -> bool | ssl.SSLContext:
    """The ``verify`` argument for httpx. True becomes a context on the system trust store:
    httpx's own default is certifi's bundle, and with ``trust_env=False`` (set so no proxy
    from the environment sits in a measurement) it would also ignore SSL_CERT_FILE. A CA
    bundle path becomes an SSLContext here, since httpx deprecates ``verify=<path>``, and so
    a missing or unreadable bundle fails when the client is built, naming the path, not as a
    CONNECT_ERROR on every request."""
    if verify is True:
        return ssl.create_default_context()
    if verify is False:
        return False
    if not isinstance(verify, str) or not verify:
        raise ValueError(f"verify={verify!r}: must be True, False or the path of a CA bundle (PEM)")
    if not os.path.isfile(verify):
        raise ValueError(f"verify={verify!r}: no such CA bundle file")
    try:
        return ssl.create_default_context(cafile=verify)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"verify={verify!r}: not a readable PEM CA bundle ({exc})") from None


def tls_context(verify: bool | str | ssl.SSLContext) -> ssl.SSLContext:
    """``tls_verify`` as an SSLContext, for the HTTP/1.1 core (streaming/h1.py): False checks
    nothing (tests only)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    checked = tls_verify(verify)
    if checked is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    assert isinstance(checked, ssl.SSLContext)
    return checked
