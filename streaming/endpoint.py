"""Where a variant is: its base URL parsed once, for every path that speaks to it (the replay's
client, the gateway's upstream pools, the tokenizer probe, the metrics scrape)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from streaming.egress import EgressError, split_url


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A variant's OpenAI-style base URL (``https://host:8443/prefix/v1``), parsed: http(s)
    only, no credentials in it (the message never repeats the URL: it may carry a password)."""

    scheme: str
    host: str
    port: int
    base_path: str  # the URL's path without a trailing /v1 (the API paths carry /v1)
    host_header: str  # built from host and port, never the netloc: nothing but the host reaches Host

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        try:
            split_url(url)
        except EgressError as exc:
            raise ValueError(f"endpoint: {exc}") from None
        base = url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        parts = urllib.parse.urlsplit(base)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host_header = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        return cls(parts.scheme, host, port, parts.path.rstrip("/"), host_header)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def root(self) -> str:
        """The server's root URL (where /tokenize and /metrics live), without /v1."""
        return f"{self.scheme}://{self.host_header}{self.base_path}"
