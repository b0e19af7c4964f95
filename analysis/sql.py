"""SQL building blocks shared by the readers and the rollup build: the one WHERE builder, the
"meets every SLO" expression, metric and bucket expressions, and locating ranks through a
histogram. Strings and parameters only: nothing here runs a query it was not handed a store for.

Runs unchanged on ClickHouse 18.16 and chDB: no CTEs, no window functions, no DateTime64, client
side %(name)s parameters (samples.sql.bind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from analysis.definitions import GAP_METRICS, METRICS, MW_SCALE, SETUP_ERROR, Filters, QueryError, Slo
from samples import schema

# What analytics read: the raw table, no FINAL (the dedup contract, analysis.readers.raw).
SAMPLES = schema.SAMPLES_TABLE

# A histogram: per variant, (sorted keys, counts, largest value in each key).
Hist = Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]]


def conditions(
    f: Filters,
    extra: Sequence[str] = (),
    *,
    builds: Mapping[int, int] | None = None,
    experiment: bool = True,
) -> tuple[list[str], list[str], dict[str, Any]]:
    """The one WHERE builder: (key conditions, other conditions, parameters) for filters f.

    Key conditions (experiment, run) go to PREWHERE on the samples table. With ``builds``
    ({run_id: build_id}, a rollup read) the runs are named by their builds instead:
    ``(run_id, build_id) IN (...)``, or ``build_id IN (...)`` for a table without an experiment
    column (experiment=False); a rollup has no send time, so since/until are refused there.
    """
    pre: list[str] = []
    conds: list[str] = []
    params: dict[str, Any] = {}
    if experiment:
        pre.append("experiment = %(experiment)s")
        params["experiment"] = f.experiment
    if builds is not None:
        if f.since is not None or f.until is not None:
            raise QueryError("a rollup read cannot take a time window (its cells are 10 s wide)")
        if experiment:
            pairs = ", ".join(f"({int(r)}, {int(b)})" for r, b in sorted(builds.items()))
            pre.append(f"(run_id, build_id) IN ({pairs})")
        else:
            pre.append("build_id IN %(builds)s")
            params["builds"] = tuple(sorted(builds.values()))
    else:
        pre.extend(run_conditions(f, params))
    conds.extend(window_conditions(f, params))
    conds.extend(extra)
    return pre, conds, params


def window_conditions(f: Filters, params: dict[str, Any]) -> list[str]:
    """The conditions on the send time (since/until) and the variants a filter asks for, their
    values put in ``params``: the samples and the live shadows are read by the same."""
    conds: list[str] = []
    if f.since is not None:
        conds.append("sent_at >= %(since)s")
        params["since"] = f.since
    if f.until is not None:
        conds.append("sent_at < %(until)s")
        params["until"] = f.until
    if f.variants:
        conds.append("variant IN %(variants)s")
        params["variants"] = tuple(f.variants)
    return conds


def run_conditions(f: Filters, params: dict[str, Any]) -> list[str]:
    """The conditions on ``run_id`` a filter asks for (one run, a set of runs, or none at all),
    their values put in ``params``: the samples and the server metrics are read by the same."""
    conds = []
    if f.run_id is not None:
        conds.append("run_id = %(run_id)s")
        params["run_id"] = f.run_id
    if f.runs:
        conds.append("run_id IN %(runs)s")
        params["runs"] = tuple(f.runs)
    elif f.runs is not None:  # no run at all (an empty IN list is not valid SQL on 18.16)
        conds.append("run_id != run_id")
    return conds


def where(
    f: Filters,
    extra: Sequence[str] = (),
    *,
    builds: Mapping[int, int] | None = None,
    experiment: bool = True,
) -> tuple[str, dict[str, Any]]:
    """All of ``conditions`` joined for one WHERE (the rollup tables)."""
    pre, conds, params = conditions(f, extra, builds=builds, experiment=experiment)
    return " AND ".join(pre + conds), params


# The samples every figure of the report is computed on: all but the setup errors
# (definitions.SETUP_ERROR), which are counted apart (RawReader.setup_errors).
JUDGED = f"NOT {SETUP_ERROR}"


def from_where(
    f: Filters, extra: Sequence[str] = (), table: str = SAMPLES, *, setup_errors: bool = False
) -> tuple[str, dict[str, Any]]:
    """FROM samples PREWHERE <experiment, run> WHERE <the rest>; no FINAL (dedup contract).
    Setup errors are left out (JUDGED) unless ``setup_errors``: the reads that count them, and
    SRM's users (a user is assigned whatever the variant then answers)."""
    pre, conds, params = conditions(f, extra if setup_errors else [JUDGED, *extra])
    sql = f"FROM {table} PREWHERE {' AND '.join(pre)}"
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


def rounded_sql(expr: str) -> str:
    """expr rounded half up to 1 / MW_SCALE ms (definitions.MW_SCALE)."""
    return f"floor(({expr}) * {MW_SCALE} + 0.5) / {MW_SCALE}"


def bucket_sql(column: str, edges: Sequence[float]) -> str:
    """Bucket index = number of edges <= x (segments.bucket_index). A sum of comparisons,
    not arrayCount(e -> e <= x, [...]): 18.16 cannot see columns inside that lambda under
    GROUP BY ("Unknown identifier")."""
    return "(" + " + ".join(f"({column} >= {float(e)!r})" for e in edges) + ")"


# Distinct users, counted on a 64-bit hash of the id: uniqExact(user_id) already counts 128-bit
# SipHash values of the strings; CityHash64 was 2.8x faster at 10M distinct users on 18.16
# (0.99 vs 2.76 s), and a collision (probability ~3e-6 at 10^7 users) changes a count by one.
DISTINCT_USERS = "uniqExact(cityHash64(user_id))"

# The samples whose variant the router chose, the ones sample ratio mismatch is tested on: every
# sample of a split replay, and of live traffic (the gateway) the first attempt of a request the
# router assigned. Live requests without a user, and those for an experiment without weights or
# an unknown one, go to the control by rule and are recorded with config revision 0; a retry on
# the control after the variant failed (attempt 2) is the gateway's choice, not the router's.
# Counting either would make a healthy split look mismatched towards the control.
SRM_SAMPLES = "(mode = 'split' OR (mode = 'live' AND config_revision > 0 AND attempt = 1 AND user_id != ''))"
# DISTINCT_USERS of those alone, in a query that reads every sample (a rollout step's reading,
# rollouts/readings.py: a live retry on the control carries the step's revision; counted, it
# would tilt the SRM test just when the candidate fails).
ASSIGNED_USERS = f"uniqExactIf(cityHash64(user_id), {SRM_SAMPLES})"

# integer bucket of the rounded TTFT: compared as integers (a float literal in SQL might parse
# one ulp away from the computed value on 18.16)
_TTFT_KEY = f"toInt64(floor(assumeNotNull(ttft_ms) * {MW_SCALE} + 0.5))"
# Histogram keys per metric, each monotone in the value, so a bucket's running count locates any
# rank: TTFT at 0.1 ms (the rank test's rounding, also the CDF's), the others in relative steps
# of 0.2% (e2e spans seconds: 0.1 ms steps would make 10^5 buckets per variant; the report reads
# every bucket, the exact pass only the values of the few buckets that hold a rank).
LOG_STEPS = 500


def _log_key(value_ms: str) -> str:
    return f"toInt64(floor(log(greatest({value_ms}, 0.001)) * {LOG_STEPS}))"


# One gap of a GAP_METRICS column, as the ARRAY JOIN alias of its element (microseconds), and
# in ms: the one expression the raw reader and the rollup build share, so their keys agree.
GAP = "gap_us"
GAP_MS = f"({GAP} / 1000)"

HIST_KEYS: dict[str, str] = {
    metric: _TTFT_KEY
    if metric == "ttft_ms"
    else _log_key(GAP_MS)
    if metric in GAP_METRICS
    else _log_key(f"assumeNotNull({column})")
    for metric, column in METRICS.items()
}


def gap_table(metric: str, table: str = SAMPLES) -> str:
    """The samples with one row per gap of a GAP_METRICS column: ``table ARRAY JOIN column AS
    gap_us`` (a request without gaps has no row; ARRAY JOIN runs on 18.16 and chDB alike)."""
    return f"{table} ARRAY JOIN {GAP_METRICS[metric]} AS {GAP}"


def metric_count(metric: str) -> str:
    """SQL: how many values of a metric the successful requests of a group hold (summary
    metric_n): one per request with the metric, one per gap for GAP_METRICS."""
    column = METRICS[metric]
    if metric in GAP_METRICS:
        return f"sumIf(length({column}), outcome = 'ok')"
    return f"countIf({metric_ok(column)})"


def rank_level(rank: int, n: int) -> float:
    """quantileExact level that returns the rank-th smallest (1-based) of n values."""
    if not 1 <= rank <= n:
        raise QueryError(f"rank {rank} outside 1..{n}")
    return (rank - 0.5) / n


def values_at_ranks(
    store: Any,
    source: Callable[[tuple[int, ...]], tuple[str, dict[str, Any]]],
    value_sql: str,
    key_sql: str,
    hist: Hist,
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


def gap_value_counts(f: Filters, metric: str, keys: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
    """SELECT variant, k, v, n: each distinct gap (microseconds) of the successful requests in
    f whose histogram key is one of keys, with its count (sql.gap_values_at_ranks' source)."""
    key = HIST_KEYS[metric]
    fw, params = from_where(f, ["outcome = 'ok'", f"{key} IN %(gap_keys)s"], table=gap_table(metric))
    sql = (
        f"SELECT CAST(variant AS String) AS variant, {key} AS k, {GAP} AS v, count() AS n {fw} "
        "GROUP BY variant, k, v"
    )
    return sql, {**params, "gap_keys": keys}


def gap_values_at_ranks(
    store: Any,
    source: Callable[[tuple[int, ...]], tuple[str, dict[str, Any]]],
    hist: Hist,
    ranks: Mapping[str, Sequence[int]],
) -> dict[str, dict[int, float]]:
    """{variant: {rank: exact value in ms}} of pooled gaps (GAP_METRICS), located through their
    histogram (keys HIST_KEYS, counts of gaps): values_at_ranks for values that repeat.

    1. The histogram's running count says which bucket holds rank r and how many gaps lie in
       lower buckets (the key is monotone in the value).
    2. One query gives, for those buckets only, each distinct gap value (whole microseconds)
       with its count: source(keys) -> (SELECT variant, k, v, n ..., params), rows that may
       repeat a (variant, k, v) (a rollup part and a raw part: their counts add up).
    3. Rank r is the first value of its bucket, in value order, whose running count reaches
       r - (gaps in lower buckets). A bucket that holds fewer gaps than its histogram said (rows
       arrived between the two queries) gives its largest value.
    """
    import numpy as np

    plan: dict[str, tuple[list[int], np.ndarray, np.ndarray]] = {}
    keys: set[int] = set()
    for variant, rs in sorted(ranks.items()):
        if variant not in hist or not rs:
            continue
        hkeys = np.asarray(hist[variant][0], dtype=np.int64)
        cum = np.cumsum(np.asarray(hist[variant][1], dtype=np.int64))
        rs = sorted(set(int(r) for r in rs))
        if rs[0] < 1 or rs[-1] > int(cum[-1]):
            raise QueryError(f"rank outside 1..{int(cum[-1])} for variant {variant!r}: {rs}")
        idx = np.searchsorted(cum, np.asarray(rs), side="left")
        below = np.where(idx > 0, cum[np.maximum(idx - 1, 0)], 0)
        plan[variant] = (rs, hkeys[idx], np.asarray(rs) - below)
        keys.update(int(k) for k in hkeys[idx])
    if not plan:
        return {}
    sql, params = source(tuple(sorted(keys)))
    cells: dict[tuple[str, int], dict[int, int]] = {}
    for variant, k, v, n in store.query(sql, params):
        cell = cells.setdefault((str(variant), int(k)), {})
        cell[int(v)] = cell.get(int(v), 0) + int(n)
    out: dict[str, dict[int, float]] = {}
    for variant, (rs, at_keys, positions) in plan.items():
        got: dict[int, float] = {}
        for r, k, pos in zip(rs, at_keys.tolist(), positions.tolist(), strict=True):
            values = sorted(cells.get((variant, k), {}).items())
            if not values:
                raise QueryError(f"variant {variant!r}: no gaps in histogram bucket {k} (data changed?)")
            running = np.cumsum([n for _v, n in values])
            i = min(int(np.searchsorted(running, pos, side="left")), len(values) - 1)
            got[r] = values[i][0] / 1000.0
        out[variant] = got
    return out
