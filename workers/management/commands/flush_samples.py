from django.core.management.base import BaseCommand, CommandError

from samples.factory import sample_writer
from samples.store import StoreUnavailable
from workers.models import ReplayRun
from workers.runs import reap_abandoned
from workers.tasks import complete_run


class Command(BaseCommand):
    help = (
        "Write spooled samples to the sample store and end the runs that were waiting for it, and the "
        "runs whose owner died (no heartbeat for the lease)."
    )

    def handle(self, *args, **options):
        try:
            report = sample_writer().flush()
        except StoreUnavailable as exc:
            raise CommandError(f"sample store still unavailable; samples stay spooled: {exc}") from None
        self.stdout.write(f"flushed {report.inserted} samples ({report.skipped_stored} already stored)")
        for run in ReplayRun.objects.filter(status=ReplayRun.Status.FLUSHING):
            if complete_run(run.pk):
                run.refresh_from_db()
                self.stdout.write(f"run {run.pk}: {run.status}, {run.samples_recorded} samples")
        # Runs whose owner died (eager Celery: nothing redelivers their shards) end here too.
        for run in ReplayRun.objects.filter(pk__in=reap_abandoned()):
            self.stdout.write(f"run {run.pk}: owner lost, {run.status}, {run.samples_recorded} samples")
