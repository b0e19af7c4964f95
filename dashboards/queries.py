"""Every SQL query of the SLA report. Aggregation happens in ClickHouse; only aggregates return.

Runs unchanged on ClickHouse 18.16 and chDB: no CTEs, no window functions, no DateTime64, client
side %(name)s parameters (samples.sql.bind). Reads deduplicate with FINAL: the samples table is
a ReplacingMergeTree keyed on (experiment, variant, run_id, seq, request_id), and FINAL measured
faster than argMax-per-key on 18.16 (bench/bench_report.py prints both).

Order statistics are exact: ClickHouse's quantileExact(level) returns the element at 0-based
index floor(level * n) of the sorted values, so asking for level (r - 0.5) / n returns exactly
the r-th smallest value (1-based rank r, the ranks dashboards.stats asks for). All quantiles of
all metrics of all variants come back from a single pass (quantilesExactIf per variant).

Definitions shared with the report:
- a request meets the SLA when outcome = 'ok' and every SLO holds with a strict "<"
  (TTFT under sla_ttft_ms, and TPOT / end-to-end when the experiment sets them); a metric the
  request never produced is a miss;
- latency percentiles are over successful requests (outcome = 'ok') that produced the metric:
  failures are counted once, as errors and misses, not as latencies.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Mapping, Sequence
from typing import Any

from dashboards.attribution import INFLIGHT_EDGES, PROMPT_TOKEN_EDGES
from samples import schema

# metric key in the report -> samples column
METRICS: dict[str, str] = {
    "ttft_ms": "ttft_ms",
    "ttfb_ms": "ttfb_ms",
    "itl_ms": "itl_mean_ms",  # per-request mean inter-token latency
    "tpot_ms": "tpot_ms",
    "e2e_ms": "e2e_ms",
}
METRIC_LABELS = {
    "ttft_ms": "TTFT",
    "ttfb_ms": "TTFB",
    "itl_ms": "ITL (per-request mean)",
    "tpot_ms": "TPOT",
    "e2e_ms": "End-to-end",
}
CDF_LEVELS: tuple[float, ...] = tuple(i / 400 for i in range(1, 400)) + (0.9975, 0.999)
# TTFT (and mirror differences) rounded to 0.1 ms for the rank tests' counts, half up, as
# floor(x * 10 + 0.5) / 10: the same IEEE arithmetic everywhere, unlike round(), whose ties
# differ between 18.16, chDB and numpy.
MW_SCALE = 10


def rounded_sql(expr: str) -> str:
    return f"floor(({expr}) * {MW_SCALE} + 0.5) / {MW_SCALE}"


TIME_BUCKETS_S = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
MAX_TIME_BUCKETS = 120


class QueryError(ValueError):
    """A bad filter or SLO; the message names the value."""


@dataclasses.dataclass(frozen=True)
class Filters:
    experiment: str
    run_id: int | None = None
    since: dt.datetime | None = None  # inclusive, on sent_at (UTC)
    until: dt.datetime | None = None  # exclusive
    variants: tuple[str, ...] = ()  # empty: all

    def __post_init__(self) -> None:
        if not self.experiment:
            raise QueryError("Filters.experiment must be a non-empty key")
        if self.run_id is not None and (
            isinstance(self.run_id, bool) or not isinstance(self.run_id, int) or self.run_id < 0
        ):
            raise QueryError(f"Filters.run_id must be a non-negative integer, got {self.run_id!r}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, dt.datetime) or value.tzinfo is None):
                raise QueryError(f"Filters.{name} must be a timezone-aware datetime, got {value!r}")
        if self.since and self.until and self.since >= self.until:
            raise QueryError(f"Filters: since ({self.since}) must be before until ({self.until})")

    def as_dict(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "run_id": self.run_id,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "variants": list(self.variants),
        }


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is None and name != "ttft_ms":
                continue
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise QueryError(f"Slo.{name} must be a positive number of ms, got {value!r}")

    def limits(self) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2e_ms", self.e2e_ms))
            if v is not None
        }


def where_clause(f: Filters, extra: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    conds = ["experiment = %(experiment)s"]
    params: dict[str, Any] = {"experiment": f.experiment}
    if f.run_id is not None:
        conds.append("run_id = %(run_id)s")
        params["run_id"] = f.run_id
    if f.since is not None:
        conds.append("sent_at >= %(since)s")
        params["since"] = f.since
    if f.until is not None:
        conds.append("sent_at < %(until)s")
        params["until"] = f.until
    if f.variants:
        conds.append("variant IN %(variants)s")
        params["variants"] = tuple(f.variants)
    conds.extend(extra)
    return " AND ".join(conds), params


def hit_expr(slo: Slo) -> tuple[str, dict[str, Any]]:
    """SQL boolean: the request met every SLO (NULL metric -> miss, error -> miss)."""
    parts = ["outcome = 'ok'"]
    params: dict[str, Any] = {}
    for name, limit in slo.limits().items():
        parts.append(f"ifNull({name} < %(slo_{name})s, 0)")
        params[f"slo_{name}"] = limit
    return "(" + " AND ".join(parts) + ")", params


def _metric_ok(column: str) -> str:
    return f"outcome = 'ok' AND isNotNull({column})"


# ---------------------------------------------------------------------------------------------
# 1. Summary per variant: counts, hits, window, metric counts, phase sums of misses, the CDF

_PHASE_SQL = {
    "schedule_lag": "schedule_lag_ms",
    "connect": "ifNull(connect_ms, 0)",
    "headers": "assumeNotNull(ttfb_ms) - ifNull(connect_ms, 0)",
    "headers_to_first_event": "assumeNotNull(ttft_event_ms) - assumeNotNull(ttfb_ms)",
    "first_event_to_first_content": "assumeNotNull(ttft_ms) - assumeNotNull(ttft_event_ms)",
}
# Misses with a complete TTFT timeline (a failed request without TTFT has no phases to split).
_PHASE_ROWS = "isNotNull(ttft_ms) AND isNotNull(ttfb_ms) AND isNotNull(ttft_event_ms)"


def summary(store: Any, f: Filters, slo: Slo) -> dict[str, dict[str, Any]]:
    where, params = where_clause(f)
    hit, hp = hit_expr(slo)
    metric_counts = ", ".join(f"countIf({_metric_ok(col)}) AS n_{key}" for key, col in METRICS.items())
    phase_sums = ", ".join(
        f"sumIf({expr}, NOT {hit} AND {_PHASE_ROWS}) AS phase_{name}" for name, expr in _PHASE_SQL.items()
    )
    levels = ", ".join(repr(x) for x in CDF_LEVELS)
    sql = f"""
        SELECT variant, count() AS n, countIf(outcome != 'ok') AS errors, countIf({hit}) AS hits,
               min(sent_unix_ms) AS first_ms, max(sent_unix_ms) AS last_ms,
               {metric_counts},
               countIf(NOT {hit} AND {_PHASE_ROWS}) AS phase_n, {phase_sums},
               quantilesExactIf({levels})(assumeNotNull(ttft_ms), {_metric_ok("ttft_ms")}) AS cdf
        FROM {schema.SAMPLES_FROM}
        WHERE {where}
        GROUP BY variant
        ORDER BY variant
    """
    cols = store.query_columns(sql, {**params, **hp})
    out: dict[str, dict[str, Any]] = {}
    for i, variant in enumerate(cols.get("variant", [])):
        row = {name: values[i] for name, values in cols.items()}
        out[variant] = {
            "n": int(row["n"]),
            "errors": int(row["errors"]),
            "hits": int(row["hits"]),
            "first_ms": float(row["first_ms"]),
            "last_ms": float(row["last_ms"]),
            "metric_n": {k: int(row[f"n_{k}"]) for k in METRICS},
            "phase_n": int(row["phase_n"]),
            "phase_sums": {p: float(row[f"phase_{p}"]) for p in _PHASE_SQL},
            "cdf": {
                "levels": list(CDF_LEVELS),
                "values": [float(x) for x in row["cdf"]] if row["n_ttft_ms"] else [],
            },
        }
    return out


# ---------------------------------------------------------------------------------------------
# 2. Exact order statistics at given ranks, every variant and metric in one pass


def rank_level(rank: int, n: int) -> float:
    """quantileExact level that returns the rank-th smallest (1-based) of n values."""
    if not 1 <= rank <= n:
        raise QueryError(f"rank {rank} outside 1..{n}")
    return (rank - 0.5) / n


def order_statistics(
    store: Any, f: Filters, plan: Mapping[tuple[str, str], tuple[int, Sequence[int]]]
) -> dict[tuple[str, str], dict[int, float]]:
    """{(variant, metric): {rank: value}} for plan {(variant, metric): (n, ranks)}.

    n must be the count of successful requests with that metric (summary()["metric_n"]).
    """
    where, params = where_clause(f)
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
            f"variant = %(v{i})s AND {_metric_ok(column)}) AS q{len(keys)}"
        )
        keys.append(((variant, metric), ranks))
    if not selects:
        return {}
    sql = f"SELECT {', '.join(selects)} FROM {schema.SAMPLES_FROM} WHERE {where}"
    row = store.query(sql, params)[0]
    out: dict[tuple[str, str], dict[int, float]] = {}
    for (key, ranks), values in zip(keys, row, strict=True):
        out[key] = {r: float(v) for r, v in zip(ranks, values, strict=True)}
    return out


# ---------------------------------------------------------------------------------------------
# 3. Counts per rounded TTFT value for the Mann-Whitney test


def ttft_value_counts(store: Any, f: Filters) -> dict[str, tuple[list[float], list[int]]]:
    where, params = where_clause(f, [_metric_ok("ttft_ms")])
    sql = f"""
        SELECT variant, {rounded_sql("assumeNotNull(ttft_ms)")} AS v, count() AS c
        FROM {schema.SAMPLES_FROM}
        WHERE {where}
        GROUP BY variant, v
        ORDER BY variant, v
    """
    out: dict[str, tuple[list[float], list[int]]] = {}
    for variant, value, count in store.query(sql, params):
        values, counts = out.setdefault(variant, ([], []))
        values.append(float(value))
        counts.append(int(count))
    return out


# ---------------------------------------------------------------------------------------------
# 4. Segments: (variant, config revision, prompt bucket, in-flight bucket, time bucket) cells


def choose_bucket_s(window_s: float) -> int:
    for b in TIME_BUCKETS_S:
        if window_s / b <= MAX_TIME_BUCKETS:
            return b
    return TIME_BUCKETS_S[-1]


def bucket_sql(column: str, edges: Sequence[float]) -> str:
    """Bucket index = number of edges <= x (attribution.bucket_index). A sum of comparisons,
    not arrayCount(e -> e <= x, [...]): 18.16 cannot see columns inside that lambda under
    GROUP BY ("Unknown identifier")."""
    return "(" + " + ".join(f"({column} >= {float(e)!r})" for e in edges) + ")"


def segment_cells(store: Any, f: Filters, slo: Slo, bucket_s: int) -> list[dict[str, Any]]:
    """One row per non-empty cell; the report sums them along each dimension.

    Also carries the SRM counts (per config revision) and the first send time of each revision,
    so one pass serves segments, SRM and the weight-change markers.
    """
    if not isinstance(bucket_s, int) or bucket_s < 1:
        raise QueryError(f"bucket_s must be a positive integer, got {bucket_s!r}")
    where, params = where_clause(f)
    hit, hp = hit_expr(slo)
    sql = f"""
        SELECT variant, config_revision AS rev,
               {bucket_sql("prompt_tokens", PROMPT_TOKEN_EDGES)} AS pb,
               {bucket_sql("in_flight", INFLIGHT_EDGES)} AS ib,
               intDiv(toUInt32(sent_at), {bucket_s}) * {bucket_s} AS tb,
               count() AS n, countIf({hit}) AS hits, min(sent_unix_ms) AS first_ms
        FROM {schema.SAMPLES_FROM}
        WHERE {where}
        GROUP BY variant, rev, pb, ib, tb
    """
    names = ("variant", "rev", "pb", "ib", "tb", "n", "hits", "first_ms")
    return [dict(zip(names, r, strict=True)) for r in store.query(sql, {**params, **hp})]


# ---------------------------------------------------------------------------------------------
# 5. p99 TTFT per time bucket (chart)


def p99_over_time(store: Any, f: Filters, bucket_s: int) -> dict[str, list[tuple[int, int, float]]]:
    """{variant: [(bucket start unix s, n, p99)]}.

    Chart only: quantileExact(0.99) takes rank floor(0.99 n) + 1, one rank above ceil(0.99 n)
    when 0.99 n is an integer; the report's own p99 uses the exact ranks.
    """
    where, params = where_clause(f, [_metric_ok("ttft_ms")])
    sql = f"""
        SELECT variant, intDiv(toUInt32(sent_at), {int(bucket_s)}) * {int(bucket_s)} AS tb,
               count() AS n, quantileExact(0.99)(assumeNotNull(ttft_ms)) AS p99
        FROM {schema.SAMPLES_FROM}
        WHERE {where}
        GROUP BY variant, tb
        ORDER BY variant, tb
    """
    out: dict[str, list[tuple[int, int, float]]] = {}
    for variant, tb, n, p99 in store.query(sql, params):
        out.setdefault(variant, []).append((int(tb), int(n), float(p99)))
    return out


# ---------------------------------------------------------------------------------------------
# 6. Mirror mode: pair control and variant by (run_id, seq)


def modes(store: Any, f: Filters) -> dict[str, int]:
    where, params = where_clause(f)
    rows = store.query(
        f"SELECT mode, count() FROM {schema.SAMPLES_TABLE} WHERE {where} GROUP BY mode", params
    )
    return {m: int(c) for m, c in rows}


def mirror_pairs(store: Any, f: Filters, slo: Slo, control: str, variant: str) -> dict[str, Any]:
    """Paired counts for McNemar and counts of rounded TTFT differences for Wilcoxon."""
    where, params = where_clause(f, ["mode = 'mirror'"])
    hit, hp = hit_expr(slo)
    side = (
        "SELECT run_id, seq, {hit} AS {p}_hit, ({ok}) AS {p}_ok, ttft_ms AS {p}_ttft "
        "FROM " + schema.SAMPLES_FROM + " WHERE {where} AND variant = %({p}_variant)s"
    )
    sql = f"""
        SELECT c_hit, v_hit, c_ok AND v_ok AS paired,
               if(paired, {rounded_sql("assumeNotNull(v_ttft) - assumeNotNull(c_ttft)")}, 0) AS d,
               count() AS pairs
        FROM ({side.format(hit=hit, ok=_metric_ok("ttft_ms"), p="c", where=where)}) AS c
        ALL INNER JOIN
             ({side.format(hit=hit, ok=_metric_ok("ttft_ms"), p="v", where=where)}) AS v
        USING (run_id, seq)
        GROUP BY c_hit, v_hit, paired, d
    """
    rows = store.query(sql, {**params, **hp, "c_variant": control, "v_variant": variant})
    cells = {"both_hit": 0, "control_only": 0, "variant_only": 0, "both_miss": 0}
    diffs: dict[float, int] = {}
    for c_hit, v_hit, paired, d, pairs in rows:
        name = (
            "both_hit" if c_hit and v_hit else
            "control_only" if c_hit else "variant_only" if v_hit else "both_miss"
        )  # fmt: skip
        cells[name] += int(pairs)
        if paired:
            diffs[float(d)] = diffs.get(float(d), 0) + int(pairs)
    return {"cells": cells, "diff_values": list(diffs), "diff_counts": list(diffs.values())}
