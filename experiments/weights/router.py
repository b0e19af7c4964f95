"""The router every process embeds: all experiments' weights in memory, hot-reloaded.

Readers call ``assign()``; a background thread owns all writes:

1. load every document under the store prefix (``list_raw``), remember the listing revision;
2. watch from ``last_seen + 1`` and apply each batch of changes;
3. on a dropped watch (etcd restart: one UNAVAILABLE, then silence) keep serving the snapshot,
   back off, and register a new watch from ``last_seen + 1`` until it succeeds: etcd replays
   every change made meanwhile, so none is missed;
4. every ``resync_interval`` compare against a full listing as a safety net.

Each change builds a new immutable ``Snapshot`` and swaps one attribute (double buffering): a
reader holds either the old or the new snapshot, never a mix. A document that fails validation
(written by hand with etcdctl, say) is rejected: the previous one stays, the reason is logged,
``metrics["documents_rejected"]`` counts it and ``rejections`` keeps the latest reason per key.

Every count of ``metrics`` is also a Prometheus counter, and the snapshot's revision, when it was
last known to match the store and whether the watch is connected are gauges
(telemetry/metrics.py, ``abplat_router_*``; docs/metrics.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Self

from experiments.assignment import make_assigner
from experiments.weights.document import WeightsDocument, parse_document
from experiments.weights.errors import StoreUnavailable, WatchCompacted, WeightsError
from experiments.weights.store import WatchEvent, WeightsStore
from telemetry.metrics import RouterMeter, router_store_label

log = logging.getLogger(__name__)


class Assignment(NamedTuple):
    experiment: str
    variant: str
    revision: int  # the store revision of the weights document used: tag samples with it
    hash_version: int


_new_tuple = tuple.__new__


class UnknownExperiment(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class Entry:
    doc: WeightsDocument
    revision: int
    assign: Callable[[str], str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "assign", make_assigner(self.doc.salt, self.doc.allocation))


@dataclass(frozen=True, slots=True)
class Snapshot:
    entries: Mapping[str, Entry]
    revision: int  # the store revision this snapshot is synced to
    loaded: bool

    def __contains__(self, key: object) -> bool:
        return key in self.entries


@dataclass(frozen=True, slots=True)
class Rejection:
    key: str
    revision: int
    reason: str


_EMPTY = Snapshot(MappingProxyType({}), 0, loaded=False)


class Router:
    def __init__(
        self,
        store: WeightsStore,
        *,
        resync_interval: float = 30.0,
        backoff_min: float = 0.05,
        backoff_max: float = 1.0,
        on_swap: Callable[[Snapshot], None] | None = None,
    ):
        self.store = store
        self.resync_interval = resync_interval
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self._on_swap = on_swap
        self._snapshot = _EMPTY
        self._last_seen = 0  # highest store revision applied
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._rejections: dict[str, Rejection] = {}
        self._metrics: dict[str, int] = dict.fromkeys(
            (
                "documents_rejected",
                "changes_applied",
                "snapshots_swapped",
                "full_loads",
                "watch_registrations",
                "watch_reconnects",
                "watch_errors",
                "store_errors",
            ),
            0,
        )
        self.connected = False
        self.last_error = ""
        self._meter = RouterMeter(router_store_label(store))

    # Reading -----------------------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def metrics(self) -> dict[str, int]:
        return dict(self._metrics)

    @property
    def rejections(self) -> dict[str, Rejection]:
        return dict(self._rejections)

    def document(self, experiment_key: str) -> tuple[WeightsDocument, int]:
        entry = self._entry(self._snapshot, experiment_key)
        return entry.doc, entry.revision

    def assign(self, experiment_key: str, user_id: str) -> Assignment:
        snapshot = self._snapshot  # one read: the whole call uses one consistent snapshot
        entry = snapshot.entries.get(experiment_key)
        if entry is None:
            entry = self._entry(snapshot, experiment_key)
        # tuple.__new__ skips the NamedTuple's Python-level __new__ (~0.3 us of ~1.5)
        return _new_tuple(
            Assignment,
            (experiment_key, entry.assign(user_id), entry.revision, entry.doc.allocation.hash_version),
        )

    def _entry(self, snapshot: Snapshot, key: str) -> Entry:
        entry = snapshot.entries.get(key)
        if entry is not None:
            return entry
        if not snapshot.loaded:
            raise UnknownExperiment(
                f"no weights for experiment {key!r}: the router has not loaded the weights store "
                f"yet ({self.store.description}; last error: {self.last_error or 'none'})"
            )
        rejected = self._rejections.get(key)
        detail = f"; its document was rejected: {rejected.reason}" if rejected else ""
        raise UnknownExperiment(f"no weights for experiment {key!r} in {self.store.description}{detail}")

    # Lifecycle ---------------------------------------------------------------------------

    def start(self, wait: float | None = 5.0) -> bool:
        """Start the background loader; wait up to ``wait`` s for the first load. Returns
        whether it loaded (False: the store is down, the loader keeps trying)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="weights-router", daemon=True)
            self._thread.start()
        return self.wait_ready(wait)

    def wait_ready(self, timeout: float | None = 5.0) -> bool:
        return self._ready.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def refresh(self) -> Snapshot:
        """Load everything now, in the calling thread (CLI, tests). StoreUnavailable if down."""
        self._full_load()
        return self._snapshot

    # Writing (background thread, or refresh) -----------------------------------------------

    def _run(self) -> None:
        backoff = self.backoff_min
        need_load = True
        down_since: float | None = None  # monotonic time of the first error of an outage
        while not self._stop.is_set():
            try:
                if need_load:
                    self._full_load()
                    need_load = False
                next_resync = time.monotonic() + self.resync_interval
                batches = self.store.watch(self._last_seen + 1, self._stop)
                for batch in batches:
                    if not self.connected or down_since is not None:
                        self._count("watch_registrations")
                        self.connected = True
                        self._meter.connected.set(1)
                        backoff = self.backoff_min
                        if down_since is not None:
                            self._count("watch_reconnects")
                            log.warning(
                                "weights router: watch re-registered from revision %d after %.2f s",
                                self._last_seen + 1,
                                time.monotonic() - down_since,
                            )
                            down_since = None
                    if batch:
                        self._apply(batch)
                    self._meter.synced(self._snapshot.revision)  # a live watch: in sync now
                    if time.monotonic() >= next_resync:
                        self._full_load()
                        next_resync = time.monotonic() + self.resync_interval
            except WatchCompacted as exc:
                log.warning("weights router: %s; reloading everything", exc)
                need_load = True
            except Exception as exc:  # keep serving whatever happens; never kill the thread
                self.connected = False
                self._meter.connected.set(0)
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._count("watch_errors")
                if down_since is None:
                    down_since = time.monotonic()
                    # One warning per outage; the retries that follow are logged at debug.
                    serving = (
                        f"serving the last good snapshot (revision {self._last_seen}) and "
                        f"re-registering the watch from revision {self._last_seen + 1}"
                        if self._snapshot.loaded
                        else "nothing loaded yet: assignments fail until the first load"
                    )
                    log.warning(
                        "weights router: %s; %s; retrying until the store is back",
                        self.last_error,
                        serving,
                        exc_info=not isinstance(exc, StoreUnavailable),
                    )
                else:
                    log.debug("weights router: still down: %s", self.last_error)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max)

    def _full_load(self) -> None:
        try:
            listing = self.store.list_raw()
        except StoreUnavailable as exc:
            self._count("store_errors")
            self.last_error = str(exc)
            raise
        events = [WatchEvent(k, v.raw, v.revision) for k, v in listing.values.items()]
        # A key we hold that the listing lacks was deleted at or before listing.revision.
        events += [
            WatchEvent(k, None, listing.revision) for k in self._snapshot.entries if k not in listing.values
        ]
        self._apply(events, store_revision=listing.revision, full=True)
        self._count("full_loads")
        self._meter.synced(self._snapshot.revision)
        self._ready.set()

    def _apply(self, events: Iterable[WatchEvent], store_revision: int = 0, full: bool = False) -> None:
        with self._write_lock:
            current = self._snapshot
            entries = dict(current.entries)
            changed = False
            last_seen = max(self._last_seen, store_revision)
            for event in events:
                last_seen = max(last_seen, event.revision)
                held = entries.get(event.key)
                if held is not None and event.revision <= held.revision:
                    continue  # a replay (watch re-registered, or resync): already applied
                if event.raw is None:
                    if held is not None:
                        del entries[event.key]
                        changed = True
                        self._count("changes_applied")
                    self._rejections.pop(event.key, None)
                    continue
                rejected = self._rejections.get(event.key)
                if rejected is not None and rejected.revision == event.revision:
                    continue  # already rejected and counted
                try:
                    doc = parse_document(event.raw, expected_key=event.key)
                except WeightsError as exc:
                    self._reject(event, str(exc), held)
                    continue
                entries[event.key] = Entry(doc, event.revision)
                self._rejections.pop(event.key, None)
                changed = True
                self._count("changes_applied")
            self._last_seen = last_seen
            if changed or not current.loaded or (full and last_seen != current.revision):
                snapshot = Snapshot(MappingProxyType(entries), last_seen, loaded=True)
                self._snapshot = snapshot  # the swap: a single attribute store
                self._metrics["snapshots_swapped"] += 1
            else:
                snapshot = None
        if snapshot is not None and self._on_swap is not None:
            try:
                self._on_swap(snapshot)
            except Exception:
                log.exception("weights router: on_swap callback failed")

    def _count(self, what: str) -> None:
        self._metrics[what] += 1
        self._meter.count(what)

    def _reject(self, event: WatchEvent, reason: str, held: Entry | None) -> None:
        self._rejections[event.key] = Rejection(event.key, event.revision, reason)
        self._count("documents_rejected")
        keeping = f"keeping revision {held.revision}" if held else "no previous document"
        log.error(
            "weights router: rejected document %r at revision %d (%s): %s",
            event.key,
            event.revision,
            keeping,
            reason,
        )
