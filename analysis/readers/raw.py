"""RawReader: every query of the SLA report over the samples table. Aggregation happens in
ClickHouse; only aggregates return.

No FINAL (it cost ~7 s per pass at 10M rows on 18.16). Reads rely on the dedup contract: a
completed run holds one row per (experiment, variant, run_id, seq, request_id). Exactly-once is
enforced at write time (a redelivered shard skips stored request ids; the spool flush filters
stored keys), and the replay's finish step checks count() == uniqExact(variant, request_id) and
calls SampleStore.deduplicate(run_id) (OPTIMIZE ... PARTITION p FINAL) when they differ. A run
still in progress may transiently show a duplicate after an insert retry, until its finish step.

Order statistics are exact: ClickHouse's quantileExact(level) returns the element at 0-based
index floor(level * n) of the sorted values, so asking for level (r - 0.5) / n returns exactly
the r-th smallest value (1-based rank r, the ranks stats.quantiles asks for). TTFT ranks
are selected in two steps instead: the histogram of TTFT at 0.1 ms (the Mann-Whitney counts,
needed anyway) says which 0.1 ms bucket holds each rank and its place there; a second pass sorts
only the values of those few buckets (sql.values_at_ranks). The CDF chart comes from the same
histogram: each point is (largest TTFT of a bucket, exact share of requests <= it), so it needs
no ranks at all (400 quantileExact levels cost more than every other query together on 18.16).
ITL (itl_ms) pools every inter-token gap of every successful request (definitions.GAP_METRICS):
the samples are read one row per gap (ARRAY JOIN itl_gaps_us), its histogram is of gaps, and
its exact ranks come from the distinct gap values of the few buckets that hold them
(sql.gap_values_at_ranks), as the rollup's do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from analysis import answer_fidelity
from analysis.definitions import (
    GAP_METRICS,
    GAP_REQUESTS,
    INFLIGHT_EDGES,
    METRICS,
    MODES,
    PHASE_COLUMNS,
    PHASE_ROWS,
    PROMPT_TOKEN_EDGES,
    SETUP_ERROR,
    Filters,
    QueryError,
    Slo,
)
from analysis.phases import phases_from_sums
from analysis.readers import shards
from analysis.readers.base import (
    DataVersion,
    Failures,
    Summary,
    failure_rows,
    histogram_rows,
    p99_rows,
    parallelism,
    run_queries,
    setup_error_rows,
    summary_rows,
    with_phases,
)
from analysis.sql import (
    DISTINCT_USERS,
    GAP,
    HIST_KEYS,
    SAMPLES,
    SRM_SAMPLES,
    Hist,
    bucket_sql,
    conditions,
    from_where,
    gap_table,
    gap_value_counts,
    gap_values_at_ranks,
    hit_expr,
    metric_count,
    metric_ok,
    rank_level,
    rounded_sql,
    values_at_ranks,
)
from analysis.units import UnitMoments
from samples.schema import FIDELITY_SCORES_TABLE, FIDELITY_SHADOWS_TABLE

# Metrics whose order statistics the raw reader locates through a histogram (the others ask
# quantilesExact: a histogram per metric would cost a pass each): TTFT, whose histogram the
# rank test and the CDF need anyway, and the pooled gaps, too many values for quantilesExact.
HIST_METRICS = ("ttft_ms", *GAP_METRICS)


class RawReader:
    """The SampleReader over the samples table (analysis.readers.base)."""

    source = "samples"
    p99_note = ""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.parallel_queries = parallelism(store)
        # On a cluster, quantilesExact ships every value of a metric from every shard to the
        # entry, which sorts them alone (at 100M samples slower than on one server); a histogram
        # is summed on each shard and merged small, and the exact values then come from the few
        # buckets holding the ranks. So there every metric goes through its histogram.
        self.hist_metrics = tuple(METRICS) if getattr(store, "cluster", "") else HIST_METRICS

    # 1. Summary per variant: counts, hits, window, metric counts, modes; phase sums of misses

    def summary(self, f: Filters, slo: Slo) -> Summary:
        """counts() and phase_sums() together (two passes, run concurrently)."""
        got = run_queries(
            self.parallel_queries,
            {"counts": lambda: self.counts(f, slo), "phases": lambda: self.phase_sums(f, slo)},
        )
        return with_phases(got["counts"], got["phases"])

    def counts(self, f: Filters, slo: Slo) -> Summary:
        """Per variant: n, errors, hits, first/last send (unix ms), metric_n, mode counts, and
        the successful requests with and without gaps (definitions.GAP_REQUESTS)."""
        fw, params = from_where(f)
        hit, hp = hit_expr(slo)
        metric_counts = ", ".join(
            [f"{metric_count(key)} AS n_{key}" for key in METRICS]
            + [f"countIf({cond}) AS n_{name}" for name, cond in GAP_REQUESTS.items()]
        )
        # countIf per mode, not GROUP BY mode: a second LowCardinality key doubled the time on 18.16
        mode_counts = ", ".join(f"countIf(mode = '{m}') AS mode_{m}" for m in MODES)
        sql = f"""
            SELECT variant, count() AS n, countIf(outcome != 'ok') AS errors, countIf({hit}) AS hits,
                   min(sent_unix_ms) AS first_ms, max(sent_unix_ms) AS last_ms,
                   {metric_counts}, {mode_counts}
            {fw}
            GROUP BY variant
            ORDER BY variant
        """
        return summary_rows(self.store.query_columns(sql, {**params, **hp}))

    def phase_sums(self, f: Filters, slo: Slo) -> dict[str, dict[str, Any]]:
        """{variant: {"phase_n", "phase_sums": {phase: total ms}}} over misses.

        Sums of the five timestamps, differenced in Python (a sum of differences is the
        difference of sums), with the miss filter in WHERE: a fifth of the aggregates of sumIf
        per phase.
        """
        hit, hp = hit_expr(slo)
        fw, params = from_where(f, [f"NOT {hit}", PHASE_ROWS])
        sums = ", ".join(f"sum({expr}) AS s_{name}" for name, expr in PHASE_COLUMNS.items())
        cols = self.store.query_columns(
            f"SELECT variant, count() AS n, {sums} {fw} GROUP BY variant", {**params, **hp}
        )
        out: dict[str, dict[str, Any]] = {}
        for i, variant in enumerate(cols.get("variant", [])):
            t = {name: float(cols[f"s_{name}"][i]) for name in PHASE_COLUMNS}
            out[variant] = {"phase_n": int(cols["n"][i]), "phase_sums": phases_from_sums(t)}
        return out

    # 2. Histograms and exact order statistics

    def histograms(
        self, f: Filters, metrics: Sequence[str] | None = None
    ) -> dict[str, dict[str, tuple[list[int], list[int], list[float]]]]:
        """{metric: histogram}; by default those of self.hist_metrics (HIST_METRICS: TTFT's and
        the gaps'; every metric's on a cluster)."""
        jobs = {
            m: (lambda m=m: self.histogram(f, m)) for m in (self.hist_metrics if metrics is None else metrics)
        }
        return run_queries(self.parallel_queries, jobs)

    def histogram(self, f: Filters, metric: str) -> dict[str, tuple[list[int], list[int], list[float]]]:
        """{variant: (sorted keys, counts, largest value in each key)} of a metric over
        successful requests, keyed by sql.HIST_KEYS[metric] (of every gap for GAP_METRICS)."""
        if metric in GAP_METRICS:
            fw, params = from_where(f, ["outcome = 'ok'"], table=gap_table(metric))
            sql = (
                f"SELECT variant, {HIST_KEYS[metric]} AS k, count() AS c, max({GAP}) / 1000 AS top "
                f"{fw} GROUP BY variant, k ORDER BY variant, k"
            )
            return histogram_rows(self.store.query(sql, params))
        column = METRICS[metric]
        fw, params = from_where(f, [metric_ok(column)])
        sql = (
            f"SELECT variant, {HIST_KEYS[metric]} AS k, count() AS c, max(assumeNotNull({column})) AS top "
            f"{fw} GROUP BY variant, k ORDER BY variant, k"
        )
        return histogram_rows(self.store.query(sql, params))

    def order_statistics(
        self,
        f: Filters,
        metric: str,
        ranks: Mapping[str, Sequence[int]],
        counts: Mapping[str, int],
        hist: Hist | None,
    ) -> dict[str, dict[int, float]]:
        """Through the histogram when given (values_at_ranks; gap_values_at_ranks for
        GAP_METRICS, which always go through theirs), else quantilesExact at each rank."""
        if metric in GAP_METRICS:
            return self.gap_order_statistics(
                f, metric, self.histogram(f, metric) if hist is None else hist, ranks
            )
        if hist is not None:
            return self.order_statistics_from_histogram(f, metric, hist, ranks)
        plan = {(v, metric): (counts[v], r) for v, r in ranks.items()}
        return {v: by_rank for (v, _m), by_rank in self.order_statistics_exact(f, plan).items()}

    def order_statistics_exact(
        self, f: Filters, plan: Mapping[tuple[str, str], tuple[int, Sequence[int]]]
    ) -> dict[tuple[str, str], dict[int, float]]:
        """{(variant, metric): {rank: value}} for plan {(variant, metric): (n, ranks)}.

        n must be the count of successful requests with that metric (summary()["metric_n"]);
        a per-request metric (not GAP_METRICS).
        """
        if any(metric in GAP_METRICS for _v, metric in plan):
            raise QueryError(f"order_statistics_exact: {sorted(GAP_METRICS)} go through their histogram")
        fw, params = from_where(f)
        selects: list[str] = []
        keys: list[tuple[tuple[str, str], list[int]]] = []
        for i, ((variant, metric), (n, ranks)) in enumerate(sorted(plan.items())):
            ranks = sorted(set(int(r) for r in ranks))
            if not ranks or n < 1:
                continue
            column = METRICS[metric]
            levels = ", ".join(repr(rank_level(r, n)) for r in ranks)
            params[f"v{i}"] = variant
            selects.append(
                f"quantilesExactIf({levels})(assumeNotNull({column}), "
                f"variant = %(v{i})s AND {metric_ok(column)}) AS q{len(keys)}"
            )
            keys.append(((variant, metric), ranks))
        if not selects:
            return {}
        row = self.store.query(f"SELECT {', '.join(selects)} {fw}", params)[0]
        out: dict[tuple[str, str], dict[int, float]] = {}
        for (key, ranks), values in zip(keys, row, strict=True):
            out[key] = {r: float(v) for r, v in zip(ranks, values, strict=True)}
        return out

    def order_statistics_from_histogram(
        self, f: Filters, metric: str, hist: Hist, ranks: Mapping[str, Sequence[int]]
    ) -> dict[str, dict[int, float]]:
        """{variant: {rank: exact value}} located through the metric's histogram (keys
        sql.HIST_KEYS[metric], counts of successful requests with the metric), the values read
        from the samples."""
        column = METRICS[metric]

        def source(all_keys: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
            fw, params = from_where(f, [metric_ok(column), f"{HIST_KEYS[metric]} IN %(tk_all)s"])
            return fw, {**params, "tk_all": all_keys}

        return values_at_ranks(self.store, source, f"assumeNotNull({column})", HIST_KEYS[metric], hist, ranks)

    def gap_order_statistics(
        self, f: Filters, metric: str, hist: Hist, ranks: Mapping[str, Sequence[int]]
    ) -> dict[str, dict[int, float]]:
        """{variant: {rank: exact gap in ms}} of a GAP_METRICS metric, through its histogram."""
        return gap_values_at_ranks(self.store, lambda keys: gap_value_counts(f, metric, keys), hist, ranks)

    # 3. Segments: (variant, config revision, prompt bucket, in-flight bucket, time bucket) cells

    def segment_cells(self, f: Filters, slo: Slo, bucket_s: int) -> list[dict[str, Any]]:
        """One row per non-empty cell; the report sums them along each dimension.

        Also carries the SRM counts (per config revision) and the first send time of each
        revision, so one pass serves segments, SRM and the weight-change markers.
        """
        if not isinstance(bucket_s, int) or bucket_s < 1:
            raise QueryError(f"bucket_s must be a positive integer, got {bucket_s!r}")
        fw, params = from_where(f)
        hit, hp = hit_expr(slo)
        sql = f"""
            SELECT variant, config_revision AS rev,
                   {bucket_sql("prompt_tokens", PROMPT_TOKEN_EDGES)} AS pb,
                   {bucket_sql("in_flight", INFLIGHT_EDGES)} AS ib,
                   intDiv(toUInt32(sent_at), {bucket_s}) * {bucket_s} AS tb,
                   count() AS n, countIf({hit}) AS hits, min(sent_unix_ms) AS first_ms
            {fw}
            GROUP BY variant, rev, pb, ib, tb
        """
        names = ("variant", "rev", "pb", "ib", "tb", "n", "hits", "first_ms")
        return [dict(zip(names, r, strict=True)) for r in self.store.query(sql, {**params, **hp})]

    def srm_users(self, f: Filters) -> list[dict[str, Any]]:
        """Distinct users per (config revision, variant) of the samples the router assigned
        (sql.SRM_SAMPLES: split replays, live traffic's assigned first attempts): the unit the
        router assigns, so the unit sample ratio mismatch is tested on. Requests are not
        independent draws (a heavy user sends many, all to one variant), so request counts would
        flag SRM on healthy traffic."""
        fw, params = from_where(f, [SRM_SAMPLES], setup_errors=True)
        sql = f"SELECT config_revision AS rev, variant, {DISTINCT_USERS} AS users {fw} GROUP BY rev, variant"
        return [{"rev": int(r), "variant": v, "n": int(n)} for r, v, n in self.store.query(sql, params)]

    def failures(self, f: Filters) -> Failures:
        """{variant: {outcome: {"n", "http_status", "example"}}} of the failed requests (outcome
        other than 'ok'; setup errors are setup_errors'): what broke, by error class, with one HTTP status and error message,
        cut to FAILURE_EXAMPLE_CHARS (a variant's error body may quote the request)."""
        fw, params = from_where(f, ["outcome != 'ok'"])
        sql = f"SELECT variant, outcome, count(), any(http_status), any(error) {fw} GROUP BY variant, outcome"
        return failure_rows(self.store.query(sql, params))

    def setup_errors(self, f: Filters) -> Failures:
        """{variant: {http status: {"n", "example"}}} of the setup errors (definitions.SETUP_ERROR):
        the requests every other query leaves out, counted apart, with one error message per
        status cut to FAILURE_EXAMPLE_CHARS."""
        fw, params = from_where(f, [SETUP_ERROR], setup_errors=True)
        sql = f"SELECT variant, http_status, count(), any(error) {fw} GROUP BY variant, http_status"
        return setup_error_rows(self.store.query(sql, params))

    def unit_moments(self, f: Filters, slo: Slo, unit: str) -> dict[str, UnitMoments]:
        """{variant: moments} per user or per request (analysis.units.moments_select): one
        pass, a GROUP BY per cluster inside it for unit "user"; a few hundred sums per variant
        travel. On a cluster sharded by the unit, one pass per shard over its own table, side
        by side, added up (analysis.readers.shards)."""
        return shards.unit_moments(self.store, f, slo, unit)

    # 4. p99 TTFT per time bucket (chart)

    def p99_over_time(self, f: Filters, bucket_s: int) -> dict[str, list[tuple[int, int, float]]]:
        """{variant: [(bucket start unix s, n, p99)]}.

        Chart only: quantileExact(0.99) takes rank floor(0.99 n) + 1, one rank above
        ceil(0.99 n) when 0.99 n is an integer; the report's own p99 uses the exact ranks.
        """
        fw, params = from_where(f, [metric_ok("ttft_ms")])
        sql = f"""
            SELECT variant, intDiv(toUInt32(sent_at), {int(bucket_s)}) * {int(bucket_s)} AS tb,
                   count() AS n, quantileExact(0.99)(assumeNotNull(ttft_ms)) AS p99
            {fw}
            GROUP BY variant, tb
            ORDER BY variant, tb
        """
        return p99_rows(self.store.query(sql, params))

    # 5. Mirror mode: pair control and variant by (run_id, seq)

    def mirror_pairs(self, f: Filters, slo: Slo, control: str, variant: str) -> dict[str, Any]:
        """Paired counts for McNemar and counts of rounded TTFT differences for Wilcoxon."""
        fw, params = from_where(f, ["mode = 'mirror'"])
        hit, hp = hit_expr(slo)
        side = (
            "SELECT run_id, seq, {hit} AS {p}_hit, ({ok}) AS {p}_ok, ttft_ms AS {p}_ttft "
            "{fw} AND variant = %({p}_variant)s"
        )
        sql = f"""
            SELECT c_hit, v_hit, c_ok AND v_ok AS paired,
                   if(paired, {rounded_sql("assumeNotNull(v_ttft) - assumeNotNull(c_ttft)")}, 0) AS d,
                   count() AS pairs
            FROM ({side.format(hit=hit, ok=metric_ok("ttft_ms"), p="c", fw=fw)}) AS c
            ALL INNER JOIN
                 ({side.format(hit=hit, ok=metric_ok("ttft_ms"), p="v", fw=fw)}) AS v
            USING (run_id, seq)
            GROUP BY c_hit, v_hit, paired, d
        """
        rows = self.store.query(sql, {**params, **hp, "c_variant": control, "v_variant": variant})
        cells = {"both_hit": 0, "control_only": 0, "variant_only": 0, "both_miss": 0}
        diffs: dict[float, int] = {}
        for c_hit, v_hit, paired, d, pairs in rows:
            name = (
                "both_hit"
                if c_hit and v_hit
                else "control_only"
                if c_hit
                else "variant_only"
                if v_hit
                else "both_miss"
            )
            cells[name] += int(pairs)
            if paired:
                diffs[float(d)] = diffs.get(float(d), 0) + int(pairs)
        return {"cells": cells, "diff_values": list(diffs), "diff_counts": list(diffs.values())}

    # 6. Mirror mode: the variant's answers against the control's (analysis.answer_fidelity)

    def fidelity_pairs(
        self, f: Filters, unit: str, control: str, variant: str, *, examples: bool = False
    ) -> dict[str, Any]:
        """{"moments": the identical share's per-cluster sums, "kinds": pair counts by kind and
        first divergence}: one pass over the pairs, one row back. With ``examples`` (the
        experiment stores answers), "examples": a few diverged pairs' texts, from a second query
        that reads only theirs (answer_fidelity.examples_select)."""
        sql, params = answer_fidelity.pairs_select(f, unit, control, variant)
        rows = self.store.query(sql, params)
        out: dict[str, Any] = {"moments": None, "kinds": []}
        if rows:
            *moments, (keys, counts) = rows[0]
            out = {"moments": tuple(moments), "kinds": answer_fidelity.kinds_of(keys, counts)}
        if examples:
            out["examples"] = self.store.query(*answer_fidelity.examples_select(f, control, variant))
        return out

    def fidelity_scores(self, f: Filters, unit: str, control: str) -> dict[str, dict[str, Any]]:
        """{variant: {"moments", "outcomes"}} of the scoring pass's teacher-forced KL, the control's
        noise floor included (answer_fidelity.kl_rows): one pass for the moments, one for the
        outcomes, over the scores alone (a few rows per request picked)."""
        jobs = {
            "moments": lambda: self.store.query(*answer_fidelity.kl_select(f, unit, control)),
            "outcomes": lambda: self.store.query(*answer_fidelity.kl_outcomes_select(f, control)),
        }
        got = run_queries(self.parallel_queries, jobs)
        return answer_fidelity.kl_rows(got["moments"], got["outcomes"])

    def fidelity_shadows(self, f: Filters, unit: str, control: str) -> dict[str, dict[str, Any]]:
        """{variant: {"moments", "kinds"}} of the gateway's live shadows against the control
        (answer_fidelity.shadow_rows): one pass for the identical share's moments, one for the
        counts by outcome and first divergence."""
        jobs = {
            "moments": lambda: self.store.query(*answer_fidelity.shadows_select(f, unit, control)),
            "kinds": lambda: self.store.query(*answer_fidelity.shadow_kinds_select(f, control)),
        }
        got = run_queries(self.parallel_queries, jobs)
        return answer_fidelity.shadow_rows(got["moments"], got["kinds"])

    # 7. Data version (the report cache's key)

    def data_version(self, experiment: str) -> DataVersion:
        """(run_id, rows, sum and max of recorded_ms) per run of an experiment, in run order.

        It changes with every insert, delete and dedup merge (a newer recording replacing an
        older one changes the sum), at the cost of one column scan instead of the report's
        passes. It keys the report cache, and the same per-run (rows, sum) tells which rollups
        are current (merged.report_scope), so a cold page scans the column once."""
        pre, _conds, params = conditions_of(experiment)
        rows = self.store.query(
            f"SELECT run_id, count(), sum(recorded_ms), max(recorded_ms) FROM {SAMPLES} "
            f"PREWHERE {pre} GROUP BY run_id ORDER BY run_id",
            params,
        )
        return tuple((int(r), int(n), int(total), int(newest)) for r, n, total, newest in rows)

    def answers_version(self, experiment: str) -> tuple[int, ...]:
        """(rows, max of the write stamp) of the experiment's fidelity scores and live shadows:
        written after their samples (a scoring pass ends after its run), so the report cache's key
        holds them beside data_version."""
        params = {"experiment": experiment}
        out: list[int] = []
        for table, stamp in ((FIDELITY_SCORES_TABLE, "scored_ms"), (FIDELITY_SHADOWS_TABLE, "recorded_ms")):
            ((n, newest),) = self.store.query(
                f"SELECT count(), max({stamp}) FROM {table} WHERE experiment = %(experiment)s", params
            )
            out += [int(n), int(newest)]
        return tuple(out)

    def run_modes(self, experiment: str) -> dict[int, str]:
        """{run_id: mode} of an experiment's runs from their samples (the mode with the most rows;
        a run has one). For runs without a run catalog row (analysis.runs)."""
        pre, _conds, params = conditions_of(experiment)
        rows = self.store.query(
            f"SELECT run_id, mode, count() FROM {SAMPLES} PREWHERE {pre} GROUP BY run_id, mode", params
        )
        out: dict[int, tuple[int, str]] = {}
        for run_id, mode, n in rows:
            if int(n) > out.get(int(run_id), (-1, ""))[0]:
                out[int(run_id)] = (int(n), str(mode))
        return {r: m for r, (_n, m) in out.items()}

    def signature(self, experiment: str, run_id: int | None = None) -> dict[int, tuple[int, int]]:
        """{run_id: (rows, sum(recorded_ms))} of the samples of an experiment (or of one run)."""
        pre, _conds, params = conditions_of(experiment, run_id)
        rows = self.store.query(
            f"SELECT run_id, count(), sum(recorded_ms) FROM {SAMPLES} PREWHERE {pre} GROUP BY run_id", params
        )
        return {int(r): (int(n), int(s)) for r, n, s in rows}


def conditions_of(experiment: str, run_id: int | None = None) -> tuple[str, list[str], dict[str, Any]]:
    """The PREWHERE of one experiment (or one run of it), from the one WHERE builder."""
    pre, conds, params = conditions(Filters(experiment, run_id=run_id))
    return " AND ".join(pre), conds, params
