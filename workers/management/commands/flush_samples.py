import os

from django.core.management.base import BaseCommand, CommandError

from samples.factory import sample_writer
from samples.spool import ID_FILE
from samples.store import StoreUnavailable
from workers.models import ReplayRun, SpoolRecord
from workers.runs import reap_abandoned
from workers.tasks import SPOOL_FLUSH_INTERVAL_S, complete_run, fail_run


class Command(BaseCommand):
    help = (
        "Write spooled samples to the sample store and end the runs that were waiting for it, and the "
        "runs whose owner died (no heartbeat for the lease). Workers flush their own spool every "
        f"{SPOOL_FLUSH_INTERVAL_S:g} s; this is the way with eager Celery, and for a retired worker's "
        "spool (--spool-dir)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--spool-dir", metavar="PATH",
            help="flush this spool directory instead of this host's (ABPLAT_SPOOL_DIR): a retired "
            "worker's spool, copied or mounted here whole (with its spool.id file, which names it)",
        )  # fmt: skip
        parser.add_argument(
            "--forget-spool", metavar="ID",
            help="give up a spool that is gone for good (its disk lost), by the id the run's error "
            "names (host:directory): its rows count as lost and its runs end failed, naming them",
        )  # fmt: skip

    def handle(self, *args, spool_dir=None, forget_spool=None, **options):
        if forget_spool:
            lost = SpoolRecord.forget(forget_spool)
            self.stdout.write(f"spool {forget_spool}: {lost} spooled samples given up as lost")
        if spool_dir and not os.path.isfile(os.path.join(spool_dir, ID_FILE)):
            raise CommandError(f"{spool_dir} is not a spool directory (no {ID_FILE} in it)")
        writer = sample_writer(spool_dir)
        try:
            report = writer.flush()
        except StoreUnavailable as exc:
            raise CommandError(f"sample store still unavailable; samples stay spooled: {exc}") from None
        self.stdout.write(
            f"spool {writer.spool.id}: flushed {report.inserted} samples ({report.skipped_stored} already stored)"
        )
        for q in report.quarantined:
            lost = ", ".join(f"run {run}: {n}" for run, n in sorted(q.lost.items())) or "nothing readable"
            self.stderr.write(f"quarantined {q.path}: {q.salvaged} rows flushed, lost {lost}")
        for run in ReplayRun.objects.filter(status=ReplayRun.Status.FLUSHING):
            try:
                ended = complete_run(run.pk)
            except StoreUnavailable as exc:
                self.stdout.write(f"run {run.pk}: still waiting: {exc}")
                continue
            except Exception as exc:  # a failed deduplicate, say: ended failed, not flushing forever
                ended = fail_run(run.pk, f"ending it failed: {type(exc).__name__}: {exc}")
            if ended:
                run.refresh_from_db()
                self.stdout.write(f"run {run.pk}: {run.status}, {run.samples_recorded} samples")
        # Runs whose owner died (eager Celery: nothing redelivers their shards) end here too.
        for run in ReplayRun.objects.filter(pk__in=reap_abandoned()):
            self.stdout.write(f"run {run.pk}: owner lost, {run.status}, {run.samples_recorded} samples")
