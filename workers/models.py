from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q


class ReplayRun(models.Model):
    """One replay of recorded traffic through an experiment's variants."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        FLUSHING = "flushing", "Waiting for samples to be durable"
        DONE = "done", "Done"
        CANCELLING = "cancelling", "Cancelling"
        CANCELLED = "cancelled", "Cancelled"
        FAILED = "failed", "Failed"

    FINAL = (Status.DONE, Status.CANCELLED, Status.FAILED)

    class Mode(models.TextChoices):
        SPLIT = "split", "Split (A/B by user)"
        MIRROR = "mirror", "Mirror (every request to every variant)"

    class SourceFormat(models.TextChoices):
        AZURE = "azure", "Azure trace CSV"
        JSONL = "jsonl", "abplat JSONL log"

    experiment = models.ForeignKey("experiments.Experiment", on_delete=models.PROTECT, related_name="runs")
    source = models.CharField(max_length=1000, help_text="path of the trace or log, as the workers see it")
    source_format = models.CharField(max_length=8, choices=SourceFormat.choices, default=SourceFormat.AZURE)
    on_malformed = models.CharField(
        max_length=8, default="reject", choices=[("reject", "reject"), ("skip", "skip")]
    )
    mode = models.CharField(max_length=8, choices=Mode.choices, default=Mode.SPLIT)
    render_chat = models.CharField(
        max_length=8, default="reject", choices=[("reject", "reject"), ("plain", "plain")],
        help_text="chat messages for completions variants: reject the run, or render as plain text",
    )  # fmt: skip
    wrap_prompt = models.BooleanField(
        default=False, help_text="prompt lines for chat variants: send each as one user message"
    )
    prompt_plan = models.JSONField(
        default=dict, blank=True,
        help_text="each variant's prompt per synthetic request, calibrated on its tokenizer before the "
        "schedule starts: variant -> seq -> [words, pad, tokens, estimated] (replay/calibration.py)",
    )  # fmt: skip
    arrival = models.JSONField(
        default=dict, help_text="arrival process: mode, speed, rate, cv, concurrency, seed"
    )
    limit = models.PositiveIntegerField(null=True, blank=True, help_text="replay only the first N requests")
    sample_fraction = models.FloatField(default=1.0, help_text="keep this share of the requests (0, 1]")
    concurrency = models.PositiveIntegerField(default=512, help_text="requests in flight per shard at most")
    shard_count = models.PositiveSmallIntegerField(default=1, help_text="slots: shards sending at once")
    window_s = models.FloatField(
        null=True, blank=True,
        help_text="each shard task covers this long a window of the schedule (empty: one window)",
    )  # fmt: skip
    population_seed = models.IntegerField(default=0)
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED)
    cancel_requested = models.BooleanField(default=False)
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    start_at_unix = models.FloatField(null=True, blank=True, help_text="the schedule's time zero")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    total_requests = models.PositiveIntegerField(default=0)
    expected_samples = models.PositiveIntegerField(default=0)
    samples_recorded = models.PositiveIntegerField(default=0)
    skipped_lines = models.PositiveIntegerField(default=0)
    outcomes = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]
        permissions = [("operate_replay", "Can start and cancel replays")]
        constraints = [
            models.CheckConstraint(condition=Q(shard_count__gte=1), name="replay_run_shards_positive"),
            models.CheckConstraint(condition=Q(concurrency__gte=1), name="replay_run_concurrency_positive"),
            models.CheckConstraint(
                condition=Q(sample_fraction__gt=0) & Q(sample_fraction__lte=1), name="replay_run_sample_0_1"
            ),
        ]
        # Serves the runs list of one experiment, newest first.
        indexes = [models.Index(fields=["experiment", "-created_at"], name="replay_run_by_experiment")]

    def __str__(self) -> str:
        return f"run {self.pk} of {self.experiment.key} ({self.status})"

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL

    def progress(self) -> dict:
        shards = list(self.shards.values("sent", "recorded", "status"))
        sent = sum(s["sent"] for s in shards)
        recorded = sum(s["recorded"] for s in shards)
        return {
            "sent": sent, "recorded": recorded, "expected": self.expected_samples,
            "fraction": round(recorded / self.expected_samples, 4) if self.expected_samples else 0.0,
            "shards_done": sum(1 for s in shards if s["status"] == ReplayShard.Status.DONE),
            "shards": len(shards),
        }  # fmt: skip


class ReplayShard(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    run = models.ForeignKey(ReplayRun, on_delete=models.CASCADE, related_name="shards")
    index = models.PositiveIntegerField()
    window = models.PositiveIntegerField(default=0, help_text="the schedule window this shard sends")
    slot = models.PositiveSmallIntegerField(default=0)
    start_s = models.FloatField(default=0.0, help_text="its window opens this long after time zero")
    enqueued_at = models.DateTimeField(null=True, blank=True, help_text="its task was queued")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True)
    planned = models.PositiveIntegerField(default=0)
    sent = models.PositiveIntegerField(default=0)
    recorded = models.PositiveIntegerField(default=0)
    skipped_recorded = models.PositiveIntegerField(default=0)
    lag_p50_ms = models.FloatField(null=True, blank=True)
    lag_p99_ms = models.FloatField(null=True, blank=True)
    lag_max_ms = models.FloatField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True, help_text="last sign of life of its worker")
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["run", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "index"], name="replay_shard_unique")]

    def __str__(self) -> str:
        return f"run {self.run_id} shard {self.index} ({self.status})"
