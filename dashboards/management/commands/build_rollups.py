"""python manage.py build_rollups KEY [--run ID ...]

(Re)build the report rollups (analysis.rollup) of an experiment's runs: every run with
samples, or the runs named. A run's rollup is built when the replay announces its end
(samples.signals.replay_finished, received in dashboards.receivers); this command is for runs
recorded before rollups existed, a build that failed (the store was down), or runs whose
samples changed after their build (the report then reads the raw samples until rebuilt).

It reads the sample store only (the report side never asks the replay's database): a run
whose samples change while it is being built (still replaying) is skipped with nothing of it
published, and gets its rollup when it ends.
"""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError

from analysis import rollup
from dashboards.reports import slo_of
from experiments.models import Experiment
from samples.factory import sample_store


class Command(BaseCommand):
    help = "Build the SLA report rollups of an experiment's finished runs"

    def add_arguments(self, parser):
        parser.add_argument("key")
        parser.add_argument(
            "--run", type=int, action="append", default=[], help="repeatable; default: every run"
        )

    def handle(self, *args, **opts):
        try:
            experiment = Experiment.objects.get(key=opts["key"])
        except Experiment.DoesNotExist:
            raise CommandError(f"no experiment with key {opts['key']!r}") from None
        store = sample_store()
        runs = opts["run"] or list(rollup.runs_of(store, experiment.key))
        built = 0
        for run_id in runs:
            t = time.perf_counter()
            try:
                b = rollup.build_run_rollup(store, experiment.key, run_id, slo_of(experiment))
            except rollup.RollupStale:
                self.stdout.write(
                    f"run {run_id}: still replaying (its samples changed during the build), skipped "
                    "(its rollup is built when it ends)"
                )
                continue
            if b is None:
                self.stdout.write(f"run {run_id}: no samples of {experiment.key!r}, nothing to build")
                continue
            built += 1
            self.stdout.write(f"run {run_id}: {b.rows} samples rolled up in {time.perf_counter() - t:.2f} s")
        self.stdout.write(f"{built} run(s) built; rollup rows: {rollup.rollup_rows(store, experiment.key)}")
