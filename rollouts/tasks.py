"""The periodic rollout look (Celery beat, every ABPLAT_ROLLOUT_INTERVAL_S: abplat/celery.py)."""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from rollouts.service import RolloutError, look, running_rollouts

log = logging.getLogger(__name__)


@shared_task(name="rollouts.tasks.rollout_tick", ignore_result=True)
def rollout_tick() -> dict[str, str]:
    """One look at every running rollout. The lease in rollouts.service makes a second tick
    within the interval (another beat, a redelivery) a no-op; one experiment's failure does not
    stop the others."""
    done: dict[str, str] = {}
    for key in running_rollouts():
        try:
            r = look(key, interval_s=float(settings.ROLLOUT_INTERVAL_S))
        except RolloutError as exc:
            done[key] = f"error: {exc}"
            log.error("rollout %s: %s", key, exc)
            continue
        except Exception:
            done[key] = "error: see the log"
            log.exception("rollout %s: the look failed", key)
            continue
        done[key] = r.decision.action if r.decision else f"no decision: {r.note}"
        log.info("rollout %s: %s", key, done[key])
    return done
