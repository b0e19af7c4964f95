"""Before a replay starts: does every variant's endpoint answer, and does it serve the model?

One ``GET {base}/v1/models`` per variant (the OpenAI-compatible model list that vLLM and the
simulator serve) with short timeouts, all variants probed at once, so a dead port or a wrong
model name is reported in a second or two instead of as a run full of connect errors or 404s.
Whether the requests fit each variant's API is decided offline (replay.shapes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ssl
from collections.abc import Sequence

import httpx

from streaming.client import tls_verify

TIMEOUT = httpx.Timeout(3.0, connect=2.0)


@dataclasses.dataclass(frozen=True)
class Target:
    key: str
    endpoint: str  # the variant's OpenAI-style base URL (".../v1")
    model: str
    http2: bool = False


def models_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return f"{base}/v1/models"


def probe(target: Target, *, verify: bool | str | ssl.SSLContext = True) -> str | None:
    """None when the variant answers and lists its model; otherwise one line saying what is wrong."""
    url = models_url(target.endpoint)
    plain = url.startswith("http://")
    # The replay's own trust rules (system store, or exactly the configured CA bundle).
    tls = verify if isinstance(verify, ssl.SSLContext) else tls_verify(verify)
    try:
        # Plain-http HTTP/2 variants speak h2c with prior knowledge (as streaming.client does).
        with httpx.Client(timeout=TIMEOUT, verify=tls, trust_env=False, http2=target.http2,
                          http1=not (target.http2 and plain)) as client:  # fmt: skip
            response = client.get(url)
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


def check(targets: Sequence[Target], *, verify: bool | str = True) -> list[str]:
    """Probe every variant at once; the problems found, in variant order (empty: all good)."""
    if not targets:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(16, len(targets))) as pool:
        return [p for p in pool.map(lambda t: probe(t, verify=verify), targets) if p]
