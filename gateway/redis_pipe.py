"""A lean Redis connection for the gateway's hot path (gateway/shared_limits.py): one asyncio
connection per process, every command written as it is asked for and the replies matched to
the askers in order (Redis answers a connection's commands in the order they came: pipelining).

Why not redis-py's asyncio client: it checks a connection out of its pool for every command
and parses replies in Python layers, ~70 us of the event loop's CPU per call (bench/RESULTS.md,
"Shared client limits"); at 64 streams the gateway's loop queued behind those calls for
milliseconds. Here a call is one ``transport.write`` and one future, and a reply is parsed once:
the replies the limits use are integers, arrays of them, bulk strings and errors (RESP2).

1. ``call`` connects on first use (and after a failure), within the caller's deadline.
2. A caller that gives up (its deadline) leaves its future behind: its reply is read and dropped
   when it comes, so the replies after it still find their askers.
3. ``send`` writes a command nobody waits for (the end of a request: its reply is dropped).
4. A connection that fails or closes fails every waiting call (``ConnectionError``); the next
   call opens a new one.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import unquote, urlsplit

# A connect (and its AUTH/SELECT) in progress is shared by the callers, each leaving it at its
# own deadline; past this it fails and the next call tries again.
CONNECT_TIMEOUT_S = 5.0


class RedisError(Exception):
    """An error reply from Redis (e.g. ``NOSCRIPT``): the message Redis sent."""


def _encode(args: tuple) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self, lost: asyncio.Future) -> None:
        self.transport: asyncio.Transport | None = None
        # one entry per command written, in order: its caller's future, or None (sent, not awaited)
        self.waiting: collections.deque[asyncio.Future | None] = collections.deque()
        self.buf = bytearray()
        self.lost = lost

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        while True:
            try:
                reply, pos2 = _parse(buf, pos)
            except IndexError:  # an incomplete reply: wait for more
                break
            pos = pos2
            if not self.waiting:
                continue  # nobody asked (cannot happen with a sane server)
            fut = self.waiting.popleft()
            if fut is not None and not fut.done():  # else nobody waits (send, or a deadline passed)
                if isinstance(reply, RedisError):
                    fut.set_exception(reply)
                else:
                    fut.set_result(reply)
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        error = ConnectionError(f"the connection to Redis closed: {exc!r}" if exc else "Redis closed it")
        while self.waiting:
            fut = self.waiting.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(error)
        if not self.lost.done():
            self.lost.set_result(None)


def _line_end(buf: bytearray, pos: int) -> int:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise IndexError
    return end


def _parse(buf: bytearray, pos: int) -> tuple[object, int]:
    """One RESP2 reply at ``pos``: (value, the position after it); IndexError if incomplete."""
    if pos >= len(buf):
        raise IndexError
    kind = buf[pos]
    end = _line_end(buf, pos + 1)
    head = bytes(buf[pos + 1 : end])
    if kind == 58:  # ':' integer
        return int(head), end + 2
    if kind == 43:  # '+' simple string
        return head.decode(), end + 2
    if kind == 45:  # '-' error
        return RedisError(head.decode(errors="replace")), end + 2
    if kind == 36:  # '$' bulk string
        n = int(head)
        if n < 0:
            return None, end + 2
        if end + 2 + n + 2 > len(buf):
            raise IndexError
        return bytes(buf[end + 2 : end + 2 + n]), end + 2 + n + 2
    if kind == 42:  # '*' array
        n = int(head)
        if n < 0:
            return None, end + 2
        items = []
        pos = end + 2
        for _ in range(n):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    raise ConnectionError(f"Redis sent a reply this client does not read: {bytes(buf[pos : pos + 40])!r}")


class RedisPipe:
    """One pipelined connection to the Redis of ``url`` (redis:// or rediss://, with the
    user, password and database number it names)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"{url!r}: a redis:// or rediss:// URL")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        path = parts.path.strip("/")
        self.db = int(path) if path.isdigit() else 0
        self.user = unquote(parts.username) if parts.username else ""
        self.password = unquote(parts.password) if parts.password else ""
        self.ssl = ssl.create_default_context() if parts.scheme == "rediss" else None
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        _, proto = await loop.create_connection(lambda: _Protocol(lost), self.host, self.port, ssl=self.ssl)
        hello = []
        if self.password:
            hello.append(("AUTH", self.user, self.password) if self.user else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        for args in hello:
            fut = loop.create_future()
            proto.waiting.append(fut)
            proto.transport.write(_encode(args))  # type: ignore[union-attr]
            await fut
        return proto

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and not proto.lost.done():
            return proto
        if self._connecting is None:  # one connect at a time; the others wait for it
            self._connecting = asyncio.ensure_future(asyncio.wait_for(self._connect(), CONNECT_TIMEOUT_S))
        try:
            proto = await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None
        self._proto = proto
        return proto

    async def call(self, *args: object) -> object:
        """The reply to one command; RedisError for an error reply, ConnectionError/OSError
        when Redis cannot be reached. Cancel it (a deadline) at any time."""
        proto = self._proto
        if proto is None or proto.lost.done():
            proto = await self._connection()
        fut = asyncio.get_running_loop().create_future()
        proto.waiting.append(fut)
        proto.transport.write(_encode(args))  # type: ignore[union-attr]
        return await fut

    def send(self, *args: object) -> bool:
        """Write one command without waiting for its reply (read and dropped when it comes);
        False when there is no open connection to write it on."""
        proto = self._proto
        if proto is None or proto.lost.done():
            return False
        proto.waiting.append(None)
        proto.transport.write(_encode(args))  # type: ignore[union-attr]
        return True

    async def evalsha(self, sha: str, script: str, keys: list[str], args: tuple) -> object:
        """EVALSHA, and once SCRIPT LOAD then EVALSHA again if Redis does not have the script
        (its first use since Redis started or flushed its scripts)."""
        try:
            return await self.call("EVALSHA", sha, len(keys), *keys, *args)
        except RedisError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self.call("SCRIPT", "LOAD", script)
        return await self.call("EVALSHA", sha, len(keys), *keys, *args)

    async def aclose(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()
