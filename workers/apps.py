import logging

from django.apps import AppConfig

log = logging.getLogger(__name__)

STOPPING_ACTIONS = ("pause", "conclude")


def stop_replays(sender, *, experiment, action, actor=None, **kwargs) -> None:
    """Pausing or concluding an experiment cancels its open replays (audited): their shards stop
    at their next check and the runs end cancelled. Runs inside the lifecycle move's
    transaction (experiments.signals): setting the flags never touches the sample store, so it
    cannot fail the move; ending a run whose owner died (which needs the store) waits until the
    move committed, and a failure there is logged, never raised."""
    if action not in STOPPING_ACTIONS:
        return
    from django.db import transaction

    from workers.models import ReplayRun
    from workers.runs import cancel_run, end_if_abandoned

    open_runs = list(ReplayRun.objects.filter(experiment=experiment).exclude(status__in=ReplayRun.FINAL))
    for run in open_runs:
        cancel_run(run, actor, end_abandoned=False)

        def end_later(run_id=run.pk):
            try:
                end_if_abandoned(run_id)
            except Exception as exc:  # the move has committed; the periodic check retries
                log.warning("run %s: cancelled by %s, not ended yet: %s", run_id, action, exc)

        transaction.on_commit(end_later)


class WorkersConfig(AppConfig):
    name = "workers"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from experiments.signals import experiment_transitioned

        experiment_transitioned.connect(stop_replays, dispatch_uid="workers.stop_replays")
