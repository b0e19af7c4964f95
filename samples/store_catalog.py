"""RunCatalog: the run catalog, each run's mode, source and status (schema.RUNS_TABLE).

Who writes it: a replay (workers.tasks) and the gateway (gateway.recording, mode and source
live) as a run starts and ends. Who reads it: the SLA report, which reads by default only the
runs the catalog says are done (analysis.runs).
"""

from __future__ import annotations

import time
from typing import Any

from samples import columns as colmod
from samples import schema
from samples.store_base import StoreBase

# Added to the version of a terminal status in the run catalog (record_run): above any
# time.time_ns() of this era (~1.7e18) and still inside UInt64 with it.
_TERMINAL_RANK = 1 << 62


class RunCatalog(StoreBase):
    """record_run and runs, on any backend."""

    def record_run(
        self,
        run_id: int,
        experiment: str,
        mode: str,
        status: str,
        *,
        source: str = "replay",
        started_ms: int = 0,
        finished_ms: int = 0,
    ) -> None:
        """Record a run's status in the run catalog (schema.RUNS_TABLE); idempotent.

        The latest call wins (version: wall-clock nanoseconds), except that a terminal status
        (done, cancelled, failed) always outranks 'running': a delayed retry of the 'running'
        record never reopens a finished run. started_ms/finished_ms of 0 mean "unknown" and keep
        what an earlier call recorded (runs() takes the largest). Raises ValueError on a bad
        argument (nothing is written) and StoreUnavailable when the store is down.
        """
        if isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 0:
            raise ValueError(f"record_run: run_id must be a non-negative integer, got {run_id!r}")
        if not isinstance(experiment, str) or not experiment:
            raise ValueError(f"record_run: experiment must be a non-empty key, got {experiment!r}")
        if mode not in colmod.MODES:
            raise ValueError(f"record_run: mode must be one of {colmod.MODES}, got {mode!r}")
        if status not in schema.RUN_STATUSES:
            raise ValueError(f"record_run: status must be one of {schema.RUN_STATUSES}, got {status!r}")
        if not isinstance(source, str) or not source:
            raise ValueError(f"record_run: source must be a non-empty name, got {source!r}")
        for name, value in (("started_ms", started_ms), ("finished_ms", finished_ms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"record_run: {name} must be a non-negative integer (unix ms), got {value!r}"
                )
        version = time.time_ns() + (_TERMINAL_RANK if status != "running" else 0)
        self.execute(
            f"INSERT INTO {schema.RUNS_TABLE} "
            "(run_id, experiment, mode, source, status, started_ms, finished_ms, version) "
            "SELECT %(run_id)s, %(experiment)s, %(mode)s, %(source)s, %(status)s, "
            "%(started_ms)s, %(finished_ms)s, %(version)s",
            {
                "run_id": run_id,
                "experiment": experiment,
                "mode": mode,
                "source": source,
                "status": status,
                "started_ms": started_ms,
                "finished_ms": finished_ms,
                "version": version,
            },
        )

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        """The run catalog of an experiment, one dict per run (its latest record), in run order:
        {run_id, experiment, mode, source, status, started_ms, finished_ms, version}.
        started_ms/finished_ms are the largest recorded (0: never recorded)."""
        rows = self.query(
            "SELECT run_id, argMax(mode, version), argMax(source, version), argMax(status, version), "
            "max(started_ms), max(finished_ms), max(version) "
            f"FROM {schema.RUNS_TABLE} WHERE experiment = %(experiment)s GROUP BY run_id ORDER BY run_id",
            {"experiment": experiment},
        )
        return [
            {
                "run_id": int(r),
                "experiment": experiment,
                "mode": m,
                "source": src,
                "status": st,
                "started_ms": int(t0),
                "finished_ms": int(t1),
                "version": int(ver),
            }
            for r, m, src, st, t0, t1, ver in rows
        ]
