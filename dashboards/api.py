"""GET /api/experiments/<key>/report: the report JSON (same shape as `sla_report --json`)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from dashboards.filters import filters_from_params
from dashboards.queries import QueryError
from dashboards.report import report_for
from experiments.api.permissions import CanView
from experiments.models import Experiment


class ExperimentReport(APIView):
    permission_classes = [CanView]

    def get(self, request, key: str) -> Response:
        experiment = get_object_or_404(Experiment, key=key)
        known = [v.key for v in experiment.variants.all()]
        try:
            filters = filters_from_params(
                key, request.query_params, request.query_params.getlist("variant"), known
            )
        except QueryError as e:
            raise ValidationError({"filters": str(e)}) from None
        return Response(report_for(experiment, filters))
