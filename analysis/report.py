"""The SLA report: what a SampleReader (analysis.readers) returns, assembled with the statistics
(stats), the factor attribution, phases and segments.

``build_report`` is free of Django: it takes an ExperimentInfo (analysis.experiment_info) and a
store (or a reader), so tests and benches can call it directly. It runs the queries and puts the
report together; its parts are built beside it: each variant against the control
(analysis.control_comparisons), the other keys from what the reader returned
(analysis.report_sections), setup errors (analysis.setup_errors). The Django glue (models,
audit log, the report cache) is dashboards.reports. The returned dict is the stable JSON shape
documented in docs/report-json.md; ``SCHEMA_VERSION`` changes whenever a key is removed or
changes meaning (adding keys does not).

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

from analysis import answer_fidelity, units
from analysis import server_metrics as servermod
from analysis.anytime import NOTE as ANYTIME_NOTE
from analysis.anytime import anytime_intervals, anytime_srm, p99_ranks, unit_sequences
from analysis.control_comparisons import P99, attribution, compare_with_control
from analysis.definitions import METRICS, Filters, QueryError
from analysis.experiment_info import ExperimentInfo, VariantInfo
from analysis.phases import phase_breakdown_from_sums
from analysis.readers.base import SampleReader, run_queries
from analysis.readers.merged import reader_for
from analysis.readers.raw import RawReader
from analysis.report_sections import (
    cdf_points,
    iso,
    itl_counts,
    labelled,
    mix_rate_entry,
    mode_counts,
    runs_entry,
    segments_entry,
    server_entry,
    srm_entry,
    srm_parts,
    values_from_histogram,
    with_units,
)
from analysis.runs import select_runs
from analysis.segments import choose_bucket_s
from analysis.setup_errors import UNJUDGED, setup_banner, setup_errors_entry, unjudged_verdict
from stats._common import DEFAULT_CONF
from stats.comparisons import quantile_difference_conf
from stats.proportions import sla_attainment
from stats.quantiles import REPORT_QUANTILES, quantile_from_order_stats, ranks_to_fetch
from stats.verdict import sla_verdict

# Importable from here as before: the report's input (analysis.experiment_info) and the verdict
# of a variant that cannot be judged (analysis.setup_errors).
__all__ = ["SCHEMA_VERSION", "UNJUDGED", "ExperimentInfo", "VariantInfo", "build_report"]

# 2: percentiles.itl_ms over every inter-token gap, not the per-request mean; 3: setup errors
# (definitions.SETUP_ERROR) are left out of n, errors, error_rate, hits, attainment and every
# figure built on them, and counted apart in variants[].setup_errors
SCHEMA_VERSION = 3
ALPHA = round(1.0 - DEFAULT_CONF, 12)  # the anytime-valid sequences' error rate, as the fixed-horizon CIs'


def _unix_s(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


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
        "setup": lambda: reader.setup_errors(filters),
    }
    if exp.cluster_by_user or exp.adjust:
        first_jobs["units"] = lambda: reader.unit_moments(filters, exp.slo, exp.unit)
    got = run_queries(par, first_jobs)
    summ, hists, unit_moments = got["summary"], got["hists"], got.get("units")
    setup = got["setup"]
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
            jobs[f"fidelity_{v}"] = lambda v=v: reader.fidelity_pairs(
                filters, exp.unit, control, v, examples=exp.store_answers
            )
        if mirror_with:  # the scoring pass's teacher-forced KL, every variant's at once
            jobs["kl_scores"] = lambda: reader.fidelity_scores(filters, exp.unit, control)
    if modes.get("live"):  # the gateway's live answers against the control's (its own or not)
        jobs["live_shadows"] = lambda: reader.fidelity_shadows(filters, exp.unit, control)
    got = run_queries(par, jobs)
    order_stats: dict[tuple[str, str], dict[int, float]] = {}
    for name, value in got.items():
        if name.startswith("os_"):
            order_stats.update({(v, name[len("os_") :]): by_rank for v, by_rank in value.items()})
    cdf = cdf_points(hist)
    pairs = {k[len("pairs_") :]: p for k, p in got.items() if k.startswith("pairs_")}
    kl_scores = got.get("kl_scores", {})
    fidelity = {
        k[len("fidelity_") :]: answer_fidelity.with_kl(
            answer_fidelity.with_examples(
                answer_fidelity.fidelity_entry(p["moments"], p["kinds"], control, DEFAULT_CONF),
                exp.store_answers,
                p.get("examples"),
            ),
            kl_scores.get(k[len("fidelity_") :]),
            kl_scores.get(control),
            DEFAULT_CONF,
            exp.score_share,
        )
        for k, p in got.items()
        if k.startswith("fidelity_")
    }
    for v, shadows in got.get("live_shadows", {}).items():
        live = answer_fidelity.live_entry(shadows, DEFAULT_CONF)
        if v == control or v not in known or live is None:
            continue
        if v not in fidelity:  # no mirror pair read: the entry holds the live answers alone
            fidelity[v] = answer_fidelity.with_kl(
                answer_fidelity.with_examples(answer_fidelity.empty_entry(control), exp.store_answers, None),
                None,
                None,
                DEFAULT_CONF,
                exp.score_share,
            )
        fidelity[v] = answer_fidelity.with_live(fidelity[v], live)
    fidelity = {v: answer_fidelity.with_live(e, e.get("live")) if e else e for v, e in fidelity.items()}
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
            # the requests the variant refused as configured or called, left out of every figure
            # of this row (definitions.SETUP_ERROR)
            "setup_errors": setup_errors_entry(setup.get(v, {}), s["n"]),
            "error_rate_includes_setup_errors": False,
            "percentiles": {},
            "vs_control": None,
            # the same per user, the unit of randomization (analysis.units); None when off
            "clustered": None,
            # what broke: error classes of the failed requests (streaming.result.Outcome values)
            "failures": got["failures"].get(v, {}),
            # the variant's answers against the control's in mirror replays (analysis.answer_fidelity)
            "fidelity": fidelity.get(v),
        }
        if not s["n"] and entry["setup_errors"]["n"]:
            entry["verdict"] = unjudged_verdict(entry["setup_errors"], exp.target)
        if s["n"]:
            a = sla_attainment(s["n"], s["hits"], s["errors"], window_s)
            entry.update(
                error_rate=a.error_rate,
                attainment=a.attainment.as_dict(),
                goodput_rps=a.goodput_rps,
            )
        entry["percentiles"] = {
            m: [labelled(m, estimate(v, m, quant).as_dict()) for quant in REPORT_QUANTILES] for m in METRICS
        }
        entry["itl"] = itl_counts(s)
        variants.append(entry)
    by_key = {e["key"]: e for e in variants}

    # 3. every variant against the control (Holm across variants)
    counts = values_from_histogram(hist)
    comparisons = compare_with_control(exp, summ, present, estimate, counts, pairs)
    inference, clustered, per_unit = units.statistics(
        unit_moments, order, control, modes, exp.cluster_by_user, exp.adjust
    )
    for v, comp in comparisons.items():
        comp.update(per_unit.get(v, {}))
        by_key[v]["vs_control"] = comp
    for v, entry in clustered.items():
        by_key[v]["clustered"] = entry

    # 4. segments from the cells; SRM on distinct users, the unit of assignment
    srm_by_revision = srm_parts(exp, got["srm_users"], present)
    srm = srm_entry(exp, srm_by_revision, modes)
    ttft_os = {v: order_stats.get((v, "ttft_ms"), {}) for v in present}
    anytime_units, per_unit_seq = unit_sequences(
        unit_moments, order, control, modes, exp.cluster_by_user, exp.adjust, ALPHA
    )
    anytime = {
        "alpha": ALPHA,
        "note": ANYTIME_NOTE,
        "units": anytime_units,
        "variants": with_units(anytime_intervals(summ, order, control, ttft_os, ALPHA), per_unit_seq),
        "srm": anytime_srm(srm_by_revision, ALPHA) if srm.get("applicable") else {"applicable": False},
    }
    segments = segments_entry(cells, present)
    mix_rate = mix_rate_entry(segments, control, present)

    # 5. why: factors, phases
    attribution_out = attribution(exp, by_key, present)
    phases: dict[str, Any] = {}
    for v in present:
        try:
            phases[v] = phase_breakdown_from_sums(summ[v]["phase_sums"], summ[v]["phase_n"])
        except ValueError as e:
            phases[v] = {"n": summ[v]["phase_n"], "dropped": 0, "phases": {}, "note": str(e)}
    server = server_entry(got.get("server"), by_key, present, cells, phases, bucket_s)

    # 6. over time, and the CDF
    rev_first: dict[int, float] = {}
    for c in cells:
        rev_first[int(c["rev"])] = min(rev_first.get(int(c["rev"]), math.inf), float(c["first_ms"]))
    markers = [
        {"at": iso(ms / 1000.0), "kind": "config_revision", "label": f"config revision {rev}"}
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
    banners += [
        setup_banner(e["key"], e["control"], e["setup_errors"]) for e in variants if e["setup_errors"]["n"]
    ]
    runs_info = runs_entry(selection, modes)
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
            "first": iso(first / 1000.0) if first is not None else None,
            "last": iso(last / 1000.0) if last is not None else None,
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
                v: [{"t": iso(tb), "n": n, "p99": p} for tb, n, p in series.get(v, [])] for v in present
            },
            "markers": markers,
        },
        "cdf": {v: cdf[v] for v in present if v in cdf},
        "timing": {
            "query_s": time.perf_counter() - t0,
            "source": reader.source,
        },
    }
