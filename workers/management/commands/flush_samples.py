"""python manage.py flush_samples [--spool-dir PATH] [--forget-spool ID] [--json] [--progress]

--json: {"spool", "forgotten": {"spool", "lost"} | null, "files", "flushed", "already_stored",
"quarantined": [{"path", "salvaged", "lost": {run: rows}}], "runs": [{"run_id", "result":
"ended" | "still_waiting" | "owner_lost", "status", "samples_recorded", "note"}]}. Progress
(spool files written, rate, ETA) on stderr: experiments.cli.
"""

import os

from experiments.cli import CliError, JsonCommand, add_json_argument, add_progress_arguments
from samples.factory import sample_writer
from samples.spool import ID_FILE
from samples.store import StoreUnavailable
from workers.models import ReplayRun, SpoolRecord
from workers.runs import reap_abandoned
from workers.tasks import SPOOL_FLUSH_INTERVAL_S, complete_run, fail_run


class Command(JsonCommand):
    help = (
        "Write spooled samples to the sample store and end the runs that were waiting for it, and the "
        "runs whose owner died (no heartbeat for the lease). Workers flush their own spool every "
        f"{SPOOL_FLUSH_INTERVAL_S:g} s; this is the way with eager Celery, and for a retired worker's "
        "spool (--spool-dir)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--spool-dir",
            metavar="PATH",
            help="flush this spool directory instead of this host's (ABPLAT_SPOOL_DIR): a retired "
            "worker's spool, copied or mounted here whole (with its spool.id file, which names it)",
        )
        parser.add_argument(
            "--forget-spool",
            metavar="ID",
            help="give up a spool that is gone for good (its disk lost), by the id the run's error "
            "names (host:directory): its rows count as lost and its runs end failed, naming them",
        )
        add_json_argument(parser)
        add_progress_arguments(parser)

    def handle(self, *args, spool_dir=None, forget_spool=None, **options):
        forgotten = None
        if forget_spool:
            lost = SpoolRecord.forget(forget_spool)
            forgotten = {"spool": forget_spool, "lost": lost}
            self.say(f"spool {forget_spool}: {lost} spooled samples given up as lost")
        if spool_dir and not os.path.isfile(os.path.join(spool_dir, ID_FILE)):
            raise CliError(f"{spool_dir} is not a spool directory (no {ID_FILE} in it)", field="--spool-dir")
        writer = sample_writer(spool_dir)
        progress = self.progress(options, unit="files")
        try:
            report = writer.flush(progress=lambda done, files: progress.update(done, files))
        except StoreUnavailable as exc:
            progress.finish(0, None, "store unavailable")
            raise CliError(
                f"sample store still unavailable; samples stay spooled: {exc}",
                context={"spool": writer.spool.id, "forgotten": forgotten},
            ) from None
        progress.finish(report.files, report.files, "flushed")
        self.say(
            f"spool {writer.spool.id}: flushed {report.inserted} samples ({report.skipped_stored} already stored)"
        )
        quarantined = []
        for q in report.quarantined:
            quarantined.append({"path": q.path, "salvaged": q.salvaged, "lost": dict(sorted(q.lost.items()))})
            lost = ", ".join(f"run {run}: {n}" for run, n in sorted(q.lost.items())) or "nothing readable"
            self.stderr.write(f"quarantined {q.path}: {q.salvaged} rows flushed, lost {lost}")
        runs = []
        for run in ReplayRun.objects.filter(status=ReplayRun.Status.FLUSHING):
            try:
                ended = complete_run(run.pk)
            except StoreUnavailable as exc:
                runs.append(_run(run, "still_waiting", str(exc)))
                self.say(f"run {run.pk}: still waiting: {exc}")
                continue
            except Exception as exc:  # a failed deduplicate, say: ended failed, not flushing forever
                ended = fail_run(run.pk, f"ending it failed: {type(exc).__name__}: {exc}")
            if ended:
                run.refresh_from_db()
                runs.append(_run(run, "ended"))
                self.say(f"run {run.pk}: {run.status}, {run.samples_recorded} samples")
        # Runs whose owner died (eager Celery: nothing redelivers their shards) end here too.
        for run in ReplayRun.objects.filter(pk__in=reap_abandoned()):
            runs.append(_run(run, "owner_lost"))
            self.say(f"run {run.pk}: owner lost, {run.status}, {run.samples_recorded} samples")
        if self.json:
            self.emit(
                {
                    "spool": writer.spool.id,
                    "forgotten": forgotten,
                    "files": report.files,
                    "flushed": report.inserted,
                    "already_stored": report.skipped_stored,
                    "quarantined": quarantined,
                    "runs": runs,
                }
            )


def _run(run: ReplayRun, result: str, note: str = "") -> dict:
    return {
        "run_id": run.pk,
        "result": result,
        "status": run.status,
        "samples_recorded": run.samples_recorded,
        "note": note or run.error,
    }
