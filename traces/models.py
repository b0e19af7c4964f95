from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

# A label, never a path: the file is stored under its sha256, whatever the name says.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
validate_name = RegexValidator(
    NAME_PATTERN, "a name is 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit"
)


class Trace(models.Model):
    """One uploaded trace or log: its file is TRACE_DIR/<sha256>, written once, never changed."""

    class Format(models.TextChoices):
        AZURE = "azure", "Azure trace CSV"
        JSONL = "jsonl", "abplat JSONL log"

    name = models.CharField(max_length=200, validators=[validate_name], help_text="how replays name it")
    sha256 = models.CharField(max_length=64, help_text="content hash; the file's name in TRACE_DIR")
    size = models.PositiveBigIntegerField(help_text="bytes")
    format = models.CharField(max_length=8, choices=Format.choices)
    rows = models.PositiveBigIntegerField(help_text="requests in the trace")
    span_s = models.FloatField(help_text="seconds from the first to the last recorded arrival")
    rate = models.FloatField(null=True, blank=True, help_text="mean requests per second over the span")
    uploaded_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # Dedupe: one row per content; the upload of a known file answers with its row.
            models.UniqueConstraint(fields=["sha256"], name="trace_sha256_unique"),
            # Replays name a trace by name or hash: both must find one row.
            models.UniqueConstraint(fields=["name"], name="trace_name_unique"),
            models.CheckConstraint(condition=Q(sha256__regex=r"^[0-9a-f]{64}$"), name="trace_sha256_hex"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.rows} requests, {self.format}, sha256 {self.sha256[:12]})"

    @property
    def path(self) -> Path:
        return Path(settings.TRACE_DIR) / self.sha256
