"""Starting, cancelling and describing replay runs (Django glue around replay).

Imports flow one way inside workers: api, admin, commands -> runs -> tasks -> shard ->
(replay, streaming, samples, experiments); models below all of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from django.conf import settings
from django.db import transaction

from experiments import audit
from experiments.models import Experiment
from replay.arrivals import Arrival
from replay.plan import expected_samples
from replay.sources import SourceError, load_requests
from workers.models import ReplayRun, ReplayShard
from workers.tasks import start_replay


class ReplayError(ValueError):
    """A replay that cannot start; nothing was created or sent."""


def resolve_source(path: str) -> Path:
    candidate = Path(path)
    if not candidate.is_absolute() and not candidate.exists():
        candidate = Path(settings.BASE_DIR) / path  # shipped traces: data/traces/...
    return candidate


def create_run(experiment: Experiment, *, source: str, source_format: str = "azure", mode: str = "split",
               arrival: Arrival | None = None, limit: int | None = None, concurrency: int = 512,
               shard_count: int | None = None, on_malformed: str = "reject", population_seed: int = 0,
               sample_fraction: float = 1.0, actor=None, enqueue: bool = True) -> ReplayRun:  # fmt: skip
    """Validate everything, record the run and its shards, and queue it after commit."""
    arrival = arrival or Arrival()
    if experiment.status != Experiment.Status.RUNNING:
        raise ReplayError(
            f"experiment {experiment.key!r} is {experiment.status}: only running experiments replay"
        )
    if mode not in ReplayRun.Mode.values:
        raise ReplayError(f"mode must be split or mirror, got {mode!r}")
    if on_malformed not in ("reject", "skip"):
        raise ReplayError(f"on_malformed must be reject or skip, got {on_malformed!r}")
    if concurrency < 1:
        raise ReplayError(f"concurrency must be at least 1, got {concurrency}")
    if limit is not None and limit < 1:
        raise ReplayError(f"limit must be at least 1, got {limit}")
    if shard_count is None:
        shard_count = 1 if settings.CELERY_TASK_ALWAYS_EAGER else settings.REPLAY_SHARDS
    if not 1 <= shard_count <= 256:
        raise ReplayError(f"shard count must be in [1, 256], got {shard_count}")
    if settings.CELERY_TASK_ALWAYS_EAGER and shard_count > 1:
        # Eager tasks run one after another: later shards would start late and show it as lag.
        raise ReplayError("with Celery eager (no ABPLAT_BROKER_URL) a replay runs as one shard")
    path = resolve_source(source)
    try:
        # A malformed source is rejected here, before anything is sent.
        loaded = load_requests(path, source_format, on_malformed=on_malformed, limit=limit,
                               seed=population_seed, sample_fraction=sample_fraction)  # fmt: skip
    except (SourceError, ValueError) as exc:
        raise ReplayError(str(exc)) from None
    n_variants = experiment.variants.count()
    with transaction.atomic():
        run = ReplayRun.objects.create(
            experiment=experiment, source=str(path), source_format=source_format, mode=mode,
            arrival=dataclasses.asdict(arrival), limit=limit, sample_fraction=sample_fraction,
            concurrency=concurrency, shard_count=shard_count,
            on_malformed=on_malformed, population_seed=population_seed,
            started_by=actor if getattr(actor, "pk", None) else None,
            total_requests=len(loaded.requests), skipped_lines=len(loaded.skipped),
            expected_samples=expected_samples(len(loaded.requests), mode, n_variants),
        )  # fmt: skip
        ReplayShard.objects.bulk_create(
            ReplayShard(run=run, index=i, planned=len(range(i, len(loaded.requests), shard_count)))
            for i in range(shard_count)
        )
        audit.record(actor, experiment, "replay_started", after=describe(run))
        if enqueue:
            transaction.on_commit(lambda: start_replay.delay(run.pk))
    return run


def cancel_run(run: ReplayRun, actor=None) -> bool:
    """Ask a run to stop: shards stop sending at their next check (about a second) and record
    what they sent. Returns False when the run had already ended."""
    with transaction.atomic():
        updated = (
            ReplayRun.objects.filter(pk=run.pk)
            .exclude(status__in=ReplayRun.FINAL)
            .update(cancel_requested=True)
        )
        if updated:
            ReplayRun.objects.filter(pk=run.pk, status=ReplayRun.Status.QUEUED).update(
                status=ReplayRun.Status.CANCELLED
            )
            audit.record(actor, run.experiment, "replay_cancelled", after={"run": run.pk})
    run.refresh_from_db()
    return bool(updated)


def describe(run: ReplayRun) -> dict:
    return {
        "run": run.pk, "experiment": run.experiment.key, "status": run.status, "mode": run.mode,
        "source": run.source, "format": run.source_format, "arrival": run.arrival, "limit": run.limit,
        "sample_fraction": run.sample_fraction,
        "total_requests": run.total_requests, "expected_samples": run.expected_samples,
        "samples_recorded": run.samples_recorded, "skipped_lines": run.skipped_lines,
        "outcomes": run.outcomes, "shards": run.shard_count, "error": run.error,
    }  # fmt: skip
