"""python manage.py score_fidelity RUN [RUN ...] [--json]

Score mirror runs' requests by teacher forcing now, in this process (workers/fidelity_scores.py,
the pass a mirror run's end queues): for a run that ended before its experiment's
fidelity.score_share was set, or again after a variant's server was fixed. The rows replace the
run's earlier ones. --json: {"runs": [{"run_id", "picked", "rows"}]}.
"""

from django.core.management.base import CommandError

from experiments.cli import JsonCommand, add_json_argument
from replay.plan import MIRROR
from workers.fidelity_scores import CHUNK, score_chunk, sending_to
from workers.models import ReplayRun


class Command(JsonCommand):
    help = (
        "Score a share of mirror runs' requests by teacher forcing (the experiment's "
        "fidelity.score_share and score_top_k), in this process; their rows replace earlier ones."
    )

    def add_arguments(self, parser):
        parser.add_argument("runs", nargs="+", type=int, metavar="RUN", help="replay run ids")
        add_json_argument(parser)

    def handle(self, *args, **options):
        out = []
        for run_id in options["runs"]:
            run = ReplayRun.objects.select_related("experiment").filter(pk=run_id).first()
            if run is None:
                raise CommandError(f"run {run_id}: no such replay run")
            if run.mode != MIRROR or not run.is_final:
                raise CommandError(
                    f"run {run_id}: only a mirror run that has ended is scored ({run.mode}, {run.status})"
                )
            share = run.experiment.fidelity_score_share
            if share <= 0:
                raise CommandError(
                    f"run {run_id}: experiment {run.experiment.key!r} scores nothing (fidelity.score_share "
                    "is 0 in its document)"
                )
            busy = sending_to(run, run.replay_variants())
            if busy is not None:
                raise CommandError(
                    f"run {run_id}: run {busy} is sending to the same servers; score after it ends "
                    "(its latency would count these calls)"
                )
            rows, picked, start = 0, None, 0
            while picked is None or start < picked:
                written, picked = score_chunk(run, start)
                rows, start = rows + written, start + CHUNK
            self.say(f"run {run_id}: {picked} requests picked ({share:g} of those recorded), {rows} rows")
            out.append({"run_id": run_id, "picked": picked, "rows": rows})
        if self.json:
            self.emit({"runs": out})
