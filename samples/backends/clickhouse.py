"""The sample store on a ClickHouse server, through clickhouse-driver (native protocol).

Many processes share one server (workers, the web process, benches); each thread of a process
gets its own connection. Transient failures (network, server busy) are retried with backoff and
then raised as StoreUnavailable; anything else is a permanent StoreError at once.

Inserts encode the validated columns into one native block themselves (_encoder, _send_block)
and send it through the driver's connection, query and packet handling: this leans on
clickhouse-driver 0.2.11 internals (Client.receive_sample_block, Connection.fout), so a driver
upgrade must run tests/samples (every column type round-trips on the server there).
"""

from __future__ import annotations

import datetime as dt
import operator
import os
import struct
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from samples import columns as colmod
from samples.schema import SAMPLES_SORT_KEY, SAMPLES_TABLE
from samples.store import (
    QuerySettings,
    QueryTimeout,
    SampleStore,
    StoreError,
    StoreUnavailable,
    check_ident,
    query_settings,
)

_TIMEOUT_EXCEEDED = 159
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

    def prepare_for_writes(self) -> None:
        """Import the driver's modules an insert uses (the client, its errors, the block writer
        of _send_block) now: imported on first use they cost 0.1-0.2 s in the sink's thread, the
        first write of a replay shard, holding the interpreter against its event loop while
        sends are due. Reading processes never import them for writing."""
        import clickhouse_driver.block  # noqa: F401
        import clickhouse_driver.errors  # noqa: F401
        import clickhouse_driver.protocol  # noqa: F401
        import clickhouse_driver.varint  # noqa: F401
        import clickhouse_driver.writer  # noqa: F401
        from clickhouse_driver import Client  # noqa: F401

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

    def _select(
        self, sql: str, settings: QuerySettings | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        chosen = query_settings(settings)

        def select(client: Any) -> Any:
            from clickhouse_driver import errors

            try:
                return client.execute(sql, with_column_types=True, settings=chosen or None)
            except errors.ServerException as e:
                # Past the time limit we set: the same query would only time out again, so no
                # retry (TIMEOUT_EXCEEDED is otherwise transient: a server-wide limit, a busy server).
                if e.code == _TIMEOUT_EXCEEDED and "max_execution_time" in chosen:
                    raise QueryTimeout(
                        f"{self.describe()}: query stopped after max_execution_time = "
                        f"{chosen['max_execution_time']} s"
                    ) from e
                raise

        try:
            rows, types = self._run(select, "query")
        except StoreError as e:
            if isinstance(e.__cause__, QueryTimeout):  # _run wrapped it: hand it on as it is
                raise e.__cause__ from e.__cause__.__cause__
            raise
        names = [n for n, _t in types]
        return names, [tuple(_normalize_value(v) for v in r) for r in rows]

    def _insert_columns(self, table: str, cols: dict[str, np.ndarray]) -> None:
        # The validated arrays are encoded here, a whole column at a time (numpy bytes, one
        # C-level pass per string column), and the block is sent as it is: clickhouse-driver's
        # own column writers loop in Python over every Nullable, LowCardinality and DateTime
        # value, which cost more than the validation (bench/bench_insert.py).
        names = list(cols)
        sql = f"INSERT INTO {table} ({', '.join(names)}) VALUES"
        n = len(cols[names[0]])
        dictionaries = {
            name: _dictionary(arr)
            for name, arr in cols.items()
            if colmod.BY_NAME[name].ch_type.startswith("LowCardinality(")
        }
        order = None
        if table == SAMPLES_TABLE and set(SAMPLES_SORT_KEY) <= cols.keys():
            order = _sort_order(cols, dictionaries, SAMPLES_SORT_KEY)
        encoders = [
            _encoder(colmod.BY_NAME[name], cols[name], order, dictionaries.get(name)) for name in names
        ]
        self._run(lambda c: _send_block(c, sql, names, encoders, n), f"insert into {table}")


def _dictionary(arr: np.ndarray) -> tuple[list[str], np.ndarray]:
    """A LowCardinality(String) column as its distinct values, sorted, and each row's index into
    them (uint8/16/32/64 by their number): the block's dictionary and keys, and a sort key."""
    values = arr.tolist()
    distinct = sorted(set(values))
    size = len(distinct)
    key_dtype = "<u1" if size <= 1 << 8 else "<u2" if size <= 1 << 16 else "<u4" if size <= 1 << 32 else "<u8"
    if size <= 8:  # the usual few names: one vectorized comparison per name after the first
        keys = np.zeros(len(values), dtype=key_dtype)
        for i, v in enumerate(distinct[1:], 1):
            keys[arr == v] = i
    else:
        index = {v: i for i, v in enumerate(distinct)}
        keys = np.fromiter(map(index.__getitem__, values), dtype=key_dtype, count=len(values))
    return distinct, keys


def _sort_order(
    cols: dict[str, np.ndarray], dictionaries: dict[str, tuple[list[str], np.ndarray]], key: Sequence[str]
) -> np.ndarray | None:
    """The permutation putting the rows in the table's sorting-key order, or None when they are
    in it already. Stable: rows with equal keys keep their order, so the replacing engine still
    keeps the last of two equal recordings. The server then finds the block sorted and skips
    its own sort and the copy of every column that follows it: per 10k bench rows, 4-7 ms less
    server user time (system.query_log), for ~2 ms of client time (this, and each column's
    permutation in _encoder).

    1. LowCardinality key columns sort by their dictionary index (the dictionary is sorted),
       numbers by themselves; a column holding one value is left out.
    2. A String key column (request_id) would need its strings sorted: it only decides between
       rows equal in every key before it, so it is ranked only if such rows exist."""

    def ranks(name: str) -> np.ndarray | None:
        if name in dictionaries:
            distinct, keys = dictionaries[name]
            return keys if len(distinct) > 1 else None
        arr = cols[name]
        if arr.dtype != object:
            return arr
        index = {v: i for i, v in enumerate(sorted(set(arr.tolist())))}
        return np.fromiter(map(index.__getitem__, arr.tolist()), dtype=np.intp, count=len(arr))

    first_string = next(
        (i for i, name in enumerate(key) if name not in dictionaries and cols[name].dtype == object), len(key)
    )
    head = [r for r in map(ranks, key[:first_string]) if r is not None]
    order = np.lexsort(head[::-1]) if head else np.arange(len(cols[key[0]]))
    if first_string < len(key):
        tied = np.ones(len(order) - 1, dtype=bool)
        for r in head:
            in_order = r[order]
            tied &= in_order[1:] == in_order[:-1]
        if tied.any():  # rows equal up to the String key: sort by every key
            every = [r for r in map(ranks, key) if r is not None]
            order = np.lexsort(every[::-1])
    if (order[1:] > order[:-1]).all():
        return None
    return order


# ---- the native block, written by us --------------------------------------------------------
# Formats as clickhouse-driver 0.2.11 writes them (columns/*.py), for the types in COLUMNS only:
# fixed-width numbers little-endian; Nullable(T): one null byte per row, then T with 0 for NULL;
# String: varint length + UTF-8 per value; LowCardinality(String): keys version 1, then the
# dictionary (String) and one key per row (UInt8/16/32/64 by dictionary size); Array(UInt32):
# each row's end offset into the values (UInt64, cumulative), then every row's values.
_LC_FLAGS = (1 << 9) | (1 << 10)  # has additional keys | update dictionary
_LC_KEY_TYPES = {1: 0, 2: 1, 4: 2, 8: 3}  # key width in bytes -> UInt8/16/32/64 in the flags
_LE_DTYPES = {
    "u8": "<u1",
    "u16": "<u2",
    "u32": "<u4",
    "u64": "<u8",
    "i64": "<i8",
    "datetime": "<u4",
    "f64": "<f8",
}


def _encoder(
    col: colmod.Column,
    arr: np.ndarray,
    order: np.ndarray | None = None,
    dictionary: tuple[list[str], np.ndarray] | None = None,
) -> Callable[[Any], None]:
    """A function writing one validated column (samples.columns.validate_columns' dtypes) into
    the driver's buffered socket writer, its rows in `order` (None: as they are).
    LowCardinality columns come as their _dictionary."""
    kind = col.kind
    if dictionary is not None:
        distinct, keys_arr = dictionary
        keys = (keys_arr if order is None else keys_arr[order]).tobytes()
        # keys version 1, then flags with the key width, dictionary size (n >= 1: never empty)
        head = struct.pack("<qqq", 1, _LC_FLAGS | _LC_KEY_TYPES[keys_arr.itemsize], len(distinct))
        rows = struct.pack("<q", len(keys_arr))

        def write(buf: Any) -> None:
            buf.write(head)
            buf.write_strings(distinct, encoding="utf-8")
            buf.write(rows)
            buf.write(keys)

        return write
    if order is not None:
        arr = arr[order]
    if kind in _LE_DTYPES:
        data = np.ascontiguousarray(arr, dtype=_LE_DTYPES[kind]).tobytes()
        return lambda buf: buf.write(data)
    if kind == "nf64":
        null = np.isnan(arr)
        data = null.view(np.uint8).tobytes() + np.where(null, 0.0, arr).astype("<f8").tobytes()
        return lambda buf: buf.write(data)
    if kind == "nu64":  # an object array of int | None
        items = arr.tolist()
        nulls = items.count(None)
        if nulls == len(items):  # all NULL (a server that reports no timestamps)
            data = b"\x01" * len(items) + bytes(8 * len(items))
        else:
            null = np.zeros(len(items), dtype=np.uint8)
            if nulls:
                null = np.fromiter(map(operator.is_, items, repeat(None)), dtype=np.uint8, count=len(items))
                items = [0 if v is None else v for v in items]
            data = null.tobytes() + np.array(items, dtype="<u8").tobytes()
        return lambda buf: buf.write(data)
    if kind == "au32":  # an object array of uint32 arrays
        parts = arr.tolist()
        ends = np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), dtype=np.int64)
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
        data = ends.astype("<u8").tobytes() + values.astype("<u4").tobytes()
        return lambda buf: buf.write(data)
    if col.ch_type != "String":
        raise StoreError(f"insert: no block encoding for column {col.name} ({col.ch_type})")
    values = arr.tolist()
    return lambda buf: buf.write_strings(values, encoding="utf-8")


def _send_block(
    client: Any, sql: str, names: list[str], encoders: list[Callable[[Any], None]], n: int
) -> None:
    """INSERT one block of n rows: clickhouse-driver's insert flow (Client.process_insert_query,
    Connection.send_data), with the column data written by `encoders` instead of the driver's
    column classes. The server's sample block must name our columns with our types."""
    from clickhouse_driver import defines
    from clickhouse_driver.block import BlockInfo, ColumnOrientedBlock
    from clickhouse_driver.protocol import ClientPacketTypes
    from clickhouse_driver.varint import write_varint
    from clickhouse_driver.writer import write_binary_str

    with client.disconnect_on_error(sql, None):
        conn = client.connection
        if conn.compression:
            raise StoreError("the native block writer does not compress; connect without compression")
        conn.send_query(sql)
        conn.send_external_tables(None)
        sample = client.receive_sample_block()
        want = [(name, colmod.BY_NAME[name].ch_type) for name in names]
        got = [tuple(ct) for ct in sample.columns_with_types]
        if got != want:
            raise StoreError(f"insert: the server's columns {got} are not the table's {want}")
        revision = conn.server_info.used_revision
        out = conn.fout
        write_varint(ClientPacketTypes.DATA, out)
        if revision >= defines.DBMS_MIN_REVISION_WITH_TEMPORARY_TABLES:
            write_binary_str("", out)
        if revision >= defines.DBMS_MIN_REVISION_WITH_BLOCK_INFO:
            BlockInfo().write(out)
        write_varint(len(names), out)
        write_varint(n, out)
        for (name, ch_type), encode in zip(want, encoders, strict=True):
            write_binary_str(name, out)
            write_binary_str(ch_type, out)
            if revision >= defines.DBMS_MIN_REVISION_WITH_CUSTOM_SERIALIZATION:
                out.write(b"\x00")  # no sparse serialization
            encode(out)
        out.flush()
        client.receive_profile_events()
        conn.send_data(ColumnOrientedBlock())  # the empty block: end of data
        client.receive_profile_events()
        client.receive_end_of_insert_query()
