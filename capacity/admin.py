"""Capacity searches in the admin: listed read-only, started by sre with the same checks as the
command line and the API (a trace from the trace directory only)."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path

from capacity.models import CapacitySearch
from capacity.search import rate_text
from capacity.steps import ARRIVALS
from capacity.tasks import start_search
from experiments.models import Experiment
from experiments.teams import visible_experiments
from traces.models import Trace
from workers.runs import ReplayError


class StartSearchForm(forms.Form):
    experiment = forms.ModelChoiceField(queryset=Experiment.objects.filter(status=Experiment.Status.RUNNING))
    trace = forms.ModelChoiceField(
        queryset=Trace.objects.all(), help_text="an uploaded trace (Traces: Upload a trace)"
    )
    variants = forms.CharField(
        required=False, max_length=1000, help_text="comma-separated keys (default: all)"
    )
    arrival = forms.ChoiceField(choices=[(a, a) for a in ARRIVALS], initial="poisson")
    cv = forms.FloatField(initial=1.0, min_value=1e-3, max_value=1e3, help_text="gamma: burstiness")
    max_rate = forms.FloatField(initial=50.0, min_value=1e-3, max_value=1e6, help_text="req/s")
    start_rate = forms.FloatField(required=False, min_value=1e-3, max_value=1e6, help_text="default: max / 4")
    min_rate = forms.FloatField(initial=0.05, min_value=1e-3, max_value=1e6)
    tolerance = forms.FloatField(initial=0.05, min_value=1e-3, max_value=1.0)
    max_steps = forms.IntegerField(initial=12, min_value=2, max_value=100)
    step_requests = forms.IntegerField(initial=2000, min_value=50)
    warmup = forms.FloatField(initial=5.0, min_value=0.0, max_value=600.0, help_text="seconds not judged")
    seed = forms.IntegerField(initial=0)
    alpha = forms.FloatField(initial=0.05, min_value=1e-6, max_value=0.5)
    lag_limit = forms.FloatField(
        required=False,
        min_value=0.01,
        max_value=10_000.0,
        help_text="ms of the replay's own lag p99 (default: max(5, 5% of the tightest SLO threshold))",
    )

    def clean(self):
        data = super().clean()
        if not self.errors and data["arrival"] != "gamma" and data["cv"] != 1.0:
            self.add_error("cv", f"cv applies to gamma arrivals, not {data['arrival']}")
        if not self.errors and data["step_requests"] > settings.REPLAY_MAX_REQUESTS:
            self.add_error(
                "step_requests", f"at most {settings.REPLAY_MAX_REQUESTS} (setting REPLAY_MAX_REQUESTS)"
            )
        return data


@admin.register(CapacitySearch)
class CapacitySearchAdmin(admin.ModelAdmin):
    list_display = ("id", "experiment", "status", "summary", "created_at", "finished_at")
    list_filter = ("status",)
    search_fields = ("experiment__key",)
    readonly_fields = (
        "experiment",
        "status",
        "params",
        "result",
        "error",
        "started_by",
        "created_at",
        "finished_at",
    )

    def get_queryset(self, request):
        return visible_experiments(request.user, super().get_queryset(request), via="experiment")

    @admin.display(description="capacity (req/s)")
    def summary(self, obj: CapacitySearch) -> str:
        parts = [
            f"{v}: {rate_text(r['capacity_rps']) if r.get('capacity_rps') else '-'}"
            for v, r in (obj.result or {}).items()
        ]
        return ", ".join(parts) or "-"

    def can_start(self, request) -> bool:
        return request.user.has_perm("workers.operate_replay")  # a search is replays

    def get_urls(self):
        start = path(
            "start/", self.admin_site.admin_view(self.start_view), name="capacity_capacitysearch_start"
        )
        return [start, *super().get_urls()]

    def changelist_view(self, request, extra_context=None):
        extra_context = {**(extra_context or {}), "can_start_search": self.can_start(request)}
        return super().changelist_view(request, extra_context)

    def start_view(self, request):
        if not self.can_start(request):
            raise PermissionDenied("starting a capacity search needs the permission workers.operate_replay")
        form = StartSearchForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            d = form.cleaned_data
            try:
                record = start_search(
                    d["experiment"],
                    d,
                    trace=d["trace"].sha256,
                    source_format=d["trace"].format,
                    variants=[v.strip() for v in d["variants"].split(",") if v.strip()],
                    actor=request.user,
                )
            except ReplayError as exc:
                form.add_error(None, str(exc))
            else:
                self.message_user(request, f"capacity search {record.pk} started", messages.SUCCESS)
                return redirect("admin:capacity_capacitysearch_change", record.pk)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "form": form,
            "title": "Start a capacity search",
        }
        return TemplateResponse(request, "admin/capacity/capacitysearch/start.html", context)

    # Who reads replays reads searches (their steps are replays), as the API has it.
    def has_view_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("workers.view_replayrun")

    def has_module_permission(self, request) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request) -> bool:
        return False  # started with the form above, the command or POST /api/capacity/

    def has_change_permission(self, request, obj=None) -> bool:
        return False
