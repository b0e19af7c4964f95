from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path

from experiments.models import Experiment
from experiments.teams import visible_experiments
from replay.arrivals import MODES, Arrival
from traces.models import Trace
from workers.models import ReplayRun, ReplayShard
from workers.runs import ReplayError, ReplayInputError, ReplayRequest, cancel_run
from workers.service import submit


class StartReplayForm(forms.Form):
    experiment = forms.ModelChoiceField(queryset=Experiment.objects.filter(status=Experiment.Status.RUNNING))
    trace = forms.ModelChoiceField(
        queryset=Trace.objects.all(), required=False, help_text="an uploaded trace (Traces: Upload a trace)"
    )
    source = forms.CharField(
        required=False, max_length=1000, help_text="or a file name inside the trace directory (TRACE_DIR)"
    )
    source_format = forms.ChoiceField(
        choices=[("", "the trace's (else azure)"), *ReplayRun.SourceFormat.choices], required=False
    )
    mode = forms.ChoiceField(choices=ReplayRun.Mode.choices, initial="split")
    arrival = forms.ChoiceField(choices=[(m, m) for m in MODES], initial="recorded")
    speed = forms.FloatField(initial=1.0, help_text="recorded arrivals: time compression")
    rate = forms.FloatField(initial=0.0, help_text="poisson/gamma: requests per second")
    cv = forms.FloatField(initial=1.0, help_text="gamma: burstiness")
    concurrency = forms.IntegerField(initial=512, min_value=1)
    limit = forms.IntegerField(required=False, min_value=1)
    sample_fraction = forms.FloatField(initial=1.0, min_value=0.0001, max_value=1.0)
    skip_malformed = forms.BooleanField(required=False)
    render_chat = forms.ChoiceField(
        choices=[("reject", "reject"), ("plain", "plain")],
        initial="reject",
        required=False,
        help_text="chat messages for completions variants: reject, or render as plain text",
    )
    wrap_prompt = forms.BooleanField(
        required=False, help_text="prompt lines to chat variants as one user message"
    )
    max_duration = forms.FloatField(
        required=False, min_value=0.001, help_text="seconds; default: setting REPLAY_MAX_DURATION_S (2 h)"
    )
    confirm = forms.BooleanField(
        required=False, help_text="start even if the plan exceeds the maximum duration"
    )

    def clean(self):
        data = super().clean()
        if not self.errors and bool(data.get("trace")) == bool(data.get("source")):
            raise forms.ValidationError("choose a trace, or give a file name inside the trace directory")
        if not self.errors:
            try:
                data["arrival_obj"] = Arrival(
                    mode=data["arrival"],
                    speed=data["speed"],
                    rate=data["rate"],
                    cv=data["cv"],
                    concurrency=data["concurrency"],
                )
            except ValueError as exc:
                raise forms.ValidationError(str(exc)) from None
        return data


class ReplayShardInline(admin.TabularInline):
    model = ReplayShard
    extra = 0
    can_delete = False
    fields = (
        "index",
        "status",
        "attempts",
        "worker",
        "planned",
        "sent",
        "recorded",
        "lag_p50_ms",
        "lag_p99_ms",
        "lag_max_ms",
        "started_at",
        "finished_at",
        "error",
    )
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.action(description="Cancel selected replays", permissions=["operate"])
def cancel_replays(modeladmin, request, queryset):
    for run in queryset:
        if cancel_run(run, actor=request.user):
            modeladmin.message_user(request, f"run {run.pk}: {run.status}", messages.SUCCESS)
        else:
            modeladmin.message_user(request, f"run {run.pk}: already {run.status}", messages.WARNING)


@admin.register(ReplayRun)
class ReplayRunAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "experiment",
        "status",
        "mode",
        "total_requests",
        "samples_recorded",
        "started_by",
        "created_at",
        "finished_at",
    )
    # Only the experiments whose runs the user sees (their teams'), never every key.
    list_filter = ("status", "mode", ("experiment", admin.RelatedOnlyFieldListFilter))
    search_fields = ("experiment__key", "source")
    inlines = [ReplayShardInline]
    # The plan (megabytes for a long replay) is summarised, not rendered.
    exclude = ("prompt_plan",)
    readonly_fields = ("prompt_plan_summary",)

    @admin.display(description="prompt plan")
    def prompt_plan_summary(self, obj: ReplayRun) -> str:
        plan = obj.prompt_plan if obj.pk else {}
        if not plan:
            return "none (not calibrated yet, or the variants need no calibration)"
        return "; ".join(f"{variant}: {len(book):,} prompts" for variant, book in sorted(plan.items()))

    actions = [cancel_replays]

    def get_queryset(self, request):
        return visible_experiments(request.user, super().get_queryset(request), via="experiment")

    def has_operate_permission(self, request):
        return request.user.has_perm("workers.operate_replay")

    def get_urls(self):
        start = path("start/", self.admin_site.admin_view(self.start_view), name="workers_replayrun_start")
        return [start, *super().get_urls()]

    def changelist_view(self, request, extra_context=None):
        extra_context = {**(extra_context or {}), "can_start_replay": self.has_operate_permission(request)}
        return super().changelist_view(request, extra_context)

    def start_view(self, request):
        """Start a replay (sre): validated like the API and the replay command."""
        if not self.has_operate_permission(request):
            raise PermissionDenied("starting a replay needs the permission workers.operate_replay")
        form = StartReplayForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            d = form.cleaned_data
            try:
                run = submit(
                    ReplayRequest(
                        d["experiment"],
                        trace=d["trace"].sha256 if d["trace"] else None,
                        source=d["source"] or None,
                        source_format=d["source_format"] or None,
                        local_paths=False,
                        mode=d["mode"],
                        arrival=d["arrival_obj"],
                        limit=d["limit"],
                        concurrency=d["concurrency"],
                        on_malformed="skip" if d["skip_malformed"] else "reject",
                        sample_fraction=d["sample_fraction"],
                        actor=request.user,
                        render_chat=d["render_chat"] or "reject",
                        wrap_prompt=d["wrap_prompt"],
                        max_duration_s=d["max_duration"],
                        confirm=d["confirm"],
                    ),
                    detached=True,  # not inside this request
                ).run
            except ReplayError as exc:
                field = exc.field if isinstance(exc, ReplayInputError) else None
                form.add_error(field if field in form.fields else None, str(exc))
            else:
                self.message_user(
                    request, f"run {run.pk} started: {run.total_requests} requests", messages.SUCCESS
                )
                return redirect("admin:workers_replayrun_change", run.pk)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "form": form,
            "title": "Start a replay",
        }
        return TemplateResponse(request, "admin/workers/replayrun/start.html", context)

    def has_add_permission(self, request):
        return False  # started with the replay command or POST /api/replays/ (validated there)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
