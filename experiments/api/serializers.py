"""API shapes. Validation of experiment documents is the pure ``experiments.document``
module, so the API, the command line and the admin reject exactly the same things."""

from __future__ import annotations

from django.urls import NoReverseMatch, reverse
from rest_framework import serializers

from experiments import lifecycle
from experiments.checks import document_egress
from experiments.document import APIS, DocumentError, validate_document
from experiments.models import AuditEntry, Experiment
from experiments.services import document_for, redact_audit_value


class SlaSerializer(serializers.Serializer):
    ttft_ms = serializers.FloatField(help_text="TTFT (first content) must be under this")
    tpot_ms = serializers.FloatField(required=False, help_text="optional TPOT bound")
    e2e_ms = serializers.FloatField(required=False, help_text="optional end-to-end bound")
    target = serializers.FloatField(help_text="share of requests that must meet every SLO")


class VariantAuthSerializer(serializers.Serializer):
    secret = serializers.CharField(
        help_text="name of a secret the operator configured (never the token itself); "
        "sent as 'Authorization: Bearer <value>'"
    )


class VariantCostSerializer(serializers.Serializer):
    per_hour = serializers.FloatField(help_text="price of the deployment per hour (its GPUs)")
    currency = serializers.CharField(default="USD", help_text="ISO 4217 code, e.g. USD")


class VariantDocumentSerializer(serializers.Serializer):
    key = serializers.SlugField()
    control = serializers.BooleanField(default=False)
    weight = serializers.IntegerField(min_value=0, max_value=100)
    endpoint = serializers.URLField(
        help_text="http(s) base URL on a host the variant allowlist permits; no user:password@"
    )
    model = serializers.CharField()
    api = serializers.ChoiceField(choices=APIS, default="chat")
    http2 = serializers.BooleanField(default=False)
    factors = serializers.DictField(child=serializers.JSONField(), required=False)
    engine_args = serializers.DictField(child=serializers.JSONField(), required=False)
    auth = VariantAuthSerializer(required=False, allow_null=True)
    cost = VariantCostSerializer(required=False, allow_null=True)


class GuardrailSerializer(serializers.Serializer):
    metric = serializers.CharField(help_text="attainment, error_rate, or a quantile like p99_ttft_ms")
    at_least = serializers.JSONField(required=False, help_text="a number, or sla_target (attainment)")
    at_most = serializers.FloatField(required=False)
    at_least_over_control = serializers.FloatField(required=False)
    at_most_over_control = serializers.FloatField(required=False)


class RolloutSerializer(serializers.Serializer):
    """A progressive rollout plan (docs/rollouts.md); the controller is rollouts/service.py."""

    candidate = serializers.SlugField(help_text="the variant rolled out; the control takes the rest")
    steps = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=100))
    min_samples = serializers.IntegerField(min_value=1, help_text="per step and arm, before a promotion")
    min_duration = serializers.CharField(help_text='per step: "30s", "10m", "1h"')
    guardrails = GuardrailSerializer(many=True)
    on_breach = serializers.ChoiceField(choices=["rollback", "pause"], default="rollback")
    notify = serializers.ListField(child=serializers.URLField(), required=False, help_text="webhooks")
    alpha = serializers.FloatField(required=False, help_text="error budget of the whole rollout (0.05)")


class AnalysisSerializer(serializers.Serializer):
    """How the SLA report analyses the experiment (docs/statistics.md)."""

    cluster_by_user = serializers.BooleanField(
        default=True, help_text="users as the independent unit (the unit the router assigns), not requests"
    )
    adjust = serializers.BooleanField(
        default=True,
        help_text="differences of means and shares adjusted on prompt_tokens and max_tokens (not p99)",
    )


class FidelitySerializer(serializers.Serializer):
    """What mirror replays keep of the variants' answers (docs/experiments.md, "Answers")."""

    store_answers = serializers.BooleanField(
        default=False,
        help_text="keep each successful answer's text (up to 16 KiB of UTF-8) for the report's "
        "examples; false: fingerprints only",
    )
    score_share = serializers.FloatField(
        default=0.0,
        min_value=0.0,
        max_value=1.0,
        help_text="share of a mirror run's requests scored afterwards by teacher forcing (top-k KL)",
    )
    score_top_k = serializers.IntegerField(
        default=20, min_value=1, max_value=20, help_text="log-probabilities per position the KL reads"
    )
    shadow_share = serializers.FloatField(
        default=0.0,
        min_value=0.0,
        max_value=1.0,
        help_text="share of live requests on a non-control variant sent again greedily to the control",
    )


class ExperimentDocumentSerializer(serializers.Serializer):
    """The experiment document (docs/experiments.md). Errors are keyed by field path."""

    key = serializers.SlugField()
    name = serializers.CharField()
    team = serializers.SlugField(
        required=False,
        help_text="the team that owns the experiment (one of yours); default: its team, or your only team",
    )
    hypothesis = serializers.CharField(required=False, allow_blank=True)
    sla = SlaSerializer()
    variants = VariantDocumentSerializer(many=True)
    rollout = RolloutSerializer(required=False, allow_null=True)
    analysis = AnalysisSerializer(required=False, help_text="default: both true")
    fidelity = FidelitySerializer(
        required=False,
        help_text="default: store_answers false, score_share 0, score_top_k 20, shadow_share 0",
    )

    def to_internal_value(self, data):
        try:
            return validate_document(data, **document_egress())
        except DocumentError as exc:
            raise serializers.ValidationError(exc.as_dict()) from None


class ExperimentSerializer(serializers.Serializer):
    """An experiment as read: its document plus lifecycle and bookkeeping. Webhook URLs in the
    document are in full for the context's ``request.user`` when that user may change traffic,
    redacted otherwise (and without a request in the context)."""

    document = serializers.SerializerMethodField()
    status = serializers.CharField()
    allowed_actions = serializers.SerializerMethodField()
    owner = serializers.SerializerMethodField()
    salt = serializers.CharField()
    hash_version = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)  # null until started / concluded
    concluded_at = serializers.DateTimeField(allow_null=True)
    links = serializers.SerializerMethodField()

    def get_document(self, obj: Experiment) -> dict:
        request = self.context.get("request")
        return document_for(obj, getattr(request, "user", None))

    def get_allowed_actions(self, obj: Experiment) -> list[str]:
        return lifecycle.allowed_actions(obj.status)

    def get_owner(self, obj: Experiment) -> str | None:
        return obj.owner.get_username() if obj.owner else None

    def get_links(self, obj: Experiment) -> dict:
        links = {"self": f"/api/experiments/{obj.key}/", "audit": f"/api/experiments/{obj.key}/audit/"}
        try:
            links["dashboard"] = reverse("dashboards:experiment", args=[obj.key])
        except NoReverseMatch:
            pass
        return links


class AuditEntrySerializer(serializers.ModelSerializer):
    """An audit entry; webhook URLs redacted (entries are stored so; older ones are redacted
    when served)."""

    class Meta:
        model = AuditEntry
        fields = ["id", "experiment_key", "actor_name", "at", "action", "reason", "before", "after"]
        read_only_fields = fields

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["before"] = redact_audit_value(data["before"])
        data["after"] = redact_audit_value(data["after"])
        return data


class ActionSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=2000, default="")
