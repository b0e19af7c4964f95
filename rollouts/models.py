"""What the rollout controller remembers between looks: one row per experiment with a plan."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from experiments.models import Experiment
from rollouts import controller


class RolloutState(models.Model):
    class Status(models.TextChoices):
        RUNNING = controller.RUNNING, "Running"
        PAUSED = controller.PAUSED, "Paused (breach or split mismatch: a person decides)"
        YIELDED = controller.YIELDED, "Yielded (a person changed the weights)"
        COMPLETED = controller.COMPLETED, "Completed (candidate at 100%)"
        ROLLED_BACK = controller.ROLLED_BACK, "Rolled back (candidate at 0%)"

    experiment = models.OneToOneField(Experiment, on_delete=models.CASCADE, related_name="rollout_state")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    step = models.PositiveSmallIntegerField(null=True, blank=True, help_text="index into the plan's steps")
    # Seconds since the epoch on the database's clock (rollouts.service.db_now): every process
    # reads the same clock, so skewed hosts agree on a step's age and on the lease.
    step_started_s = models.FloatField(null=True, blank=True)
    last_seen_revision = models.BigIntegerField(
        default=0, help_text="weights revision last written or adopted"
    )
    srm_max_log_e = models.FloatField(default=0.0, help_text="sequential SRM: largest log e-value this step")
    # A weight change announced before it is written (committed first): a controller killed
    # between the store write and its own commit finds it on the next look and adopts the
    # revision instead of mistaking its own write for a person's.
    pending = models.JSONField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_until_s = models.FloatField(default=0.0, help_text="database-clock seconds the lease runs to")
    last_decision = models.JSONField(null=True, blank=True)
    decisions = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(status__in=list(controller.STATES)), name="rollout_state_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.experiment.key}: {self.status} at step {self.step}"

    def as_state(self) -> controller.State:
        return controller.State(
            self.status, self.step, self.step_started_s, self.last_seen_revision, self.srm_max_log_e
        )
