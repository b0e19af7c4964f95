"""Admin for product teams: experiments with inline variants, validated exactly like the API
(the pure document rules), lifecycle actions that respect the transitions.

Each user sees and acts on their teams' experiments only (experiments.teams; sre and superusers:
all): the lists are filtered, so another team's experiment is missing from them and from every
page and action keyed by it. Teams and their members are a superuser's to edit (Teams)."""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.contrib.admin.actions import delete_selected as django_delete_selected
from django.core.exceptions import ValidationError
from django.db import models
from django.forms.models import BaseInlineFormSet
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.timezone import localtime

from experiments import lifecycle, services
from experiments.admin_weights import WeightsAdminMixin
from experiments.checks import document_egress
from experiments.document import DocumentError, validate_document
from experiments.models import AuditEntry, Experiment, Team, Variant
from experiments.teams import may_act_on, teams_of, usable_teams, visible_audit, visible_experiments

VARIANT_FIELDS = (
    "key",
    "control",
    "weight",
    "endpoint",
    "model",
    "api",
    "http2",
    "factors",
    "engine_args",
    "auth_secret",
    "cost",
)


def variant_document(row: dict) -> dict:
    """One inline row as the document's variant: the auth_secret column is ``auth: {secret}``."""
    doc = {f: row.get(f) for f in VARIANT_FIELDS if f != "auth_secret"}
    name = (row.get("auth_secret") or "").strip()
    doc["auth"] = {"secret": name} if name else None
    return doc


def document_from_admin(experiment: Experiment, variant_rows: list[dict]) -> dict:
    """The document the change form describes. The admin has no field for the rollout plan:
    the stored plan goes with the document unchanged (a document without it would remove it).
    The analysis and fidelity blocks come from the form's Analysis and Answers fields."""
    doc = {
        "key": experiment.key,
        "name": experiment.name,
        "hypothesis": experiment.hypothesis,
        "sla": services.sla_document(experiment),
        "variants": [variant_document(row) for row in variant_rows],
    }
    if experiment.team_id is not None:  # left empty: the author's only team (services.with_team)
        doc["team"] = experiment.team.name
    if experiment.rollout:
        doc["rollout"] = experiment.rollout
    # the form's Analysis and Answers checkboxes, as the document's analysis and fidelity blocks
    doc["analysis"] = experiment.analysis()
    doc["fidelity"] = experiment.fidelity()
    return doc


class VariantFormSet(BaseInlineFormSet):
    """Validates the whole experiment as one document and keeps it for save_model."""

    actor = None  # the user saving the form (VariantInline.get_formset sets it per request)

    def clean(self):
        super().clean()
        if any(self.errors):
            return
        rows = []
        for form in self.forms:
            if not form.cleaned_data or form.cleaned_data.get("DELETE"):
                continue
            row = dict(form.cleaned_data)
            if form.instance.pk and "key" not in row:
                row["key"] = form.instance.key
            for name in VARIANT_FIELDS:  # read-only fields of a running experiment
                if name not in row and form.instance.pk:
                    row[name] = getattr(form.instance, name)
            row["factors"] = row.get("factors") or {}
            row["engine_args"] = row.get("engine_args") or {}
            rows.append(row)
        doc = document_from_admin(self.instance, rows)
        try:
            # The settings' variant allowlist, as the API and the command line apply it.
            validated = validate_document(doc, **document_egress())
            existing = Experiment.objects.filter(pk=self.instance.pk).first()
            # What apply_document checks beyond the document: engine flags, locked fields.
            services.check_change(existing, services._normalized(validated), actor=self.actor)
        except DocumentError as exc:
            raise ValidationError([str(e) for e in exc.errors]) from None
        self.instance._abplat_document = doc


class VariantInline(admin.StackedInline):
    model = Variant
    formset = VariantFormSet
    # Endpoints are often plain http on a private network: do not guess https.
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}
    extra = 0
    min_num = 2
    fields = VARIANT_FIELDS

    def get_formset(self, request, obj=None, **kwargs):
        formset = super().get_formset(request, obj, **kwargs)  # a class made for this request
        formset.actor = request.user
        return formset

    def get_readonly_fields(self, request, obj=None):
        if obj is not None and obj.status == Experiment.Status.CONCLUDED:
            return VARIANT_FIELDS
        if obj is not None and obj.is_locked:
            # The variant set is fixed once running; weights change through the SRE weights form.
            return ("key", "control", "weight", "factors")
        return ()

    def has_add_permission(self, request, obj=None):
        return super().has_add_permission(request, obj) and (obj is None or not obj.is_locked)

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and (obj is None or not obj.is_locked)


def _lifecycle_action(action: str):
    def run(modeladmin, request, queryset):
        for experiment in queryset:
            try:
                services.transition(experiment, action, request.user, reason="admin action")
                modeladmin.message_user(request, f"{experiment.key}: {action} done", messages.SUCCESS)
            except (lifecycle.TransitionError, services.ConflictError) as exc:
                modeladmin.message_user(request, f"{experiment.key}: {exc}", messages.ERROR)

    run.__name__ = f"{action}_experiments"
    run.short_description = f"{action.capitalize()} selected experiments"
    run.allowed_permissions = ("run_lifecycle",)
    return run


@admin.action(permissions=["delete"], description="Delete selected draft experiments (audited)")
def delete_selected(modeladmin, request, queryset):
    """Replaces Django's bulk delete (same name, so its confirmation page posts back here), which
    deletes the rows in one query: no audit entry, no draft rule. Each experiment goes through
    services.delete_experiment, like the delete page and the API."""
    refused = [e for e in queryset if e.status != Experiment.Status.DRAFT]
    for experiment in refused:
        modeladmin.message_user(
            request,
            f"Experiment {experiment.key} is {experiment.status}: only drafts can be deleted "
            "(conclude it instead). Nothing was deleted.",
            messages.ERROR,
        )
    if refused:
        return None
    if not request.POST.get("post"):
        # Django's confirmation page: what goes with each experiment, and the runs that protect one.
        return django_delete_selected(modeladmin, request, queryset)
    deleted = []
    for experiment in queryset:
        try:
            services.delete_experiment(experiment, actor=request.user)
        except lifecycle.TransitionError as exc:  # also ProtectedExperimentError: it has runs
            modeladmin.message_user(request, str(exc), messages.ERROR)  # names the experiment
        else:
            deleted.append(experiment.key)
    if deleted:
        modeladmin.message_user(request, f"Deleted (audited): {', '.join(deleted)}", messages.SUCCESS)
    return None


def _json(value) -> str:
    return (
        "-"
        if value is None
        else format_html('<pre class="json">{}</pre>', json.dumps(value, indent=2, sort_keys=True))
    )


@admin.register(Experiment)
class ExperimentAdmin(WeightsAdminMixin, admin.ModelAdmin):
    # One short "SLA" column, not the two SLA fields: their verbose names ("SLA: share of requests
    # that must meet it") became headers that the admin's CSS does not wrap (changelists.css:
    # thead th nowrap), which made the table wider than its scrolling box and cut the last header.
    # The update time as "2026-12-05 07:48" for the same reason: the admin's long form
    # ("Dec. 5, 2026, 7:48 a.m.") is what pushed the last column out at 1000 px.
    list_display = ("key", "name", "team", "status", "sla", "owner", "updated", "dashboard")
    # Only the teams and owners of the experiments the user sees (never every user's name).
    list_filter = (
        "status",
        ("team", admin.RelatedOnlyFieldListFilter),
        ("owner", admin.RelatedOnlyFieldListFilter),
    )
    search_fields = ("key", "name", "hypothesis", "variants__key", "variants__model")
    inlines = [VariantInline]
    actions = [*(_lifecycle_action(a) for a in lifecycle.ACTIONS), delete_selected]
    readonly_fields = (
        "status",
        "salt",
        "hash_version",
        "owner",
        "created_at",
        "updated_at",
        "started_at",
        "concluded_at",
        "dashboard",
        "weights_link",
    )
    fieldsets = (
        (None, {"fields": ("key", "name", "team", "hypothesis", "status", "owner", "dashboard")}),
        ("SLA", {"fields": ("sla_ttft_ms", "sla_tpot_ms", "sla_e2e_ms", "sla_target")}),
        ("Analysis", {"fields": ("analysis_cluster_by_user", "analysis_adjust")}),
        (
            "Answers",
            {
                "fields": (
                    "fidelity_store_answers",
                    "fidelity_score_share",
                    "fidelity_score_top_k",
                    "fidelity_shadow_share",
                )
            },
        ),
        ("Assignment", {"fields": ("salt", "hash_version", "weights_link")}),
        ("Timeline", {"fields": ("created_at", "updated_at", "started_at", "concluded_at")}),
    )

    def get_queryset(self, request):
        return visible_experiments(request.user, super().get_queryset(request).select_related("team"))

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "team":
            # The user's own teams (every team for sre and superusers); left empty on a new
            # experiment: the user's only team, or the default team (services.with_team).
            kwargs["queryset"] = usable_teams(request.user)
            kwargs["required"] = False
            kwargs["help_text"] = "the team that owns it; empty: your only team (or the default team)"
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_changeform_initial_data(self, request):
        initial = super().get_changeform_initial_data(request)
        mine = list(teams_of(request.user)[:2])
        if len(mine) == 1:
            initial.setdefault("team", mine[0].pk)
        return initial

    def get_readonly_fields(self, request, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        if obj is not None and obj.is_locked:
            fields.append("key")
        if obj is not None and obj.status == Experiment.Status.CONCLUDED:
            fields += [
                "name",
                "team",
                "hypothesis",
                "sla_ttft_ms",
                "sla_tpot_ms",
                "sla_e2e_ms",
                "sla_target",
                "analysis_cluster_by_user",
                "analysis_adjust",
                "fidelity_store_answers",
                "fidelity_score_share",
                "fidelity_score_top_k",
                "fidelity_shadow_share",
            ]
        return fields

    def has_run_lifecycle_permission(self, request):
        return request.user.has_perm("experiments.run_lifecycle")

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and (obj is None or may_act_on(request.user, obj))

    def has_delete_permission(self, request, obj=None):
        if obj is not None and obj.status != Experiment.Status.DRAFT:
            return False
        return super().has_delete_permission(request, obj) and (obj is None or may_act_on(request.user, obj))

    @admin.display(description="SLA", ordering="sla_ttft_ms")
    def sla(self, obj):
        return f"TTFT < {obj.sla_ttft_ms:g} ms, {obj.sla_target * 100:.10g}%"

    @admin.display(description="Updated", ordering="updated_at")
    def updated(self, obj):
        return date_format(localtime(obj.updated_at), "Y-m-d H:i")

    @admin.display(description="Dashboard")
    def dashboard(self, obj):
        if obj is None or obj.pk is None:
            return "-"
        return format_html('<a href="/dashboards/{}/">open dashboard</a>', obj.key)

    def save_model(self, request, obj, form, change):
        doc = getattr(obj, "_abplat_document", None)
        if doc is None:  # concluded experiments have no editable inline; nothing to apply
            return
        result = services.apply_document(doc, actor=request.user)
        obj.pk = result.experiment.pk
        obj.refresh_from_db()
        if result.changes:
            messages.info(request, "Changes: " + "; ".join(result.changes))

    def save_related(self, request, form, formsets, change):
        # Variants were written by apply_document together with the experiment; the change
        # message (construct_change_message) still reads these from each formset.
        for formset in formsets:
            formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []

    def delete_model(self, request, obj):
        services.delete_experiment(obj, actor=request.user)

    def delete_queryset(self, request, queryset):
        # Never one bulk query: every deletion is audited and checked.
        for experiment in queryset:
            services.delete_experiment(experiment, actor=request.user)


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ("at", "experiment_key", "actor_name", "action", "reason")
    list_filter = ("action",)
    search_fields = ("experiment_key", "actor_name", "reason")
    # before/after shown with webhook URLs redacted (entries written before they were stored so).
    fields = (
        "experiment",
        "experiment_key",
        "actor",
        "actor_name",
        "at",
        "action",
        "reason",
        "before_shown",
        "after_shown",
    )
    readonly_fields = fields

    def get_queryset(self, request):
        return visible_audit(request.user, super().get_queryset(request))

    @admin.display(description="before")
    def before_shown(self, obj):
        return _json(services.redact_audit_value(obj.before))

    @admin.display(description="after")
    def after_shown(self, obj):
        return _json(services.redact_audit_value(obj.after))

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """Teams and their members: a superuser's (no role is granted the team permissions)."""

    list_display = ("name", "description", "members_shown", "experiment_count")
    search_fields = ("name", "description", "members__username")
    filter_horizontal = ("members",)

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .prefetch_related("members")
            .annotate(n_experiments=models.Count("experiments", distinct=True))
        )

    @admin.display(description="members")
    def members_shown(self, obj: Team) -> str:
        names = [u.get_username() for u in obj.members.all()[:10]]
        return ", ".join(names) or "-"

    @admin.display(description="experiments", ordering="n_experiments")
    def experiment_count(self, obj: Team) -> int:
        return obj.n_experiments
