from __future__ import annotations

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q


class ReplayRunManager(models.Manager):
    """Runs with their prompt plan deferred: every variant's prompt for every request, megabytes
    for a long replay, which the API's run lists, the admin and the dashboards' run pickers never
    show. Reading ``run.prompt_plan`` loads it (one query; the shard that replays does), and
    ``save()`` of a run loaded here writes only the fields it loaded, never a plan it did not read."""

    def get_queryset(self) -> models.QuerySet:
        return super().get_queryset().defer("prompt_plan")


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
        max_length=8,
        default="reject",
        choices=[("reject", "reject"), ("plain", "plain")],
        help_text="chat messages for completions variants: reject the run, or render as plain text",
    )
    wrap_prompt = models.BooleanField(
        default=False, help_text="prompt lines for chat variants: send each as one user message"
    )
    prompt_plan = models.JSONField(
        default=dict,
        blank=True,
        help_text="each variant's prompt per synthetic request, calibrated on its tokenizer before the "
        "schedule starts: variant -> seq -> [words, pad, tokens, estimated] (replay/calibration.py)",
    )
    arrival = models.JSONField(
        default=dict, help_text="arrival process: mode, speed, rate, cv, concurrency, seed"
    )
    limit = models.PositiveIntegerField(null=True, blank=True, help_text="replay only the first N requests")
    sample_fraction = models.FloatField(default=1.0, help_text="keep this share of the requests (0, 1]")
    concurrency = models.PositiveIntegerField(default=512, help_text="requests in flight per shard at most")
    shard_count = models.PositiveSmallIntegerField(default=1, help_text="slots: shards sending at once")
    window_s = models.FloatField(
        null=True,
        blank=True,
        help_text="each shard task covers this long a window of the schedule (empty: one window)",
    )
    population_seed = models.IntegerField(default=0)
    # Mirror runs only: the variants every request goes to (keys); empty: every variant. A
    # capacity search step loads one deployment alone (capacity/).
    targets = models.JSONField(default=list, blank=True, help_text="mirror: only these variants (empty: all)")
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

    objects = ReplayRunManager()

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

    def refresh_from_db(self, using=None, fields=None, **kwargs) -> None:
        """As Django's, except that a refresh of every field leaves the prompt plan out: it is
        loaded again only when read. A run's plan holds every variant's prompt for every request
        (megabytes for a long replay), and the commands that follow a run refresh it twice a
        second in the process whose event loop is replaying: decoding the plan held the
        interpreter ~100 ms a time, the loop stalled and first tokens were stamped late (the
        demo's main replay, bench/RESULTS.md "The demo")."""
        if fields is None:
            fields = [f.attname for f in self._meta.concrete_fields if f.attname != "prompt_plan"]
            self.__dict__.pop("prompt_plan", None)  # deferred: read afresh from the row when used
        super().refresh_from_db(using=using, fields=fields, **kwargs)

    def replay_variants(self) -> list:
        """The variants this run sends to, in their order: ``targets`` when set, else all."""
        # With each experiment's team: the secrets' bindings name teams, and a shard reads it in
        # its event loop, where no query may run (workers.variants.team_of).
        variants = list(self.experiment.variants.select_related("experiment__team").order_by("position"))
        return [v for v in variants if v.key in self.targets] if self.targets else variants

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL

    def progress(self) -> dict:
        # .all(): a list's prefetch_related("shards") serves it (no query per run)
        shards = [{"sent": s.sent, "recorded": s.recorded, "status": s.status} for s in self.shards.all()]
        sent = sum(s["sent"] for s in shards)
        recorded = sum(s["recorded"] for s in shards)
        return {
            "sent": sent,
            "recorded": recorded,
            "expected": self.expected_samples,
            "fraction": round(recorded / self.expected_samples, 4) if self.expected_samples else 0.0,
            "shards_done": sum(1 for s in shards if s["status"] == ReplayShard.Status.DONE),
            "shards": len(shards),
        }


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


class SpoolRecord(models.Model):
    """What one worker's spool holds of a run (samples spooled while the sample store was down),
    and the rows of it that spool files lost to quarantine. Kept current by the spool itself
    (samples.spool.SpoolHooks, wired in workers.apps), so a step on another host can see it: a
    run ends only when no spool holds its rows, and a resumed shard waits until the rows other
    hosts spooled for its run are in the store (they would be sent again otherwise)."""

    run = models.ForeignKey(ReplayRun, on_delete=models.CASCADE, related_name="spool_records")
    spool = models.CharField(max_length=500, help_text="the spool's id, host:directory (its spool.id file)")
    rows = models.PositiveIntegerField(default=0, help_text="rows of the run waiting there for the store")
    quarantined = models.JSONField(
        default=dict,
        blank=True,
        help_text="quarantined spool file -> rows of the run it held that could not be read",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["run", "spool"]
        # Its index serves "which spools hold rows of run R" (complete_run, a resumed shard).
        constraints = [models.UniqueConstraint(fields=["run", "spool"], name="spool_record_unique")]
        # Serves "what does spool S hold" (SpoolRecord.sync, on every spool and flush).
        indexes = [models.Index(fields=["spool"], name="spool_record_by_spool")]

    def __str__(self) -> str:
        lost = f", {self.quarantined_rows} quarantined" if self.quarantined else ""
        return f"run {self.run_id}: {self.rows} rows spooled on {self.spool}{lost}"

    @property
    def host(self) -> str:
        return self.spool.partition(":")[0]

    @property
    def directory(self) -> str:
        return self.spool.partition(":")[2]

    @property
    def quarantined_rows(self) -> int:
        return sum(self.quarantined.values())

    def describe_spooled(self) -> str:
        return f"{self.rows} samples still spooled on host {self.host} (spool directory {self.directory})"

    @classmethod
    def sync(cls, spool: str, rows_by_run: dict[int, int]) -> None:
        """Spool ``spool`` now holds these rows per run; none of the runs it does not name.
        Absolute, not a delta: every call repairs what an earlier failed one left wrong. Runs
        this database does not know (a spool shared with another installation, tests) are
        skipped. Calls for one spool come one at a time (its lock is held)."""
        holding = {run: n for run, n in rows_by_run.items() if n > 0}
        known = set(ReplayRun.objects.filter(pk__in=holding).values_list("pk", flat=True))
        with transaction.atomic():
            cls.objects.filter(spool=spool, rows__gt=0).exclude(run_id__in=known).update(rows=0)
            for run_id in known:
                cls.objects.update_or_create(run_id=run_id, spool=spool, defaults={"rows": holding[run_id]})

    @classmethod
    def record_quarantined(cls, spool: str, path: str, lost_by_run: dict[int, int]) -> None:
        """A file of ``spool``, now at ``path``, lost these rows per run. Idempotent per path."""
        for run_id in ReplayRun.objects.filter(pk__in=lost_by_run).values_list("pk", flat=True):
            with transaction.atomic():
                record, _ = cls.objects.select_for_update().get_or_create(run_id=run_id, spool=spool)
                record.quarantined[path] = lost_by_run[run_id]
                record.save(update_fields=["quarantined", "updated_at"])

    @classmethod
    def forget(cls, spool: str) -> int:
        """A spool gone for good (its disk lost): its rows will never come. They count as lost
        (quarantined) so its runs stop waiting and end failed, naming them. Returns the rows."""
        lost = 0
        with transaction.atomic():
            for record in cls.objects.select_for_update().filter(spool=spool, rows__gt=0):
                record.quarantined[f"{spool} (forgotten: the spool is gone)"] = record.rows
                lost += record.rows
                record.rows = 0
                record.save(update_fields=["rows", "quarantined", "updated_at"])
        return lost
