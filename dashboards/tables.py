"""The report's tables as rows: the CSV export (``write_csv``, one file per table of ``TABLES``),
and the rows the page and the sla_report command show as they are.

Every table has fixed columns (COLUMNS): a CSV always starts with its header row, even when the
report has no row for it (an arm without samples, SRM not applicable). The report formatted as
text for reading (intervals, the first screen, the per-user and anytime summaries) is
dashboards.summaries."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from typing import IO, Any

TABLES = (
    "variants",
    "percentiles",
    "comparisons",
    "segments",
    "phases",
    "attribution",
    "srm",
    "failures",
    "server",
    "server_phases",
    "anytime",
    "clustered",
)
COLUMNS: dict[str, tuple[str, ...]] = {
    "variants": (
        "variant",
        "control",
        "n",
        "errors",
        "error_rate",
        "hits",
        "attainment",
        "attainment_lo",
        "attainment_hi",
        "goodput_rps",
        "verdict",
        "n_needed",
    ),
    "percentiles": (
        "variant",
        "metric",
        "quantile",
        "n",
        "value_ms",
        "ci_lo_ms",
        "ci_hi_ms",
        "coverage",
        "note",
    ),
    "comparisons": (
        "variant",
        "attainment_diff",
        "attainment_diff_lo",
        "attainment_diff_hi",
        "attainment_p",
        "attainment_p_holm",
        "p99_ttft_diff_ms",
        "p99_ttft_diff_lo_ms",
        "p99_ttft_diff_hi_ms",
        "mann_whitney_p",
        "mann_whitney_p_holm",
        "prob_variant_slower",
        "paired_attainment_diff",
        "paired_p",
    ),
    "segments": ("dimension", "segment", "variant", "n", "hits", "attainment", "lo", "hi"),
    "phases": ("variant", "missed_requests", "phase", "mean_ms", "share_of_total"),
    "attribution": ("metric", "variant", "method", "factor", "contribution", "share", "total"),
    "srm": ("revision", "variant", "observed", "expected", "chi2", "p_value", "flagged"),
    "failures": ("variant", "outcome", "n", "http_status", "example"),
    # the variants' own metrics (report "server"): server quantiles are interpolated in vLLM's buckets
    "server": (
        "variant",
        "scrapes_ok",
        "scrapes_failed",
        "requests_finished",
        "client_ttft_p50_ms",
        "client_ttft_p99_ms",
        "server_ttft_mean_ms",
        "server_ttft_p50_ms",
        "server_ttft_p99_ms",
        "queue_mean_ms",
        "queue_p50_ms",
        "queue_p99_ms",
        "prefill_mean_ms",
        "prefill_p50_ms",
        "prefill_p99_ms",
        "running_mean",
        "waiting_mean",
        "kv_cache_usage_max",
        "last_error",
    ),
    # the miss phases split by the server's queue and prefill (an interval estimate: basis)
    "server_phases": ("variant", "basis", "misses", "covered_misses", "phase", "mean_ms"),
    # the anytime-valid intervals (report "anytime"): the ones that may be read mid-run
    # with the user-clustered and adjusted sequences beside the request-level ones: inference says
    # which ("requests", "user-clustered"), quantity "..._adjusted" the adjusted differences; note
    # says why a sequence has no bounds yet (the columns after alpha came later: appended)
    "anytime": (
        "variant",
        "quantity",
        "estimate",
        "lo",
        "hi",
        "alpha",
        "inference",
        "adjusted_on",
        "variance_reduction",
        "note",
    ),
    # per user, the unit of randomization, and adjusted on pre-request covariates (report
    # variants[].clustered, vs_control.clustered / .adjusted): unadjusted and adjusted rows side by side
    "clustered": (
        "variant",
        "quantity",
        "inference",
        "adjusted_on",
        "estimate",
        "lo",
        "hi",
        "se",
        "se_iid",
        "design_effect",
        "p_value",
        "p_holm",
        "variance_reduction",
    ),
}
UNIT_MEANS = (
    ("attainment", "attainment", ".4f"),
    ("error_rate", "error rate", ".4f"),
    ("mean_ttft_ms", "mean TTFT ms", ".1f"),
)
UNIT_DIFFERENCES = (
    ("attainment_difference", "attainment", "+.4f"),
    ("error_rate_difference", "error rate", "+.4f"),
    ("mean_ttft_difference", "mean TTFT ms", "+.1f"),
)
ANYTIME_QUANTITIES = ("attainment", "error_rate", "p99_ttft_ms")
ANYTIME_DIFFERENCES = ("attainment_difference", "error_rate_difference", "p99_ttft_difference")
# The inference of the anytime sequences that treat requests as independent draws (the report's
# own label for them, analysis.units.INFERENCE_REQUEST).
INFERENCE_REQUESTS = "requests"


def _round6(x: float | None) -> float | None:
    """x rounded to 6 decimals (a share in the CSV: 0.987654); None stays None."""
    return None if x is None else round(x, 6)


def variants(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for e in report["variants"]:
        a = e["attainment"] or {}
        yield {
            "variant": e["key"],
            "control": e["control"],
            "n": e["n"],
            "errors": e["errors"],
            "error_rate": _round6(e["error_rate"]),
            "hits": e["hits"],
            "attainment": _round6(a.get("estimate")),
            "attainment_lo": _round6(a.get("lo")),
            "attainment_hi": _round6(a.get("hi")),
            "goodput_rps": e["goodput_rps"],
            "verdict": e["verdict"]["verdict"],
            "n_needed": e["verdict"]["n_needed"],
        }


def percentiles(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for e in report["variants"]:
        for metric, ests in e["percentiles"].items():
            for est in ests:
                yield {
                    "variant": e["key"],
                    "metric": metric,
                    "quantile": est["label"],
                    "n": est["n"],
                    "value_ms": est["value"],
                    "ci_lo_ms": est["lo"],
                    "ci_hi_ms": est["hi"],
                    "coverage": est["coverage"],
                    "note": est["note"],
                }


def comparisons(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for e in report["variants"]:
        vs = e["vs_control"]
        if not vs:
            continue
        d, p99, mw = vs["attainment_difference"], vs["p99_ttft_difference"], vs["mann_whitney_ttft"]
        paired = (vs.get("paired") or {}).get("attainment") or {}
        yield {
            "variant": e["key"],
            "attainment_diff": d["estimate"],
            "attainment_diff_lo": d["lo"],
            "attainment_diff_hi": d["hi"],
            "attainment_p": d["p_value"],
            "attainment_p_holm": vs["attainment_p_holm"],
            "p99_ttft_diff_ms": p99["estimate"] if p99 else None,
            "p99_ttft_diff_lo_ms": p99["lo"] if p99 else None,
            "p99_ttft_diff_hi_ms": p99["hi"] if p99 else None,
            "mann_whitney_p": mw["p_value"] if mw else None,
            "mann_whitney_p_holm": mw.get("p_holm") if mw else None,
            "prob_variant_slower": mw["prob_variant_greater"] if mw else None,
            "paired_attainment_diff": (paired.get("difference") or {}).get("estimate"),
            "paired_p": (paired.get("difference") or {}).get("p_value"),
        }


def segments(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for dim, seg in report["segments"].items():
        for v, cells in seg["variants"].items():
            for label in seg["labels"]:
                c = cells[label]
                yield {
                    "dimension": dim,
                    "segment": label,
                    "variant": v,
                    "n": c["n"],
                    "hits": c["hits"],
                    "attainment": c["attainment"],
                    "lo": c["lo"],
                    "hi": c["hi"],
                }


def phases(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for v, p in report["phases"].items():
        for phase, d in p.get("phases", {}).items():
            yield {
                "variant": v,
                "missed_requests": p["n"],
                "phase": phase,
                "mean_ms": d["mean_ms"],
                "share_of_total": d["share_of_total"],
            }


def attribution(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for metric in ("attainment", "p99_ttft_ms"):
        for v, entry in report["attribution"].get(metric, {}).items():
            parts = {**entry["contributions"], "residual": entry["residual"]}
            for factor, value in parts.items():
                yield {
                    "metric": metric,
                    "variant": v,
                    "method": entry["method"],
                    "factor": factor,
                    "contribution": value,
                    "share": (value / entry["total"]) if entry["total"] else None,
                    "total": entry["total"],
                }


def srm(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    s = report["srm"]
    if not s.get("applicable"):
        return
    for part in [*s["revisions"], s["combined"]]:
        for v, obs in part["observed"].items():
            yield {
                "revision": part["revision"],
                "variant": v,
                "observed": obs,
                "expected": round(part["expected"][v], 3),
                "chi2": part["chi2"],
                "p_value": part["p_value"],
                "flagged": part["flagged"],
            }


def failures(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for e in report["variants"]:
        for outcome, f in sorted(e.get("failures", {}).items()):
            yield {
                "variant": e["key"],
                "outcome": outcome,
                "n": f["n"],
                "http_status": f["http_status"],
                "example": f["example"],
            }


def _q(summary: Mapping[str, Any], label: str) -> float | None:
    return next((q["value_ms"] for q in summary.get("quantiles", []) if q["label"] == label), None)


def server(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for v, e in report.get("server", {}).get("variants", {}).items():
        yield {
            "variant": v,
            "scrapes_ok": e["scrapes"]["ok"],
            "scrapes_failed": e["scrapes"]["failed"],
            "requests_finished": e["requests_finished"],
            "client_ttft_p50_ms": e["client_ttft_ms"].get("p50"),
            "client_ttft_p99_ms": e["client_ttft_ms"].get("p99"),
            "server_ttft_mean_ms": e["ttft_ms"]["mean_ms"],
            "server_ttft_p50_ms": _q(e["ttft_ms"], "p50"),
            "server_ttft_p99_ms": _q(e["ttft_ms"], "p99"),
            "queue_mean_ms": e["queue_ms"]["mean_ms"],
            "queue_p50_ms": _q(e["queue_ms"], "p50"),
            "queue_p99_ms": _q(e["queue_ms"], "p99"),
            "prefill_mean_ms": e["prefill_ms"]["mean_ms"],
            "prefill_p50_ms": _q(e["prefill_ms"], "p50"),
            "prefill_p99_ms": _q(e["prefill_ms"], "p99"),
            "running_mean": e["running"]["mean"],
            "waiting_mean": e["waiting"]["mean"],
            "kv_cache_usage_max": e["kv_cache_usage"]["max"],
            "last_error": e["scrapes"]["last_error"] or "",
        }


def server_phases(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for v, p in report["phases"].items():
        split = p.get("server_split") or {}
        for phase, d in split.get("phases", {}).items():
            yield {
                "variant": v,
                "basis": split["basis"],
                "misses": split["misses"],
                "covered_misses": split["covered_misses"],
                "phase": phase,
                "mean_ms": d["mean_ms"],
            }


def anytime(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    """One row per variant and quantity: its request-level sequences, their differences to the
    control, then its user-clustered sequences, their differences and the adjusted differences
    (quantity "..._difference_adjusted", with its covariates). A None bound of a request-level
    sequence is infinite (too few samples for that side yet); of a clustered or adjusted one, no
    bounds yet (note says why)."""
    for v, e in report.get("anytime", {}).get("variants", {}).items():
        vs = e["vs_control"] or {}
        found = [(name, INFERENCE_REQUESTS, e[name]) for name in ANYTIME_QUANTITIES]
        found += [(name, INFERENCE_REQUESTS, vs.get(name)) for name in ANYTIME_DIFFERENCES]
        per = e.get("clustered") or {}
        found += [(name, per.get("inference"), per.get(name)) for name, _label, _fmt in UNIT_MEANS]
        for part, suffix in (("clustered", ""), ("adjusted", "_adjusted")):
            found += [
                (name + suffix, None, (vs.get(part) or {}).get(name)) for name, _l, _f in UNIT_DIFFERENCES
            ]
        for name, inference, iv in found:
            if iv is None:
                continue
            share = not (name.startswith("p99") or name.startswith("mean_ttft"))
            adjusted = iv.get("adjusted") or {}
            yield {
                "variant": v,
                "quantity": name,
                "estimate": _round6(iv["estimate"]) if share else iv["estimate"],
                "lo": _round6(iv["lo"]) if share else iv["lo"],
                "hi": _round6(iv["hi"]) if share else iv["hi"],
                "alpha": iv["alpha"],
                "inference": iv.get("inference") or inference,
                "adjusted_on": " ".join(adjusted.get("covariates", [])),
                "variance_reduction": adjusted.get("variance_reduction"),
                "note": iv.get("note") or "",
            }


def clustered(report: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    """Per variant its per-user means, then per comparison the clustered difference (quantity
    "..._difference") and the adjusted one ("..._difference_adjusted") with its covariates and
    variance reduction; nothing when the experiment turned the analysis off."""
    for e in report["variants"]:
        per = e.get("clustered") or {}
        for name, _label, _fmt in UNIT_MEANS:
            est = per.get(name)
            if est:
                yield _unit_row(e["key"], name, per["inference"], est)
        vs = e.get("vs_control") or {}
        for part, suffix in (("clustered", ""), ("adjusted", "_adjusted")):
            for name, _label, _fmt in UNIT_DIFFERENCES:
                est = (vs.get(part) or {}).get(name)
                if est:
                    yield _unit_row(e["key"], name + suffix, est["inference"], est)


def _unit_row(variant: str, quantity: str, inference: str, est: Mapping[str, Any]) -> dict[str, Any]:
    adjusted = est.get("adjusted") or {}
    return {
        "variant": variant,
        "quantity": quantity,
        "inference": inference,
        "adjusted_on": " ".join(adjusted.get("covariates", [])),
        "estimate": est["estimate"],
        "lo": est["lo"],
        "hi": est["hi"],
        "se": est["se"],
        "se_iid": est["se_iid"],
        "design_effect": est.get("design_effect"),
        "p_value": est.get("p_value"),
        "p_holm": est.get("p_holm"),
        "variance_reduction": adjusted.get("variance_reduction"),
    }


def rows(report: Mapping[str, Any], table: str) -> list[dict[str, Any]]:
    if table not in TABLES:
        raise KeyError(f"unknown table {table!r}; one of {', '.join(TABLES)}")
    return list(globals()[table](report))


def write_csv(out: IO[str], report: Mapping[str, Any], table: str) -> int:
    """One table as CSV into out: the header row always, then its rows; returns the row count."""
    found = rows(report, table)
    writer = csv.DictWriter(out, fieldnames=COLUMNS[table])
    writer.writeheader()
    writer.writerows(found)
    return len(found)
