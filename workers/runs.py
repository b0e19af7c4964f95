"""Recording, cancelling and describing replay runs (Django glue around replay).

A replay is asked for with a ReplayRequest; ``create_run`` validates it and records the run
and its shards, and workers.service starts it. Imports flow one way inside workers: api,
admin, commands -> service -> runs -> tasks -> shard -> (replay, streaming, samples,
experiments); models below all of them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from experiments import audit
from experiments.models import Experiment
from replay import shapes
from replay.arrivals import Arrival
from replay.plan import expected_samples
from replay.sources import SourceError, load_requests
from samples.factory import sample_store
from samples.store import NotMigrated, StoreError, StoreUnavailable
from telemetry.logs import context_from_args
from traces import storage as trace_storage
from traces.models import Trace
from workers import preflight
from workers.models import ReplayRun, ReplayShard
from workers.shard import shard_rows
from workers.tasks import complete_run, lease_s, maybe_finish

log = logging.getLogger(__name__)


class ReplayError(ValueError):
    """A replay that cannot start; nothing was created or sent."""


def human_duration(seconds: float) -> str:
    """3725 -> '1 h 2 min'; 90061 -> '1 d 1 h'; 42.5 -> '42.5 s'."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60)} s"
    hours = minutes // 60
    if hours < 24:
        return f"{hours} h {minutes % 60} min"
    return f"{hours // 24} d {hours % 24} h"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a replay is about to do, shown before it starts."""

    requests: int
    samples: int
    duration_s: float | None  # None: closed loop (as long as the requests take)
    arrival: Arrival

    @property
    def rate(self) -> float | None:
        if self.duration_s is None:
            return None
        return self.requests / self.duration_s if self.duration_s > 0 else float("inf")

    def __str__(self) -> str:
        a = self.arrival
        how = {
            "recorded": f"recorded arrivals x{a.speed:g}",
            "poisson": f"poisson at {a.rate:g}/s",
            "gamma": f"gamma at {a.rate:g}/s, cv {a.cv:g}",
            "closed": f"closed loop, {a.concurrency} in flight",
        }[a.mode]
        if self.duration_s is None:
            return f"plan: {self.requests} requests ({how}), {self.samples} samples expected"
        rate = "all at once" if self.rate == float("inf") else f"{self.rate:.3g} requests/s on average"
        return (
            f"plan: {self.requests} requests over {human_duration(self.duration_s)} ({how}; {rate}), "
            f"{self.samples} samples expected"
        )


def max_duration_default() -> float:
    return float(settings.REPLAY_MAX_DURATION_S)


class ReplayInputError(ReplayError):
    """A replay refused for one input, named by ``field`` (the API keys its 400 with it)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class Source:
    """The file a replay reads, what messages call it, and its upload row (if uploaded)."""

    path: Path
    label: str
    trace: Trace | None = None
    in_trace_dir: bool = True


def resolve_source(
    source: str | None = None, *, trace: str | None = None, local_paths: bool = False
) -> Source:
    """Which file a replay reads.

    The API and the admin (``local_paths`` off) read from TRACE_DIR only: ``trace`` is an
    uploaded trace's name or sha256, ``source`` a file name inside TRACE_DIR; absolute paths,
    '..', symlinks out of the directory and anything but regular files are refused, naming the
    input and never a file's content (traces.storage.resolve). The replay command
    (``local_paths``: the operator owns that shell) also reads a local path: relative to the
    working directory, else to the project (the shipped data/traces/...), else a trace."""
    if (source is None) == (trace is None):
        raise ReplayInputError(
            "trace", "give a trace (an uploaded trace's name or sha256) or a source, not both"
        )
    field, ref = ("trace", trace) if trace is not None else ("source", source)
    if local_paths:
        candidate = Path(ref)
        if not candidate.is_absolute() and not candidate.exists():
            candidate = Path(settings.BASE_DIR) / ref  # shipped traces: data/traces/...
            if not candidate.exists():
                try:
                    path, row = trace_storage.resolve(ref, field=field)
                except trace_storage.TraceError:
                    pass  # the load names the missing path
                else:
                    return Source(path, row.name if row else ref, row)
        return Source(candidate, str(candidate), in_trace_dir=False)
    try:
        path, row = trace_storage.resolve(ref, field=field)
    except trace_storage.TraceError as exc:
        raise ReplayInputError(field, str(exc)) from None
    return Source(path, row.name if row else ref, row)


@dataclasses.dataclass(frozen=True)
class ReplayRequest:
    """A replay asked for: what to read, how to send it and to whom, and who asks. The
    defaults are the replay command's. ``local_paths``: read a local path too (the operator's
    shell and code); whatever takes a source over HTTP sets it off (TRACE_DIR only,
    ``resolve_source``). ``targets``: in mirror mode, send only to these variants (a capacity
    step loads one deployment alone). ``shards``: None for the default (``shard_count``)."""

    experiment: Experiment
    source: str | None = None  # a file (``local_paths``) or a file name inside TRACE_DIR
    trace: str | None = None  # or an uploaded trace's name or sha256
    source_format: str | None = None  # None: the trace's, else azure
    local_paths: bool = True
    mode: str = "split"
    targets: tuple[str, ...] = ()
    arrival: Arrival = dataclasses.field(default_factory=Arrival)
    limit: int | None = None
    concurrency: int = 512
    shards: int | None = None
    seed: int = 0  # the user population's (the run's population_seed)
    sample_fraction: float = 1.0
    on_malformed: str = "reject"
    render_chat: str = "reject"
    wrap_prompt: bool = False
    max_duration_s: float | None = None  # None: settings.REPLAY_MAX_DURATION_S
    confirm: bool = False  # start even if the plan exceeds max_duration_s
    check_variants: bool = True  # probe every variant's GET /v1/models first (workers.preflight)
    actor: Any = None

    def shard_count(self) -> int:
        """``shards``, by default one with eager Celery and settings.REPLAY_SHARDS with a broker."""
        if self.shards is not None:
            return self.shards
        return 1 if settings.CELERY_TASK_ALWAYS_EAGER else settings.REPLAY_SHARDS

    def check(self) -> None:
        """Refuse what is wrong before anything is read: the experiment must be running; mode,
        render_chat and on_malformed known; concurrency and limit at least 1 and within the caps
        (settings REPLAY_MAX_*: what one sre request may make the workers do), like the speed;
        the shard count in [1, 256], and one with eager Celery."""
        arrival, experiment = self.arrival, self.experiment
        if experiment.status != Experiment.Status.RUNNING:
            raise ReplayError(
                f"experiment {experiment.key!r} is {experiment.status}: only running experiments replay"
            )
        if self.mode not in ReplayRun.Mode.values:
            raise ReplayError(f"mode must be split or mirror, got {self.mode!r}")
        if self.render_chat not in shapes.RENDERINGS:
            raise ReplayError(
                f"render_chat must be one of {', '.join(shapes.RENDERINGS)}, got {self.render_chat!r}"
            )
        if self.on_malformed not in ("reject", "skip"):
            raise ReplayError(f"on_malformed must be reject or skip, got {self.on_malformed!r}")
        if self.concurrency < 1:
            raise ReplayError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.limit is not None and self.limit < 1:
            raise ReplayError(f"limit must be at least 1, got {self.limit}")
        for field, value, cap, name in (
            ("speed", arrival.speed, settings.REPLAY_MAX_SPEED, "REPLAY_MAX_SPEED"),
            ("concurrency", self.concurrency, settings.REPLAY_MAX_CONCURRENCY, "REPLAY_MAX_CONCURRENCY"),
            (
                "arrival.concurrency",
                arrival.concurrency,
                settings.REPLAY_MAX_CONCURRENCY,
                "REPLAY_MAX_CONCURRENCY",
            ),
            ("limit", self.limit or 0, settings.REPLAY_MAX_REQUESTS, "REPLAY_MAX_REQUESTS"),
        ):
            if value > cap:
                got = f"{value:g}" if isinstance(value, float) else value
                raise ReplayInputError(field, f"{field} must be at most {cap} (setting {name}), got {got}")
        shard_count = self.shard_count()
        if not 1 <= shard_count <= 256:
            raise ReplayError(f"shard count must be in [1, 256], got {shard_count}")
        if settings.CELERY_TASK_ALWAYS_EAGER and shard_count > 1:
            # Eager tasks run one after another: later shards would start late and show it as lag.
            raise ReplayError("with Celery eager (no ABPLAT_BROKER_URL) a replay runs as one shard")


def create_run(request: ReplayRequest) -> ReplayRun:
    """Validate everything and record the run and its shards (workers.service starts it).

    Before anything is created: the request's options hold (``ReplayRequest.check``); the
    source resolves (``resolve_source``) and loads (streamed, stopping at ``limit``); every
    request fits every variant's API (replay.shapes, with ``render_chat`` / ``wrap_prompt``);
    the planned schedule is at most ``max_duration_s`` (default: the REPLAY_MAX_DURATION_S
    setting, 2 h) unless ``confirm``; the sample store has its tables; and
    (``check_variants``) every variant answers ``GET /v1/models`` listing its model
    (workers.preflight). The plan is on the returned run as ``run.plan``."""
    request.check()
    experiment, arrival, mode, limit = request.experiment, request.arrival, request.mode, request.limit
    max_requests = settings.REPLAY_MAX_REQUESTS
    source_format = request.source_format
    src = resolve_source(request.source, trace=request.trace, local_paths=request.local_paths)
    if src.trace is not None:
        if source_format not in (None, src.trace.format):
            raise ReplayInputError(
                "format",
                f"format {source_format} does not match trace {src.label}, which is {src.trace.format}",
            )
        source_format = src.trace.format
        if limit is None and src.trace.rows > max_requests:
            raise ReplayInputError(
                "limit",
                f"trace {src.label} has {src.trace.rows} requests, over the cap of {max_requests} "
                "(setting REPLAY_MAX_REQUESTS); give a limit",
            )
    source_format = source_format or ReplayRun.SourceFormat.AZURE
    if source_format not in ReplayRun.SourceFormat.values:
        raise ReplayInputError("format", f"format must be azure or jsonl, got {source_format!r}")
    path = src.path
    try:
        # A malformed source is rejected here, before anything is sent. Streamed: reading stops
        # at the limit (or one past the request cap), a long line or (in TRACE_DIR) a big file.
        loaded = load_requests(
            path,
            source_format,
            on_malformed=request.on_malformed,
            limit=limit or max_requests + 1,
            seed=request.seed,
            sample_fraction=request.sample_fraction,
            name=src.label,
            max_bytes=settings.TRACE_MAX_BYTES if src.in_trace_dir else None,
            max_line_bytes=settings.TRACE_MAX_LINE_BYTES,
        )
    except (SourceError, ValueError) as exc:
        raise ReplayError(str(exc)) from None
    if loaded.read > max_requests:
        raise ReplayInputError(
            "limit",
            f"{src.label} has more than {max_requests} requests (setting REPLAY_MAX_REQUESTS); give a limit",
        )
    variants = list(experiment.variants.order_by("position"))
    targets = list(dict.fromkeys(request.targets))
    if targets:
        unknown = sorted(set(targets) - {v.key for v in variants})
        if unknown:
            raise ReplayInputError("targets", f"no variant {unknown} in experiment {experiment.key!r}")
        if mode != "mirror":
            raise ReplayInputError("targets", "targets apply to mirror runs (split mode follows the weights)")
        variants = [v for v in variants if v.key in targets]
    try:
        shapes.check(
            loaded.requests,
            {v.key: v.api for v in variants},
            render_chat=request.render_chat,
            wrap_prompt=request.wrap_prompt,
        )
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    n_variants = len(variants)
    plan = Plan(
        requests=len(loaded.requests),
        samples=expected_samples(len(loaded.requests), mode, n_variants),
        duration_s=arrival.duration_s([r.offset_s for r in loaded.requests]),
        arrival=arrival,
    )
    cap = max_duration_default() if request.max_duration_s is None else request.max_duration_s
    if plan.duration_s is not None and plan.duration_s > cap and not request.confirm:
        raise ReplayError(
            f"{plan}: the planned duration exceeds the cap of {human_duration(cap)} "
            f"(max_duration {cap:g} s); speed it up (--speed, --rate, --limit), raise the cap "
            "(--max-duration), or confirm (--yes; API: confirm)"
        )
    # A store without its tables would fail every shard with a raw ClickHouse error; an
    # unreachable one is fine here (the shards spool until it is back). Asked once per process.
    try:
        sample_store().check_schema()
    except NotMigrated as exc:
        raise ReplayError(f"nothing was sent: {exc}") from None
    except StoreUnavailable:
        pass
    except StoreError as exc:  # chDB locked by another process, say
        raise ReplayError(f"nothing was sent: the sample store cannot be used: {exc}") from None
    if request.check_variants:
        verify = settings.VARIANT_CA_BUNDLE or True
        problems = preflight.check(
            [
                preflight.Target(v.key, v.endpoint, v.model, v.http2, v.auth_secret, experiment.team.name)
                for v in variants
            ],
            verify=verify,
        )
        if problems:
            raise ReplayError("preflight failed, nothing was sent: " + "; ".join(problems))
    # Bounded tasks: with a broker each shard covers one window of the schedule (a closed loop
    # works one window's time per task); eager Celery runs the whole schedule in one call.
    window_s = None if settings.CELERY_TASK_ALWAYS_EAGER else float(settings.REPLAY_WINDOW_S)
    offsets = arrival.offsets([r.offset_s for r in loaded.requests])
    with transaction.atomic():
        run = ReplayRun.objects.create(
            experiment=experiment,
            source=str(path),
            source_format=source_format,
            mode=mode,
            arrival=dataclasses.asdict(arrival),
            limit=limit,
            sample_fraction=request.sample_fraction,
            concurrency=request.concurrency,
            shard_count=request.shard_count(),
            window_s=window_s,
            on_malformed=request.on_malformed,
            population_seed=request.seed,
            render_chat=request.render_chat,
            wrap_prompt=request.wrap_prompt,
            targets=targets,
            started_by=request.actor if getattr(request.actor, "pk", None) else None,
            total_requests=len(loaded.requests),
            skipped_lines=len(loaded.skipped),
            expected_samples=expected_samples(len(loaded.requests), mode, n_variants),
        )
        ReplayShard.objects.bulk_create(shard_rows(run, offsets, len(loaded.requests)))
        audit.record(request.actor, experiment, "replay_started", after=describe(run))
    run.plan = plan
    return run


def cancel_run(run: ReplayRun, actor=None, *, end_abandoned: bool = True) -> bool:
    """Cancel a run in whatever state it is; False when it had already ended.

    Queued: cancelled at once. Running: shards stop sending at their next check (about a
    second), record what they sent (requests in flight finish or are recorded as cancelled)
    and the run ends cancelled. A run whose shards all lost their lease (its owner died: no
    heartbeat for settings.REPLAY_LEASE_S) is ended here, from the samples the store has
    (``end_abandoned``).
    Flushing: ends cancelled once its samples are durable (now, or at flush_samples)."""
    with transaction.atomic():
        updated = (
            ReplayRun.objects.filter(pk=run.pk)
            .exclude(status__in=ReplayRun.FINAL)
            .update(cancel_requested=True)
        )
        if updated:
            ReplayRun.objects.filter(pk=run.pk, status=ReplayRun.Status.QUEUED).update(
                status=ReplayRun.Status.CANCELLED, finished_at=timezone.now()
            )
            audit.record(actor, run.experiment, "replay_cancelled", after={"run": run.pk})
    if updated:
        maybe_finish(run.pk)  # shards not started yet end now, without sending
    if updated and end_abandoned:
        try:
            end_if_abandoned(run.pk)
        except StoreUnavailable as exc:
            log.warning(
                "run %s: cancelled; its samples wait for the sample store: %s",
                run.pk,
                exc,
                extra={"run": run.pk},
            )
    run.refresh_from_db()
    return bool(updated)


def stale_shards(run: ReplayRun, now=None) -> list[ReplayShard] | None:
    """The run's open shards when every one that is due lost its lease (no heartbeat for
    settings.REPLAY_LEASE_S, or never claimed that long after its window opened); None when any
    is alive, or none is due or open. A window that has not opened yet is neither alive nor stale."""
    now = now or timezone.now()
    stale = now - dt.timedelta(seconds=lease_s())
    open_shards = list(run.shards.filter(status__in=[ReplayShard.Status.PENDING, ReplayShard.Status.RUNNING]))
    due = []
    for shard in open_shards:
        opens = run.started_at
        if opens is not None and run.start_at_unix is not None and shard.heartbeat_at is None:
            opens = dt.datetime.fromtimestamp(run.start_at_unix + shard.start_s, tz=dt.UTC)
        beat = shard.heartbeat_at or opens
        if beat is None or beat > now:
            continue  # not due yet
        if beat >= stale:
            return None
        due.append(shard)
    return open_shards if due else None


@context_from_args(run="run_id")  # log fields of the call (telemetry/logs.py)
def end_if_abandoned(run_id: int) -> bool:
    """End a running run whose owner died (every open shard's lease expired): its open shards
    fail as abandoned, and the run ends, cancelled if cancellation was asked for and failed
    otherwise, with the exact counts of the samples the store has. Also ends a flushing run
    whose samples are now durable. True when this call ended the run. Raises StoreUnavailable
    (the run then waits in flushing for flush_samples)."""
    run = ReplayRun.objects.filter(pk=run_id).first()
    if run is None or run.is_final:
        return False
    if run.status == ReplayRun.Status.RUNNING:
        abandoned = stale_shards(run)
        if abandoned is None:
            return False
        reason = f"abandoned: its owner stopped sending heartbeats (lease {lease_s():g} s); partial"
        ReplayShard.objects.filter(pk__in=[s.pk for s in abandoned]).exclude(
            status__in=[ReplayShard.Status.DONE, ReplayShard.Status.FAILED]
        ).update(status=ReplayShard.Status.FAILED, error=reason, finished_at=timezone.now())
        claimed = ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.RUNNING).update(
            status=ReplayRun.Status.FLUSHING, error=f"shard(s) {[s.index for s in abandoned]} {reason}"[:4000]
        )
        if not claimed:
            return False
        log.warning("run %s: %s", run_id, reason)
    elif run.status != ReplayRun.Status.FLUSHING:
        return False  # cancelling: its shards are alive and stopping
    return complete_run(run_id, exact_shards=True)


def reap_abandoned() -> list[int]:
    """End every running run whose owner died (the periodic check, run by flush_samples).
    Returns the ids ended; a store that is down leaves them flushing, logged. Eager Celery
    only: with a broker, a dead worker's shard is redelivered and resumes (workers.tasks)."""
    ended = []
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        return ended
    for run in ReplayRun.objects.filter(
        Q(status=ReplayRun.Status.RUNNING) | Q(status=ReplayRun.Status.FLUSHING)
    ):
        try:
            if end_if_abandoned(run.pk):
                ended.append(run.pk)
        except StoreUnavailable as exc:
            log.warning(
                "run %s: abandoned, its samples wait for the sample store: %s",
                run.pk,
                exc,
                extra={"run": run.pk},
            )
    return ended


def describe(run: ReplayRun) -> dict:
    return {
        "run": run.pk,
        "experiment": run.experiment.key,
        "status": run.status,
        "mode": run.mode,
        "source": run.source,
        "format": run.source_format,
        "arrival": run.arrival,
        "limit": run.limit,
        "sample_fraction": run.sample_fraction,
        "render_chat": run.render_chat,
        "wrap_prompt": run.wrap_prompt,
        "total_requests": run.total_requests,
        "expected_samples": run.expected_samples,
        "samples_recorded": run.samples_recorded,
        "skipped_lines": run.skipped_lines,
        "outcomes": run.outcomes,
        "shards": run.shard_count,
        "error": run.error,
        "targets": run.targets,
    }


def lag_p99_ms(run: ReplayRun) -> float | None:
    """The run's schedule lag p99: its worst shard's (None before any shard has sent)."""
    lags = [x for x in run.shards.values_list("lag_p99_ms", flat=True) if x is not None]
    return max(lags) if lags else None
