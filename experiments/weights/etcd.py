"""The one etcd wrapper: weights documents under a key prefix, via ``pyetcd``
(PyPI etcd-sdk-python 0.0.7, the python-etcd3 API on current protobuf).

Fixed timeouts and bounded retries:
- every RPC has a ``timeout`` deadline (default 2 s);
- reads are retried up to ``READ_TRIES`` times on transient errors, then StoreUnavailable;
- a compare-and-set write is retried the same way; when a retry finds the key already holding
  exactly our bytes, the earlier attempt landed and that is success, not a conflict;
- a refusal no retry can fix (wrong password, a role without access to the prefix, a client
  certificate etcd rejects) is StoreAuthError at once.
The endpoints are built by hand with ``time_retry=0.5``: pyetcd's default ``client()`` marks a
node failed for 300 s after one error, which would outlive an etcd restart by minutes.

Security (optional; ``factory.etcd_security`` checks the settings):
- TLS: a CA bundle for etcd's server certificate and a client certificate and key for etcd's
  ``--client-cert-auth``;
- a user and password: ``Authenticate`` returns a token that every call carries as the
  ``token`` metadata, watches included. Tokens die (a simple token after ``--auth-token-ttl``
  idle seconds and on every etcd restart, a JWT at its expiry), so when etcd answers "invalid
  auth token" we authenticate again and repeat the call once. pyetcd's own ``user=`` support
  authenticates once in its constructor and never again, so we do it ourselves.

Watches run on a Watch stream of their own instead of pyetcd's shared watcher: pyetcd ignores a
watch that etcd creates and cancels in the same answer, which is how etcd refuses one (a token
it no longer knows, a role without read access), and the router would then wait forever for
events. Here that refusal is an error and the watch is registered again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exceptions
from pyetcd.utils import prefix_range_end

from experiments.weights.errors import ConflictError, StoreAuthError, StoreUnavailable, WatchCompacted
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
# gRPC codes after which this endpoint is marked failed (pyetcd's own list), so a cluster fails
# over to the next endpoint.
ENDPOINT_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
# etcd's answers to a token it does not (or no longer) accept: authenticate again and retry.
TOKEN_REJECTED = (
    "invalid auth token",  # expired or unknown token (Unauthenticated)
    "revision of auth store is old",  # users or roles changed since the token was issued
    "user name is empty",  # auth was enabled after we found it off
)

T = TypeVar("T")


def _rpc_error(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error behind ``exc``: pyetcd turns some into bare ``ConnectionFailedError()``
    ("etcd connection failed"), keeping the one that says why as the context."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        if isinstance(current, grpc.RpcError) and hasattr(current, "code"):
            return current
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def _details(exc: BaseException) -> str:
    rpc = _rpc_error(exc)
    if rpc is None:
        return f"{type(exc).__name__}: {exc}"
    code = rpc.code()
    text = rpc.details() or ""
    prefix = f"{type(exc).__name__}: " if rpc is not exc else ""
    return f"{prefix}{code.name if code else 'UNKNOWN'}: {text}"


def _token_rejected(exc: BaseException) -> bool:
    rpc = _rpc_error(exc)
    if rpc is None:
        return False
    text = (rpc.details() or "").lower()
    return any(reason in text for reason in TOKEN_REJECTED)


class _WatchStream:
    """One Watch RPC: requests go in through a queue, responses (or the error that ended the
    stream) come out through ``inbox``, read by a daemon thread so the caller can wait with a
    timeout and notice ``stop``."""

    def __init__(self, channel: grpc.Channel, metadata: Any):
        self._requests: queue.Queue[Any] = queue.Queue()
        self.inbox: queue.Queue[Any] = queue.Queue()
        self._call = etcdrpc.WatchStub(channel).Watch(self._outgoing(), metadata=metadata)
        threading.Thread(target=self._read, name="etcd-watch", daemon=True).start()

    def _outgoing(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for response in self._call:
                self.inbox.put(response)
            self.inbox.put(EOFError("etcd closed the watch stream"))
        except grpc.RpcError as exc:
            self.inbox.put(exc)

    def send(self, request: Any) -> None:
        self._requests.put(request)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


class EtcdWeightsStore(WeightsStore):
    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        ca_cert: str = "",
        cert: str = "",
        key: str = "",
        user: str = "",
        password: str = "",
    ):
        if not endpoints:
            raise ValueError("etcd endpoints: at least one host:port is required")
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"etcd prefix: must start and end with '/', got {prefix!r}")
        if bool(cert) != bool(key):
            raise ValueError("etcd TLS: a client certificate and its key go together")
        if bool(user) != bool(password):
            raise ValueError("etcd authentication: a user and its password go together")
        self.prefix = prefix
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = bool(ca_cert or cert)
        self.user = user
        self._password = password
        scheme = "https" if self.tls else "http"
        security = f" as user {user!r}" if user else ""
        self.description = (
            f"etcd {','.join(f'{scheme}://{h}:{p}' for h, p in self.endpoints)} prefix {prefix}{security}"
            if self.tls or user
            else f"etcd {','.join(f'{h}:{p}' for h, p in self.endpoints)} prefix {prefix}"
        )
        credentials = None
        if self.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(ca_cert), private_key=_read(key), certificate_chain=_read(cert)
            )
        self._client = pyetcd.MultiEndpointEtcd3Client(
            endpoints=[
                pyetcd.Endpoint(
                    host,
                    port,
                    secure=self.tls,
                    creds=credentials,
                    time_retry=0.5,
                    opts=CHANNEL_OPTIONS,
                )
                for host, port in self.endpoints
            ],
            timeout=timeout,
            failover=True,
        )
        # Authentication state: pyetcd sends ``self._client.metadata`` with every KV call.
        self._auth_lock = threading.Lock()
        self._authenticated = not user
        self.authentications = 0  # tokens obtained: 1, then one more per token etcd let die

    def _key(self, key: str) -> str:
        return self.prefix + key

    # Authentication ------------------------------------------------------------------------

    def _authenticate(self, rejected: Any = None) -> None:
        """Get a token for our user: the first time, or after etcd refused the metadata
        ``rejected`` (skipped when another thread has already replaced it)."""
        with self._auth_lock:
            if self._authenticated and self._client.metadata is not rejected:
                return
            request = etcdrpc.AuthenticateRequest(name=self.user, password=self._password)
            try:
                response = self._client.authstub.Authenticate(request, self.timeout)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in ENDPOINT_DOWN:
                    self._client.endpoint_in_use.fail()  # fail over, as pyetcd does for KV calls
                    raise
                if code == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in (exc.details() or ""):
                    # Users and roles exist only once `etcdctl auth enable` ran; until then etcd
                    # lets anyone in, and we say so rather than refuse to work.
                    log.warning(
                        "%s: etcd has authentication disabled, so the user and password protect "
                        "nothing; run `etcdctl auth enable`",
                        self.description,
                    )
                    self._client.metadata = None
                    self._authenticated = True
                    return
                raise StoreAuthError(
                    f"{self.description}: authentication as {self.user!r} failed: {_details(exc)}"
                ) from exc
            self._client.metadata = (("token", response.token),)
            self._authenticated = True
            self.authentications += 1

    def _call(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One call with the current token; a token etcd rejects is renewed and the call made
        once more."""
        if not self._authenticated:
            self._authenticate()
        metadata = self._client.metadata
        try:
            return call(*args, **kwargs)
        except TRANSIENT as exc:
            if not self.user or not _token_rejected(exc):
                raise
            log.info(
                "%s: etcd rejected our token (%s); authenticating again", self.description, _details(exc)
            )
        self._authenticate(rejected=metadata)
        return call(*args, **kwargs)

    def _refusal(self, what: str, exc: BaseException) -> StoreAuthError | None:
        """A StoreAuthError when ``exc`` is etcd refusing us for good (retrying cannot help)."""
        if isinstance(exc, StoreAuthError):
            return exc
        rpc = _rpc_error(exc)
        code = rpc.code() if rpc is not None else None
        text = (rpc.details() or "").lower() if rpc is not None else ""
        if code == grpc.StatusCode.PERMISSION_DENIED:
            who = f"user {self.user!r}" if self.user else "a client without a user (no token)"
            return StoreAuthError(
                f"{self.description}: {what} refused: {_details(exc)}; {who} needs a role with "
                f"readwrite on the prefix {self.prefix!r}"
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT) and (
            "auth" in text or "user" in text
        ):
            hint = "" if self.user else "; etcd has authentication enabled: set a user and password"
            return StoreAuthError(f"{self.description}: {what} refused: {_details(exc)}{hint}")
        return None

    def _unavailable(self, what: str, exc: BaseException, tries: int, note: str = "") -> StoreUnavailable:
        hint = ""
        text = _details(exc).lower()
        if self.tls and any(w in text for w in ("ssl", "handshake", "certificate", "tsi_")):
            # etcd refusing our client certificate shows here only as a broken TLS stream.
            hint = (
                " (TLS failed: does etcd's CA sign our client certificate, is the key its key, "
                "and does our CA bundle sign etcd's server certificate?)"
            )
        elif not self.tls and "socket closed" in text:
            hint = " (etcd closed the connection: does it expect TLS?)"
        return StoreUnavailable(
            f"{self.description}: {what} failed after {tries} {'try' if tries == 1 else 'tries'}"
            f"{note}: {_details(exc)}{hint}"
        )

    def _retrying(self, what: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        for attempt in range(READ_TRIES):
            try:
                return self._call(call, *args, **kwargs)
            except etcd_exceptions.RevisionCompactedError:
                raise
            except (*TRANSIENT, StoreAuthError) as exc:
                refusal = self._refusal(what, exc)
                if refusal is not None:
                    raise refusal from exc
                if attempt == READ_TRIES - 1:
                    raise self._unavailable(what, exc, READ_TRIES) from exc
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
                ok, responses = self._call(
                    self._client.transaction,
                    compare=compare,
                    success=[tx.put(full, raw)],
                    failure=[tx.get(full)],
                )
            except (*TRANSIENT, StoreAuthError) as exc:
                refusal = self._refusal(f"write of {key}", exc)
                if refusal is not None:
                    raise refusal from exc
                if attempt == READ_TRIES - 1:
                    raise self._unavailable(
                        f"write of {key}",
                        exc,
                        READ_TRIES,
                        " (it may or may not have landed; re-read before retrying)",
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
        stream = self._register(max(start_revision, 1))
        try:
            yield []  # registered: the caller may count it before any change arrives
            while not stop.is_set():
                try:
                    item = stream.inbox.get(timeout=IDLE_TICK_S)
                except queue.Empty:
                    yield []
                    continue
                if isinstance(item, BaseException):
                    # An etcd restart ends the gRPC stream once (UNAVAILABLE) and then goes
                    # silent: the caller must register a new watch from its last revision.
                    raise StoreUnavailable(f"{self.description}: watch stream ended: {_details(item)}")
                if item.compact_revision:
                    raise WatchCompacted(item.compact_revision)
                if item.canceled:
                    raise StoreUnavailable(
                        f"{self.description}: etcd cancelled the watch: {item.cancel_reason or 'no reason given'}"
                    )
                if item.events:
                    yield [self._event(ev) for ev in item.events]
        finally:
            stream.close()

    def _register(self, start_revision: int) -> _WatchStream:
        """Open a stream and create the prefix watch on it; etcd's first answer says whether it
        took. A refusal is retried once with a fresh token: etcd reports a dead token on a watch
        as "permission denied", not as "invalid auth token"."""
        key = self.prefix.encode()
        create = etcdrpc.WatchRequest(
            create_request=etcdrpc.WatchCreateRequest(
                key=key, range_end=prefix_range_end(key), start_revision=start_revision
            )
        )
        what = f"watch from revision {start_revision}"
        for attempt in range(2):
            stream = None
            try:
                if not self._authenticated:
                    self._authenticate()
                metadata = self._client.metadata
                stream = _WatchStream(self._client.channel, metadata)
                stream.send(create)
                first = stream.inbox.get(timeout=self.timeout)
            except queue.Empty:
                assert stream is not None
                stream.close()
                raise StoreUnavailable(
                    f"{self.description}: {what}: etcd did not confirm it within {self.timeout} s"
                ) from None
            except (*TRANSIENT, StoreAuthError) as exc:
                refusal = self._refusal(what, exc)
                if refusal is not None:
                    raise refusal from exc
                raise self._unavailable(what, exc, 1) from exc
            if isinstance(first, BaseException):
                stream.close()
                rpc = _rpc_error(first)
                if rpc is not None and rpc.code() in ENDPOINT_DOWN:
                    self._client.endpoint_in_use.fail()
                if attempt == 0 and self.user and _token_rejected(first):
                    self._authenticate(rejected=metadata)
                    continue
                refusal = self._refusal(what, first)
                if refusal is not None:
                    raise refusal from first
                raise self._unavailable(what, first, 1) from first
            if first.compact_revision:
                stream.close()
                raise WatchCompacted(first.compact_revision)
            if first.canceled:
                stream.close()
                reason = first.cancel_reason or "no reason given"
                if attempt == 0 and self.user:
                    log.info(
                        "%s: etcd refused the watch (%s); authenticating again", self.description, reason
                    )
                    self._authenticate(rejected=metadata)
                    continue
                who = f"user {self.user!r}" if self.user else "a client without a user (no token)"
                raise StoreAuthError(
                    f"{self.description}: {what} refused: {reason}; {who} needs a role with "
                    f"read access to the prefix {self.prefix!r}"
                )
            return stream
        raise AssertionError("unreachable")

    def _event(self, ev: Any) -> WatchEvent:
        key = ev.kv.key.decode("utf-8", errors="replace")[len(self.prefix) :]
        if ev.type == ev.DELETE:
            return WatchEvent(key, None, ev.kv.mod_revision)
        return WatchEvent(key, bytes(ev.kv.value), ev.kv.mod_revision)

    def close(self) -> None:
        try:
            self._client.close()
        except TRANSIENT:
            pass


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()
