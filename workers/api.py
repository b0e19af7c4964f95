"""Replays over the API: sre starts and cancels them; every role reads them."""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import connections, transaction
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from experiments.api.permissions import require
from experiments.teams import visible_experiments
from replay.arrivals import MODES, Arrival
from workers.models import ReplayRun
from workers.runs import ReplayError, ReplayInputError, cancel_run, create_run, describe
from workers.tasks import start_replay

log = logging.getLogger(__name__)

CanOperate = require("workers.operate_replay", read_perm="workers.view_replayrun")


class ArrivalSerializer(serializers.Serializer):
    mode = serializers.ChoiceField(choices=MODES, default="recorded")
    # Bounded so that the schedule's arithmetic stays finite: a gap is about 1/rate (or 1/speed)
    # and the gamma shape is 1/cv**2, which a rate of 1e-300 or a cv of 1e300 turn into inf.
    speed = serializers.FloatField(default=1.0, min_value=1e-6)
    rate = serializers.FloatField(
        default=0.0, min_value=0.0, max_value=1e6, help_text="requests/s; 0: not given"
    )
    cv = serializers.FloatField(default=1.0, min_value=1e-3, max_value=1e3)
    concurrency = serializers.IntegerField(default=0)
    seed = serializers.IntegerField(default=0)

    def validate_rate(self, value: float) -> float:
        if 0 < value < 1e-6:
            raise serializers.ValidationError("must be 0 (not given) or at least 0.000001 requests/s")
        return value

    def validate(self, attrs):
        try:
            Arrival(**attrs)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return attrs


class ReplayCreateSerializer(serializers.Serializer):
    experiment = serializers.SlugField()
    trace = serializers.CharField(
        required=False, max_length=1000, help_text="an uploaded trace's name or sha256 (GET /api/traces/)"
    )
    source = serializers.CharField(
        required=False, max_length=1000,
        help_text="or a file name inside the trace directory (setting TRACE_DIR); nothing outside it",
    )  # fmt: skip
    format = serializers.ChoiceField(
        choices=ReplayRun.SourceFormat.choices, required=False, help_text="default: the trace's, else azure"
    )
    mode = serializers.ChoiceField(choices=ReplayRun.Mode.values, default="split")
    arrival = ArrivalSerializer(required=False)
    limit = serializers.IntegerField(required=False, min_value=1, allow_null=True)
    sample = serializers.FloatField(
        default=1.0, min_value=0.0001, max_value=1.0, help_text="share of requests kept"
    )
    concurrency = serializers.IntegerField(
        default=512, min_value=1, help_text="at most REPLAY_MAX_CONCURRENCY"
    )
    shards = serializers.IntegerField(required=False, min_value=1, max_value=256, allow_null=True)
    on_malformed = serializers.ChoiceField(choices=["reject", "skip"], default="reject")
    seed = serializers.IntegerField(default=0, min_value=-(2**31), max_value=2**31 - 1)  # the run's column
    render_chat = serializers.ChoiceField(
        choices=["reject", "plain"], default="reject",
        help_text="chat messages for completions variants: reject, or render as plain text (replay/shapes.py)",
    )  # fmt: skip
    wrap_prompt = serializers.BooleanField(
        default=False, help_text="prompt lines to chat variants as one user message"
    )
    max_duration = serializers.FloatField(
        required=False, min_value=0.001, allow_null=True,
        help_text="seconds; refuse a longer planned schedule (default: setting REPLAY_MAX_DURATION_S, 2 h)",
    )  # fmt: skip
    confirm = serializers.BooleanField(default=False, help_text="start even if the plan exceeds max_duration")
    preflight = serializers.BooleanField(default=True, help_text="probe each variant's GET /v1/models first")

    def validate(self, attrs):
        if ("trace" in attrs) == ("source" in attrs):
            raise serializers.ValidationError(
                {"trace": ["give trace (an uploaded trace's name or sha256) or source"]}
            )
        return attrs


class ReplayRunSerializer(serializers.ModelSerializer):
    experiment = serializers.SlugRelatedField(slug_field="key", read_only=True)
    started_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    progress = serializers.SerializerMethodField()

    class Meta:
        model = ReplayRun
        fields = [
            "id", "experiment", "status", "mode", "source", "source_format", "arrival", "limit", "sample_fraction",
            "concurrency", "shard_count", "on_malformed", "render_chat", "wrap_prompt", "population_seed",
            "cancel_requested",
            "started_by", "created_at", "started_at", "finished_at", "total_requests",
            "expected_samples", "samples_recorded", "skipped_lines", "outcomes", "error", "progress",
        ]  # fmt: skip
        read_only_fields = fields

    def get_progress(self, obj: ReplayRun) -> dict:
        return obj.progress()


def refusal(exc: ReplayError) -> dict:
    """A 400's body: ``detail``, and the field at fault when one is."""
    body = {"detail": str(exc)}
    if isinstance(exc, ReplayInputError):
        body[exc.field] = [str(exc)]
    return body


def start_in_background(run_id: int) -> None:
    """Eager Celery (no broker): start the run once this transaction commits, in a daemon
    thread of this process (it owns the embedded sample store), so the request that started it
    answers at once instead of running the whole replay. The thread closes its own database
    connections; a run that fails before it starts sending ends failed (a run that dies while
    sending is ended by the periodic check, workers.runs.reap_abandoned)."""

    def work():
        try:
            start_replay(run_id)
        except Exception as exc:
            log.exception("run %s: failed to start in the background", run_id)
            ReplayRun.objects.filter(pk=run_id, status=ReplayRun.Status.QUEUED).update(
                status=ReplayRun.Status.FAILED,
                error=f"failed to start: {exc}"[:4000],
                finished_at=timezone.now(),
            )
        finally:
            connections.close_all()  # this thread's own connections

    def start():
        threading.Thread(target=work, name=f"abplat-replay-{run_id}", daemon=True).start()

    transaction.on_commit(start)


class ReplayListView(generics.ListAPIView):
    permission_classes = [CanOperate]
    serializer_class = ReplayRunSerializer

    def get_queryset(self):
        # The shards for every run's progress in one query (ReplayRun.progress reads them).
        qs = ReplayRun.objects.select_related("experiment", "started_by").prefetch_related("shards")
        qs = visible_experiments(self.request.user, qs, via="experiment")  # the user's teams' runs
        if key := self.request.query_params.get("experiment"):
            qs = qs.filter(experiment__key=key)
        return qs

    @extend_schema(request=ReplayCreateSerializer, responses={202: ReplayRunSerializer})
    def post(self, request):
        """Start a replay: 202 at once with the run's URL (Location and ``url``); poll it."""
        body = ReplayCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        # Another team's experiment is "no experiment", as a key never made.
        experiment = visible_experiments(request.user).filter(key=data["experiment"]).first()
        if experiment is None:
            return Response({"experiment": [f"no experiment with key {data['experiment']!r}"]}, status=400)
        eager = settings.CELERY_TASK_ALWAYS_EAGER
        try:
            run = create_run(
                experiment, trace=data.get("trace"), source=data.get("source"), source_format=data.get("format"),
                local_paths=False, mode=data["mode"], enqueue=not eager,
                arrival=Arrival(**data.get("arrival", {})), limit=data.get("limit"),
                concurrency=data["concurrency"], shard_count=data.get("shards"),
                on_malformed=data["on_malformed"], population_seed=data["seed"],
                sample_fraction=data["sample"], actor=request.user, render_chat=data["render_chat"],
                wrap_prompt=data["wrap_prompt"], max_duration_s=data.get("max_duration"),
                confirm=data["confirm"], check_variants=data["preflight"],
            )  # fmt: skip
        except ReplayError as exc:
            return Response(refusal(exc), status=status.HTTP_400_BAD_REQUEST)
        run.refresh_from_db()
        url = request.build_absolute_uri(reverse("replay-detail", args=[run.pk]))
        out = {**ReplayRunSerializer(run).data, "url": url}
        if eager:
            start_in_background(run.pk)
        return Response(out, status=status.HTTP_202_ACCEPTED, headers={"Location": url})


class ReplayDetailView(generics.RetrieveAPIView):
    permission_classes = [CanOperate]
    serializer_class = ReplayRunSerializer

    def get_queryset(self):
        qs = ReplayRun.objects.select_related("experiment", "started_by")
        return visible_experiments(self.request.user, qs, via="experiment")


class ReplayCancelView(APIView):
    """Cancel a run in whatever state: queued and abandoned runs (owner died) end at once,
    running ones within about a second; 409 only for a run that had already ended."""

    permission_classes = [CanOperate]

    @extend_schema(request=None, responses=ReplayRunSerializer)
    def post(self, request, pk: int):
        run = get_object_or_404(
            visible_experiments(request.user, ReplayRun.objects.all(), via="experiment"), pk=pk
        )
        if not cancel_run(run, actor=request.user):
            return Response(
                {"detail": f"run {run.pk} already ended ({run.status})", **describe(run)}, status=409
            )
        return Response(ReplayRunSerializer(run).data)
