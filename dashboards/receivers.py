"""What the report does when the replay says a run's samples are final.

Connected in DashboardsConfig.ready() to samples.signals.replay_finished, so the replay
(workers) never imports the report: it only announces that a run ended.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from experiments.models import Experiment

log = logging.getLogger(__name__)


def build_rollup(sender: Any, *, run_id: int, experiment: str, store: Any, **kwargs: Any) -> None:
    """The run's samples are final: sum them into the report's rollup (analysis.rollup).
    Best effort: without it the report reads the raw samples (the same numbers, slower), and
    `python manage.py build_rollups` builds it later."""
    # Deferred: the analysis stack (numpy, scipy) loads when a run ends, not in every process
    # that starts Django (this module is imported by DashboardsConfig.ready()).
    from analysis import rollup
    from analysis.definitions import slo_of

    t = time.perf_counter()
    try:
        slo = slo_of(Experiment.objects.get(key=experiment))
        built = rollup.build_run_rollup(store, experiment, run_id, slo)
    except Exception as e:  # noqa: BLE001 - the run has ended either way; say what failed
        log.warning("run %s: report rollup not built (%s); `manage.py build_rollups` retries", run_id, e)
        return
    if built is not None:
        log.info(
            "run %s: report rollup of %d samples built in %.2f s", run_id, built.rows, time.perf_counter() - t
        )
