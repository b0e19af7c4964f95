"""The sample store on a ClickHouse server, through clickhouse-driver (native protocol).

Many processes share one server (workers, the web process, benches); each thread of a process
gets its own connection. Transient failures (network, server busy) are retried with backoff and
then raised as StoreUnavailable; anything else is a permanent StoreError at once.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from samples import columns as colmod
from samples.store import SampleStore, StoreError, StoreUnavailable, check_ident

# ClickHouse error codes worth a retry: the server is busy or the connection broke.
_TRANSIENT_SERVER_CODES = {
    159,  # TIMEOUT_EXCEEDED
    202,  # TOO_MANY_SIMULTANEOUS_QUERIES
    209,  # SOCKET_TIMEOUT
    210,  # NETWORK_ERROR
    252,  # TOO_MANY_PARTS
    319,  # UNKNOWN_STATUS_OF_INSERT
}


def _normalize_value(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, list):
        return [_normalize_value(x) for x in v]
    return v


class ClickHouseServerBackend(SampleStore):
    backend_name = "clickhouse-server"
    parallel_queries = 4  # a connection per thread (self._local); the server runs them together

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 3.0,
        send_receive_timeout: float = 30.0,
        tries: int = 3,
        backoff_s: Sequence[float] = (0.2, 0.5),
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("clickhouse", "clickhouses") or not parts.hostname:
            raise StoreError(
                f"ClickHouse URL {url!r} must look like clickhouse://user:password@host:port/db"
                " (clickhouses:// for TLS)"
            )
        self.database = check_ident(parts.path.lstrip("/") or "default", "ClickHouse database")
        if tries < 1:
            raise StoreError(f"tries must be >= 1, got {tries}")
        self._conn_kwargs = {
            "host": parts.hostname,
            "port": parts.port or (9440 if parts.scheme == "clickhouses" else 9000),
            "secure": parts.scheme == "clickhouses",
            "user": urllib.parse.unquote(parts.username or "default"),
            "password": urllib.parse.unquote(parts.password or ""),
            "connect_timeout": connect_timeout,
            "send_receive_timeout": send_receive_timeout,
            "sync_request_timeout": min(5.0, send_receive_timeout),
        }
        self.url_safe = f"clickhouse://{parts.hostname}:{parts.port or 9000}/{self.database}"
        self._tries = tries
        self._backoff = tuple(backoff_s)
        self._local = threading.local()  # clickhouse-driver clients are not thread-safe
        self._pid = os.getpid()

    def describe(self) -> str:
        return f"{self.backend_name} {self.url_safe}"

    def _client(self, database: str | None = None) -> Any:
        from clickhouse_driver import Client

        if os.getpid() != self._pid:
            # A forked child must not share the parent's socket: start fresh.
            self._local = threading.local()
            self._pid = os.getpid()
        key = database or self.database
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        if key not in clients:
            clients[key] = Client(database=key, **self._conn_kwargs)
        return clients[key]

    def close(self) -> None:
        for c in getattr(self._local, "clients", {}).values():
            c.disconnect()
        self._local = threading.local()

    @staticmethod
    def _is_transient(e: BaseException) -> bool:
        from clickhouse_driver import errors

        if isinstance(e, errors.ServerException):
            return e.code in _TRANSIENT_SERVER_CODES
        return isinstance(
            e,
            errors.NetworkError
            | errors.SocketTimeoutError
            | errors.UnexpectedPacketFromServerError
            | EOFError
            | ConnectionError
            | TimeoutError
            | OSError,
        )

    def _run(
        self,
        fn: Callable[[Any], Any],
        what: str,
        database: str | None = None,
        tries: int | None = None,
    ) -> Any:
        tries = tries or self._tries
        last: BaseException | None = None
        for attempt in range(tries):
            client = self._client(database)
            try:
                return fn(client)
            except Exception as e:
                client.disconnect()  # never reuse a connection in an unknown state
                if not self._is_transient(e):
                    # 18.16 appends a server stack trace to every message: keep the message.
                    msg = str(e).split("Stack trace:", 1)[0].strip()
                    raise StoreError(f"{self.describe()}: {what} failed: {msg}") from e
                last = e
                if attempt + 1 < tries:
                    time.sleep(self._backoff[min(attempt, len(self._backoff) - 1)])
        raise StoreUnavailable(
            f"{self.describe()} unavailable after {tries} tries ({what}): {last}. "
            "Is it running? (scripts/clickhouse.sh start)"
        ) from last

    def ping(self) -> None:
        # /healthz wants the truth now, not after backoff: one try.
        self._run(lambda c: c.execute("SELECT 1"), "ping", tries=1)

    def ensure_database(self) -> None:
        self._run(
            lambda c: c.execute(f"CREATE DATABASE IF NOT EXISTS {self.database}"),
            "create database",
            database="default",
        )

    def _command(self, sql: str) -> None:
        self._run(lambda c: c.execute(sql), sql.split("\n", 1)[0][:80])

    def _select(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        rows, types = self._run(lambda c: c.execute(sql, with_column_types=True), "query")
        names = [n for n, _t in types]
        return names, [tuple(_normalize_value(v) for v in r) for r in rows]

    def _insert_columns(self, table: str, cols: dict[str, np.ndarray]) -> None:
        # The validated arrays go in as they are (numpy columnar is clickhouse-driver's fastest
        # insert path, bench/bench_insert.py), but for two types the driver reads differently.
        arrays = [_for_driver(colmod.BY_NAME[n].kind, arr) for n, arr in cols.items()]
        sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES"
        self._run(
            lambda c: c.execute(sql, arrays, columnar=True, settings={"use_numpy": True}),
            f"insert into {table}",
        )


def _for_driver(kind: str, arr: np.ndarray) -> np.ndarray:
    if kind == "datetime":
        return arr.astype("datetime64[s]")
    if kind == "nf64":
        # The driver's numpy Nullable(Float64) takes NULL only as None (a NaN is stored as NaN).
        null = np.isnan(arr)
        if null.any():
            arr = arr.astype(object)
            arr[null] = None
    return arr
