"""Capacity searches over the API: sre starts them (202, then poll); every role that reads
replays reads them. Traces come from the trace directory only (uploaded ones), never a path."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.response import Response

from capacity import tasks
from capacity.models import CapacitySearch
from capacity.service import Options, create_search, ranking
from capacity.steps import ARRIVALS
from experiments.api.permissions import require
from experiments.teams import visible_experiments
from workers.runs import ReplayError, resolve_source

# Starting a search is running replays; reading one is reading replays.
CanOperate = require("workers.operate_replay", read_perm="workers.view_replayrun")


class CapacityCreateSerializer(serializers.Serializer):
    experiment = serializers.SlugField()
    trace = serializers.CharField(
        max_length=1000, help_text="an uploaded trace's name or sha256 (GET /api/traces/)"
    )
    format = serializers.ChoiceField(choices=["azure", "jsonl"], required=False)
    variants = serializers.ListField(child=serializers.SlugField(), required=False, max_length=26,
                                     help_text="variant keys to search (default: all)")  # fmt: skip
    arrival = serializers.ChoiceField(choices=ARRIVALS, default="poisson")
    cv = serializers.FloatField(default=1.0, min_value=1e-3, max_value=1e3)
    start_rate = serializers.FloatField(required=False, min_value=1e-3, max_value=1e6, allow_null=True)
    max_rate = serializers.FloatField(default=50.0, min_value=1e-3, max_value=1e6)
    min_rate = serializers.FloatField(default=0.05, min_value=1e-3, max_value=1e6)
    tolerance = serializers.FloatField(default=0.05, min_value=1e-3, max_value=1.0)
    max_steps = serializers.IntegerField(default=12, min_value=2, max_value=100)
    step_requests = serializers.IntegerField(default=2000, min_value=50)
    warmup = serializers.FloatField(default=5.0, min_value=0.0, max_value=600.0)
    seed = serializers.IntegerField(default=0, min_value=-(2**31), max_value=2**31 - 1)
    alpha = serializers.FloatField(default=0.05, min_value=1e-6, max_value=0.5)
    lag_limit = serializers.FloatField(
        required=False, allow_null=True, default=None, min_value=0.01, max_value=10_000.0,
        help_text="ms of schedule lag p99 above which a step is void (default: max(5, 5% of the tightest SLO))",
    )  # fmt: skip

    def validate_step_requests(self, value: int) -> int:
        if value > settings.REPLAY_MAX_REQUESTS:
            raise serializers.ValidationError(
                f"at most {settings.REPLAY_MAX_REQUESTS} (setting REPLAY_MAX_REQUESTS)"
            )
        return value

    def validate(self, attrs):
        if attrs["arrival"] != "gamma" and attrs["cv"] != 1.0:
            raise serializers.ValidationError(
                {"cv": [f"cv applies to gamma arrivals, not {attrs['arrival']}"]}
            )
        return attrs


class CapacitySearchSerializer(serializers.ModelSerializer):
    experiment = serializers.SlugRelatedField(slug_field="key", read_only=True)
    ranking = serializers.SerializerMethodField()

    class Meta:
        model = CapacitySearch
        fields = [
            "id",
            "experiment",
            "status",
            "params",
            "result",
            "ranking",
            "error",
            "created_at",
            "finished_at",
        ]
        read_only_fields = fields

    def get_ranking(self, obj: CapacitySearch) -> list[str]:
        return ranking(obj.result or {})


class CapacityListView(generics.ListAPIView):
    permission_classes = [CanOperate]
    serializer_class = CapacitySearchSerializer

    def get_queryset(self):
        qs = CapacitySearch.objects.select_related("experiment")
        qs = visible_experiments(self.request.user, qs, via="experiment")  # the user's teams' searches
        if key := self.request.query_params.get("experiment"):
            qs = qs.filter(experiment__key=key)
        return qs

    @extend_schema(request=CapacityCreateSerializer, responses={202: CapacitySearchSerializer})
    def post(self, request):
        """Start a capacity search: 202 at once with its URL (Location and ``url``); poll it."""
        body = CapacityCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        d = body.validated_data
        # Another team's experiment is "no experiment", as a key never made.
        experiment = visible_experiments(request.user).filter(key=d["experiment"]).first()
        if experiment is None:
            return Response({"experiment": [f"no experiment with key {d['experiment']!r}"]}, status=400)
        try:
            src = resolve_source(trace=d["trace"], local_paths=False)
            opts = Options(
                trace=src.path.name, source_format=d.get("format"), variants=d.get("variants", []),
                arrival=d["arrival"], cv=d["cv"], start_rps=d.get("start_rate"), max_rps=d["max_rate"],
                min_rps=d["min_rate"], rel_tol=d["tolerance"], max_steps=d["max_steps"], alpha=d["alpha"],
                step_requests=d["step_requests"], warmup_s=d["warmup"], seed=d["seed"],
                lag_limit_ms=d["lag_limit"], local_paths=False,
            )  # fmt: skip
            record = create_search(experiment, opts, actor=request.user)
        except ReplayError as exc:
            body = {"detail": str(exc)}
            if field := getattr(exc, "field", None):
                body[field] = [str(exc)]
            return Response(body, status=status.HTTP_400_BAD_REQUEST)
        url = request.build_absolute_uri(reverse("capacity-detail", args=[record.pk]))
        if settings.CELERY_TASK_ALWAYS_EAGER:
            tasks.start_in_background(record.pk)
        else:
            transaction.on_commit(lambda: tasks.run_search.delay(record.pk))
        out = {**CapacitySearchSerializer(record).data, "url": url}
        return Response(out, status=status.HTTP_202_ACCEPTED, headers={"Location": url})


class CapacityDetailView(generics.RetrieveAPIView):
    permission_classes = [CanOperate]
    serializer_class = CapacitySearchSerializer

    def get_queryset(self):
        qs = CapacitySearch.objects.select_related("experiment")
        return visible_experiments(self.request.user, qs, via="experiment")
