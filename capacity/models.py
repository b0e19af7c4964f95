"""A capacity search and its result, per experiment (capacity/service.py writes them)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class CapacitySearch(models.Model):
    class Status(models.TextChoices):
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    experiment = models.ForeignKey(
        "experiments.Experiment", on_delete=models.CASCADE, related_name="capacity_searches"
    )
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.RUNNING)
    # what was asked: trace, arrival, rates, tolerance, steps, alpha, step cap, warm-up, seed
    params = models.JSONField(default=dict)
    # per variant: search.Capacity.as_dict() plus its cost at capacity (service.search_experiment)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"capacity search {self.pk} of {self.experiment.key} ({self.status})"
