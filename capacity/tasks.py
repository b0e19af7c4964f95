"""A capacity search started over the API, as a Celery task (with a broker) or a thread of the
web process (eager Celery, the embedded default), so the request answers 202 at once.

The task orchestrates: it starts each step's replay and polls the store, while the steps' shard
tasks run on the workers. So it holds one worker process for the whole search (minutes to an
hour): run workers with a concurrency of 2 or more (`celery -A abplat worker`, the default is one
process per core). Its time limit is the search's own bound, not the shard tasks' 30 minutes.
"""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from django.db import connections, transaction
from django.utils import timezone

from capacity.models import CapacitySearch
from capacity.service import execute_search

log = logging.getLogger(__name__)
SEARCH_TIME_LIMIT_S = 12 * 3600


@shared_task(name="capacity.tasks.run_search", ignore_result=True, acks_late=False,
             soft_time_limit=SEARCH_TIME_LIMIT_S, time_limit=SEARCH_TIME_LIMIT_S + 600)  # fmt: skip
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
