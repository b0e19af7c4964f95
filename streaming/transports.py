"""httpx transports whose every new connection passes the egress check (streaming/egress.py):
the name is resolved once, every address it got is checked, and only checked addresses are
dialled, so it cannot be rebound between the check and the connect. TLS still verifies the
certificate against the URL's host name (SNI), and HTTP/2 still negotiates as before.

Every outbound call but the HTTP/1.1 core's goes through them: the replay's HTTP/2 path
(streaming/client.py), the tokenizer probe, the metrics scrape, the preflight, the rollout
webhooks. ``egress_client`` builds the asyncio client the probe and the scrape share.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import httpcore
import httpx

from streaming.egress import Allowlist, EgressRefused, allowed_addresses, allowed_addresses_sync
from streaming.tls import tls_verify


# egress: resolve once, check every address, dial only those ----------------------------------
class _AllowedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's asyncio backend, dialling only addresses the allowlist accepts. httpcore
    hands it the URL's host; TLS is started afterwards with that host as SNI and for the
    certificate check, so pinning the address changes nothing the server sees."""

    def __init__(self, allow: Allowlist) -> None:
        self._allow = allow
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                addresses = await allowed_addresses(host, port, self._allow)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host!r} took over {timeout}s") from None
        except OSError as exc:
            raise httpcore.ConnectError(error_text(exc)) from None
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise EgressRefused("unix sockets are not variant endpoints")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# (host, port) -> the addresses that may be dialled, in order, resolved once; EgressRefused,
# or the OSError of a failed lookup.
AddressCheck = Callable[[str, int], Sequence[str]]


class _AllowedSyncBackend(httpcore.NetworkBackend):
    """The blocking twin of _AllowedBackend (the preflight's httpx.Client). ``addresses``
    replaces the allowlist's rule (allowed_addresses_sync) with another resolve-and-check step
    (the rollout webhooks' rule), dialled the same way."""

    def __init__(self, allow: Allowlist | None, addresses: AddressCheck | None = None) -> None:
        if addresses is None:
            if allow is None:
                raise ValueError("_AllowedSyncBackend: give an allowlist or an address check")
            addresses = functools.partial(allowed_addresses_sync, allow=allow)
        self._addresses = addresses
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = self._addresses(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(error_text(exc)) from None
        error: Exception | None = None
        for address in addresses:
            try:
                return self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None
        raise error

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise EgressRefused("unix sockets are not variant endpoints")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# httpx's own default pool size, for the clients that do not size theirs.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)


def _pool_options(verify: bool | ssl.SSLContext, http1: bool, http2: bool, limits: httpx.Limits) -> dict:
    return {
        "ssl_context": httpx.create_ssl_context(verify=verify, trust_env=False),
        "max_connections": limits.max_connections,
        "max_keepalive_connections": limits.max_keepalive_connections,
        "keepalive_expiry": limits.keepalive_expiry,
        "http1": http1,
        "http2": http2,
    }


class AllowedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport on a pool whose connections pass the egress check. httpcore's pool
    takes a network backend; httpx's transport does not pass one on, so the pool it built is
    replaced by the same pool with ours (everything else, errors included, stays httpx's)."""

    def __init__(
        self,
        allow: Allowlist,
        *,
        verify: bool | ssl.SSLContext,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(verify=verify, http1=http1, http2=http2, limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            **_pool_options(verify, http1, http2, limits), network_backend=_AllowedBackend(allow)
        )


class AllowedSyncTransport(httpx.HTTPTransport):
    """The blocking twin of AllowedTransport. ``addresses``: another resolve-and-check step
    than the allowlist's (``allow`` is then None), e.g. the rollout webhooks' rule."""

    def __init__(
        self,
        allow: Allowlist | None,
        *,
        verify: bool | ssl.SSLContext,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits = DEFAULT_LIMITS,
        addresses: AddressCheck | None = None,
    ) -> None:
        super().__init__(verify=verify, http1=http1, http2=http2, limits=limits, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            **_pool_options(verify, http1, http2, limits),
            network_backend=_AllowedSyncBackend(allow, addresses),
        )


def egress_client(
    *,
    allow: Allowlist | None,
    verify: bool | str | ssl.SSLContext,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    **options: Any,
) -> httpx.AsyncClient:
    """An asyncio httpx client for small calls to a variant's server (its /tokenize, its
    /metrics): the egress check on every connection (none without ``allow``), the TLS rule of
    streaming/tls.py, no proxy from the environment, one timeout for every phase."""
    tls = verify if isinstance(verify, ssl.SSLContext) else tls_verify(verify)
    return httpx.AsyncClient(
        verify=tls,
        timeout=httpx.Timeout(timeout_s),
        trust_env=False,
        transport=None if allow is None else AllowedTransport(allow, verify=tls),
        headers=dict(headers or {}),
        **options,
    )


def error_text(exc: BaseException) -> str:
    """An exception as a sample's error says it: its type, and its message when it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
