"""Fetching a variant's Prometheus ``/metrics`` during a replay, under the replay's egress rules.

The same rules as the requests the replay measures (streaming/egress.py): the connection goes
only to an address the variant allowlist accepts, checked after name resolution and pinned
(AllowedTransport), never through a proxy from the environment; TLS is verified as for the
variant's requests; the variant's named secret rides as its Authorization header and never in
an error. Every fetch is bounded in time (connect, each read, and the whole fetch) and in size
(the body is read in pieces and abandoned past ``max_bytes``), so a slow or huge answer costs
the replay one failed scrape, never a stuck or swollen worker.

vLLM serves ``/metrics`` at the server root (not under /v1), as the simulator does.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping

import httpx

from streaming.egress import Allowlist, EgressRefused
from streaming.endpoint import Endpoint
from streaming.transports import egress_client

SCRAPE_TIMEOUT_S = 2.0
# vLLM's exposition is a few hundred kB at most (one engine: ~60 kB); far past that is not it.
SCRAPE_MAX_BYTES = 8 * 1024 * 1024


class ScrapeError(RuntimeError):
    """A scrape that gave no usable exposition (status, size, timeout, refused, not text)."""


def metrics_url(endpoint: str) -> str:
    """The /metrics URL of a variant whose endpoint is its OpenAI base URL (``.../v1``)."""
    return Endpoint.parse(endpoint).root + "/metrics"


class MetricsFetcher:
    """GETs one variant's /metrics; ``fetch()`` returns the text or raises ScrapeError."""

    def __init__(
        self,
        endpoint: str,
        *,
        allow: Allowlist | None,
        verify: bool | str | ssl.SSLContext = True,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        max_bytes: int = SCRAPE_MAX_BYTES,
    ) -> None:
        if timeout_s <= 0 or max_bytes <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) and max_bytes ({max_bytes}) must be positive")
        self.url = metrics_url(endpoint)
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self._client = egress_client(
            allow=allow,
            verify=verify,
            timeout_s=timeout_s,
            headers={**(headers or {}), "accept": "text/plain"},
            follow_redirects=False,
        )

    async def fetch(self) -> str:
        try:
            return await asyncio.wait_for(self._fetch(), self.timeout_s)
        except TimeoutError:
            raise ScrapeError(f"GET {self.url}: no complete answer within {self.timeout_s:g} s") from None
        except (httpx.HTTPError, EgressRefused) as exc:
            raise ScrapeError(f"GET {self.url}: {type(exc).__name__}: {exc}") from None

    async def _fetch(self) -> str:
        async with self._client.stream("GET", self.url) as resp:
            if resp.status_code != 200:
                raise ScrapeError(f"GET {self.url}: HTTP {resp.status_code}")
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > self.max_bytes:
                    raise ScrapeError(f"GET {self.url}: the answer is larger than {self.max_bytes} bytes")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            raise ScrapeError(f"GET {self.url}: the answer is not UTF-8 text") from None

    async def aclose(self) -> None:
        await self._client.aclose()
