"""Replays over the API: sre starts and cancels them; every role reads them."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from experiments.api.permissions import require
from experiments.models import Experiment
from experiments.teams import visible_experiments
from replay.arrivals import MODES, Arrival
from workers.models import ReplayRun
from workers.runs import ReplayError, ReplayInputError, ReplayRequest, cancel_run, describe
from workers.service import submit

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
        required=False,
        max_length=1000,
        help_text="or a file name inside the trace directory (setting TRACE_DIR); nothing outside it",
    )
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
        choices=["reject", "plain"],
        default="reject",
        help_text="chat messages for completions variants: reject, or render as plain text (replay/shapes.py)",
    )
    wrap_prompt = serializers.BooleanField(
        default=False, help_text="prompt lines to chat variants as one user message"
    )
    max_duration = serializers.FloatField(
        required=False,
        min_value=0.001,
        allow_null=True,
        help_text="seconds; refuse a longer planned schedule (default: setting REPLAY_MAX_DURATION_S, 2 h)",
    )
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
            "id",
            "experiment",
            "status",
            "mode",
            "source",
            "source_format",
            "arrival",
            "limit",
            "sample_fraction",
            "concurrency",
            "shard_count",
            "on_malformed",
            "render_chat",
            "wrap_prompt",
            "population_seed",
            "cancel_requested",
            "started_by",
            "created_at",
            "started_at",
            "finished_at",
            "total_requests",
            "expected_samples",
            "samples_recorded",
            "skipped_lines",
            "outcomes",
            "error",
            "progress",
        ]
        read_only_fields = fields

    def get_progress(self, obj: ReplayRun) -> dict:
        return obj.progress()


def refusal(exc: ReplayError) -> dict:
    """A 400's body: ``detail``, and the field at fault when one is."""
    body = {"detail": str(exc)}
    if isinstance(exc, ReplayInputError):
        body[exc.field] = [str(exc)]
    return body


class ExperimentScopedListView(generics.ListAPIView):
    """A list of rows that belong to experiments (``queryset``: replay runs; capacity searches,
    which are replays too): the user's teams' rows only, ``?experiment=KEY`` for one
    experiment's. A POST starts one for the experiment its body names (``requested``)."""

    permission_classes = [CanOperate]

    def get_queryset(self):
        qs = visible_experiments(self.request.user, super().get_queryset(), via="experiment")
        if key := self.request.query_params.get("experiment"):
            qs = qs.filter(experiment__key=key)
        return qs

    def requested(self, body_class: type[serializers.Serializer]) -> tuple[dict, Experiment]:
        """The request's body, validated by ``body_class``, and the experiment it names: one of
        the user's teams'. Another team's is "no experiment", as a key never made (a 400)."""
        body = body_class(data=self.request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        experiment = visible_experiments(self.request.user).filter(key=data["experiment"]).first()
        if experiment is None:
            raise serializers.ValidationError(
                {"experiment": [f"no experiment with key {data['experiment']!r}"]}
            )
        return data, experiment

    def accepted(self, row, detail: str) -> Response:
        """202: ``row`` started, described with its URL (the route ``detail``) in Location and
        ``url``: the caller polls it."""
        url = self.request.build_absolute_uri(reverse(detail, args=[row.pk]))
        out = {**self.get_serializer(row).data, "url": url}
        return Response(out, status=status.HTTP_202_ACCEPTED, headers={"Location": url})


class ExperimentScopedDetailView(generics.RetrieveAPIView):
    """One row of ``queryset`` of the user's teams' experiments (another team's: 404)."""

    permission_classes = [CanOperate]

    def get_queryset(self):
        return visible_experiments(self.request.user, super().get_queryset(), via="experiment")


class ReplayListView(ExperimentScopedListView):
    serializer_class = ReplayRunSerializer
    # The shards for every run's progress in one query (ReplayRun.progress reads them).
    queryset = ReplayRun.objects.select_related("experiment", "started_by").prefetch_related("shards")

    @extend_schema(request=ReplayCreateSerializer, responses={202: ReplayRunSerializer})
    def post(self, request):
        """Start a replay: 202 at once with the run's URL (Location and ``url``); poll it."""
        data, experiment = self.requested(ReplayCreateSerializer)
        try:
            handle = submit(
                ReplayRequest(
                    experiment,
                    trace=data.get("trace"),
                    source=data.get("source"),
                    source_format=data.get("format"),
                    local_paths=False,
                    mode=data["mode"],
                    arrival=Arrival(**data.get("arrival", {})),
                    limit=data.get("limit"),
                    concurrency=data["concurrency"],
                    shards=data.get("shards"),
                    on_malformed=data["on_malformed"],
                    seed=data["seed"],
                    sample_fraction=data["sample"],
                    actor=request.user,
                    render_chat=data["render_chat"],
                    wrap_prompt=data["wrap_prompt"],
                    max_duration_s=data.get("max_duration"),
                    confirm=data["confirm"],
                    check_variants=data["preflight"],
                ),
                detached=True,  # not inside this request: it answers at once
            )
        except ReplayError as exc:
            return Response(refusal(exc), status=status.HTTP_400_BAD_REQUEST)
        handle.run.refresh_from_db()
        return self.accepted(handle.run, "replay-detail")


class ReplayDetailView(ExperimentScopedDetailView):
    serializer_class = ReplayRunSerializer
    queryset = ReplayRun.objects.select_related("experiment", "started_by")


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
