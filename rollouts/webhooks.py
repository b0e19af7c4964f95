"""A rollout decision sent to the plan's webhooks: one JSON POST to each, all at once.

``post_decision`` sends and reports; it never raises and never waits longer than the timeout
(plus a margin), so a webhook can neither undo nor delay the decision it carries.

1. Resolve. Each connection resolves the webhook's host once (``Webhooks.resolve``; an IP
   literal stands for itself).
2. Check. Those addresses are checked (``webhook_addresses``): the variant allowlist as it is
   now, or a name over https that resolves only to public addresses.
3. Dial. One of the checked addresses is dialled through the variants' egress transport
   (streaming.transports.AllowedSyncTransport), so DNS that answers differently after the check
   cannot move the POST; TLS still verifies the certificate for the URL's name. No redirects,
   no proxy from the environment, ``NOTIFY_TIMEOUT_S`` per request, no retry.
4. Report. Each webhook's outcome (``status``, or ``error``) names it redacted
   (``scheme://host:port/[redacted]``): its path or query often carries the receiver's token.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from experiments.checks import resolve_host, variant_allowlist
from experiments.document import redact_url, scrub_url
from streaming.egress import Allowlist, EgressError, EgressRefused, check_addresses, ip_literal, split_url
from streaming.tls import tls_verify
from streaming.transports import AllowedSyncTransport

NOTIFY_TIMEOUT_S = 3.0


@dataclasses.dataclass(frozen=True)
class Webhooks:
    """How a look sends its webhooks: ``resolve`` answers a host's addresses (asked once per
    connection; the settings' resolver by default), ``verify`` is the TLS trust (True: the
    system's CA store; or the path of a CA bundle)."""

    resolve: Callable[[str], Sequence[str]] = resolve_host
    verify: bool | str = True


def post_decision(urls: Sequence[str], message: dict[str, Any], how: Webhooks) -> list[dict[str, Any]]:
    """POST ``message`` (JSON values only) to every URL of ``urls`` at once; wait at most the
    timeout (plus a margin). One result per URL, in order: ``url`` redacted, and ``status``
    (the HTTP status) and/or ``error`` (why it failed: refused, unreachable, HTTP 3xx and up,
    or "no answer in time"), redacted too."""
    body = json.dumps(message).encode()
    outcomes: list[dict[str, Any]] = [{} for _ in urls]
    threads = [
        threading.Thread(target=_post, args=(url, body, out, how), daemon=True)
        for url, out in zip(urls, outcomes, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(NOTIFY_TIMEOUT_S + 1.0)
    # A thread still running may yet write into its outcome: read each one once, now.
    results = [{"url": redact_url(url), **dict(out)} for url, out in zip(urls, outcomes, strict=True)]
    for r in results:
        if "status" not in r:  # the POST never finished (a refusal or failure has its error)
            r.setdefault("error", "no answer in time")
    return results


def webhook_addresses(scheme: str, host: str, addresses: Sequence[str], allow: Allowlist) -> list[str]:
    """The addresses of ``host`` (as resolved, once) a webhook may be sent to, or EgressRefused
    saying why not: a host on the variant allowlist (by name, or every address it resolves to)
    over http(s); any other host only over https and only while every address it resolves to is
    public (no loopback, private, link-local or reserved address: a name that starts resolving
    inward is refused)."""
    try:
        return check_addresses(host, list(addresses), allow)
    except EgressRefused as exc:
        refused = str(exc)
    if scheme != "https":
        raise EgressRefused(f"{refused}: plain http goes only to hosts on the allowlist")
    inward = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global]
    if inward or ip_literal(host) is not None:
        raise EgressRefused(
            f"host {host!r} resolves to non-public addresses {inward or list(addresses)}; not on the allowlist"
        )
    return list(addresses)


def _resolved(host: str, resolve: Callable[[str], Sequence[str]]) -> list[str]:
    """``host``'s addresses: an IP literal as itself, a name as ``resolve`` answers it now."""
    literal = ip_literal(host)
    if literal is not None:
        return [str(literal)]
    try:
        return list(dict.fromkeys(resolve(host)))
    except OSError as exc:
        raise EgressRefused(f"host {host!r} does not resolve: {exc}") from None


def _post(url: str, body: bytes, out: dict[str, Any], how: Webhooks) -> None:
    """POST ``body`` to ``url``; the outcome (``status``, ``error``) goes into ``out``, with the
    URL redacted in any error text."""
    try:
        target = split_url(url)
        allow = variant_allowlist()

        def addresses(host: str, port: int) -> list[str]:
            # Called by the transport for each new connection: one lookup, checked, dialled.
            found = _resolved(host, how.resolve)
            return webhook_addresses(target.scheme, host, found, allow)

        transport = AllowedSyncTransport(None, verify=tls_verify(how.verify), addresses=addresses)
        with httpx.Client(
            transport=transport, timeout=NOTIFY_TIMEOUT_S, follow_redirects=False, trust_env=False
        ) as client:
            resp = client.post(url, content=body, headers={"Content-Type": "application/json"})
        out["status"] = resp.status_code
        if resp.status_code >= 300:
            out["error"] = f"HTTP {resp.status_code}"
    except (EgressError, EgressRefused) as exc:
        out["error"] = scrub_url(f"refused by the egress rules: {exc}", url)
    except Exception as exc:  # every failure is reported, none escapes
        out["error"] = scrub_url(f"{type(exc).__name__}: {exc}", url)[:300]
