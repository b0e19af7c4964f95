"""The platform's own Prometheus metrics: every ``abplat_`` metric, defined once, here.

docs/metrics.md describes each one (type, unit, labels, what to read from it, alerts) and
docs/grafana/abplat.json charts them; a test holds both to this module's names.

Two modes, chosen by ``ABPLAT_METRICS_DIR`` when this module is first imported:

- empty (the embedded default): values live in this process (``REGISTRY``); ``/metrics`` shows
  this process's metrics. Right for one process (``make demo``, eager Celery).
- a directory: prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``). Every
  process on the machine that sets it (gunicorn workers, Celery prefork children, management
  commands) writes its values to its own memory-mapped files there, and ``/metrics`` (or a
  worker's ``ABPLAT_WORKER_METRICS_PORT``) adds them all up (``exposition``).

Why here and at import: prometheus_client picks its value class when it is imported, and every
metric built before multiprocess mode is on keeps its values in one process; the metrics below
are built when this module is imported. So its import fixes the mode, from ABPLAT_METRICS_DIR in
the process environment (``multiprocess_dir``, telemetry/metrics_config.py): it sets
``PROMETHEUS_MULTIPROC_DIR`` before it imports prometheus_client, and if something imported
prometheus_client earlier, switches its value class before defining any metric.

When: settings never import this module (abplat/config.py checks the same variables with
telemetry/metrics_config.py, so a bad directory stops the process while it loads its settings,
with ImproperlyConfigured naming the variable: one line from manage.py). Every process that sets up Django imports it at app start,
before any request, task or command runs (workers/apps.py, configure_metrics): runserver, each
gunicorn worker, a Celery worker's main process before its pool forks, management commands, the
gateway command and each of its uvicorn workers. A process without Django imports it when it
first needs it (gunicorn's master when a worker exits: gunicorn.conf.py, child_exit). Forked
children (Celery prefork) keep the mode and notice the new pid on their first update and open
files of their own.

Gauges in multiprocess mode say how processes combine: ``livesum`` (shards running, requests in
flight), ``livemin`` (the router furthest behind), ``livemostrecent`` (the spool: one directory per
host, measured by whichever process touched it last). "live" gauges of a process are removed
when it dies: ``mark_process_dead`` (Celery: worker_process_shutdown in workers/apps.py;
gunicorn: ``gunicorn_child_exit`` as the config's ``child_exit``), and at every scrape for pids
that no longer exist on this machine (a SIGKILLed child). Counters and histograms of dead
processes stay in the directory so totals never go down; empty it only when every abplat
process on the machine is stopped (docs/metrics.md, "Multiprocess mode").

Labels are bounded: experiment keys, variant keys, outcomes, view names, status classes,
backends, the gateway's routing reasons and refusal statuses. Never run, request or user ids,
and never a client's string (a model name that matches no experiment).

Imports prometheus_client and telemetry.metrics_config only: no Django, no project code (the
bottom layer, .importlinter).
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# The settings' checks (stdlib only, no import-time effect): this module fixes the mode with
# multiprocess_dir. address_allowed and parse_networks stay importable from here for /metrics
# (abplat/metrics.py) and its tests.
from telemetry.metrics_config import (  # noqa: F401
    SETTING,
    THEIRS,
    MetricsConfigError,
    Network,
    address_allowed,
    check_dir,
    multiprocess_dir,
    parse_networks,
)

log = logging.getLogger(__name__)

PREFIX = "abplat_"


def _mode_from_environment() -> str:
    """The multiprocess directory ("" for in-process), checked, with PROMETHEUS_MULTIPROC_DIR set
    to match before prometheus_client is imported."""
    path = multiprocess_dir(os.environ)
    if path:
        os.environ[THEIRS] = path
    return path


METRICS_DIR = _mode_from_environment()

# prometheus_client only now: it reads PROMETHEUS_MULTIPROC_DIR when it is imported.
from prometheus_client import (  # noqa: E402
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.multiprocess import mark_process_dead as _mark_process_dead  # noqa: E402

if METRICS_DIR and not getattr(values.ValueClass, "_multiprocess", False):
    # prometheus_client was imported before this module (by a library): its value class is the
    # in-process one. Every metric below must write to the directory instead.
    values.ValueClass = values.MultiProcessValue()
if METRICS_DIR:
    # A management command (or any process that exits normally) takes its live gauges with it.
    # Celery's prefork children leave with os._exit: workers/apps.py hooks worker_process_shutdown.
    atexit.register(lambda: mark_process_dead(os.getpid()))


def configure(directory: str) -> str:
    """What app start (workers/apps.py, configure_metrics) calls with the ABPLAT_METRICS_DIR
    settings parsed: the mode was fixed when this module was imported (from the same variable in
    the process environment); a process whose settings name another directory cannot switch
    modes, and says so. Returns the directory ("" for in-process)."""
    wanted = check_dir(directory) if directory else ""
    if wanted != METRICS_DIR:
        raise MetricsConfigError(
            f"{SETTING}={directory!r} but this process's metrics were set up with "
            f"{SETTING}={METRICS_DIR!r} when telemetry.metrics was first imported: set it in the "
            "environment before the process starts."
        )
    return METRICS_DIR


# The in-process registry (never prometheus_client's global one, which libraries and the
# simulator may fill): /metrics in the embedded mode shows exactly these.
REGISTRY = CollectorRegistry(auto_describe=True)

# Seconds. Schedule lag: 0.5 ms (on time) to 10 s (an overloaded worker).
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Seconds. One insert of a batch into the sample store.
INSERT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Seconds. One web or API request (a report may take seconds).
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    return Counter(name, doc, labelnames=labels, registry=REGISTRY)


def _gauge(name: str, doc: str, mode: str, labels: Sequence[str] = ()) -> Gauge:
    return Gauge(name, doc, labelnames=labels, registry=REGISTRY, multiprocess_mode=mode)


def _histogram(name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
    return Histogram(name, doc, labelnames=labels, buckets=buckets, registry=REGISTRY)


# ---- routers (experiments/weights/router.py); label store: etcd | local -----------------------
ROUTER_SNAPSHOT_REVISION = _gauge(
    "abplat_router_snapshot_revision",
    "Weights store revision of the snapshot the router serves (multiprocess: the lowest of the live processes).",
    "livemin",
    ("store",),
)
ROUTER_LAST_SYNC = _gauge(
    "abplat_router_last_sync_timestamp_seconds",
    "Unix time the router last knew its snapshot matched the store (a load, or a live watch tick); "
    "time() minus it is the snapshot's age (multiprocess: the oldest of the live processes).",
    "livemin",
    ("store",),
)
ROUTER_CONNECTED = _gauge(
    "abplat_router_watch_connected",
    "1 while the router's watch on the weights store is registered, 0 while it reconnects "
    "(multiprocess: 0 if any live process is disconnected).",
    "livemin",
    ("store",),
)
ROUTER_WATCH_RECONNECTS = _counter(
    "abplat_router_watch_reconnects_total",
    "Watches registered again after the store dropped them (an etcd restart, a network cut).",
    ("store",),
)
ROUTER_WATCH_ERRORS = _counter(
    "abplat_router_watch_errors_total",
    "Errors of the router's load-and-watch loop (each one is followed by a backoff and a retry).",
    ("store",),
)
ROUTER_RELOAD_ERRORS = _counter(
    "abplat_router_reload_errors_total",
    "Full loads of the weights store that failed (store unavailable); the last good snapshot is kept.",
    ("store",),
)
ROUTER_FULL_LOADS = _counter(
    "abplat_router_full_loads_total",
    "Full loads of every weights document (start, resync, compaction).",
    ("store",),
)
ROUTER_CHANGES = _counter(
    "abplat_router_changes_applied_total",
    "Weights document changes applied to the router's snapshot.",
    ("store",),
)
ROUTER_REJECTED = _counter(
    "abplat_router_documents_rejected_total",
    "Weights documents the router rejected as invalid (the previous one stays in force).",
    ("store",),
)

# ---- replays (workers/shard.py, workers/tasks.py) ---------------------------------------------
REPLAY_SENT = _counter(
    "abplat_replay_requests_sent_total",
    "Replay requests handed to a variant's client.",
    ("experiment", "variant"),
)
REPLAY_COMPLETED = _counter(
    "abplat_replay_requests_completed_total",
    "Replay requests that ended and left a sample, by outcome (ok, http_5xx, stall, ...).",
    ("experiment", "variant", "outcome"),
)
REPLAY_IN_FLIGHT = _gauge(
    "abplat_replay_requests_in_flight",
    "Replay requests streaming now (multiprocess: summed).",
    "livesum",
    ("experiment",),
)
REPLAY_LAG = _histogram(
    "abplat_replay_schedule_lag_seconds",
    "How late each replay request was sent against its planned time on the trace's schedule.",
    LAG_BUCKETS,
    ("experiment",),
)
REPLAY_SAMPLES_WRITTEN = _counter(
    "abplat_replay_samples_written_total",
    "Samples a replay handed to storage: destination store (inserted) or spool (the store was down).",
    ("experiment", "destination"),
)
REPLAY_SHARDS_RUNNING = _gauge(
    "abplat_replay_shards_running", "Replay shard tasks executing now (multiprocess: summed).", "livesum"
)
REPLAY_SHARDS_FINISHED = _counter(
    "abplat_replay_shards_finished_total",
    "Replay shard tasks that ended, by status (done, failed).",
    ("status",),
)
REPLAY_SHARDS_REQUEUED = _counter(
    "abplat_replay_shards_requeued_total",
    "Replay shard tasks queued again to resume, by reason (budget, soft_time_limit, store_unavailable).",
    ("reason",),
)
RUN_STATES = ("queued", "running", "flushing", "cancelling", "done", "cancelled", "failed")
REPLAY_RUNS_NAME = "abplat_replay_runs"
REPLAY_RUNS_HELP = "Replay runs in the database by status (read from the database at each scrape)."

# ---- live gateway recording (gateway/recording.py) ---------------------------------------------
LIVE_SAMPLES_RECORDED = _counter(
    "abplat_live_recorded_samples_total",
    "Live requests' samples the gateway's recorder built (each with its run's next seq).",
    ("experiment",),
)
LIVE_SAMPLES_WRITTEN = _counter(
    "abplat_live_written_samples_total",
    "Live samples written: destination store (inserted) or spool (the store was down or slow).",
    ("experiment", "destination"),
)
LIVE_SAMPLES_DROPPED = _counter(
    "abplat_live_dropped_samples_total",
    "Live samples lost before reaching store or spool, by reason: queue_full (the recorder's memory "
    "queue was full), closed (recorded after close), invalid (not a valid row). 0 in normal operation.",
    ("reason",),
)
LIVE_QUEUE_ROWS = _gauge(
    "abplat_live_recorder_queue_rows",
    "Live samples in the gateway recorders' memory, not yet written (multiprocess: summed).",
    "livesum",
)

# ---- live gateway requests (gateway/app.py) ----------------------------------------------------
# Labels: experiment and variant keys the gateway decided (the database's), never the client's
# model name; route is gateway.routing.Reason's value or "refused"; status is the gateway's own.
GATEWAY_REQUESTS = _counter(
    "abplat_gateway_requests_total",
    "Requests to the gateway's API paths, once each, by the experiment that served them and how they "
    'were routed (assigned, unassigned, not_running, default), or route refused with experiment "" '
    "when the gateway answered before a route was decided.",
    ("experiment", "route"),
)
GATEWAY_REFUSED = _counter(
    "abplat_gateway_refused_requests_total",
    "Requests to the gateway's API paths that the gateway answered itself with an error, by HTTP status "
    "(400, 401, 404, 405, 413, 429, 503).",
    ("status",),
)
GATEWAY_UPSTREAM = _counter(
    "abplat_gateway_upstream_requests_total",
    "Requests the gateway sent to a variant, by the outcome recorded for each (ok, http_5xx, "
    "connect_error, cancelled, ...); a retry on the control is one more.",
    ("experiment", "variant", "outcome"),
)
GATEWAY_IN_FLIGHT = _gauge(
    "abplat_gateway_requests_in_flight",
    "HTTP requests the gateway processes are answering now (multiprocess: summed).",
    "livesum",
)
GATEWAY_LIMIT_FALLBACKS = _counter(
    "abplat_gateway_limit_fallback_requests_total",
    "Requests whose client limits a gateway process checked alone because the shared limits' Redis "
    "(ABPLAT_GATEWAY_LIMITS_URL) timed out, failed, or had just failed (down), by that reason.",
    ("reason",),
)

GATEWAY_SHADOWS = _counter(
    "abplat_gateway_shadow_requests_total",
    "Live requests shadowed to their experiment's control (gateway/shadow.py), by outcome: ok, "
    "control_error, variant_error, timeout, cancelled, gateway_error (each one row in fidelity_shadows), "
    "or skipped_busy (the process had its cap of shadows in flight: no row).",
    ("experiment", "outcome"),
)

# ---- spool (samples/spool.py) -----------------------------------------------------------------
SPOOL_ROWS = _gauge(
    "abplat_spool_rows", "Samples waiting in this host's spool for the store to come back.", "livemostrecent"
)
SPOOL_BYTES = _gauge(
    "abplat_spool_bytes", "Bytes of the spool files waiting on this host's disk.", "livemostrecent"
)
SPOOL_SPOOLED_ROWS = _counter(
    "abplat_spool_spooled_rows_total",
    "Samples written to the spool because the sample store was unavailable.",
)
SPOOL_FLUSHES = _counter(
    "abplat_spool_flushes_total",
    "Spool flushes, by result (ok, store_unavailable: the spool stays for the next try).",
    ("result",),
)
SPOOL_FLUSHED_ROWS = _counter(
    "abplat_spool_flushed_rows_total", "Spooled samples inserted into the store by a flush."
)
SPOOL_QUARANTINED_FILES = _counter(
    "abplat_spool_quarantined_files_total",
    "Spool files that could not be read whole and went to quarantine/.",
)
SPOOL_QUARANTINED_ROWS = _counter(
    "abplat_spool_quarantined_rows_total", "Samples that quarantined spool files promised but could not give."
)

# ---- sample store (samples/store.py); label backend: clickhouse-server | chdb -----------------
STORE_INSERTED_ROWS = _counter(
    "abplat_store_inserted_rows_total", "Sample rows inserted into the sample store.", ("backend",)
)
STORE_INSERT_SECONDS = _histogram(
    "abplat_store_insert_duration_seconds",
    "Time to insert one batch of samples.",
    INSERT_BUCKETS,
    ("backend",),
)
STORE_INSERT_ERRORS = _counter(
    "abplat_store_insert_errors_total",
    "Inserts that failed, by kind (unavailable: spooled and retried; permanent: bad data or schema).",
    ("backend", "kind"),
)

# ---- web and API (abplat/metrics.py middleware) -----------------------------------------------
HTTP_REQUESTS = _counter(
    "abplat_http_requests_total",
    "Web and API requests by view name, method and status class (2xx, 3xx, 4xx, 5xx).",
    ("view", "method", "status"),
)
HTTP_DURATION = _histogram(
    "abplat_http_request_duration_seconds",
    "Time to answer one web or API request, by view name.",
    HTTP_BUCKETS,
    ("view",),
)


# ---- recording helpers -------------------------------------------------------------------------


class ReplayMeter:
    """One shard's metrics: the labelled children cached per variant, so a request costs a dict
    lookup and a few increments (bench/bench_observability.py measures it)."""

    def __init__(self, experiment: str) -> None:
        self.experiment = experiment
        self._sent: dict[str, Any] = {}
        self._completed: dict[tuple[str, str], Any] = {}
        self._written: dict[str, Any] = {}
        self.in_flight = REPLAY_IN_FLIGHT.labels(experiment)
        self.lag = REPLAY_LAG.labels(experiment)

    def sent(self, variant: str) -> None:
        child = self._sent.get(variant)
        if child is None:
            child = self._sent[variant] = REPLAY_SENT.labels(self.experiment, variant)
        child.inc()

    def completed(self, variant: str, outcome: str, lag_s: float) -> None:
        key = (variant, outcome)
        child = self._completed.get(key)
        if child is None:
            child = self._completed[key] = REPLAY_COMPLETED.labels(self.experiment, variant, outcome)
        child.inc()
        self.lag.observe(lag_s)

    def written(self, rows: int, destination: str) -> None:
        child = self._written.get(destination)
        if child is None:
            child = self._written[destination] = REPLAY_SAMPLES_WRITTEN.labels(self.experiment, destination)
        child.inc(rows)

    def put_row(self, put: Callable[[Any], None]) -> Callable[[Any], None]:
        """``put`` (the sample sink's) that counts each row first: its variant and outcome, and
        its schedule lag (rows are samples.columns.SampleRow or mappings: read by name)."""

        def metered(row: Any) -> None:
            self.completed(row["variant"], str(row["outcome"]), row["schedule_lag_ms"] / 1000.0)
            put(row)

        return metered

    def wrap_client(self, variant: str, client: Any) -> MeteredStreamer:
        return MeteredStreamer(client, self, variant)


class MeteredStreamer:
    """A variant client (anything with ``async stream(...)`` and ``aclose()``) that counts each
    request sent and keeps the in-flight gauge."""

    def __init__(self, inner: Any, meter: ReplayMeter, variant: str) -> None:
        self.inner, self.meter, self.variant = inner, meter, variant

    def __getattr__(self, name: str) -> Any:  # api, model, ...: the wrapped client's
        return getattr(self.inner, name)

    async def stream(
        self, request_id: str, prompt: Any, max_tokens: int, extra: Mapping[str, Any] | None = None
    ):
        self.meter.sent(self.variant)
        self.meter.in_flight.inc()
        try:
            return await self.inner.stream(request_id, prompt, max_tokens, extra)
        finally:
            self.meter.in_flight.dec()

    async def aclose(self) -> None:
        await self.inner.aclose()


class ShardsRunning:
    """``with ShardsRunning():`` around a shard's execution (the gauge goes up and down)."""

    def __enter__(self) -> None:
        REPLAY_SHARDS_RUNNING.inc()

    def __exit__(self, *exc: object) -> None:
        REPLAY_SHARDS_RUNNING.dec()


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def observe_http(view: str, method: str, status: int, seconds: float) -> None:
    HTTP_REQUESTS.labels(view, method if method in _METHODS else "other", status_class(status)).inc()
    HTTP_DURATION.labels(view).observe(seconds)


def router_store_label(store: object) -> str:
    """``etcd`` or ``local`` for the project's weights stores (a class name otherwise)."""
    name = type(store).__name__
    return name.removesuffix("WeightsStore").lower() or name


class RouterMeter:
    """One router's metrics (labelled by its store kind)."""

    def __init__(self, store_label: str) -> None:
        self.revision = ROUTER_SNAPSHOT_REVISION.labels(store_label)
        self.last_sync = ROUTER_LAST_SYNC.labels(store_label)
        self.connected = ROUTER_CONNECTED.labels(store_label)
        self.counters = {
            "watch_reconnects": ROUTER_WATCH_RECONNECTS.labels(store_label),
            "watch_errors": ROUTER_WATCH_ERRORS.labels(store_label),
            "store_errors": ROUTER_RELOAD_ERRORS.labels(store_label),
            "full_loads": ROUTER_FULL_LOADS.labels(store_label),
            "changes_applied": ROUTER_CHANGES.labels(store_label),
            "documents_rejected": ROUTER_REJECTED.labels(store_label),
        }

    def count(self, what: str) -> None:
        child = self.counters.get(what)
        if child is not None:
            child.inc()

    def synced(self, revision: int) -> None:
        self.revision.set(revision)
        self.last_sync.set(time.time())


class GatewayMeter:
    """One gateway's request metrics. The hot path of a latency-sensitive proxy: children are
    cached per label tuple (an update is a dict lookup and an increment), and no update ever
    raises (a metrics failure, e.g. a full disk under ABPLAT_METRICS_DIR, must not fail a
    user's request; the first one is logged)."""

    def __init__(self) -> None:
        self._requests: dict[tuple[str, str], Any] = {}
        self._refused: dict[int, Any] = {}
        self._upstream: dict[tuple[str, str, str], Any] = {}
        self._failed = False

    def routed(self, experiment: str, route: str) -> None:
        try:
            key = (experiment, route)
            child = self._requests.get(key)
            if child is None:
                child = self._requests[key] = GATEWAY_REQUESTS.labels(experiment, route)
            child.inc()
        except Exception as exc:  # noqa: BLE001 - never into the request path
            self._failure(exc)

    def refused(self, status: int, *, routed: bool = False) -> None:
        """A request the gateway answered itself; ``routed``: it was already counted by its route
        (the variants not loaded yet), else it counts as route refused."""
        if not routed:
            self.routed("", "refused")
        try:
            child = self._refused.get(status)
            if child is None:
                child = self._refused[status] = GATEWAY_REFUSED.labels(str(status))
            child.inc()
        except Exception as exc:  # noqa: BLE001 - never into the request path
            self._failure(exc)

    def upstream(self, experiment: str, variant: str, outcome: str) -> None:
        try:
            key = (experiment, variant, outcome)
            child = self._upstream.get(key)
            if child is None:
                child = self._upstream[key] = GATEWAY_UPSTREAM.labels(experiment, variant, outcome)
            child.inc()
        except Exception as exc:  # noqa: BLE001 - never into the request path
            self._failure(exc)

    def shadow(self, experiment: str, outcome: str) -> None:
        try:
            GATEWAY_SHADOWS.labels(experiment, outcome).inc()
        except Exception as exc:  # noqa: BLE001 - never into the event loop
            self._failure(exc)

    def limit_fallback(self, reason: str) -> None:
        try:
            GATEWAY_LIMIT_FALLBACKS.labels(reason).inc()
        except Exception as exc:  # noqa: BLE001 - never into the request path
            self._failure(exc)

    def entered(self) -> None:
        try:
            GATEWAY_IN_FLIGHT.inc()
        except Exception as exc:  # noqa: BLE001 - never into the request path
            self._failure(exc)

    def left(self) -> None:
        try:
            GATEWAY_IN_FLIGHT.dec()
        except Exception as exc:  # noqa: BLE001 - never into the request path
            self._failure(exc)

    def _failure(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            log.warning("metrics: a gateway metric update failed (later ones are not logged): %r", exc)


# ---- exposition ---------------------------------------------------------------------------------


class RunStatesCollector:
    """``abplat_replay_runs{status}`` from ``counts()`` (status -> runs), read at each scrape.
    A failing ``counts`` (the database is down) leaves the family out of that scrape, logged."""

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            found = dict(self.counts())
        except Exception as exc:  # noqa: BLE001 - a scrape must still answer with everything else
            log.warning("metrics: replay runs by status not read: %s", exc)
            return []
        family = GaugeMetricFamily(REPLAY_RUNS_NAME, REPLAY_RUNS_HELP, labels=["status"])
        for status in (*RUN_STATES, *sorted(set(found) - set(RUN_STATES))):
            family.add_metric([status], float(found.get(status, 0)))
        return [family]


class _OwnFamilies:
    """Only ``abplat_`` families of another collector: a multiprocess directory also holds the
    values of any library metric a process created there."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterable[Any]:
        return [m for m in self.inner.collect() if m.name.startswith(PREFIX)]


class _Forward:
    """The in-process registry's families without their ``_created`` samples (the multiprocess
    mode has none: both modes show the same series)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Any]:
        for family in self.registry.collect():
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield copy


_PID_FILE = re.compile(r"^gauge_live\w*?_(\d+)\.db$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def prune_dead_processes(directory: str | None = None) -> list[int]:
    """mark_process_dead for every pid with live-gauge files that no longer exists on this
    machine (a child killed without its exit hook). Only valid where every process writing the
    directory shares this machine's pid namespace (docs/metrics.md). Returns the pids pruned."""
    directory = directory or METRICS_DIR
    if not directory:
        return []
    pids = set()
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        m = _PID_FILE.match(os.path.basename(path))
        if m:
            pids.add(int(m.group(1)))
    dead = sorted(p for p in pids if p != os.getpid() and not _alive(p))
    for pid in dead:
        mark_process_dead(pid, directory)
    return dead


def mark_process_dead(pid: int, directory: str | None = None) -> None:
    """Remove a dead process's live gauges (its counters and histograms stay, so totals never
    go down). A no-op in the in-process mode."""
    directory = directory or METRICS_DIR
    if directory:
        _mark_process_dead(pid, directory)


def gunicorn_child_exit(server: Any, worker: Any) -> None:
    """gunicorn's ``child_exit`` hook (in the gunicorn config: ``from telemetry.metrics import
    gunicorn_child_exit as child_exit``): a worker that exits takes its live gauges with it."""
    mark_process_dead(worker.pid)


def registry_for_scrape(extra: Sequence[Any] = ()) -> CollectorRegistry:
    """What one scrape shows: this process's registry (in-process mode) or every process's
    files in ABPLAT_METRICS_DIR, plus ``extra`` collectors (the web's run states)."""
    registry = CollectorRegistry(auto_describe=False)
    if METRICS_DIR:
        prune_dead_processes()
        registry.register(_OwnFamilies(MultiProcessCollector(None, path=METRICS_DIR)))
    else:
        registry.register(_Forward(REGISTRY))
    for collector in extra:
        registry.register(collector)
    return registry


def exposition(extra: Sequence[Any] = ()) -> tuple[bytes, str]:
    """(body, content type) of one scrape in the Prometheus text format."""
    return generate_latest(registry_for_scrape(extra)), CONTENT_TYPE_LATEST


class _ScrapeTime:
    """A collector that builds the scrape's registry when scraped (start_http_server)."""

    def collect(self) -> Iterable[Any]:
        return registry_for_scrape().collect()


_server_lock = threading.Lock()
_server: Any = None


def serve(port: int, addr: str = "127.0.0.1") -> bool:
    """Serve ``/metrics`` on ``addr:port`` from a thread of this process (a Celery worker's main
    process: with ABPLAT_METRICS_DIR it shows every pool child). Once per process; True if this
    call started it."""
    global _server
    from prometheus_client import start_http_server

    with _server_lock:
        if _server is not None:
            return False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_ScrapeTime())
        _server = start_http_server(port, addr=addr, registry=registry)
        return True
