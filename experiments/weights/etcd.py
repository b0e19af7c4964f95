"""The one etcd wrapper: weights documents under a key prefix, via ``pyetcd``
(PyPI etcd-sdk-python 0.0.7, the python-etcd3 API on current protobuf).

Fixed timeouts and bounded retries:
- every RPC has a ``timeout`` deadline (default 2 s);
- reads are retried up to ``READ_TRIES`` times on transient errors, then StoreUnavailable;
- a compare-and-set write is retried the same way; when a retry finds the key already holding
  exactly our bytes, the earlier attempt landed and that is success, not a conflict.
The endpoints are built by hand with ``time_retry=0.5``: pyetcd's default ``client()`` marks a
node failed for 300 s after one error, which would outlive an etcd restart by minutes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exceptions
from pyetcd.events import DeleteEvent

from experiments.weights.errors import ConflictError, StoreUnavailable, WatchCompacted
from experiments.weights.store import (
    Listing,
    StoredValue,
    WatchEvent,
    WeightsStore,
    check_key,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/abplat/experiments/"
DEFAULT_TIMEOUT_S = 2.0
READ_TRIES = 3
RETRY_BACKOFF_S = (0.2, 0.4)
IDLE_TICK_S = 0.25
# gRPC's own reconnect backoff grows to 120 s by default; cap it so a restarted etcd is found
# within a second.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# What a down, restarting or unreachable etcd looks like through pyetcd. ValueError is raised by
# Endpoint.use() for a node still inside its time_retry window.
TRANSIENT = (etcd_exceptions.Etcd3Exception, grpc.RpcError, ValueError)

T = TypeVar("T")


class EtcdWeightsStore(WeightsStore):
    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        if not endpoints:
            raise ValueError("etcd endpoints: at least one host:port is required")
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"etcd prefix: must start and end with '/', got {prefix!r}")
        self.prefix = prefix
        self.endpoints = list(endpoints)
        self.description = f"etcd {','.join(f'{h}:{p}' for h, p in self.endpoints)} prefix {prefix}"
        self._client = pyetcd.MultiEndpointEtcd3Client(
            endpoints=[
                pyetcd.Endpoint(host, port, secure=False, time_retry=0.5, opts=CHANNEL_OPTIONS)
                for host, port in self.endpoints
            ],
            timeout=timeout,
            failover=True,
        )

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _retrying(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(READ_TRIES):
            try:
                return call(*args, **kwargs)
            except etcd_exceptions.RevisionCompactedError:
                raise
            except TRANSIENT as exc:
                if attempt == READ_TRIES - 1:
                    raise StoreUnavailable(
                        f"{self.description}: {what} failed after {READ_TRIES} tries: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                time.sleep(RETRY_BACKOFF_S[attempt])
        raise AssertionError("unreachable")

    # WeightsStore ----------------------------------------------------------------------

    def get_raw(self, key: str) -> StoredValue | None:
        check_key(key)
        value, meta = self._retrying(f"get {key}", self._client.get, self._key(key))
        if meta is None:
            return None
        return StoredValue(key, bytes(value), meta.mod_revision)

    def list_raw(self) -> Listing:
        response = self._retrying("list", self._client.get_prefix_response, self.prefix)
        values = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8", errors="replace")[len(self.prefix) :]
            values[key] = StoredValue(key, bytes(kv.value), kv.mod_revision)
        return Listing(values=values, revision=response.header.revision)

    def put_raw(self, key: str, raw: bytes, expected_revision: int) -> int:
        check_key(key)
        full = self._key(key)
        tx = self._client.transactions
        # Create only when absent (version == 0); else only if nobody wrote since our read.
        if expected_revision == 0:
            compare = [tx.version(full) == 0]
        else:
            compare = [tx.mod(full) == expected_revision]
        for attempt in range(READ_TRIES):
            try:
                ok, responses = self._client.transaction(
                    compare=compare, success=[tx.put(full, raw)], failure=[tx.get(full)]
                )
            except TRANSIENT as exc:
                if attempt == READ_TRIES - 1:
                    raise StoreUnavailable(
                        f"{self.description}: write of {key} failed after {READ_TRIES} tries "
                        f"(it may or may not have landed; re-read before retrying): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                time.sleep(RETRY_BACKOFF_S[attempt])
                continue
            if ok:
                return responses[0].response_put.header.revision
            current = responses[0][0] if responses and responses[0] else None
            actual = current[1].mod_revision if current is not None else 0
            if attempt > 0 and current is not None and bytes(current[0]) == raw:
                return actual  # our earlier, ambiguous attempt did land
            raise ConflictError(key, expected_revision, actual)
        raise AssertionError("unreachable")

    def delete(self, key: str) -> int:
        check_key(key)
        tx = self._client.transactions
        full = self._key(key)
        _, responses = self._retrying(
            f"delete {key}",
            self._client.transaction,
            compare=[],
            success=[tx.delete(full)],
            failure=[],
        )
        return responses[0].response_delete_range.header.revision

    def watch(self, start_revision: int, stop: threading.Event) -> Iterator[list[WatchEvent]]:
        inbox: queue.Queue[Any] = queue.Queue()
        try:
            watch_id = self._client.add_watch_prefix_callback(
                self.prefix, inbox.put, start_revision=max(start_revision, 1)
            )
        except etcd_exceptions.RevisionCompactedError as exc:
            raise WatchCompacted(exc.compacted_revision) from exc
        except TRANSIENT as exc:
            raise StoreUnavailable(
                f"{self.description}: cannot register watch from revision {start_revision}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            yield []  # registered: the caller may count it before any change arrives
            while not stop.is_set():
                try:
                    item = inbox.get(timeout=IDLE_TICK_S)
                except queue.Empty:
                    yield []
                    continue
                if isinstance(item, etcd_exceptions.RevisionCompactedError):
                    raise WatchCompacted(item.compacted_revision)
                if item is None or isinstance(item, BaseException):
                    # An etcd restart ends the gRPC stream once (UNAVAILABLE) and then goes
                    # silent: the caller must register a new watch from its last revision.
                    raise StoreUnavailable(
                        f"{self.description}: watch stream ended: {type(item).__name__}: {item}"
                    )
                yield [self._event(ev) for ev in item.events]
        finally:
            try:
                self._client.cancel_watch(watch_id)
            except TRANSIENT:
                pass  # the stream is gone already

    def _event(self, ev: Any) -> WatchEvent:
        key = ev.key.decode("utf-8", errors="replace")[len(self.prefix) :]
        if isinstance(ev, DeleteEvent):
            return WatchEvent(key, None, ev.mod_revision)
        return WatchEvent(key, bytes(ev.value), ev.mod_revision)

    def close(self) -> None:
        try:
            self._client.close()
        except TRANSIENT:
            pass
