"""A capacity search started over the web (the API or the admin), as a Celery task (with a
broker) or a thread of the web process (eager Celery, the embedded default), so the request
answers at once.

The task orchestrates: it starts each step's replay and polls the store, while the steps' shard
tasks run on the workers. So it holds one worker process for the whole search (minutes to an
hour): run workers with a concurrency of 2 or more (`celery -A abplat worker`, the default is one
process per core). Its time limit is the search's own bound, not the shard tasks' 30 minutes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from capacity.models import CapacitySearch
from capacity.service import Options, create_search, execute_search
from experiments.models import Experiment
from workers.runs import resolve_source

log = logging.getLogger(__name__)
SEARCH_TIME_LIMIT_S = 12 * 3600


@shared_task(
    name="capacity.tasks.run_search",
    ignore_result=True,
    acks_late=False,
    soft_time_limit=SEARCH_TIME_LIMIT_S,
    time_limit=SEARCH_TIME_LIMIT_S + 600,
)
def run_search(search_id: int) -> None:
    """Run a recorded search to its end (a search that already ended is left alone)."""
    record = CapacitySearch.objects.select_related("experiment", "started_by").get(pk=search_id)
    if record.status != CapacitySearch.Status.RUNNING or record.finished_at is not None:
        log.info("capacity search %s already ended (%s)", search_id, record.status)
        return
    execute_search(record, say=lambda line: log.info("capacity search %s: %s", search_id, line))


def start_in_background(search_id: int) -> None:
    """Eager Celery: after this transaction commits, in a daemon thread of this process."""

    def work():
        try:
            run_search(search_id)
        except Exception as exc:
            log.exception("capacity search %s failed", search_id)
            CapacitySearch.objects.filter(pk=search_id, finished_at__isnull=True).update(
                status=CapacitySearch.Status.FAILED, error=str(exc)[:2000], finished_at=timezone.now()
            )
        finally:
            connections.close_all()

    transaction.on_commit(
        lambda: threading.Thread(target=work, name=f"abplat-capacity-search-{search_id}", daemon=True).start()
    )


def start_search(
    experiment: Experiment,
    fields: Mapping[str, Any],
    *,
    trace: str,
    source_format: str | None,
    variants: Sequence[str],
    actor,
) -> CapacitySearch:
    """Record the search the API or the admin asks for (capacity.service.create_search) and
    start it once this transaction commits: a Celery task with a broker, else a thread of this
    process (``start_in_background``). ``trace``: an uploaded trace's name or sha256, read from
    the trace directory only; ``fields``: the form's search settings, named as both name them.
    Raises ReplayError, with nothing recorded."""
    src = resolve_source(trace=trace, local_paths=False)
    opts = Options(
        trace=src.path.name,
        source_format=source_format,
        variants=variants,
        arrival=fields["arrival"],
        cv=fields["cv"],
        start_rps=fields.get("start_rate"),
        max_rps=fields["max_rate"],
        min_rps=fields["min_rate"],
        rel_tol=fields["tolerance"],
        max_steps=fields["max_steps"],
        alpha=fields["alpha"],
        step_requests=fields["step_requests"],
        warmup_s=fields["warmup"],
        seed=fields["seed"],
        lag_limit_ms=fields.get("lag_limit"),
        local_paths=False,
    )
    record = create_search(experiment, opts, actor=actor)
    if settings.CELERY_TASK_ALWAYS_EAGER:
        start_in_background(record.pk)
    else:
        transaction.on_commit(lambda: run_search.delay(record.pk))
    return record
