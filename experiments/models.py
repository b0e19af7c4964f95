from __future__ import annotations

import secrets
from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q

from experiments import lifecycle
from experiments.document import SLUG_RE, SLUG_RULE


def new_salt() -> str:
    # Fixed at creation: it keys every user's assignment in this experiment.
    return secrets.token_hex(16)


class Team(models.Model):
    """Who owns experiments. What a user may do is their role (the auth groups product, sre,
    analyst: docs/security.md, "Roles"); on which experiments is their teams': a product or analyst user
    acts on or reads the experiments of the teams they are a member of (several, if need be).
    Users who may change traffic (sre) and superusers act on every team's; experiments.teams
    has the rules."""

    # A document names its team: the name follows the document's key rule.
    name = models.SlugField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(SLUG_RE.pattern, f"a team's name is {SLUG_RULE}")],
        help_text=f"{SLUG_RULE}; documents name the team that owns the experiment by it",
    )
    description = models.CharField(max_length=200, blank=True)
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL,
        blank=True,
        related_name="abplat_teams",
        help_text="product users act on the team's experiments, analysts read them",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Experiment(models.Model):
    class Status(models.TextChoices):
        DRAFT = lifecycle.DRAFT, "Draft"
        RUNNING = lifecycle.RUNNING, "Running"
        PAUSED = lifecycle.PAUSED, "Paused"
        CONCLUDED = lifecycle.CONCLUDED, "Concluded"

    key = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    hypothesis = models.TextField(blank=True, max_length=2000)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    # The team that owns it: its members act on it (experiments.teams). A team with experiments
    # cannot be deleted; move them first.
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="experiments")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DRAFT)
    sla_ttft_ms = models.FloatField("SLA: TTFT under (ms)")
    sla_tpot_ms = models.FloatField("SLA: TPOT under (ms)", null=True, blank=True)
    sla_e2e_ms = models.FloatField("SLA: end-to-end under (ms)", null=True, blank=True)
    sla_target = models.FloatField("SLA: share of requests that must meet it")
    salt = models.CharField(max_length=64, default=new_salt, editable=False)
    hash_version = models.PositiveSmallIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The document's validated ``rollout:`` block (experiments.document), or None: no
    # progressive rollout. The rollouts app's controller reads it; changes go through
    # apply_document and are audited with the rest of the document.
    rollout = models.JSONField(null=True, blank=True, editable=False)
    # The document's ``analysis:`` block: how the SLA report analyses the experiment
    # (analysis.units). Report settings only: they change no traffic and no measurement, so they
    # may change at any status but concluded, audited with the rest of the document.
    analysis_cluster_by_user = models.BooleanField(
        "analysis: users as the independent unit",
        default=True,
        help_text="intervals per user (the unit the router assigns), not per request",
    )
    analysis_adjust = models.BooleanField(
        "analysis: adjust on pre-request covariates",
        default=True,
        help_text="differences adjusted on prompt_tokens and max_tokens (regression; means only, not p99)",
    )
    # The document's ``fidelity:`` block: whether mirror replays store each answer's text beside
    # its fingerprints (samples.answer_text). A privacy setting: off by default; it changes no
    # traffic and no measurement, so it may change at any status but concluded, audited with the
    # rest of the document, and takes effect at the next shard a replay starts.
    fidelity_store_answers = models.BooleanField(
        "fidelity: store answer texts",
        default=False,
        help_text="mirror replays keep each successful answer's text (up to 16 KiB) for the report's "
        "examples; off: fingerprints only (identical or not, where answers part)",
    )
    # The rest of the block: what a mirror replay scores afterwards by teacher forcing (a share of
    # its requests, top-k log-probabilities) and the share of live requests on a non-control
    # variant the gateway shadows to the control. Measurements only, like store_answers.
    fidelity_score_share = models.FloatField(
        "fidelity: share of mirror requests scored (KL)",
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="0 to 1: after a mirror run, this share of its requests has the control's answer "
        "scored under every variant (prompt_logprobs, top-k truncated KL); 0: none",
    )
    fidelity_score_top_k = models.PositiveSmallIntegerField(
        "fidelity: top-k of the KL",
        default=20,
        validators=[MinValueValidator(1), MaxValueValidator(20)],
        help_text="1 to 20 (vLLM's default --max-logprobs): log-probabilities per position the KL reads",
    )
    fidelity_shadow_share = models.FloatField(
        "fidelity: share of live requests shadowed",
        default=0.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="0 to 1: of the live requests a non-control variant serves, this share is sent "
        "again greedily to the control after the user's answer, to compare the answers; 0: none",
    )
    concluded_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("change_weights", "Can change traffic weights"),
            ("run_lifecycle", "Can start, pause, resume and conclude experiments"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(sla_target__gt=0) & Q(sla_target__lt=1), name="experiment_sla_target_0_1"
            ),
            models.CheckConstraint(condition=Q(sla_ttft_ms__gt=0), name="experiment_sla_ttft_positive"),
            models.CheckConstraint(
                condition=Q(status__in=list(lifecycle.STATUSES)), name="experiment_status_valid"
            ),
        ]

    def __str__(self) -> str:
        return self.key

    @property
    def is_locked(self) -> bool:
        """Once running, the key, salt and variant set are fixed."""
        return self.status != self.Status.DRAFT

    def weights(self) -> dict[str, int]:
        return {v.key: v.weight for v in self.variants.all()}

    def control_key(self) -> str | None:
        """The control variant's key (a constraint allows one); None before it has one."""
        return next((v.key for v in self.variants.all() if v.control), None)

    def analysis(self) -> dict[str, bool]:
        """The document's ``analysis`` block."""
        return {"cluster_by_user": self.analysis_cluster_by_user, "adjust": self.analysis_adjust}

    def fidelity(self) -> dict[str, Any]:
        """The document's ``fidelity`` block."""
        return {
            "store_answers": self.fidelity_store_answers,
            "score_share": self.fidelity_score_share,
            "score_top_k": self.fidelity_score_top_k,
            "shadow_share": self.fidelity_shadow_share,
        }


class Variant(models.Model):
    class Api(models.TextChoices):
        CHAT = "chat", "Chat completions"
        COMPLETIONS = "completions", "Completions"

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="variants")
    key = models.SlugField(max_length=64)
    position = models.PositiveSmallIntegerField(default=0)
    control = models.BooleanField(default=False)
    weight = models.PositiveSmallIntegerField(help_text="Percent of users (all variants sum to 100)")
    endpoint = models.URLField(max_length=500, help_text="Base URL of the OpenAI-compatible API")
    model = models.CharField(max_length=200)
    api = models.CharField(max_length=16, choices=Api.choices, default=Api.CHAT)
    http2 = models.BooleanField(default=False)
    factors = models.JSONField(default=dict, blank=True)
    engine_args = models.JSONField(default=dict, blank=True)
    # The NAME of the variant's credential (auth: {secret: NAME}); its value lives only in the
    # operator's ABPLAT_VARIANT_SECRETS_DIR and is read when a replay connects.
    auth_secret = models.CharField(
        "auth secret",
        max_length=64,
        blank=True,
        default="",
        help_text="Name of a secret the operator configured; sent as 'Authorization: Bearer <value>'",
    )
    # The deployment's price (document ``cost: {per_hour, currency}``), for cost at SLA capacity.
    cost = models.JSONField(
        null=True, blank=True, help_text='price of the deployment: {"per_hour": 4.2, "currency": "USD"}'
    )

    class Meta:
        ordering = ["experiment", "position"]
        constraints = [
            models.UniqueConstraint(fields=["experiment", "key"], name="variant_key_unique"),
            models.UniqueConstraint(
                fields=["experiment"], condition=Q(control=True), name="variant_one_control"
            ),
            models.CheckConstraint(condition=Q(weight__lte=100), name="variant_weight_max_100"),
        ]

    def __str__(self) -> str:
        return f"{self.experiment.key}/{self.key}"


class AuditEntry(models.Model):
    """Append-only: who changed what, when, with the state before and after."""

    experiment = models.ForeignKey(
        Experiment, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit"
    )
    # Kept as text too, so the entry survives the deletion of a draft experiment.
    experiment_key = models.CharField(max_length=64, db_index=True)
    # The experiment's team when the entry was written: who reads the entries of a deleted draft
    # (those of an existing experiment go with its team now).
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    actor_name = models.CharField(max_length=150)
    at = models.DateTimeField(auto_now_add=True)
    action = models.CharField(max_length=32)
    reason = models.TextField(blank=True)
    before = models.JSONField(null=True)
    after = models.JSONField(null=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        # Serves the audit list of one experiment, newest first.
        indexes = [models.Index(fields=["experiment_key", "-at"], name="audit_by_experiment")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name} {self.action} {self.experiment_key}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("audit entries are append-only and cannot be changed")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("audit entries are append-only and cannot be deleted")
