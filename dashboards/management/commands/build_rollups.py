"""python manage.py build_rollups KEY [--run ID ...]

(Re)build the report rollups (analysis.rollup) of an experiment's runs: every run with
samples, or the runs named. A run's rollup is built when the replay announces its end
(samples.signals.replay_finished, received in dashboards.receivers); this command is for runs
recorded before rollups existed, a build that failed (the store was down), or runs whose
samples changed after their build (the report then reads the raw samples until rebuilt).

It reads the sample store only (the report side never asks the replay's database): a run
whose samples change while it is being built (still replaying) is skipped with nothing of it
published, and gets its rollup when it ends.

--json: {"experiment", "runs": [{"run_id", "result": "built" | "still_replaying" |
"no_samples", "samples", "seconds"}], "built", "rollup_rows"}. Progress (runs done of all, with
rate and ETA) on stderr: experiments.cli.
"""

from __future__ import annotations

import time

from analysis import rollup
from analysis.definitions import slo_of
from experiments.cli import CliError, JsonCommand, add_json_argument, add_progress_arguments
from experiments.models import Experiment
from samples.factory import sample_store


class Command(JsonCommand):
    help = "Build the SLA report rollups of an experiment's finished runs"

    def add_arguments(self, parser):
        parser.add_argument("key")
        parser.add_argument(
            "--run", type=int, action="append", default=[], help="repeatable; default: every run"
        )
        add_json_argument(parser)
        add_progress_arguments(parser)

    def handle(self, *args, **opts):
        try:
            experiment = Experiment.objects.get(key=opts["key"])
        except Experiment.DoesNotExist:
            raise CliError(f"no experiment with key {opts['key']!r}", field="key") from None
        store = sample_store()
        runs = opts["run"] or list(rollup.runs_of(store, experiment.key))
        progress = self.progress(opts, unit="runs")
        results = []
        for i, run_id in enumerate(runs):
            progress.update(i, len(runs), f"building run {run_id}")
            t = time.perf_counter()
            result = {"run_id": run_id, "result": "built", "samples": 0, "seconds": None}
            results.append(result)
            try:
                b = rollup.build_run_rollup(store, experiment.key, run_id, slo_of(experiment))
            except rollup.RollupStale:
                result["result"] = "still_replaying"
                self.say(
                    f"run {run_id}: still replaying (its samples changed during the build), skipped "
                    "(its rollup is built when it ends)"
                )
                continue
            if b is None:
                result["result"] = "no_samples"
                self.say(f"run {run_id}: no samples of {experiment.key!r}, nothing to build")
                continue
            result["samples"], result["seconds"] = b.rows, round(time.perf_counter() - t, 3)
            self.say(f"run {run_id}: {b.rows} samples rolled up in {result['seconds']:.2f} s")
        built = sum(1 for r in results if r["result"] == "built")
        progress.finish(len(runs), len(runs), f"{built} built")
        rows = rollup.rollup_rows(store, experiment.key)
        if self.json:
            self.emit({"experiment": experiment.key, "runs": results, "built": built, "rollup_rows": rows})
            return
        self.say(f"{built} run(s) built; rollup rows: {rows}")
