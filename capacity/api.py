"""Capacity searches over the API: sre starts them (202, then poll); every role that reads
replays reads them. Traces come from the trace directory only (uploaded ones), never a path."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from capacity.models import CapacitySearch
from capacity.service import ranking
from capacity.steps import ARRIVALS
from capacity.tasks import start_search
from workers.api import ExperimentScopedDetailView, ExperimentScopedListView, refusal
from workers.runs import ReplayError

# Starting a search is running replays, and reading one is reading replays: the replay API's
# views of the user's teams' rows (workers.api), under its permission, serve searches too.


class CapacityCreateSerializer(serializers.Serializer):
    experiment = serializers.SlugField()
    trace = serializers.CharField(
        max_length=1000, help_text="an uploaded trace's name or sha256 (GET /api/traces/)"
    )
    format = serializers.ChoiceField(choices=["azure", "jsonl"], required=False)
    variants = serializers.ListField(
        child=serializers.SlugField(),
        required=False,
        max_length=26,
        help_text="variant keys to search (default: all)",
    )
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
        required=False,
        allow_null=True,
        default=None,
        min_value=0.01,
        max_value=10_000.0,
        help_text="ms of schedule lag p99 above which a step is void (default: max(5, 5% of the tightest SLO))",
    )

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
        extra_kwargs = {
            "result": {
                "help_text": (
                    'per variant: capacity_rps (met the target with confidence), upper_rps ("not met at": '
                    "the lowest rate tried above it that did not), limited_by, knee_rps, message, search_s, "
                    "cost, and steps in the order run, each with rate_rps, verdict (meets, misses or "
                    "undecided) and run_id, its capacity step's replay run. While a variant is searched: "
                    "its steps so far, message, and searching: {run_id, rate_rps} of the step replaying "
                    "(kept when the search fails: that step was cut short)"
                )
            }
        }

    def get_ranking(self, obj: CapacitySearch) -> list[str]:
        return ranking(obj.result or {})


class CapacityListView(ExperimentScopedListView):
    serializer_class = CapacitySearchSerializer
    queryset = CapacitySearch.objects.select_related("experiment")

    @extend_schema(request=CapacityCreateSerializer, responses={202: CapacitySearchSerializer})
    def post(self, request):
        """Start a capacity search: 202 at once with its URL (Location and ``url``); poll it."""
        d, experiment = self.requested(CapacityCreateSerializer)
        try:
            record = start_search(
                experiment,
                d,
                trace=d["trace"],
                source_format=d.get("format"),
                variants=d.get("variants", []),
                actor=request.user,
            )
        except ReplayError as exc:
            return Response(refusal(exc), status=status.HTTP_400_BAD_REQUEST)
        return self.accepted(record, "capacity-detail")


class CapacityDetailView(ExperimentScopedDetailView):
    serializer_class = CapacitySearchSerializer
    queryset = CapacitySearch.objects.select_related("experiment")
