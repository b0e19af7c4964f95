"""Replays over the API: sre starts and cancels them; every role reads them."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from experiments.api.permissions import require
from experiments.models import Experiment
from replay.arrivals import MODES, Arrival
from workers.models import ReplayRun
from workers.runs import ReplayError, cancel_run, create_run, describe

CanOperate = require("workers.operate_replay", read_perm="workers.view_replayrun")


class ArrivalSerializer(serializers.Serializer):
    mode = serializers.ChoiceField(choices=MODES, default="recorded")
    speed = serializers.FloatField(default=1.0)
    rate = serializers.FloatField(default=0.0)
    cv = serializers.FloatField(default=1.0)
    concurrency = serializers.IntegerField(default=0)
    seed = serializers.IntegerField(default=0)

    def validate(self, attrs):
        try:
            Arrival(**attrs)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return attrs


class ReplayCreateSerializer(serializers.Serializer):
    experiment = serializers.SlugField()
    source = serializers.CharField(help_text="trace or log path as the workers see it")
    format = serializers.ChoiceField(choices=ReplayRun.SourceFormat.values, default="azure")
    mode = serializers.ChoiceField(choices=ReplayRun.Mode.values, default="split")
    arrival = ArrivalSerializer(required=False)
    limit = serializers.IntegerField(required=False, min_value=1, allow_null=True)
    sample = serializers.FloatField(
        default=1.0, min_value=0.0001, max_value=1.0, help_text="share of requests kept"
    )
    concurrency = serializers.IntegerField(default=512, min_value=1, max_value=100_000)
    shards = serializers.IntegerField(required=False, min_value=1, max_value=256, allow_null=True)
    on_malformed = serializers.ChoiceField(choices=["reject", "skip"], default="reject")
    seed = serializers.IntegerField(default=0)
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


class ReplayRunSerializer(serializers.ModelSerializer):
    experiment = serializers.SlugRelatedField(slug_field="key", read_only=True)
    started_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
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


class ReplayListView(generics.ListAPIView):
    permission_classes = [CanOperate]
    serializer_class = ReplayRunSerializer

    def get_queryset(self):
        qs = ReplayRun.objects.select_related("experiment", "started_by")
        if key := self.request.query_params.get("experiment"):
            qs = qs.filter(experiment__key=key)
        return qs

    @extend_schema(request=ReplayCreateSerializer, responses={201: ReplayRunSerializer})
    def post(self, request):
        body = ReplayCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        experiment = Experiment.objects.filter(key=data["experiment"]).first()
        if experiment is None:
            return Response({"experiment": [f"no experiment with key {data['experiment']!r}"]}, status=400)
        try:
            run = create_run(
                experiment, source=data["source"], source_format=data["format"], mode=data["mode"],
                arrival=Arrival(**data.get("arrival", {})), limit=data.get("limit"),
                concurrency=data["concurrency"], shard_count=data.get("shards"),
                on_malformed=data["on_malformed"], population_seed=data["seed"],
                sample_fraction=data["sample"], actor=request.user, render_chat=data["render_chat"],
                wrap_prompt=data["wrap_prompt"], max_duration_s=data.get("max_duration"),
                confirm=data["confirm"], check_variants=data["preflight"],
            )  # fmt: skip
        except ReplayError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        run.refresh_from_db()
        return Response(ReplayRunSerializer(run).data, status=status.HTTP_201_CREATED)


class ReplayDetailView(generics.RetrieveAPIView):
    permission_classes = [CanOperate]
    serializer_class = ReplayRunSerializer
    queryset = ReplayRun.objects.select_related("experiment", "started_by")


class ReplayCancelView(APIView):
    """Cancel a run in whatever state: queued and abandoned runs (owner died) end at once,
    running ones within about a second; 409 only for a run that had already ended."""

    permission_classes = [CanOperate]

    @extend_schema(request=None, responses=ReplayRunSerializer)
    def post(self, request, pk: int):
        run = get_object_or_404(ReplayRun, pk=pk)
        if not cancel_run(run, actor=request.user):
            return Response(
                {"detail": f"run {run.pk} already ended ({run.status})", **describe(run)}, status=409
            )
        return Response(ReplayRunSerializer(run).data)
