"""Every SQL query of the SLA report. Aggregation happens in ClickHouse; only aggregates return.

Runs unchanged on ClickHouse 18.16 and chDB: no CTEs, no window functions, no DateTime64, client
side %(name)s parameters (samples.sql.bind).

No FINAL (it cost ~7 s per pass at 10M rows on 18.16). Reads rely on the dedup contract: a
completed run holds one row per (experiment, variant, run_id, seq, request_id). Exactly-once is
enforced at write time (a redelivered shard skips stored request ids; the spool flush filters
stored keys), and the replay's finish step checks count() == uniqExact(variant, request_id) and
calls SampleStore.deduplicate(run_id) (OPTIMIZE ... PARTITION p FINAL) when they differ. A run
still in progress may transiently show a duplicate after an insert retry, until its finish step.

Order statistics are exact: ClickHouse's quantileExact(level) returns the element at 0-based
index floor(level * n) of the sorted values, so asking for level (r - 0.5) / n returns exactly
the r-th smallest value (1-based rank r, the ranks analysis.stats asks for). TTFT ranks are
selected in two steps instead: the histogram of TTFT at 0.1 ms (the Mann-Whitney counts, needed
anyway) says which 0.1 ms bucket holds each rank and its place there; a second pass sorts only
the values of those few buckets (order_statistics_from_histogram). The CDF chart comes from the same
histogram: each point is (largest TTFT of a bucket, exact share of requests <= it), so it needs
no ranks at all (400 quantileExact levels cost more than every other query together on 18.16).

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

from analysis.attribution import INFLIGHT_EDGES, PROMPT_TOKEN_EDGES
from samples import schema
from samples.columns import MODES

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
    # Only these runs (the report's raw part beside per-run rollups; not an analyst filter,
    # so not in as_dict). Empty: no restriction.
    runs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.experiment:
            raise QueryError("Filters.experiment must be a non-empty key")
        for run in self.runs:
            if isinstance(run, bool) or not isinstance(run, int) or run < 0:
                raise QueryError(f"Filters.runs must hold non-negative integers, got {run!r}")
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


# What analytics read: the raw table, no FINAL (see the dedup contract above).
SAMPLES = schema.SAMPLES_TABLE


def _conditions(f: Filters, extra: Sequence[str]) -> tuple[list[str], list[str], dict[str, Any]]:
    pre = ["experiment = %(experiment)s"]
    conds: list[str] = []
    params: dict[str, Any] = {"experiment": f.experiment}
    if f.run_id is not None:
        pre.append("run_id = %(run_id)s")
        params["run_id"] = f.run_id
    if f.runs:
        pre.append("run_id IN %(runs)s")
        params["runs"] = tuple(f.runs)
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
    return pre, conds, params


def where_clause(f: Filters, extra: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    pre, conds, params = _conditions(f, extra)
    return " AND ".join(pre + conds), params


def from_where(f: Filters, extra: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """FROM samples PREWHERE <experiment, run> WHERE <the rest>; no FINAL (dedup contract)."""
    pre, conds, params = _conditions(f, extra)
    sql = f"FROM {SAMPLES} PREWHERE {' AND '.join(pre)}"
    return (sql + f" WHERE {' AND '.join(conds)}" if conds else sql), params


def hit_expr(slo: Slo) -> tuple[str, dict[str, Any]]:
    """SQL boolean: the request met every SLO (NULL metric -> miss, error -> miss)."""
    parts = ["outcome = 'ok'"]
    params: dict[str, Any] = {}
    for name, limit in slo.limits().items():
        parts.append(f"ifNull({name} < %(slo_{name})s, 0)")
        params[f"slo_{name}"] = limit
    return "(" + " AND ".join(parts) + ")", params


def metric_ok(column: str) -> str:
    return f"outcome = 'ok' AND isNotNull({column})"


# ---------------------------------------------------------------------------------------------
# 1. Summary per variant: counts, hits, window, metric counts, modes


def summary(store: Any, f: Filters, slo: Slo) -> dict[str, dict[str, Any]]:
    """Per variant: n, errors, hits, first/last send (unix ms), metric_n, mode counts."""
    fw, params = from_where(f)
    hit, hp = hit_expr(slo)
    metric_counts = ", ".join(f"countIf({metric_ok(col)}) AS n_{key}" for key, col in METRICS.items())
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
    return summary_rows(store.query_columns(sql, {**params, **hp}))


def summary_rows(cols: Mapping[str, Sequence[Any]], n_column: str = "n") -> dict[str, dict[str, Any]]:
    """{variant: summary} from the columns of a summary query (variant, n_column, errors, hits,
    first_ms, last_ms, n_<metric>, mode_<mode>; phase_n and s_<phase> when present)."""
    out: dict[str, dict[str, Any]] = {}
    for i, variant in enumerate(cols.get("variant", [])):
        row = {name: values[i] for name, values in cols.items()}
        out[variant] = {
            "n": int(row[n_column]),
            "errors": int(row["errors"]),
            "hits": int(row["hits"]),
            "first_ms": float(row["first_ms"]),
            "last_ms": float(row["last_ms"]),
            "metric_n": {k: int(row[f"n_{k}"]) for k in METRICS},
            "modes": {m: int(row[f"mode_{m}"]) for m in MODES},
        }
        if "phase_n" in row:
            out[variant]["phase_n"] = int(row["phase_n"])
            out[variant]["phase_sums"] = phases_from_sums(
                {name: float(row[f"s_{name}"]) for name in PHASE_COLUMNS}
            )
    return out


def mode_counts(summ: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """{mode: rows} over the summary's variants (no pass of its own)."""
    out: dict[str, int] = {}
    for s in summ.values():
        for m, c in s["modes"].items():
            if c:
                out[m] = out.get(m, 0) + c
    return out


# ---------------------------------------------------------------------------------------------
# 1b. Phase sums of misses

PHASE_COLUMNS = {
    "schedule_lag": "schedule_lag_ms",
    "connect": "ifNull(connect_ms, 0)",
    "ttfb": "assumeNotNull(ttfb_ms)",
    "ttft_event": "assumeNotNull(ttft_event_ms)",
    "ttft": "assumeNotNull(ttft_ms)",
}
# Misses with a complete TTFT timeline (a failed request without TTFT has no phases to split).
PHASE_ROWS = "isNotNull(ttft_ms) AND isNotNull(ttfb_ms) AND isNotNull(ttft_event_ms)"
PHASES = ("schedule_lag", "connect", "headers", "headers_to_first_event", "first_event_to_first_content")


def phase_sums(store: Any, f: Filters, slo: Slo) -> dict[str, dict[str, Any]]:
    """{variant: {"phase_n", "phase_sums": {phase: total ms}}} over misses.

    Sums of the five timestamps, differenced in Python (a sum of differences is the difference
    of sums), with the miss filter in WHERE: a fifth of the aggregates of sumIf per phase.
    """
    hit, hp = hit_expr(slo)
    fw, params = from_where(f, [f"NOT {hit}", PHASE_ROWS])
    sums = ", ".join(f"sum({expr}) AS s_{name}" for name, expr in PHASE_COLUMNS.items())
    cols = store.query_columns(
        f"SELECT variant, count() AS n, {sums} {fw} GROUP BY variant", {**params, **hp}
    )
    out: dict[str, dict[str, Any]] = {}
    for i, variant in enumerate(cols.get("variant", [])):
        t = {name: float(cols[f"s_{name}"][i]) for name in PHASE_COLUMNS}
        out[variant] = {"phase_n": int(cols["n"][i]), "phase_sums": phases_from_sums(t)}
    return out


def phases_from_sums(t: Mapping[str, float]) -> dict[str, float]:
    """Phase totals from the sums of the timestamps (PHASE_COLUMNS keys)."""
    return {
        "schedule_lag": t["schedule_lag"],
        "connect": t["connect"],
        "headers": t["ttfb"] - t["connect"],
        "headers_to_first_event": t["ttft_event"] - t["ttfb"],
        "first_event_to_first_content": t["ttft"] - t["ttft_event"],
    }


# ---------------------------------------------------------------------------------------------
# 2. Exact order statistics at given ranks (quantilesExact; a few ranks per metric)


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
    row = store.query(f"SELECT {', '.join(selects)} {fw}", params)[0]
    out: dict[tuple[str, str], dict[int, float]] = {}
    for (key, ranks), values in zip(keys, row, strict=True):
        out[key] = {r: float(v) for r, v in zip(ranks, values, strict=True)}
    return out


# ---------------------------------------------------------------------------------------------
# 3. TTFT at 0.1 ms: the Mann-Whitney counts, and the histogram that locates TTFT ranks

# integer bucket of the rounded TTFT: compared as integers (a float literal in SQL might parse
# one ulp away from the computed value on 18.16)
_TTFT_KEY = f"toInt64(floor(assumeNotNull(ttft_ms) * {MW_SCALE} + 0.5))"
# Histogram keys per metric, each monotone in the value, so a bucket's running count locates any
# rank: TTFT at 0.1 ms (the rank test's rounding, also the CDF's), the others in relative steps
# of 0.2% (e2e spans seconds: 0.1 ms steps would make 10^5 buckets per variant; the report reads
# every bucket, the exact pass only the values of the few buckets that hold a rank).
LOG_STEPS = 500


def _log_key(column: str) -> str:
    return f"toInt64(floor(log(greatest(assumeNotNull({column}), 0.001)) * {LOG_STEPS}))"


HIST_KEYS: dict[str, str] = {
    metric: _TTFT_KEY if metric == "ttft_ms" else _log_key(column) for metric, column in METRICS.items()
}


def histogram(store: Any, f: Filters, metric: str) -> dict[str, tuple[list[int], list[int], list[float]]]:
    """{variant: (sorted keys, counts, largest value in each key)} of a metric over successful
    requests, keyed by HIST_KEYS[metric]."""
    column = METRICS[metric]
    fw, params = from_where(f, [metric_ok(column)])
    sql = (
        f"SELECT variant, {HIST_KEYS[metric]} AS k, count() AS c, max(assumeNotNull({column})) AS top "
        f"{fw} GROUP BY variant, k ORDER BY variant, k"
    )
    out: dict[str, tuple[list[int], list[int], list[float]]] = {}
    for variant, key, count, top in store.query(sql, params):
        keys, counts, tops = out.setdefault(variant, ([], [], []))
        keys.append(int(key))
        counts.append(int(count))
        tops.append(float(top))
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
    import numpy as np

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
    # k / 10 in IEEE double is what floor(x * 10 + 0.5) / 10 gives in SQL
    return {v: ([k / MW_SCALE for k in h[0]], list(h[1])) for v, h in hist.items()}


def order_statistics_from_histogram(
    store: Any,
    f: Filters,
    metric: str,
    hist: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]],
    ranks: Mapping[str, Sequence[int]],
) -> dict[str, dict[int, float]]:
    """{variant: {rank: exact value}} for 1-based ranks of a metric, located through its
    histogram (keys HIST_KEYS[metric], counts of successful requests with the metric), the
    values read from the samples (analysis.rollup reads them from its sorted value table)."""
    column = METRICS[metric]

    def source(all_keys: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
        fw, params = from_where(f, [metric_ok(column), f"{HIST_KEYS[metric]} IN %(tk_all)s"])
        return fw, {**params, "tk_all": all_keys}

    return values_at_ranks(store, source, f"assumeNotNull({column})", HIST_KEYS[metric], hist, ranks)


def values_at_ranks(
    store: Any,
    source: Any,
    value_sql: str,
    key_sql: str,
    hist: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]],
    ranks: Mapping[str, Sequence[int]],
) -> dict[str, dict[int, float]]:
    """{variant: {rank: exact value}}: the rank-th smallest values, located through a histogram.

    1. The histogram's running count says which bucket holds rank r and how many values lie in
       lower buckets. The key is monotone, so every value of a lower bucket is <= every value
       of a higher one.
    2. One pass collects, per variant, only the values of the buckets needed, sorted; rank r is
       at position r - (values below its bucket) + (collected values below its bucket).
    source(keys) -> (FROM ... WHERE ..., params) gives the rows (with a `variant` column) whose
    key_sql is one of keys; value_sql is the value to rank.
    """
    import numpy as np

    inner: list[str] = []
    outer: list[str] = []
    wanted: list[tuple[str, list[int]]] = []
    all_keys: set[int] = set()
    params: dict[str, Any] = {}
    for variant, rs in sorted(ranks.items()):
        if variant not in hist or not rs:
            continue
        keys = np.asarray(hist[variant][0], dtype=np.int64)
        counts = np.asarray(hist[variant][1], dtype=np.int64)
        cum = np.cumsum(counts)
        rs = sorted(set(int(r) for r in rs))
        if rs[0] < 1 or rs[-1] > int(cum[-1]):
            raise QueryError(f"rank outside 1..{int(cum[-1])} for variant {variant!r}: {rs}")
        idx = np.searchsorted(cum, np.asarray(rs), side="left")  # the bucket holding each rank
        chosen = np.unique(idx)
        taken = np.zeros(keys.size, dtype=np.int64)
        taken[chosen] = counts[chosen]
        below = cum[idx] - counts[idx]  # values in lower buckets
        taken_below = (np.cumsum(taken) - taken)[idx]  # collected values in lower buckets
        positions = np.asarray(rs) - below + taken_below  # 1-based, in the collected array
        j = len(wanted)
        params[f"tv{j}"] = variant
        params[f"tk{j}"] = tuple(int(k) for k in keys[chosen])
        all_keys.update(params[f"tk{j}"])
        inner.append(
            f"arraySort(groupArrayIf({value_sql}, variant = %(tv{j})s AND {key_sql} IN %(tk{j})s)) AS s{j}"
        )
        # one element per expression: 18.16 loses outer columns in a second arrayMap lambda
        outer.extend(f"s{j}[{int(p)}]" for p in positions)
        wanted.append((variant, rs))
    if not wanted:
        return {}
    fw, fparams = source(tuple(sorted(all_keys)))
    sql = f"SELECT {', '.join(outer)} FROM (SELECT {', '.join(inner)} {fw})"
    row = iter(store.query(sql, {**fparams, **params})[0])
    return {variant: {r: float(next(row)) for r in rs} for variant, rs in wanted}


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
    return [dict(zip(names, r, strict=True)) for r in store.query(sql, {**params, **hp})]


# Distinct users, counted on a 64-bit hash of the id: uniqExact(user_id) already counts 128-bit
# SipHash values of the strings; CityHash64 was 2.8x faster at 10M distinct users on 18.16
# (0.99 vs 2.76 s), and a collision (probability ~3e-6 at 10^7 users) changes a count by one.
DISTINCT_USERS = "uniqExact(cityHash64(user_id))"


def srm_users(store: Any, f: Filters) -> list[dict[str, Any]]:
    """Distinct users per (config revision, variant) in split mode: the unit the router
    assigns, so the unit sample ratio mismatch is tested on. Requests are not independent
    draws (a heavy user sends many, all to one variant), so request counts would flag SRM on
    healthy traffic."""
    fw, params = from_where(f, ["mode = 'split'"])
    sql = f"SELECT config_revision AS rev, variant, {DISTINCT_USERS} AS users {fw} GROUP BY rev, variant"
    return [{"rev": int(r), "variant": v, "n": int(n)} for r, v, n in store.query(sql, params)]


# ---------------------------------------------------------------------------------------------
# 5. p99 TTFT per time bucket (chart)


def p99_over_time(store: Any, f: Filters, bucket_s: int) -> dict[str, list[tuple[int, int, float]]]:
    """{variant: [(bucket start unix s, n, p99)]}.

    Chart only: quantileExact(0.99) takes rank floor(0.99 n) + 1, one rank above ceil(0.99 n)
    when 0.99 n is an integer; the report's own p99 uses the exact ranks.
    """
    fw, params = from_where(f, [metric_ok("ttft_ms")])
    sql = f"""
        SELECT variant, intDiv(toUInt32(sent_at), {int(bucket_s)}) * {int(bucket_s)} AS tb,
               count() AS n, quantileExact(0.99)(assumeNotNull(ttft_ms)) AS p99
        {fw}
        GROUP BY variant, tb
        ORDER BY variant, tb
    """
    out: dict[str, list[tuple[int, int, float]]] = {}
    for variant, tb, n, p99 in store.query(sql, params):
        out.setdefault(variant, []).append((int(tb), int(n), float(p99)))
    return out


# ---------------------------------------------------------------------------------------------
# 6. Mirror mode: pair control and variant by (run_id, seq)


def mirror_pairs(store: Any, f: Filters, slo: Slo, control: str, variant: str) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------
# 7. Data version (the report cache's key)


def data_version(store: Any, experiment: str) -> tuple[tuple[int, int, int, int], ...]:
    """(run_id, rows, sum and max of recorded_ms) per run of an experiment, in run order.

    It changes with every insert, delete and dedup merge (a newer recording replacing an older
    one changes the sum), at the cost of one column scan instead of the report's passes. It
    keys the report cache, and the same per-run (rows, sum) tells which rollups are current
    (rollup.report_scope), so a cold page scans the column once."""
    rows = store.query(
        f"SELECT run_id, count(), sum(recorded_ms), max(recorded_ms) FROM {SAMPLES} "
        "PREWHERE experiment = %(e)s GROUP BY run_id ORDER BY run_id",
        {"e": experiment},
    )
    return tuple((int(r), int(n), int(total), int(newest)) for r, n, total, newest in rows)
