"""The SLA report's keys built from what the reader returned, each by its own function (their
meaning: docs/report-json.md): SRM ("srm"), segments and the mix/rate decomposition
("segments", "mix_rate"), the variants' own metrics ("server"), which runs were read ("runs"),
the anytime intervals with the per-user sequences ("anytime"), a variant's ITL counts and
labelled percentiles; and what comes from the summary and the TTFT histogram without a pass of
its own (modes, the CDF, the rank test's input).

analysis.report.build_report calls them in order; none reads the store.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from analysis import server_metrics as servermod
from analysis.definitions import GAP_METRICS, INFLIGHT_EDGES, ITL_CI_NOTE, MW_SCALE, PROMPT_TOKEN_EDGES
from analysis.experiment_info import ExperimentInfo
from analysis.segments import attainment_by_segment, bucket_labels, mix_rate_decomposition
from stats.srm import sample_ratio_mismatch


def iso(unix_s: float) -> str:
    """Unix seconds as the report writes a time: ISO 8601 in UTC, ending in Z."""
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat().replace("+00:00", "Z")


def with_units(
    intervals: Mapping[str, dict[str, Any]], per_unit: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The anytime intervals per variant with the user-clustered and adjusted sequences beside
    the request-level ones (analysis.anytime.unit_sequences): the variant's "clustered", and
    "clustered" / "adjusted" in its vs_control (None where the request-level one is None)."""
    out: dict[str, Any] = {}
    for v, entry in intervals.items():
        units_v = per_unit.get(v, {})
        e = {**entry, "clustered": units_v.get("clustered")}
        if e["vs_control"] is not None:
            comp = units_v.get("vs_control") or {}
            e["vs_control"] = {
                **e["vs_control"],
                "clustered": comp.get("clustered"),
                "adjusted": comp.get("adjusted"),
            }
        out[v] = e
    return out


def labelled(metric: str, est: dict[str, Any]) -> dict[str, Any]:
    """A percentile estimate with what its CI assumes in its note, for the pooled gaps."""
    if metric in GAP_METRICS:
        est["note"] = f"{est['note']}; {ITL_CI_NOTE}" if est["note"] else ITL_CI_NOTE
    return est


def itl_counts(s: Mapping[str, Any]) -> dict[str, Any]:
    """The report's per-variant "itl" key (docs/report-json.md): how many gaps the pooled ITL
    holds, from how many successful requests, and how many successful requests had none (one
    token, or recorded before the samples kept gaps: "unrecorded")."""
    ok = s["n"] - s["errors"]
    with_gaps = int(s.get("itl_requests", 0))
    return {
        "gaps": int(s["metric_n"]["itl_ms"]),
        "requests": with_gaps,
        "requests_without_gaps": ok - with_gaps,
        "unrecorded": int(s.get("itl_unrecorded", 0)),
        "note": ITL_CI_NOTE,
    }


def server_entry(
    read: Mapping[str, Any] | None,
    by_key: Mapping[str, Mapping[str, Any]],
    present: Sequence[str],
    cells: Sequence[Mapping[str, Any]],
    phases: dict[str, Any],
    bucket_s: int,
) -> dict[str, Any]:
    """The report's "server" key (docs/report-json.md): each variant's own metrics beside its
    client TTFT; and, in place, each variant's miss phases split by the server's queue and
    prefill time (phases[v]["server_split"], an interval estimate: analysis.server_metrics)."""
    if read is None:
        return {"available": False, "note": "no sample store to read the server metrics from", "variants": {}}
    variants: dict[str, Any] = {}
    for v in present:
        client = {
            e["label"]: e["value"]
            for e in by_key[v]["percentiles"]["ttft_ms"]
            if e["label"] in ("p50", "p99")
        }
        variants[v] = servermod.variant_summary(read.get(v), client)
        if v in phases:
            phases[v]["server_split"] = servermod.server_split(
                phases[v],
                servermod.misses_by_bucket(cells, v),
                (read.get(v) or {}).get("by_bucket", {}),
                bucket_s,
            )
    return {
        "available": any(e["scrapes"]["ok"] for e in variants.values()),
        "note": (
            "From each variant's /metrics (vLLM's vllm:* series), scraped during the replays read "
            "(ABPLAT_SERVER_METRICS_INTERVAL_S): increases between scrapes, summed over the runs and "
            "the server's engines. They count every request the server finished meanwhile, this "
            "replay's and any other traffic's. Quantiles are interpolated inside vLLM's buckets "
            "(bucket_ms gives the bucket); means are exact."
        ),
        "variants": variants,
    }


def runs_entry(selection: Any, modes: Mapping[str, int]) -> dict[str, Any]:
    """The report's "runs" key (docs/report-json.md): the selection's, its mode completed from
    the samples read when the catalog did not say (one run without a catalog row)."""
    if selection is None:  # a caller-chosen reader or run list: no catalog selection
        return {
            "read": [],
            "not_read": [],
            "statuses": [],
            "mode": None,
            "mode_source": "caller",
            "available_modes": {},
            "notes": [],
        }
    info = dict(selection.info)
    if info["mode"] is None and len(modes) == 1:
        info["mode"] = next(iter(modes))
        for r in info["read"]:
            r["mode"] = r["mode"] or info["mode"]
    return info


def srm_parts(
    exp: ExperimentInfo, user_counts: Sequence[Mapping[str, Any]], present: Sequence[str]
) -> list[tuple[str, dict[str, int], dict[str, float]]]:
    """(config revision, distinct users per variant, that revision's weights) per revision."""
    by_rev: dict[int, dict[str, int]] = {}
    for c in user_counts:
        if c["variant"] in present:
            counts = by_rev.setdefault(int(c["rev"]), {})
            counts[c["variant"]] = counts.get(c["variant"], 0) + int(c["n"])
    parts = []
    for rev, counts in sorted(by_rev.items()):
        weights = exp.weights_by_revision.get(rev, exp.weights)
        # only the variants being read: a variant filter must not look like missing traffic
        parts.append((str(rev), counts, {k: float(w) for k, w in weights.items() if k in present}))
    return parts


def srm_entry(
    exp: ExperimentInfo,
    parts: Sequence[tuple[str, dict[str, int], dict[str, float]]],
    modes: Mapping[str, int],
) -> dict[str, Any]:
    def not_applicable(note: str) -> dict[str, Any]:
        return {
            "applicable": False,
            "flagged": False,
            "message": "",
            "note": note,
            "weights_source": exp.weights_source,
        }

    if modes.get("mirror") and not (modes.get("split") or modes.get("live")):
        return not_applicable("mirror mode: every request goes to every variant")
    if not parts:
        if modes.get("live"):
            return not_applicable("no live request was assigned by the router (no user, or no weights)")
        return not_applicable("no samples")
    try:
        res = sample_ratio_mismatch(parts)
    except ValueError as e:
        return not_applicable(str(e))
    return {"applicable": True, "note": "", **res.as_dict(), "weights_source": exp.weights_source}


SEGMENT_DIMS = {
    "prompt_tokens": ("pb", bucket_labels(PROMPT_TOKEN_EDGES)),
    "in_flight": ("ib", bucket_labels(INFLIGHT_EDGES)),
}


def segments_entry(cells: Sequence[Mapping[str, Any]], present: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dims: dict[str, tuple[str, list[str] | None]] = {**SEGMENT_DIMS, "time": ("tb", None)}
    for dim, (col, labels) in dims.items():
        counts: dict[str, dict[Any, list[int]]] = {v: {} for v in present}
        for c in cells:
            if c["variant"] not in counts:
                continue
            cell = counts[c["variant"]].setdefault(c[col], [0, 0])
            cell[0] += int(c["n"])
            cell[1] += int(c["hits"])
        if labels is None:
            keys = sorted({k for per in counts.values() for k in per})
            labels = [iso(k) for k in keys]
        else:
            keys = list(range(len(labels)))
        out[dim] = {
            "labels": labels,
            "variants": {
                v: attainment_by_segment(
                    {lab: tuple(counts[v].get(k, (0, 0))) for k, lab in zip(keys, labels, strict=True)}
                )
                for v in present
            },
        }
    return out


def mix_rate_entry(segments: Mapping[str, Any], control: str, present: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if control not in present:
        return out
    for v in present:
        if v == control:
            continue
        out[v] = {}
        for dim in SEGMENT_DIMS:
            segs = segments[dim]["variants"]
            a = {s: (c["n"], c["hits"]) for s, c in segs[control].items()}
            b = {s: (c["n"], c["hits"]) for s, c in segs[v].items()}
            try:
                out[v][dim] = mix_rate_decomposition(a, b)
            except ValueError as e:
                out[v][dim] = {"note": str(e)}
    return out


# ---------------------------------------------------------------------------------------------
# From the summary and the TTFT histogram, no pass of their own

CDF_LEVELS: tuple[float, ...] = tuple(i / 400 for i in range(1, 400)) + (0.9975, 0.999)


def mode_counts(summ: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """{mode: rows} over the summary's variants."""
    out: dict[str, int] = {}
    for s in summ.values():
        for m, c in s["modes"].items():
            if c:
                out[m] = out.get(m, 0) + c
    return out


def cdf_points(
    hist: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]],
    levels: Sequence[float] = CDF_LEVELS,
) -> dict[str, dict[str, list[float]]]:
    """{variant: {"ttft_ms": [x], "share": [y]}}: exact points of the empirical CDF of TTFT.

    x is the largest TTFT of a 0.1 ms bucket (a sample value), y the exact share of requests
    with TTFT <= x; one point per level (the first bucket whose share reaches it), so ~400
    points evenly spaced in probability, from the histogram, without another pass.
    """
    out: dict[str, dict[str, list[float]]] = {}
    for variant, (_keys, counts, tops) in hist.items():
        cum = np.cumsum(np.asarray(counts, dtype=np.int64))
        if not cum.size:
            continue
        n = int(cum[-1])
        # the first bucket with cum >= level * n, counted in integers (no float share compare)
        need = np.ceil(np.asarray(levels) * n - 1e-9).astype(np.int64)
        idx = np.unique(np.searchsorted(cum, np.maximum(need, 1), side="left"))
        out[variant] = {
            "ttft_ms": [float(tops[i]) for i in idx],
            "share": [int(cum[i]) / n for i in idx],
        }
    return out


def values_from_histogram(
    hist: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]],
) -> dict[str, tuple[list[float], list[int]]]:
    """{variant: (TTFT values at 0.1 ms, counts)}, the rank test's input, from TTFT's histogram."""
    # k / 10 in IEEE double is what floor(x * 10 + 0.5) / 10 gives in SQL
    return {v: ([k / MW_SCALE for k in h[0]], list(h[1])) for v, h in hist.items()}
