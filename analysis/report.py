"""The SLA report: queries (analysis.queries) + statistics (analysis.stats) + attribution.

``build_report`` is free of Django: it takes an ExperimentInfo and a store, so tests and benches
can call it directly. The Django glue (models, audit log, the report cache) is dashboards.reports. The returned dict is the stable JSON shape documented in
docs/report-json.md; ``SCHEMA_VERSION`` changes whenever a key is removed or changes meaning
(adding keys does not).

Dedup contract: the queries read the samples table without FINAL, so the numbers are exact when
the rows read hold one recording per request. Writes guarantee that for completed runs (shards
skip stored request ids, the spool flush filters stored keys, and the replay's finish step calls
SampleStore.deduplicate(run_id) when count() != uniqExact(variant, request_id)). A run still in
progress may transiently count a duplicate after an insert retry, until that finish step.

Speed: two stages of independent queries run concurrently (one connection per thread):
summary, phase sums and the TTFT histogram first; then the exact order statistics, the TTFT
ranks, segments, the p99 series and mirror pairs, which need the counts or the window.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from analysis import attribution as attr
from analysis import queries as q
from analysis import rollup, stats

SCHEMA_VERSION = 1
P99 = 0.99


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
    slo: q.Slo
    target: float
    variants: Sequence[VariantInfo]
    # config revision -> {variant: weight} in force; revisions missing here use `weights`
    weights_by_revision: Mapping[int, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    weights_source: str = "current variant weights (no weights history recorded)"
    weight_changes: Sequence[Mapping[str, Any]] = ()  # [{"at": iso, "label": str}]

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


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _ranks_for(metric: str, n: int) -> list[int]:
    ranks = set(stats.ranks_to_fetch(n))
    if metric == "ttft_ms":
        # the p99 difference needs per-arm CIs at 1 - alpha/2 (Bonferroni)
        ranks.update(stats.ranks_to_fetch(n, (P99,), stats.quantile_difference_conf()))
    return sorted(ranks)


# One pool for the process, created on first use (and again in a forked child): its threads
# keep their store connections between reports. clickhouse-driver clients are not thread-safe;
# the server store keeps one per thread. chDB serializes queries itself (parallel_queries = 1).
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_guard = threading.Lock()
POOL_THREADS = 4


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_guard:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="sla-report")
            _pool_pid = os.getpid()
        return _pool


def run_queries(store: Any, jobs: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run independent query jobs, concurrently when the store allows it; {name: result}."""
    if int(getattr(store, "parallel_queries", 1)) <= 1 or len(jobs) <= 1:
        return {name: fn() for name, fn in jobs.items()}
    futures = {name: _executor().submit(fn) for name, fn in jobs.items()}
    return {name: fut.result() for name, fut in futures.items()}


def build_report(
    store: Any,
    exp: ExperimentInfo,
    filters: q.Filters,
    use_rollup: bool = True,
    version: Sequence[tuple[int, int, int, int]] | None = None,
) -> dict[str, Any]:
    """The report (docs/report-json.md). use_rollup=False reads the raw samples even where
    finished runs have rollups (the same numbers, slower; for checking the rollups).
    version: queries.data_version, when the caller has read it (saves a scan)."""
    t0 = time.perf_counter()
    control = exp.control
    known = {v.key: v for v in exp.variants}
    unknown = sorted(set(filters.variants) - set(known))
    if unknown:
        raise q.QueryError(f"variant filter: {unknown} not in experiment {exp.key!r}")
    if filters.variants and control not in filters.variants:
        # every comparison is against the control, so it is always read
        filters = dataclasses.replace(filters, variants=(control, *filters.variants))
    order = [v.key for v in exp.variants if not filters.variants or v.key in filters.variants]

    # Finished runs read their rollups (analysis.rollup); runs without a current one (still
    # replaying, changed since) read the raw samples beside them; a time window or a changed
    # SLO reads everything raw.
    scope = rollup.report_scope(store, filters, exp.slo, version) if use_rollup else None
    builds = scope.builds if scope is not None else None
    live = dataclasses.replace(filters, runs=scope.live) if scope is not None and scope.live else None

    # 1. counts, hits, phase sums, the histograms (independent: run together)
    jobs: dict[str, Callable[[], Any]] = {}
    if builds is not None:
        jobs["summary"] = lambda: rollup.summary(store, filters, builds)
        jobs["hists"] = lambda: rollup.histograms(store, filters, builds)
    raw_f = live if builds is not None else filters
    if raw_f is not None:
        jobs["raw_summary"] = lambda: q.summary(store, raw_f, exp.slo)
        jobs["raw_phases"] = lambda: q.phase_sums(store, raw_f, exp.slo)
        for m in q.METRICS if builds is not None else ("ttft_ms",):
            jobs[f"raw_hist_{m}"] = lambda m=m: q.histogram(store, raw_f, m)
    got = run_queries(store, jobs)
    raw_summ: dict[str, dict[str, Any]] = got.get("raw_summary", {})
    for v, s in raw_summ.items():
        s.update(got["raw_phases"].get(v, {"phase_n": 0, "phase_sums": dict.fromkeys(q.PHASES, 0.0)}))
    if builds is not None:
        summ = rollup.merge_summaries(got["summary"], raw_summ)
        hists = {m: rollup.merge_histograms(got["hists"][m], got.get(f"raw_hist_{m}", {})) for m in q.METRICS}
    else:
        summ, hists = raw_summ, {"ttft_ms": got["raw_hist_ttft_ms"]}
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
    bucket_s = q.choose_bucket_s(window_s or 60.0)
    mode_counts = q.mode_counts(summ)

    # 2. exact order statistics (a query per metric, located through histograms: TTFT's on the raw
    # path, every metric's from the rollup's sorted values), segments, the p99 series, SRM users
    # and mirror pairs: independent, run together
    def ranks_of(metric: str) -> dict[str, list[int]]:
        return {v: _ranks_for(metric, n) for v in present if (n := summ[v]["metric_n"][metric]) > 0}

    jobs = {}
    if builds is not None:
        for m in q.METRICS:
            jobs[f"os_{m}"] = lambda m=m: rollup.order_statistics(
                store, filters, builds, m, hists[m], ranks_of(m), live
            )

        def cells() -> list[dict[str, Any]]:
            out = rollup.segment_cells(store, filters, builds, bucket_s)
            return out + q.segment_cells(store, live, exp.slo, bucket_s) if live is not None else out

        jobs["cells"] = cells
        jobs["series"] = lambda: rollup.p99_over_time(store, filters, builds, bucket_s, live)
        jobs["srm_users"] = lambda: _srm_users_from_rollup(store, filters, builds, live is not None)
    else:
        jobs["os_ttft_ms"] = lambda: q.order_statistics_from_histogram(
            store, filters, "ttft_ms", hist, ranks_of("ttft_ms")
        )
        for m in q.METRICS:
            plan = {(v, m): (summ[v]["metric_n"][m], r) for v, r in ranks_of(m).items()}
            if m != "ttft_ms" and plan:
                jobs[f"os_{m}"] = lambda plan=plan, m=m: {
                    v: by_rank for (v, _m), by_rank in q.order_statistics(store, filters, plan).items()
                }
        jobs["cells"] = lambda: q.segment_cells(store, filters, exp.slo, bucket_s)
        jobs["series"] = lambda: q.p99_over_time(store, filters, bucket_s)
        jobs["srm_users"] = lambda: q.srm_users(store, filters)
    mirror_with = [v for v in present if v != control] if mode_counts.get("mirror") else []
    if control in present:
        for v in mirror_with:
            jobs[f"pairs_{v}"] = lambda v=v: q.mirror_pairs(store, filters, exp.slo, control, v)
    got = run_queries(store, jobs)
    order_stats: dict[tuple[str, str], dict[int, float]] = {}
    for name, value in got.items():
        if name.startswith("os_"):
            order_stats.update({(v, name[len("os_") :]): by_rank for v, by_rank in value.items()})
    cdf = q.cdf_points(hist)
    pairs = {k[len("pairs_") :]: p for k, p in got.items() if k.startswith("pairs_")}
    cells, series = got["cells"], got["series"]

    def estimate(v: str, m: str, quant: float, conf: float = stats.DEFAULT_CONF) -> Any:
        n = summ[v]["metric_n"][m] if v in summ else 0
        return stats.quantile_from_order_stats(n, quant, order_stats.get((v, m), {}), conf)

    variants: list[dict[str, Any]] = []
    for v in order:
        s = summ.get(v, {"n": 0, "errors": 0, "hits": 0, "metric_n": dict.fromkeys(q.METRICS, 0)})
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
            "verdict": stats.sla_verdict(s["hits"], s["n"], exp.target).as_dict(),
            "percentiles": {},
            "vs_control": None,
        }
        if s["n"]:
            a = stats.sla_attainment(s["n"], s["hits"], s["errors"], window_s)
            entry.update(
                error_rate=a.error_rate,
                attainment=a.attainment.as_dict(),
                goodput_rps=a.goodput_rps,
            )
        entry["percentiles"] = {
            m: [estimate(v, m, quant).as_dict() for quant in stats.REPORT_QUANTILES] for m in q.METRICS
        }
        variants.append(entry)
    by_key = {e["key"]: e for e in variants}

    # 3. every variant against the control (Holm across variants)
    counts = q.values_from_histogram(hist)
    comparisons = _compare(exp, summ, present, estimate, counts, pairs)
    for v, comp in comparisons.items():
        by_key[v]["vs_control"] = comp

    # 4. segments from the cells; SRM on distinct users, the unit of assignment
    srm = _srm(exp, got["srm_users"], present, mode_counts)
    segments = _segments(cells, present)
    mix_rate = _mix_rate(segments, control, present)

    # 5. why: factors, phases
    attribution_out = _attribution(exp, by_key, present)
    phases: dict[str, Any] = {}
    for v in present:
        try:
            phases[v] = attr.phase_breakdown_from_sums(summ[v]["phase_sums"], summ[v]["phase_n"])
        except ValueError as e:
            phases[v] = {"n": summ[v]["phase_n"], "dropped": 0, "phases": {}, "note": str(e)}

    # 6. over time, and the CDF
    rev_first: dict[int, float] = {}
    for c in cells:
        rev_first[int(c["rev"])] = min(rev_first.get(int(c["rev"]), math.inf), float(c["first_ms"]))
    markers = [
        {"at": _iso(ms / 1000.0), "kind": "config_revision", "label": f"config revision {rev}"}
        for rev, ms in sorted(rev_first.items(), key=lambda kv: kv[1])
    ][1:]  # the first revision is the start, not a change
    markers += [{"kind": "audit", **dict(m)} for m in exp.weight_changes]

    banners = [srm["message"]] if srm.get("flagged") else []
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
        "modes": mode_counts,
        "banners": banners,
        "srm": srm,
        "variants": variants,
        "attribution": attribution_out,
        "phases": phases,
        "segments": segments,
        "mix_rate": mix_rate,
        "timeseries": {
            "bucket_s": bucket_s,
            "note": "p99 per bucket at rank floor(0.99n)+1 (quantileExact(0.99)): chart only"
            + ("; from the rollup, the largest TTFT of the 1 ms bucket holding that rank" if builds else ""),
            "p99_ttft_ms": {
                v: [{"t": _iso(tb), "n": n, "p99": p} for tb, n, p in series.get(v, [])] for v in present
            },
            "markers": markers,
        },
        "cdf": {v: cdf[v] for v in present if v in cdf},
        "timing": {
            "query_s": time.perf_counter() - t0,
            "source": "samples" if builds is None else "rollup+samples" if live is not None else "rollup",
        },
    }


def _srm_users_from_rollup(
    store: Any, filters: q.Filters, builds: Mapping[int, int], with_live: bool
) -> list[dict[str, Any]]:
    # distinct users of one run come from its rollup; over several runs a user may appear in
    # more than one, so they are counted over all the samples in scope
    users = None if with_live else rollup.srm_users(store, filters, builds)
    return q.srm_users(store, filters) if users is None else users


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
    arms = {v: stats.ArmCounts(summ[v]["n"], summ[v]["hits"]) for v in others if summ[v]["n"]}
    att = stats.compare_attainment(stats.ArmCounts(summ[control]["n"], summ[control]["hits"]), arms)
    arm_conf = stats.quantile_difference_conf()
    out: dict[str, dict[str, Any]] = {}
    for v in arms:
        comp: dict[str, Any] = {
            "attainment_difference": att[v]["difference"],
            "attainment_p_holm": att[v]["p_holm"],
            "p99_ttft_difference": None,
            "mann_whitney_ttft": None,
            "paired": None,
        }
        if summ[v]["metric_n"]["ttft_ms"] and summ[control]["metric_n"]["ttft_ms"]:
            diff = stats.quantile_difference_from_order_stats(
                estimate(control, "ttft_ms", P99, arm_conf), estimate(v, "ttft_ms", P99, arm_conf)
            )
            comp["p99_ttft_difference"] = diff.as_dict()
        if v in counts and control in counts:
            cv, cc = dict(zip(*counts[control], strict=True)), dict(zip(*counts[v], strict=True))
            values = sorted(set(cv) | set(cc))
            rt = stats.mann_whitney_from_counts(
                values, [cv.get(x, 0) for x in values], [cc.get(x, 0) for x in values]
            )
            comp["mann_whitney_ttft"] = {
                **rt.as_dict(),
                "resolution_ms": 1.0 / q.MW_SCALE,
            }
        out[v] = comp
    # Mann-Whitney p-values are Holm-adjusted across variants too
    mw = {v: c["mann_whitney_ttft"]["p_value"] for v, c in out.items() if c["mann_whitney_ttft"]}
    for v, p in stats.holm_adjust(mw).items() if mw else ():
        out[v]["mann_whitney_ttft"]["p_holm"] = p

    # mirror mode: the same requests went to every variant, so pair them
    if pairs_by_variant:
        paired_p: dict[str, float] = {}
        for v in out:
            pairs = pairs_by_variant[v]
            c = pairs["cells"]
            if not sum(c.values()):
                continue
            pa = stats.mcnemar_attainment(c["both_hit"], c["control_only"], c["variant_only"], c["both_miss"])
            diffs = np.repeat(np.asarray(pairs["diff_values"]), np.asarray(pairs["diff_counts"]))
            wx = stats.wilcoxon_paired(diffs).as_dict() if diffs.size else None
            out[v]["paired"] = {"attainment": pa.as_dict(), "wilcoxon_ttft": wx}
            if pa.difference.p_value is not None:
                paired_p[v] = pa.difference.p_value
        for v, p in stats.holm_adjust(paired_p).items() if paired_p else ():
            out[v]["paired"]["attainment_p_holm"] = p
    return out


def _srm(
    exp: ExperimentInfo,
    user_counts: Sequence[Mapping[str, Any]],
    present: Sequence[str],
    mode_counts: Mapping[str, int],
) -> dict[str, Any]:
    def not_applicable(note: str) -> dict[str, Any]:
        return {"applicable": False, "flagged": False, "message": "", "note": note,
                "weights_source": exp.weights_source}  # fmt: skip

    if mode_counts.get("mirror") and not mode_counts.get("split"):
        return not_applicable("mirror mode: every request goes to every variant")
    by_rev: dict[int, dict[str, int]] = {}
    for c in user_counts:
        if c["variant"] in present:
            counts = by_rev.setdefault(int(c["rev"]), {})
            counts[c["variant"]] = counts.get(c["variant"], 0) + int(c["n"])
    if not by_rev:
        return not_applicable("no samples")
    parts = []
    for rev, counts in sorted(by_rev.items()):
        weights = exp.weights_by_revision.get(rev, exp.weights)
        # only the variants being read: a variant filter must not look like missing traffic
        parts.append((str(rev), counts, {k: float(w) for k, w in weights.items() if k in present}))
    try:
        res = stats.sample_ratio_mismatch(parts)
    except ValueError as e:
        return not_applicable(str(e))
    return {"applicable": True, "note": "", **res.as_dict(), "weights_source": exp.weights_source}


SEGMENT_DIMS = {
    "prompt_tokens": ("pb", attr.bucket_labels(attr.PROMPT_TOKEN_EDGES)),
    "in_flight": ("ib", attr.bucket_labels(attr.INFLIGHT_EDGES)),
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
                v: attr.attainment_by_segment(
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
                out[v][dim] = attr.mix_rate_decomposition(a, b)
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
            v: attr.Cell(dict(by_key[v]["factors"]), float(values[v]), float(by_key[v]["n"]))
            for v in live
            if values[v] is not None
        }
        try:
            result = attr.attribute_factors(cells, control)
        except ValueError as e:
            out["note"] = str(e)
            continue
        for v, entry in result.items():
            entry["text"] = attr.render_attribution(entry, higher_is_better=higher_is_better)
            out[name][v] = entry
    return out
