"""The SLA report: what a SampleReader (analysis.readers) returns, assembled with the statistics
(stats), the factor attribution, phases and segments.

``build_report`` is free of Django: it takes an ExperimentInfo and a store (or a reader), so tests
and benches can call it directly. The Django glue (models, audit log, the report cache) is
dashboards.reports. The returned dict is the stable JSON shape documented in
docs/report-json.md; ``SCHEMA_VERSION`` changes whenever a key is removed or changes meaning
(adding keys does not).

Dedup contract: the queries read the samples table without FINAL, so the numbers are exact when
the rows read hold one recording per request. Writes guarantee that for completed runs (shards
skip stored request ids, the spool flush filters stored keys, and the replay's finish step calls
SampleStore.deduplicate(run_id) when count() != uniqExact(variant, request_id)). A run still in
progress may transiently count a duplicate after an insert retry, until that finish step.

Speed: two stages of independent queries run concurrently (one connection per thread):
summary, phase sums and the histograms first; then the exact order statistics, segments, the
p99 series, SRM users and mirror pairs, which need the counts or the window.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from analysis import factors, units
from analysis import server_metrics as servermod
from analysis.anytime import NOTE as ANYTIME_NOTE
from analysis.anytime import anytime_intervals, anytime_srm, p99_ranks, unit_sequences
from analysis.definitions import (
    GAP_METRICS,
    INFLIGHT_EDGES,
    ITL_CI_NOTE,
    METRICS,
    MW_SCALE,
    PROMPT_TOKEN_EDGES,
    Filters,
    QueryError,
    Slo,
)
from analysis.phases import phase_breakdown_from_sums
from analysis.readers.base import SampleReader, run_queries
from analysis.readers.merged import reader_for
from analysis.readers.raw import RawReader
from analysis.runs import select_runs
from analysis.segments import (
    attainment_by_segment,
    bucket_labels,
    choose_bucket_s,
    mix_rate_decomposition,
)
from stats._common import DEFAULT_CONF
from stats.comparisons import (
    ArmCounts,
    compare_attainment,
    holm_adjust,
    mann_whitney_from_counts,
    quantile_difference_conf,
    quantile_difference_from_order_stats,
)
from stats.paired import mcnemar_attainment, wilcoxon_paired
from stats.proportions import sla_attainment
from stats.quantiles import REPORT_QUANTILES, quantile_from_order_stats, ranks_to_fetch
from stats.srm import sample_ratio_mismatch
from stats.verdict import sla_verdict

SCHEMA_VERSION = 2  # 2: percentiles.itl_ms over every inter-token gap, not the per-request mean
P99 = 0.99
ALPHA = round(1.0 - DEFAULT_CONF, 12)  # the anytime-valid sequences' error rate, as the fixed-horizon CIs'


@dataclasses.dataclass(frozen=True)
class VariantInfo:
    key: str
    control: bool
    weight: float
    factors: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class ExperimentInfo:
    key: str
    name: str
    slo: Slo
    target: float
    variants: Sequence[VariantInfo]
    # config revision -> {variant: weight} in force; revisions missing here use `weights`
    weights_by_revision: Mapping[int, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    weights_source: str = "current variant weights (no weights history recorded)"
    weight_changes: Sequence[Mapping[str, Any]] = ()  # [{"at": iso, "label": str}]
    # the experiment document's analysis block: users as the independent unit, and regression
    # adjustment on pre-request covariates (analysis.units); off: request-level statistics only
    cluster_by_user: bool = True
    adjust: bool = True

    @property
    def unit(self) -> str:
        return "user" if self.cluster_by_user else "request"

    @property
    def control(self) -> str:
        keys = [v.key for v in self.variants if v.control]
        if len(keys) != 1:
            raise ValueError(f"experiment {self.key!r} needs exactly one control, has {keys}")
        return keys[0]

    @property
    def weights(self) -> dict[str, float]:
        return {v.key: float(v.weight) for v in self.variants}


def _iso(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat().replace("+00:00", "Z")


def _unix_s(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _inside(t: float, lo: float, hi: float, closed: bool) -> bool:
    """lo <= t < hi (until is exclusive), or lo <= t <= hi for the samples' own first..last."""
    return lo <= t <= hi if closed else lo <= t < hi


def _ranks_for(metric: str, n: int) -> list[int]:
    ranks = set(ranks_to_fetch(n))
    if metric == "ttft_ms":
        # the p99 difference needs per-arm CIs at 1 - alpha/2 (Bonferroni)
        ranks.update(ranks_to_fetch(n, (P99,), quantile_difference_conf()))
        ranks.update(p99_ranks(n, ALPHA))  # the anytime-valid p99 sequences (analysis.anytime)
    return sorted(ranks)


def build_report(
    store: Any,
    exp: ExperimentInfo,
    filters: Filters,
    use_rollup: bool = True,
    version: Sequence[tuple[int, int, int, int]] | None = None,
    reader: SampleReader | None = None,
    catalog: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The report (docs/report-json.md), from ``reader`` or, without one, from the reader
    merged.reader_for picks over ``store``: finished runs from their rollups, runs without a
    current one (still replaying, changed since) from the raw samples beside them, everything raw
    under a time window or a changed SLO. use_rollup=False reads the raw samples even where
    finished runs have rollups (the same numbers, slower; for checking the rollups).
    version: RawReader.data_version, when the caller has read it (saves a scan); catalog:
    store.runs(experiment), likewise. Which runs are read follows analysis.runs (completed runs
    by default, one mode); the report's "runs" key says which were read and which were not."""
    t0 = time.perf_counter()
    control = exp.control
    known = {v.key: v for v in exp.variants}
    unknown = sorted(set(filters.variants) - set(known))
    if unknown:
        raise QueryError(f"variant filter: {unknown} not in experiment {exp.key!r}")
    if filters.variants and control not in filters.variants:
        # every comparison is against the control, so it is always read
        filters = dataclasses.replace(filters, variants=(control, *filters.variants))
    order = [v.key for v in exp.variants if not filters.variants or v.key in filters.variants]
    selection = None
    if filters.runs is None and store is not None:
        # which runs: the run catalog under the status and mode filters (analysis.runs)
        if version is None:
            version = RawReader(store).data_version(filters.experiment)
        selection = select_runs(
            filters,
            version,
            store.runs(filters.experiment) if catalog is None else catalog,
            lambda: RawReader(store).run_modes(filters.experiment),
        )
        if selection.runs is not None:
            filters = dataclasses.replace(filters, runs=selection.runs)
    if reader is None:
        reader = reader_for(store, filters, exp.slo, version, use_rollup)
    par = reader.parallel_queries

    # 1. counts, hits, phase sums, the histograms, the per-user moments (independent: run together)
    first_jobs: dict[str, Callable[[], Any]] = {
        "summary": lambda: reader.summary(filters, exp.slo),
        "hists": lambda: reader.histograms(filters),
    }
    if exp.cluster_by_user or exp.adjust:
        first_jobs["units"] = lambda: reader.unit_moments(filters, exp.slo, exp.unit)
    got = run_queries(par, first_jobs)
    summ, hists, unit_moments = got["summary"], got["hists"], got.get("units")
    hist = hists["ttft_ms"]
    stray = sorted(set(summ) - set(known))
    present = [k for k in order if k in summ]
    first = min((s["first_ms"] for s in summ.values()), default=None)
    last = max((s["last_ms"] for s in summ.values()), default=None)
    if filters.since and filters.until:
        window_s: float | None = (filters.until - filters.since).total_seconds()
    elif first is not None and last is not None and last > first:
        window_s = (last - first) / 1000.0
    else:
        window_s = None
    bucket_s = choose_bucket_s(window_s or 60.0)
    modes = mode_counts(summ)

    # 2. exact order statistics (a query per metric, through its histogram when the reader has
    # one), segments, the p99 series, SRM users and mirror pairs: independent, run together
    jobs: dict[str, Callable[[], Any]] = {}
    for m in METRICS:
        ranks = {v: _ranks_for(m, n) for v in present if (n := summ[v]["metric_n"][m]) > 0}
        if ranks:
            counts_m = {v: summ[v]["metric_n"][m] for v in ranks}
            jobs[f"os_{m}"] = lambda m=m, ranks=ranks, counts_m=counts_m: reader.order_statistics(
                filters, m, ranks, counts_m, hists.get(m)
            )
    jobs["cells"] = lambda: reader.segment_cells(filters, exp.slo, bucket_s)
    jobs["series"] = lambda: reader.p99_over_time(filters, bucket_s)
    jobs["srm_users"] = lambda: reader.srm_users(filters)
    jobs["failures"] = lambda: reader.failures(filters)
    if store is not None:  # the variants' own series, scraped during the replays read
        jobs["server"] = lambda: servermod.read(store, filters, present, bucket_s)
    mirror_with = [v for v in present if v != control] if modes.get("mirror") else []
    if control in present:
        for v in mirror_with:
            jobs[f"pairs_{v}"] = lambda v=v: reader.mirror_pairs(filters, exp.slo, control, v)
    got = run_queries(par, jobs)
    order_stats: dict[tuple[str, str], dict[int, float]] = {}
    for name, value in got.items():
        if name.startswith("os_"):
            order_stats.update({(v, name[len("os_") :]): by_rank for v, by_rank in value.items()})
    cdf = cdf_points(hist)
    pairs = {k[len("pairs_") :]: p for k, p in got.items() if k.startswith("pairs_")}
    cells, series = got["cells"], got["series"]

    def estimate(v: str, m: str, quant: float, conf: float = DEFAULT_CONF) -> Any:
        n = summ[v]["metric_n"][m] if v in summ else 0
        return quantile_from_order_stats(n, quant, order_stats.get((v, m), {}), conf)

    variants: list[dict[str, Any]] = []
    for v in order:
        s = summ.get(v, {"n": 0, "errors": 0, "hits": 0, "metric_n": dict.fromkeys(METRICS, 0)})
        entry: dict[str, Any] = {
            "key": v,
            "control": v == control,
            "factors": dict(known[v].factors),
            "weight": known[v].weight,
            "n": s["n"],
            "errors": s["errors"],
            "hits": s["hits"],
            "error_rate": None,
            "attainment": None,
            "goodput_rps": None,
            "verdict": sla_verdict(s["hits"], s["n"], exp.target).as_dict(),
            "percentiles": {},
            "vs_control": None,
            # the same per user, the unit of randomization (analysis.units); None when off
            "clustered": None,
            # what broke: error classes of the failed requests (streaming.result.Outcome values)
            "failures": got["failures"].get(v, {}),
        }
        if s["n"]:
            a = sla_attainment(s["n"], s["hits"], s["errors"], window_s)
            entry.update(
                error_rate=a.error_rate,
                attainment=a.attainment.as_dict(),
                goodput_rps=a.goodput_rps,
            )
        entry["percentiles"] = {
            m: [_labelled(m, estimate(v, m, quant).as_dict()) for quant in REPORT_QUANTILES] for m in METRICS
        }
        entry["itl"] = itl_counts(s)
        variants.append(entry)
    by_key = {e["key"]: e for e in variants}

    # 3. every variant against the control (Holm across variants)
    counts = values_from_histogram(hist)
    comparisons = _compare(exp, summ, present, estimate, counts, pairs)
    inference, clustered, per_unit = units.statistics(
        unit_moments, order, control, modes, exp.cluster_by_user, exp.adjust
    )
    for v, comp in comparisons.items():
        comp.update(per_unit.get(v, {}))
        by_key[v]["vs_control"] = comp
    for v, entry in clustered.items():
        by_key[v]["clustered"] = entry

    # 4. segments from the cells; SRM on distinct users, the unit of assignment
    srm_parts = _srm_parts(exp, got["srm_users"], present)
    srm = _srm(exp, srm_parts, modes)
    ttft_os = {v: order_stats.get((v, "ttft_ms"), {}) for v in present}
    anytime_units, per_unit_seq = unit_sequences(
        unit_moments, order, control, modes, exp.cluster_by_user, exp.adjust, ALPHA
    )
    anytime = {
        "alpha": ALPHA,
        "note": ANYTIME_NOTE,
        "units": anytime_units,
        "variants": _with_units(anytime_intervals(summ, order, control, ttft_os, ALPHA), per_unit_seq),
        "srm": anytime_srm(srm_parts, ALPHA) if srm.get("applicable") else {"applicable": False},
    }
    segments = _segments(cells, present)
    mix_rate = _mix_rate(segments, control, present)

    # 5. why: factors, phases
    attribution_out = _attribution(exp, by_key, present)
    phases: dict[str, Any] = {}
    for v in present:
        try:
            phases[v] = phase_breakdown_from_sums(summ[v]["phase_sums"], summ[v]["phase_n"])
        except ValueError as e:
            phases[v] = {"n": summ[v]["phase_n"], "dropped": 0, "phases": {}, "note": str(e)}
    server = _server(got.get("server"), by_key, present, cells, phases, bucket_s)

    # 6. over time, and the CDF
    rev_first: dict[int, float] = {}
    for c in cells:
        rev_first[int(c["rev"])] = min(rev_first.get(int(c["rev"]), math.inf), float(c["first_ms"]))
    markers = [
        {"at": _iso(ms / 1000.0), "kind": "config_revision", "label": f"config revision {rev}"}
        for rev, ms in sorted(rev_first.items(), key=lambda kv: kv[1])
    ][1:]  # the first revision is the start, not a change
    # audit events inside the window only (the filtered one, else the samples' first..last)
    lo_s = filters.since.timestamp() if filters.since else (first / 1000.0 if first is not None else None)
    hi_s = filters.until.timestamp() if filters.until else (last / 1000.0 if last is not None else None)
    markers += [
        {"kind": "audit", **dict(m)}
        for m in exp.weight_changes
        if lo_s is not None
        and hi_s is not None
        and _inside(_unix_s(m["at"]), lo_s, hi_s, filters.until is None)
    ]

    banners = [srm["message"]] if srm.get("flagged") else []
    runs_info = _runs_info(selection, modes)
    banners += selection.banners if selection else []
    if stray:
        banners.append(f"samples for variants not in the experiment were ignored: {stray}")
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"),
        "experiment": {
            "key": exp.key,
            "name": exp.name,
            "control": control,
            "sla": {**exp.slo.limits(), "target": exp.target, "comparison": "<"},
        },
        "filters": filters.as_dict(),
        "window": {
            "first": _iso(first / 1000.0) if first is not None else None,
            "last": _iso(last / 1000.0) if last is not None else None,
            "seconds": window_s,
        },
        "modes": modes,
        "runs": runs_info,
        "banners": banners,
        "srm": srm,
        "inference": inference,
        "variants": variants,
        "anytime": anytime,
        "attribution": attribution_out,
        "phases": phases,
        "server": server,
        "segments": segments,
        "mix_rate": mix_rate,
        "timeseries": {
            "bucket_s": bucket_s,
            "note": "p99 per bucket at rank floor(0.99n)+1 (quantileExact(0.99)): chart only"
            + reader.p99_note,
            "p99_ttft_ms": {
                v: [{"t": _iso(tb), "n": n, "p99": p} for tb, n, p in series.get(v, [])] for v in present
            },
            "markers": markers,
        },
        "cdf": {v: cdf[v] for v in present if v in cdf},
        "timing": {
            "query_s": time.perf_counter() - t0,
            "source": reader.source,
        },
    }


def _with_units(
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


def _labelled(metric: str, est: dict[str, Any]) -> dict[str, Any]:
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


def _server(
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


def _runs_info(selection: Any, modes: Mapping[str, int]) -> dict[str, Any]:
    """The report's "runs" key (docs/report-json.md): the selection's, its mode completed from
    the samples read when the catalog did not say (one run without a catalog row)."""
    if selection is None:  # a caller-chosen reader or run list: no catalog selection
        return {"read": [], "not_read": [], "statuses": [], "mode": None, "mode_source": "caller",
                "available_modes": {}, "notes": []}  # fmt: skip
    info = dict(selection.info)
    if info["mode"] is None and len(modes) == 1:
        info["mode"] = next(iter(modes))
        for r in info["read"]:
            r["mode"] = r["mode"] or info["mode"]
    return info


def _compare(
    exp: ExperimentInfo,
    summ: Mapping[str, Mapping[str, Any]],
    present: Sequence[str],
    estimate: Any,
    counts: Mapping[str, tuple[list[float], list[int]]],
    pairs_by_variant: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, Any]]:
    control = exp.control
    others = [v for v in present if v != control]
    if control not in present or summ[control]["n"] == 0 or not others:
        return {}
    arms = {v: ArmCounts(summ[v]["n"], summ[v]["hits"]) for v in others if summ[v]["n"]}
    att = compare_attainment(ArmCounts(summ[control]["n"], summ[control]["hits"]), arms)
    arm_conf = quantile_difference_conf()
    out: dict[str, dict[str, Any]] = {}
    for v in arms:
        comp: dict[str, Any] = {
            "attainment_difference": att[v]["difference"],
            "attainment_p_holm": att[v]["p_holm"],
            "p99_ttft_difference": None,
            "mann_whitney_ttft": None,
            "paired": None,
            # per user and covariate-adjusted (analysis.units); None when off or in mirror mode
            "clustered": None,
            "adjusted": None,
        }
        if summ[v]["metric_n"]["ttft_ms"] and summ[control]["metric_n"]["ttft_ms"]:
            diff = quantile_difference_from_order_stats(
                estimate(control, "ttft_ms", P99, arm_conf), estimate(v, "ttft_ms", P99, arm_conf)
            )
            comp["p99_ttft_difference"] = diff.as_dict()
        if v in counts and control in counts:
            cv, cc = dict(zip(*counts[control], strict=True)), dict(zip(*counts[v], strict=True))
            values = sorted(set(cv) | set(cc))
            rt = mann_whitney_from_counts(
                values, [cv.get(x, 0) for x in values], [cc.get(x, 0) for x in values]
            )
            comp["mann_whitney_ttft"] = {
                **rt.as_dict(),
                "resolution_ms": 1.0 / MW_SCALE,
            }
        out[v] = comp
    # Mann-Whitney p-values are Holm-adjusted across variants too
    mw = {v: c["mann_whitney_ttft"]["p_value"] for v, c in out.items() if c["mann_whitney_ttft"]}
    for v, p in holm_adjust(mw).items() if mw else ():
        out[v]["mann_whitney_ttft"]["p_holm"] = p

    # mirror mode: the same requests went to every variant, so pair them
    if pairs_by_variant:
        paired_p: dict[str, float] = {}
        for v in out:
            pairs = pairs_by_variant[v]
            c = pairs["cells"]
            if not sum(c.values()):
                continue
            pa = mcnemar_attainment(c["both_hit"], c["control_only"], c["variant_only"], c["both_miss"])
            # explicit dtypes: with no pair where both arms succeeded the lists are empty, and
            # np.asarray([]) is float64, which np.repeat refuses as counts
            diffs = np.repeat(
                np.asarray(pairs["diff_values"], dtype=np.float64),
                np.asarray(pairs["diff_counts"], dtype=np.int64),
            )
            wx = wilcoxon_paired(diffs).as_dict() if diffs.size else None
            out[v]["paired"] = {"attainment": pa.as_dict(), "wilcoxon_ttft": wx}
            if pa.difference.p_value is not None:
                paired_p[v] = pa.difference.p_value
        for v, p in holm_adjust(paired_p).items() if paired_p else ():
            out[v]["paired"]["attainment_p_holm"] = p
    return out


def _srm_parts(
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


def _srm(
    exp: ExperimentInfo,
    parts: Sequence[tuple[str, dict[str, int], dict[str, float]]],
    modes: Mapping[str, int],
) -> dict[str, Any]:
    def not_applicable(note: str) -> dict[str, Any]:
        return {"applicable": False, "flagged": False, "message": "", "note": note,
                "weights_source": exp.weights_source}  # fmt: skip

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


def _segments(cells: Sequence[Mapping[str, Any]], present: Sequence[str]) -> dict[str, Any]:
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
            labels = [_iso(k) for k in keys]
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


def _mix_rate(segments: Mapping[str, Any], control: str, present: Sequence[str]) -> dict[str, Any]:
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


def _attribution(
    exp: ExperimentInfo, by_key: Mapping[str, Mapping[str, Any]], present: Sequence[str]
) -> dict[str, Any]:
    control = exp.control
    out: dict[str, Any] = {"attainment": {}, "p99_ttft_ms": {}, "note": ""}
    live = [v for v in present if by_key[v]["n"] > 0]
    if control not in live or len(live) < 2:
        out["note"] = "needs the control and at least one other variant with samples"
        return out
    if not any(by_key[v]["factors"] for v in live):
        out["note"] = "variants carry no factor tags"
        return out

    def p99(v: str) -> float | None:
        return next(e["value"] for e in by_key[v]["percentiles"]["ttft_ms"] if e["q"] == P99)

    metrics = {
        "attainment": ({v: by_key[v]["attainment"]["estimate"] for v in live}, True),
        "p99_ttft_ms": ({v: p99(v) for v in live}, False),
    }
    for name, (values, higher_is_better) in metrics.items():
        cells = {
            v: factors.Cell(dict(by_key[v]["factors"]), float(values[v]), float(by_key[v]["n"]))
            for v in live
            if values[v] is not None
        }
        try:
            result = factors.attribute_factors(cells, control)
        except ValueError as e:
            out["note"] = str(e)
            continue
        for v, entry in result.items():
            entry["text"] = factors.render_attribution(entry, higher_is_better=higher_is_better)
            out[name][v] = entry
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
