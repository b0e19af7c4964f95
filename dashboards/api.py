"""GET /api/experiments/<key>/report: the report JSON (same shape as `sla_report --json`)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from analysis.definitions import QueryError
from dashboards.reports import report_for_params, report_time_limit_s, timeout_message
from experiments.api.permissions import CanView
from experiments.teams import visible_experiments
from samples.store import QueryTimeout


class ExperimentReport(APIView):
    permission_classes = [CanView]

    @extend_schema(
        parameters=[
            OpenApiParameter("run", int, description="one replay run"),
            OpenApiParameter("since", str, description="ISO 8601, inclusive (sent_at, UTC)"),
            OpenApiParameter("until", str, description="ISO 8601, exclusive"),
            OpenApiParameter("variant", str, many=True, description="only these variants"),
            OpenApiParameter(
                "status",
                str,
                many=True,
                description="run catalog statuses to read (running, done, cancelled, failed, or all); "
                "default: completed runs",
            ),
            OpenApiParameter(
                "mode",
                str,
                description="split, mirror (replays) or live (the gateway's real traffic); default: the "
                "mode of the latest completed run",
            ),
        ],
        responses={200: OpenApiTypes.OBJECT},
        description="The SLA report (stable JSON shape, docs/report-json.md).",
    )
    def get(self, request, key: str) -> Response:
        experiment = get_object_or_404(visible_experiments(request.user), key=key)  # the user's teams
        try:
            _filters, report = report_for_params(
                experiment,
                request.query_params,
                request.query_params.getlist("variant"),
                request.query_params.getlist("status"),
            )
        except QueryError as e:
            raise ValidationError({"filters": str(e)}) from None
        except QueryTimeout:
            raise ValidationError({"report": timeout_message(report_time_limit_s())}) from None
        return Response(report)
