"""Before a replay starts: does every variant's endpoint answer, and does it serve the model?

One ``GET {base}/v1/models`` per variant (the OpenAI-compatible model list that vLLM and the
simulator serve) with short timeouts, all variants probed at once, so a dead port or a wrong
model name is reported in a second or two instead of as a run full of connect errors or 404s.
Whether the requests fit each variant's API is decided offline (replay.shapes).

The probe goes where the replay would: only to addresses the variant allowlist accepts, with
the variant's named secret as its Authorization. A refused host and a secret that is not
configured are problems named here, before anything is sent.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ssl
from collections.abc import Sequence

import httpx

from streaming.egress import Allowlist, EgressError, EgressRefused, SecretError, split_url
from streaming.tls import tls_verify
from streaming.transports import AllowedSyncTransport
from workers import variants

TIMEOUT = httpx.Timeout(3.0, connect=2.0)


@dataclasses.dataclass(frozen=True)
class Target:
    key: str
    endpoint: str  # the variant's OpenAI-style base URL (".../v1")
    model: str
    http2: bool = False
    auth_secret: str = ""  # the name of the variant's secret ("": none)
    team: str = ""  # its experiment's team: the secret's binding must name it ("": only bindings for "*")


def models_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return f"{base}/v1/models"


def probe(
    target: Target,
    *,
    verify: bool | str | ssl.SSLContext = True,
    allow: Allowlist | None = None,
    secrets_dir: str | None = None,
) -> str | None:
    """None when the variant answers and lists its model; otherwise one line saying what is wrong.

    allow, secrets_dir: the variant allowlist and the secrets directory (None: the settings')."""
    url = models_url(target.endpoint)
    plain = url.startswith("http://")
    allow = variants.allowlist() if allow is None else allow
    try:
        split_url(target.endpoint)  # http(s) only, no credentials in it
        headers = variants.auth_headers(
            target.auth_secret, secrets_dir, endpoint=target.endpoint, team=target.team
        )
    except EgressError as exc:
        return f"variant {target.key!r}: endpoint {exc}"
    except SecretError as exc:
        return f"variant {target.key!r}: {exc}"
    # The replay's own trust rules (system store, or exactly the configured CA bundle).
    tls = verify if isinstance(verify, ssl.SSLContext) else tls_verify(verify)
    http1 = not (target.http2 and plain)
    try:
        # Plain-http HTTP/2 variants speak h2c with prior knowledge (as streaming.client does).
        transport = AllowedSyncTransport(allow, verify=tls, http1=http1, http2=target.http2)
        with httpx.Client(timeout=TIMEOUT, transport=transport, trust_env=False, headers=headers) as client:
            response = client.get(url)
    except EgressRefused as exc:
        return f"variant {target.key!r}: {url} refused: {exc}"
    except httpx.TimeoutException:
        return f"variant {target.key!r}: {url} did not answer within {TIMEOUT.read:g} s"
    except httpx.HTTPError as exc:
        return f"variant {target.key!r}: {url} does not answer ({type(exc).__name__}: {exc})"
    if response.status_code != 200:
        return f"variant {target.key!r}: GET {url} answered HTTP {response.status_code}"
    try:
        served = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return f"variant {target.key!r}: GET {url} did not return an OpenAI model list"
    if target.model not in served:
        return f"variant {target.key!r}: model {target.model!r} is not served at {url} (it serves {served})"
    return None


def check(
    targets: Sequence[Target],
    *,
    verify: bool | str = True,
    allow: Allowlist | None = None,
    secrets_dir: str | None = None,
) -> list[str]:
    """Probe every variant at once; the problems found, in variant order (empty: all good)."""
    if not targets:
        return []
    allow = variants.allowlist() if allow is None else allow
    with concurrent.futures.ThreadPoolExecutor(min(16, len(targets))) as pool:
        found = pool.map(lambda t: probe(t, verify=verify, allow=allow, secrets_dir=secrets_dir), targets)
        return [p for p in found if p]
