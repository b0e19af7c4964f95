"""The capacity page of an experiment: its latest capacity search, ranked by capacity per
price, with attainment and TTFT against load (charts.py). The dashboards' viewers see it."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from capacity import charts
from capacity.models import CapacitySearch
from capacity.service import ranking
from dashboards.views import plotly_url
from experiments.teams import visible_experiments

VIEW_PERM = "experiments.view_experiment"


@login_required
@permission_required(VIEW_PERM, raise_exception=True)
@require_GET
def capacity_page(request: HttpRequest, key: str) -> HttpResponse:
    experiment = get_object_or_404(visible_experiments(request.user), key=key)  # the user's teams
    searches = CapacitySearch.objects.filter(experiment=experiment)
    shown = searches.first()
    if (wanted := request.GET.get("search")) is not None:
        if not wanted.isdigit():
            return HttpResponse(
                f"search={wanted[:40]!r}: not a search id", status=400, content_type="text/plain"
            )
        shown = get_object_or_404(searches, pk=int(wanted))
    rows, figures = [], []
    if shown is not None and shown.result:
        for v in ranking(shown.result):
            r = shown.result[v]
            rows.append({"variant": v, **r, "n_steps": len(r.get("steps", [])), "cost": r.get("cost") or {}})
        target = shown.params.get("target", experiment.sla_target)
        figures = [
            {"id": "capacity-attainment", "figure": charts.attainment_vs_rate(shown.result, target)},
            {"id": "capacity-ttft", "figure": charts.ttft_vs_rate(shown.result)},
        ]
    context = {
        "experiment": experiment, "search": shown, "rows": rows, "figures": figures,
        "others": searches.exclude(pk=getattr(shown, "pk", None))[:20], "plotly_url": plotly_url(),
    }  # fmt: skip
    return render(request, "capacity/capacity.html", context)
