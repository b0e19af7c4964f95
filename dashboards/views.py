"""Dashboard page, CSV export and the plotly.js asset. Analyst, product, sre and superusers."""

from __future__ import annotations

import functools
import gzip
import json

from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from analysis.definitions import MODES, RUN_STATUSES, QueryError
from dashboards import charts, summaries, tables
from dashboards.reports import report_for_params, report_time_limit_s, timeout_message
from experiments.teams import visible_experiments
from samples.store import QueryTimeout

VIEW_PERM = "experiments.view_experiment"


def _guard(view):
    # anonymous -> login page; signed in without the permission -> 403
    return login_required(permission_required(VIEW_PERM, raise_exception=True)(require_GET(view)))


def _report(request: HttpRequest, key: str):
    experiment = get_object_or_404(visible_experiments(request.user), key=key)  # the user's teams
    return experiment, *report_for_params(
        experiment, request.GET, request.GET.getlist("variant"), request.GET.getlist("status")
    )


def _sources(runs: dict) -> list[dict]:
    """The report's runs (read or not) by source: replays (split, mirror) and live traffic (the
    gateway's, mode live), each with the modes it has, so the page lists live beside replays."""
    out: dict[str, dict] = {}
    for r in [*runs.get("read", []), *runs.get("not_read", [])]:
        mode = r.get("mode") or runs.get("mode")
        source = out.setdefault("live" if mode == "live" else "replay", {"runs": [], "modes": []})
        # a run the glue labelled (a capacity step: what it was for) is named by its label
        source["runs"].append(
            {"run_id": r["run_id"], "mode": mode, "read": "reason" not in r, "label": r.get("label", "")}
        )
        if mode and mode not in source["modes"]:
            source["modes"].append(mode)
    return [
        {
            "name": name,
            "runs": sorted(out[name]["runs"], key=lambda r: r["run_id"]),
            "modes": out[name]["modes"],
        }
        for name in ("replay", "live")
        if name in out
    ]


def _too_slow() -> HttpResponse:
    # 400, as for a bad filter: narrower filters are what makes this report answer.
    return HttpResponseBadRequest(
        f"Report too slow: {timeout_message(report_time_limit_s())}", content_type="text/plain"
    )


@_guard
def experiment(request: HttpRequest, key: str) -> HttpResponse:
    try:
        exp, filters, report = _report(request, key)
    except QueryError as e:
        return HttpResponseBadRequest(f"Bad filter: {e}", content_type="text/plain")
    except QueryTimeout:
        return _too_slow()
    context = {
        "experiment": exp,
        "report": report,
        # 0.992 -> "99.2": widthratio in the template would round it to 99
        "target_percent": f"{report['experiment']['sla']['target'] * 100:.10g}",
        "filters": filters,
        "all_variants": [v.key for v in exp.variants.all()],
        # the answer first: per variant its verdict and intervals, drawn (charts "answer")
        "answer": summaries.answer(report),
        # answers against the control's: identical, where they part, KL, live shadows
        "fidelity": summaries.fidelity_summary(report),
        "charts": charts.page_sections(charts.all_figures(report)),
        "percentiles": summaries.percentile_summary(report),
        "variant_rows": list(tables.variants(report)),
        "comparison_rows": list(tables.comparisons(report)),
        "failure_rows": list(tables.failures(report)),
        "server_rows": list(tables.server(report)),
        "server_split_rows": list(tables.server_phases(report)),
        # the request-level anytime rows, then the user-clustered and adjusted ones beside them
        "anytime": summaries.anytime_summary(report),
        "units": summaries.unit_summary(report),
        "run_statuses": RUN_STATUSES,
        "run_modes": MODES,
        "sources": _sources(report["runs"]),
        "attribution_texts": {
            metric: {v: e["text"] for v, e in report["attribution"][metric].items()}
            for metric in ("attainment", "p99_ttft_ms")
        },
        "tables": tables.TABLES,
        "query_string": request.GET.urlencode(),
        "plotly_url": plotly_url(),
    }
    return render(request, "dashboards/experiment.html", context)


@_guard
def export_csv(request: HttpRequest, key: str, table: str) -> HttpResponse:
    if table not in tables.TABLES:
        return HttpResponseBadRequest(
            f"Unknown table {table!r}: one of {', '.join(tables.TABLES)}", content_type="text/plain"
        )
    try:
        _, _, report = _report(request, key)
    except QueryError as e:
        return HttpResponseBadRequest(f"Bad filter: {e}", content_type="text/plain")
    except QueryTimeout:
        return _too_slow()
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{key}-{table}.csv"'
    tables.write_csv(response, report, table)
    return response


# ---- plotly.js: served from the installed plotly package, once, cached for a year -----------


@functools.cache
def _plotly_js() -> tuple[str, bytes, bytes]:
    import plotly
    from plotly.offline import get_plotlyjs

    raw = get_plotlyjs().encode()
    return plotly.__version__, raw, gzip.compress(raw, compresslevel=6)


def plotly_url() -> str:
    from django.urls import reverse

    # the version is in the URL, so the file can be cached "forever" and changes with plotly
    return reverse("dashboards:plotly", kwargs={"version": _plotly_js()[0]})


@require_GET
def plotly_js(request: HttpRequest, version: str) -> HttpResponse:
    current, raw, gz = _plotly_js()
    if version != current:
        return HttpResponse(status=404)
    use_gzip = "gzip" in request.headers.get("Accept-Encoding", "")
    response = HttpResponse(gz if use_gzip else raw, content_type="text/javascript; charset=utf-8")
    if use_gzip:
        response["Content-Encoding"] = "gzip"
    response["Vary"] = "Accept-Encoding"
    response["Cache-Control"] = "public, max-age=31536000, immutable"
    return response


def figures_json(report) -> str:
    return json.dumps(charts.all_figures(report), allow_nan=False)
