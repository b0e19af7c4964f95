"""RollupReader: the report's aggregate queries over the per-run rollup tables (built by
analysis.rollup). A few thousand rollup rows instead of a pass over the samples; the exact order
statistics read only the values of the histogram buckets that hold the ranks, from the table of
every value sorted by (build, variant, metric, bucket), through its primary index.

Where values must be ranked together (order statistics, the p99 chart), the rows of runs
without a build (``live``: Filters naming those runs) are read from the samples in the same
query (UNION ALL). A rollup cannot answer distinct users over several runs nor mirror pairs:
merged.MergedReader, the SampleReader built on this one, reads those from the samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from analysis import units
from analysis.definitions import (
    GAP_METRICS,
    GAP_REQUESTS,
    GRAIN_S,
    GRAIN_SQL,
    METRICS,
    MODES,
    PHASE_COLUMNS,
    SERIES_KEY,
    SERIES_LEVELS_S,
    Filters,
    QueryError,
)
from analysis.readers.base import (
    Failures,
    Summary,
    failure_rows,
    histogram_rows,
    p99_rows,
    setup_error_rows,
    summary_rows,
)
from analysis.sql import (
    HIST_KEYS,
    Hist,
    from_where,
    gap_value_counts,
    gap_values_at_ranks,
    metric_ok,
    values_at_ranks,
    where,
)
from analysis.units import UnitMoments
from samples import schema


def _check_bucket(bucket_s: int) -> None:
    if not isinstance(bucket_s, int) or bucket_s < GRAIN_S or bucket_s % GRAIN_S:
        raise QueryError(f"bucket_s must be a positive multiple of {GRAIN_S}, got {bucket_s!r}")


def series_level(bucket_s: int) -> int:
    """The coarsest p99-chart level a build keeps (GRAIN_S or one of SERIES_LEVELS_S) that
    divides bucket_s: its rows add up to the bucket's exactly."""
    return max((g for g in SERIES_LEVELS_S if bucket_s % g == 0), default=GRAIN_S)


class RollupReader:
    """Reads the given builds ({run_id: build_id}, from merged.report_scope)."""

    def __init__(self, store: Any, builds: Mapping[int, int]) -> None:
        self.store = store
        self.builds = dict(builds)

    def summary(self, f: Filters) -> Summary:
        """RawReader.summary from the rollup cells: the same keys per variant."""
        cond, params = where(f, builds=self.builds)
        metric_n = ", ".join(f"sum(n_{k}) AS n_{k}" for k in (*METRICS, *GAP_REQUESTS))
        modes = ", ".join(f"sumIf(n, mode = '{m}') AS mode_{m}" for m in MODES)
        phases = ", ".join(f"sum(s_{name}) AS s_{name}" for name in PHASE_COLUMNS)
        cols = self.store.query_columns(
            f"""
            SELECT variant, sum(n) AS total, sum(errors) AS errors, sum(hits) AS hits,
                   min(first_ms) AS first_ms, max(last_ms) AS last_ms, {metric_n}, {modes},
                   sum(phase_n) AS phase_n, {phases}
            FROM {schema.ROLLUP_CELLS_TABLE} WHERE {cond}
            GROUP BY variant ORDER BY variant
            """,
            params,
        )
        return summary_rows(cols, n_column="total")

    def histograms(self, f: Filters) -> dict[str, dict[str, tuple[list[int], list[int], list[float]]]]:
        """{metric: {variant: (sorted keys, counts, largest value per key)}} for every metric."""
        cond, params = where(f, builds=self.builds)
        cols = self.store.query_columns(
            f"""
            SELECT metric, variant, k, sum(n) AS c, max(top) AS t
            FROM {schema.ROLLUP_HIST_TABLE} WHERE {cond}
            GROUP BY metric, variant, k ORDER BY metric, variant, k
            """,
            params,
        )
        per_metric: dict[str, list[Sequence[Any]]] = {m: [] for m in METRICS}
        for metric, *row in zip(
            cols.get("metric", []),
            cols.get("variant", []),
            cols.get("k", []),
            cols.get("c", []),
            cols.get("t", []),
            strict=True,
        ):
            per_metric[metric].append(row)
        return {m: histogram_rows(rows) for m, rows in per_metric.items()}

    def order_statistics(
        self,
        f: Filters,
        metric: str,
        hist: Hist,
        ranks: Mapping[str, Sequence[int]],
        live: Filters | None = None,
    ) -> dict[str, dict[int, float]]:
        """RawReader.order_statistics_from_histogram, the values read from the sorted value
        table: the primary index narrows the read to the granules of the buckets that hold the
        ranks. live: the runs without a build, whose values come from the samples; hist must
        then count both. GAP_METRICS: gap_order_statistics."""
        if metric in GAP_METRICS:
            return self.gap_order_statistics(f, metric, hist, ranks, live)
        cond, params = where(f, ["metric = %(metric)s"], builds=self.builds, experiment=False)
        params["metric"] = metric

        def source(keys: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
            sql = (
                f"SELECT CAST(variant AS String) AS variant, v, k FROM {schema.ROLLUP_VALUES_TABLE} "
                f"WHERE {cond} AND k IN %(keys)s"
            )
            bound = {**params, "keys": keys}
            if live is not None:
                column, key = METRICS[metric], HIST_KEYS[metric]
                fw, raw_params = from_where(live, [metric_ok(column), f"{key} IN %(keys)s"])
                sql += (
                    f" UNION ALL SELECT CAST(variant AS String) AS variant, assumeNotNull({column}) AS v, "
                    f"{key} AS k {fw}"
                )
                bound.update(raw_params)
            return f"FROM ({sql})", bound

        return values_at_ranks(self.store, source, "v", "k", hist, ranks)

    def gap_order_statistics(
        self, f: Filters, metric: str, hist: Hist, ranks: Mapping[str, Sequence[int]], live: Filters | None
    ) -> dict[str, dict[int, float]]:
        """{variant: {rank: exact gap in ms}} of a GAP_METRICS metric: the distinct gap values of
        the buckets holding the ranks from rollup_gaps (through its primary index), the live
        runs' from their samples (UNION ALL; their counts add up in sql.gap_values_at_ranks)."""
        cond, params = where(f, builds=self.builds, experiment=False)

        def source(keys: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
            sql = (
                f"SELECT CAST(variant AS String) AS variant, k, v, n FROM {schema.ROLLUP_GAPS_TABLE} "
                f"WHERE {cond} AND k IN %(gap_keys)s"
            )
            bound = {**params, "gap_keys": keys}
            if live is not None:
                raw_sql, raw_params = gap_value_counts(live, metric, keys)
                sql += f" UNION ALL {raw_sql}"
                bound.update(raw_params)
            return sql, bound

        return gap_values_at_ranks(self.store, source, hist, ranks)

    def segment_cells(self, f: Filters, bucket_s: int) -> list[dict[str, Any]]:
        """RawReader.segment_cells from the rollup (bucket_s a multiple of the 10 s grain)."""
        _check_bucket(bucket_s)
        cond, params = where(f, builds=self.builds)
        sql = f"""
            SELECT variant, rev, pb, ib, intDiv(tb, {bucket_s}) * {bucket_s} AS tb2,
                   sum(n) AS n, sum(hits) AS hits, min(first_ms) AS first_ms
            FROM {schema.ROLLUP_CELLS_TABLE} WHERE {cond}
            GROUP BY variant, rev, pb, ib, tb2
        """
        names = ("variant", "rev", "pb", "ib", "tb", "n", "hits", "first_ms")
        return [dict(zip(names, r, strict=True)) for r in self.store.query(sql, params)]

    def srm_users(self, f: Filters) -> list[dict[str, Any]] | None:
        """RawReader.srm_users from the rollup; None when the scope holds several runs (a user
        can appear in more than one, so per-run distinct counts do not add up)."""
        if len(self.builds) != 1:
            return None
        cond, params = where(f, builds=self.builds)
        rows = self.store.query(
            f"SELECT rev, variant, sum(users) FROM {schema.ROLLUP_USERS_TABLE} WHERE {cond} GROUP BY rev, variant",
            params,
        )
        return [{"rev": int(r), "variant": v, "n": int(n)} for r, v, n in rows]

    def failures(self, f: Filters) -> Failures:
        """RawReader.failures from rollup_failures (kind 'failure'): the same classes and
        counts; the status and example of a class are any one of its requests'."""
        cond, params = where(f, ["kind = 'failure'"], builds=self.builds)
        rows = self.store.query(
            f"SELECT variant, outcome, sum(n), any(http_status), any(example) "
            f"FROM {schema.ROLLUP_FAILURES_TABLE} WHERE {cond} GROUP BY variant, outcome",
            params,
        )
        return failure_rows(rows)

    def setup_errors(self, f: Filters) -> Failures:
        """RawReader.setup_errors from rollup_failures (kind 'setup')."""
        cond, params = where(f, ["kind = 'setup'"], builds=self.builds)
        rows = self.store.query(
            f"SELECT variant, http_status, sum(n), any(example) "
            f"FROM {schema.ROLLUP_FAILURES_TABLE} WHERE {cond} GROUP BY variant, http_status",
            params,
        )
        return setup_error_rows(rows)

    def unit_moments(self, f: Filters, unit: str) -> dict[str, UnitMoments] | None:
        """RawReader.unit_moments from the rollup; None for unit "user" when the scope holds
        several runs (a user may appear in more than one, so per-run moments do not add up;
        per-request ones do), and None when a build's rows are not in this code's layout."""
        if unit == "user" and len(self.builds) != 1:
            return None
        cond, params = where(f, ["unit = %(unit)s"], builds=self.builds, experiment=False)
        rows = self.store.query(
            f"SELECT variant, counts, sums FROM {schema.ROLLUP_MOMENTS_TABLE} WHERE {cond}",
            {**params, "unit": unit},
        )
        try:
            return units.rows_to_moments(rows)
        except ValueError:  # another layout than this code's (a build of other code): read raw
            return None

    def p99_over_time(
        self, f: Filters, bucket_s: int, live: Filters | None = None
    ) -> dict[str, list[tuple[int, int, float]]]:
        """RawReader.p99_over_time from the 1 ms TTFT histogram per 10 s: the same rank
        (floor(0.99 n) + 1); the value is the largest TTFT of the 1 ms bucket holding it, so it
        is a sample value within 1 ms of quantileExact's. Chart only, as the raw one.

        The rank is found in SQL (running counts per time bucket, ARRAY JOIN, the first bucket
        reaching the rank): one row per time bucket travels, not one per 1 ms bucket."""
        _check_bucket(bucket_s)
        level = series_level(bucket_s)
        if level == GRAIN_S:
            cond, params = where(f, builds=self.builds)
            rows = f"SELECT variant, tb, k, n, top FROM {schema.ROLLUP_SERIES_TABLE} WHERE {cond}"
        else:  # the build's coarser level that divides the bucket: fewer rows to group again
            cond, params = where(f, [f"g = {level}"], builds=self.builds)
            rows = f"SELECT variant, tb, k, n, top FROM {schema.ROLLUP_SERIES_LEVELS_TABLE} WHERE {cond}"
        if live is not None:  # runs without a build: their samples, one row each
            fw, raw_params = from_where(live, [metric_ok("ttft_ms")])
            rows += (
                f" UNION ALL SELECT CAST(variant AS String) AS variant, {GRAIN_SQL} AS tb, {SERIES_KEY} AS k, "
                f"toUInt64(1) AS n, assumeNotNull(ttft_ms) AS top {fw}"
            )
            params = {**params, **raw_params}
        sql = f"""
            SELECT variant, tb2, total, argMin(t, c) AS p99
            FROM (
                SELECT variant, tb2, sum(c) AS total, toUInt64(floor(0.99 * total)) + 1 AS rnk,
                       arrayCumSum(arraySort((x, y) -> y, groupArray(c), groupArray(k))) AS cum,
                       arraySort((x, y) -> y, groupArray(t), groupArray(k)) AS tops
                FROM (
                    SELECT variant, intDiv(tb, {bucket_s}) * {bucket_s} AS tb2, k, sum(n) AS c, max(top) AS t
                    FROM ({rows})
                    GROUP BY variant, tb2, k
                )
                GROUP BY variant, tb2
            )
            ARRAY JOIN cum AS c, tops AS t
            WHERE c >= rnk
            GROUP BY variant, tb2, total
            ORDER BY variant, tb2
        """
        return p99_rows(self.store.query(sql, params))
