"""The capacity page of an experiment: its latest capacity search, ranked by capacity per
price, every step it ran, with attainment and TTFT against load (charts.py). The dashboards'
viewers see it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from capacity import charts
from capacity.labels import step_label
from capacity.models import CapacitySearch
from capacity.search import NOT_MET_AT, UNDECIDED, rate_text
from capacity.service import mirror_fidelity, ranking
from dashboards.summaries import identical_text
from dashboards.views import plotly_url
from experiments.teams import visible_experiments

VIEW_PERM = "experiments.view_experiment"
# Capacity.limited_by as the page says it
LIMITED_BY = {
    "sla": "the SLA",
    "generator": "the load generator",
    "max_rate": "the highest rate allowed",
    "min_rate": "the lowest rate allowed",
    "steps": "the step budget",
}


def _rate(x: float | None) -> str:
    return "-" if x is None else rate_text(x)


def _money(x: float | None, currency: str) -> str:
    return "-" if x is None else f"{x:,.2f} {currency}".strip()


def variant_row(variant: str, r: Mapping[str, Any], search: CapacitySearch) -> dict[str, Any]:
    """One variant's line of the table, every number at the precision it has."""
    cost = r.get("cost") or {}
    cur = cost.get("currency", "")
    per = cost.get("capacity_per_currency_hour")
    message = r.get("message", "")
    if "searching" in r and search.status == CapacitySearch.Status.FAILED:
        message = f"cut short after {len(r.get('steps', []))} steps: the search failed"
    return {
        "variant": variant,
        "capacity": _rate(r.get("capacity_rps")),
        "not_met_at": _rate(r.get("upper_rps")),
        "limited_by": LIMITED_BY.get(r.get("limited_by", ""), r.get("limited_by") or "-"),
        "knee": _rate(r.get("knee_rps")),
        "n_steps": len(r.get("steps", [])),
        "search_s": "-" if r.get("search_s") is None else f"{r['search_s']:.0f}",
        "per_million_requests": _money(cost.get("per_million_requests"), cur),
        "per_million_output_tokens": _money(cost.get("per_million_output_tokens"), cur),
        "per_price_hour": "-" if per is None else f"{per:.3g}",
        "message": message,
    }


def step_rows(result: Mapping[str, Any], search: CapacitySearch) -> list[dict[str, Any]]:
    """Every step the search ran, per variant in the order run, as the report names its run."""
    rows = []
    for variant, r in result.items():
        for i, s in enumerate(r.get("steps", []), 1):
            att = f"{s['hits'] / s['n']:.2%}" if s.get("n") else "-"
            band = "-"
            if s.get("attainment_lo") is not None and s.get("attainment_hi") is not None:
                band = f"{s['attainment_lo']:.2%} to {s['attainment_hi']:.2%}"
            rows.append(
                {
                    "variant": variant,
                    "i": i,
                    "rate": rate_text(s["rate_rps"]),
                    "verdict": s["verdict"],
                    "counted": s.get("counted", True),
                    "attainment": att,
                    "band": band,
                    "n": s.get("n", 0),
                    "ttft_p99": "-" if s.get("ttft_p99_ms") is None else f"{s['ttft_p99_ms']:.0f}",
                    "lag_p99": "-" if s.get("lag_p99_ms") is None else f"{s['lag_p99_ms']:.1f}",
                    "seconds": f"{s.get('seconds', 0.0):.0f}",
                    "run_id": s.get("run_id"),
                    "note": s.get("note", ""),
                }
            )
        if now := r.get("searching"):
            what = (
                "replaying"
                if search.status == CapacitySearch.Status.RUNNING
                else "cut short, the search failed"
            )
            rows.append(
                {
                    "variant": variant,
                    "i": len(r.get("steps", [])) + 1,
                    "rate": rate_text(now["rate_rps"]),
                    "verdict": what,
                    "counted": False,
                    "attainment": "-",
                    "band": "-",
                    "n": "-",
                    "ttft_p99": "-",
                    "lag_p99": "-",
                    "seconds": "-",
                    "run_id": now["run_id"],
                    "note": step_label(now["run_id"], variant, now["rate_rps"], what),
                }
            )
    return rows


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
    rows, steps, figures = [], [], []
    control = experiment.control_key() or ""
    fidelity, fidelity_note = mirror_fidelity(experiment) if shown is not None else ({}, "")
    if shown is not None:
        result = shown.result or {}
        rows = [variant_row(v, result[v], shown) for v in ranking(result)]
        steps = step_rows(result, shown)
        target = shown.params.get("target", experiment.sla_target)
        figures = [
            {"id": "capacity-attainment", "figure": charts.attainment_vs_rate(result, target)},
            {"id": "capacity-ttft", "figure": charts.ttft_vs_rate(result)},
        ]
        for fig in figures:
            fig["empty"] = charts.why_empty(fig["figure"], shown.status)
        if any(fidelity.values()):
            figures.append(
                {
                    "id": "capacity-fidelity",
                    "figure": charts.capacity_vs_fidelity(result, fidelity, control),
                    "empty": "",
                }
            )
        for row in rows:
            row["identical"] = (
                "reference" if row["variant"] == control else identical_text(fidelity.get(row["variant"]))
            )
    context = {
        "experiment": experiment,
        "search": shown,
        "rows": rows,
        "steps": steps,
        "figures": figures,
        "others": searches.exclude(pk=getattr(shown, "pk", None))[:20],
        "plotly_url": plotly_url(),
        "not_met_at": NOT_MET_AT,
        "fidelity": any(fidelity.values()),
        "fidelity_note": fidelity_note,
        "control": control,
        "undecided": UNDECIDED,
        "target": f"{experiment.sla_target * 100:.4g}%",
        "step_requests": shown.params.get("step_requests") if shown else None,
        "warmup": rate_text(shown.params["warmup_s"]) if shown and "warmup_s" in shown.params else None,
    }
    return render(request, "capacity/capacity.html", context)
