"""Per-run rollups of the SLA report: built once when a run ends, read instead of raw samples.

A finished run's samples no longer change (the dedup contract, see analysis.queries), so
everything additive the report needs from them is summed once, at the end of the run, into the
rollup tables (samples.schema migration 2): counts, SLO hits and phase sums per cell, value
histograms per metric and every value sorted by its bucket, a TTFT histogram per 10 s for the
p99 chart, distinct users for SRM.
A report then reads a few thousand rollup rows, and the exact order statistics read only the
values of the histogram buckets that hold the ranks, from a table of every value sorted by
(build, variant, metric, bucket), through its primary index.

Which runs a report reads from their rollup (report_scope): those whose build
- still matches the samples' row count and sum(recorded_ms) (a late row, a replaced recording
  or a delete makes it stale),
- was made for the experiment's current SLO (hits and miss phases depend on it) and by this
  version of the rollup format (FORMAT_VERSION).
The other runs in scope (still replaying, stale) are read from the raw samples beside them and
added in: counts and histograms add up, the exact ranks read the values of both (UNION ALL).
With a time window (the rollup's cells are 10 s wide; a window cuts through them), or no run
with a current build, the whole report reads the raw samples. The numbers are the same either
way (tests compare the paths); only the speed differs.

Runs unchanged on ClickHouse 18.16 and chDB (INSERT ... SELECT, ALTER ... DELETE).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from analysis import queries as q
from analysis.attribution import INFLIGHT_EDGES, PROMPT_TOKEN_EDGES
from samples import schema
from samples.columns import MODES

log = logging.getLogger(__name__)

GRAIN_S = 10  # every report time bucket (queries.TIME_BUCKETS_S) is a multiple of this
SERIES_KEY = "toInt64(floor(assumeNotNull(ttft_ms)))"  # 1 ms buckets for the p99 chart
_GRAIN_SQL = f"toUInt32(intDiv(toUInt32(sent_at), {GRAIN_S}) * {GRAIN_S})"  # the 10 s cell of a sample


class RollupStale(RuntimeError):
    """The run's samples changed while its rollup was being built; nothing was published."""


# Bump when what a build computes changes (a histogram key, a bucket edge, a column): builds of
# another version are then not used, and the report reads the raw samples until rebuilt.
FORMAT_VERSION = 2  # 2: distinct users on a 64-bit hash (queries.DISTINCT_USERS)


def build_spec(slo: q.Slo) -> str:
    """What a build depends on: the rollup format and the SLO (hits and miss phases)."""
    limits = ";".join(f"{name}<{limit!r}" for name, limit in sorted(slo.limits().items()))
    return f"v{FORMAT_VERSION}|{limits}"


@dataclasses.dataclass(frozen=True)
class Build:
    run_id: int
    build_id: int
    rows: int


def _signature(store: Any, experiment: str, run_id: int | None = None) -> dict[int, tuple[int, int]]:
    """{run_id: (rows, sum(recorded_ms))} of the samples of an experiment (or of one run)."""
    where = "experiment = %(e)s" + (" AND run_id = %(r)s" if run_id is not None else "")
    rows = store.query(
        f"SELECT run_id, count(), sum(recorded_ms) FROM {schema.SAMPLES_TABLE} PREWHERE {where} GROUP BY run_id",
        {"e": experiment, "r": run_id},
    )
    return {int(r): (int(n), int(s)) for r, n, s in rows}


# ---------------------------------------------------------------------------------------------
# Build


def build_run_rollup(store: Any, experiment: str, run_id: int, slo: q.Slo) -> Build | None:
    """Sum one run's samples into the rollup tables and publish the build; None without samples.

    Raises RollupStale when the run's samples changed during the build (nothing is published:
    readers keep using the previous build, or the raw samples)."""
    if isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 0:
        raise ValueError(f"build_run_rollup: run_id must be a non-negative integer, got {run_id!r}")
    before = _signature(store, experiment, run_id).get(run_id)
    if before is None:
        return None
    build_id = time.time_ns()
    params: dict[str, Any] = {"e": experiment, "r": run_id, "b": build_id}
    head = "%(e)s, %(r)s, %(b)s"
    scope = f"FROM {schema.SAMPLES_TABLE} PREWHERE experiment = %(e)s AND run_id = %(r)s"
    hit, hp = q.hit_expr(slo)
    params.update(hp)
    miss_phase = f"NOT {hit} AND {q.PHASE_ROWS}"
    metric_counts = ", ".join(f"countIf({q.metric_ok(col)})" for col in q.METRICS.values())
    phase_sums = ", ".join(f"sumIf({expr}, {miss_phase})" for expr in q.PHASE_COLUMNS.values())
    statements = [
        f"""
        INSERT INTO {schema.ROLLUP_CELLS_TABLE}
        SELECT {head}, toString(variant), toString(mode), config_revision,
               toUInt8({q.bucket_sql("prompt_tokens", PROMPT_TOKEN_EDGES)}) AS pb,
               toUInt8({q.bucket_sql("in_flight", INFLIGHT_EDGES)}) AS ib,
               {_GRAIN_SQL} AS tb,
               count(), countIf(outcome != 'ok'), countIf({hit}), {metric_counts},
               min(sent_unix_ms), max(sent_unix_ms), countIf({miss_phase}), {phase_sums}
        {scope}
        GROUP BY variant, mode, config_revision, pb, ib, tb
        """,
        f"""
        INSERT INTO {schema.ROLLUP_SERIES_TABLE}
        SELECT {head}, toString(variant), {_GRAIN_SQL} AS tb,
               {SERIES_KEY} AS k, count(), max(assumeNotNull(ttft_ms))
        {scope} WHERE {q.metric_ok("ttft_ms")}
        GROUP BY variant, tb, k
        """,
        f"""
        INSERT INTO {schema.ROLLUP_USERS_TABLE}
        SELECT {head}, config_revision, toString(variant), {q.DISTINCT_USERS}
        {scope} WHERE mode = 'split'
        GROUP BY config_revision, variant
        """,
    ]
    for metric, column in q.METRICS.items():
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_HIST_TABLE}
            SELECT {head}, toString(variant), '{metric}', {q.HIST_KEYS[metric]} AS k, count(),
                   max(assumeNotNull({column}))
            {scope} WHERE {q.metric_ok(column)}
            GROUP BY variant, k
            """
        )
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_VALUES_TABLE}
            SELECT %(b)s, variant, '{metric}', {q.HIST_KEYS[metric]}, assumeNotNull({column})
            {scope} WHERE {q.metric_ok(column)}
            """
        )
    for sql in statements:
        store.execute(sql, params)
    after = _signature(store, experiment, run_id).get(run_id)
    if after != before:
        _drop_build(store, experiment, run_id, build_id)
        raise RollupStale(
            f"run {run_id} of {experiment!r}: samples changed during the rollup build "
            f"(rows, recorded sum {before} -> {after}); build it again once the run is quiet"
        )
    # Published last: until this row exists, readers do not see the build.
    store.execute(
        f"INSERT INTO {schema.ROLLUP_BUILDS_TABLE} (experiment, run_id, build_id, spec, rows, recorded_sum, "
        "built_at) SELECT %(e)s, %(r)s, %(b)s, %(spec)s, %(rows)s, %(sum)s, now()",
        {**params, "spec": build_spec(slo), "rows": before[0], "sum": before[1]},
    )
    _drop_build(store, experiment, run_id, build_id, keep=True)
    return Build(run_id, build_id, before[0])


def _drop_build(store: Any, experiment: str, run_id: int, build_id: int, keep: bool = False) -> None:
    """Delete the rows of one build (keep=False) or of every other build of the run (keep=True).
    Best effort: rows of an unpublished or superseded build are never read."""
    params = {"e": experiment, "r": run_id, "b": build_id}
    cond = "build_id != %(b)s" if keep else "build_id = %(b)s"
    statements = [
        f"ALTER TABLE {table} DELETE WHERE experiment = %(e)s AND run_id = %(r)s AND {cond}"
        for table in schema.ROLLUP_TABLES
    ]
    try:
        if keep:  # the run's earlier builds, from the catalog's versions not merged away yet
            old = [
                int(b)
                for (b,) in store.query(
                    f"SELECT DISTINCT build_id FROM {schema.ROLLUP_BUILDS_TABLE} "
                    "WHERE experiment = %(e)s AND run_id = %(r)s AND build_id != %(b)s",
                    params,
                )
            ]
        else:
            old = [build_id]
        for sql in statements:
            store.execute(sql, params)
        if old:
            store.execute(
                f"ALTER TABLE {schema.ROLLUP_VALUES_TABLE} DELETE WHERE build_id IN %(old)s",
                {"old": tuple(old)},
            )
    except Exception as e:  # noqa: BLE001 - garbage rows are harmless; say so and go on
        log.warning("rollup of run %s: could not delete old rows: %s", run_id, e)


# ---------------------------------------------------------------------------------------------
# Read


@dataclasses.dataclass(frozen=True)
class Scope:
    """How a report reads its runs: builds (run -> build id) from the rollups, live (runs with
    no current build: still replaying, changed since, built before this format) from the raw
    samples."""

    builds: Mapping[int, int]
    live: tuple[int, ...] = ()


def report_scope(
    store: Any, f: q.Filters, slo: q.Slo, version: Sequence[tuple[int, int, int, int]] | None = None
) -> Scope | None:
    """Which runs in scope have a current rollup (same format version, this SLO, the samples
    unchanged since); None when none has, or a time window is set (read it all raw).

    version: the experiment's queries.data_version when the caller already read it (the report
    cache's key); the rollups are then checked against the data that key describes."""
    if f.since is not None or f.until is not None:
        return None
    if version is None:
        live = _signature(store, f.experiment, f.run_id)
    else:
        live = {r: (n, total) for r, n, total, _ in version if f.run_id is None or r == f.run_id}
    if not live:
        return None
    where = "experiment = %(e)s" + (" AND run_id = %(r)s" if f.run_id is not None else "")
    rows = store.query(
        f"SELECT run_id, build_id, spec, rows, recorded_sum FROM {schema.ROLLUP_BUILDS_TABLE} FINAL WHERE {where}",
        {"e": f.experiment, "r": f.run_id},
    )
    catalog = {int(r): (int(b), s, (int(n), int(total))) for r, b, s, n, total in rows}
    want = build_spec(slo)
    builds: dict[int, int] = {}
    raw: list[int] = []
    for run_id, sig in sorted(live.items()):
        build = catalog.get(run_id)
        if build is not None and build[1] == want and build[2] == sig:
            builds[run_id] = build[0]
        else:
            raw.append(run_id)
    return Scope(builds, tuple(raw)) if builds else None


def merge_summaries(*parts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-variant summaries (queries.summary + phase_sums shape) of disjoint runs, added up."""
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for v, s in part.items():
            if v not in out:
                out[v] = {**s, "metric_n": dict(s["metric_n"]), "modes": dict(s["modes"]),
                          "phase_sums": dict(s["phase_sums"])}  # fmt: skip
                continue
            o = out[v]
            for k in ("n", "errors", "hits", "phase_n"):
                o[k] += s[k]
            o["first_ms"], o["last_ms"] = min(o["first_ms"], s["first_ms"]), max(o["last_ms"], s["last_ms"])
            for group in ("metric_n", "modes", "phase_sums"):
                for k, x in s[group].items():
                    o[group][k] = o[group].get(k, 0) + x
    return out


def merge_histograms(
    *parts: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]],
) -> dict[str, tuple[list[int], list[int], list[float]]]:
    """Per-variant histograms (sorted keys, counts, largest value per key) added up by key."""
    nonempty = [part for part in parts if part]
    if len(nonempty) == 1:  # nothing to add (a report with no live run): copy, already sorted
        return {v: (list(k), list(c), list(t)) for v, (k, c, t) in nonempty[0].items()}
    acc: dict[str, dict[int, list[float]]] = {}
    for part in parts:
        for v, (keys, counts, tops) in part.items():
            cells = acc.setdefault(v, {})
            for k, c, t in zip(keys, counts, tops, strict=True):
                cell = cells.get(k)
                if cell is None:
                    cells[k] = [c, t]
                else:
                    cell[0] += c
                    cell[1] = max(cell[1], t)
    out: dict[str, tuple[list[int], list[int], list[float]]] = {}
    for v, cells in acc.items():
        keys = sorted(cells)
        out[v] = (keys, [int(cells[k][0]) for k in keys], [float(cells[k][1]) for k in keys])
    return out


def _scope(f: q.Filters, builds: Mapping[int, int]) -> tuple[str, dict[str, Any]]:
    pairs = ", ".join(f"({int(r)}, {int(b)})" for r, b in sorted(builds.items()))
    where = f"experiment = %(experiment)s AND (run_id, build_id) IN ({pairs})"
    params: dict[str, Any] = {"experiment": f.experiment}
    if f.variants:
        where += " AND variant IN %(variants)s"
        params["variants"] = tuple(f.variants)
    return where, params


def summary(store: Any, f: q.Filters, builds: Mapping[int, int]) -> dict[str, dict[str, Any]]:
    """queries.summary and queries.phase_sums in one: the same keys per variant."""
    where, params = _scope(f, builds)
    metric_n = ", ".join(f"sum(n_{k}) AS n_{k}" for k in q.METRICS)
    modes = ", ".join(f"sumIf(n, mode = '{m}') AS mode_{m}" for m in MODES)
    phases = ", ".join(f"sum(s_{name}) AS s_{name}" for name in q.PHASE_COLUMNS)
    cols = store.query_columns(
        f"""
        SELECT variant, sum(n) AS total, sum(errors) AS errors, sum(hits) AS hits,
               min(first_ms) AS first_ms, max(last_ms) AS last_ms, {metric_n}, {modes},
               sum(phase_n) AS phase_n, {phases}
        FROM {schema.ROLLUP_CELLS_TABLE} WHERE {where}
        GROUP BY variant ORDER BY variant
        """,
        params,
    )
    return q.summary_rows(cols, n_column="total")


def histograms(
    store: Any, f: q.Filters, builds: Mapping[int, int]
) -> dict[str, dict[str, tuple[list[int], list[int], list[float]]]]:
    """{metric: {variant: (sorted keys, counts, largest value per key)}}, as queries.histogram."""
    where, params = _scope(f, builds)
    cols = store.query_columns(
        f"""
        SELECT metric, variant, k, sum(n) AS c, max(top) AS t
        FROM {schema.ROLLUP_HIST_TABLE} WHERE {where}
        GROUP BY metric, variant, k ORDER BY metric, variant, k
        """,
        params,
    )
    out: dict[str, dict[str, tuple[list[int], list[int], list[float]]]] = {m: {} for m in q.METRICS}
    for metric, variant, key, count, top in zip(
        cols.get("metric", []), cols.get("variant", []), cols.get("k", []), cols.get("c", []), cols.get("t", []),
        strict=True,
    ):  # fmt: skip
        keys, counts, tops = out[metric].setdefault(variant, ([], [], []))
        keys.append(int(key))
        counts.append(int(count))
        tops.append(float(top))
    return out


def order_statistics(
    store: Any,
    f: q.Filters,
    builds: Mapping[int, int],
    metric: str,
    hist: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[float]]],
    ranks: Mapping[str, Sequence[int]],
    live: q.Filters | None = None,
) -> dict[str, dict[int, float]]:
    """queries.order_statistics_from_histogram, the values read from the sorted value table:
    the primary index narrows the read to the granules of the buckets that hold the ranks.
    live: the runs without a build (Filters with runs set), whose values come from the samples;
    hist must then count both."""
    where = "build_id IN %(builds)s AND metric = %(metric)s"
    params: dict[str, Any] = {"builds": tuple(sorted(builds.values())), "metric": metric}
    if f.variants:
        where += " AND variant IN %(variants)s"
        params["variants"] = tuple(f.variants)

    def source(keys: tuple[int, ...]) -> tuple[str, dict[str, Any]]:
        sql = f"SELECT CAST(variant AS String) AS variant, v, k FROM {schema.ROLLUP_VALUES_TABLE} WHERE {where} AND k IN %(keys)s"
        bound = {**params, "keys": keys}
        if live is not None:
            column, key = q.METRICS[metric], q.HIST_KEYS[metric]
            fw, raw_params = q.from_where(live, [q.metric_ok(column), f"{key} IN %(keys)s"])
            sql += f" UNION ALL SELECT CAST(variant AS String) AS variant, assumeNotNull({column}) AS v, {key} AS k {fw}"
            bound.update(raw_params)
        return f"FROM ({sql})", bound

    return q.values_at_ranks(store, source, "v", "k", hist, ranks)


def segment_cells(store: Any, f: q.Filters, builds: Mapping[int, int], bucket_s: int) -> list[dict[str, Any]]:
    """queries.segment_cells from the rollup (bucket_s a multiple of the 10 s grain)."""
    if not isinstance(bucket_s, int) or bucket_s < GRAIN_S or bucket_s % GRAIN_S:
        raise q.QueryError(f"bucket_s must be a positive multiple of {GRAIN_S}, got {bucket_s!r}")
    where, params = _scope(f, builds)
    sql = f"""
        SELECT variant, rev, pb, ib, intDiv(tb, {bucket_s}) * {bucket_s} AS tb2,
               sum(n) AS n, sum(hits) AS hits, min(first_ms) AS first_ms
        FROM {schema.ROLLUP_CELLS_TABLE} WHERE {where}
        GROUP BY variant, rev, pb, ib, tb2
    """
    names = ("variant", "rev", "pb", "ib", "tb", "n", "hits", "first_ms")
    return [dict(zip(names, r, strict=True)) for r in store.query(sql, params)]


def srm_users(store: Any, f: q.Filters, builds: Mapping[int, int]) -> list[dict[str, Any]] | None:
    """queries.srm_users from the rollup; None when the scope holds several runs (a user can
    appear in more than one, so per-run distinct counts do not add up)."""
    if len(builds) != 1:
        return None
    where, params = _scope(f, builds)
    rows = store.query(
        f"SELECT rev, variant, sum(users) FROM {schema.ROLLUP_USERS_TABLE} WHERE {where} GROUP BY rev, variant",
        params,
    )
    return [{"rev": int(r), "variant": v, "n": int(n)} for r, v, n in rows]


def p99_over_time(
    store: Any, f: q.Filters, builds: Mapping[int, int], bucket_s: int, live: q.Filters | None = None
) -> dict[str, list[tuple[int, int, float]]]:
    """queries.p99_over_time from the 1 ms TTFT histogram per 10 s: the same rank
    (floor(0.99 n) + 1); the value is the largest TTFT of the 1 ms bucket holding it, so it is
    a sample value within 1 ms of quantileExact's. Chart only, as the raw one.

    The rank is found in SQL (running counts per time bucket, ARRAY JOIN, the first bucket
    reaching the rank): one row per time bucket travels, not one per 1 ms bucket."""
    if not isinstance(bucket_s, int) or bucket_s < GRAIN_S or bucket_s % GRAIN_S:
        raise q.QueryError(f"bucket_s must be a positive multiple of {GRAIN_S}, got {bucket_s!r}")
    where, params = _scope(f, builds)
    rows = f"SELECT variant, tb, k, n, top FROM {schema.ROLLUP_SERIES_TABLE} WHERE {where}"
    if live is not None:  # runs without a build: their samples, one row each
        fw, raw_params = q.from_where(live, [q.metric_ok("ttft_ms")])
        rows += (
            f" UNION ALL SELECT CAST(variant AS String) AS variant, {_GRAIN_SQL} AS tb, {SERIES_KEY} AS k, "
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
    out: dict[str, list[tuple[int, int, float]]] = {}
    for variant, tb, n, p99 in store.query(sql, params):
        out.setdefault(variant, []).append((int(tb), int(n), float(p99)))
    return out


def rollup_rows(store: Any, experiment: str, current_only: bool = True) -> dict[str, int]:
    """Rows per rollup table for an experiment: of its current builds, or (current_only=False)
    of every build still on disk (a superseded build's rows go once its delete has run)."""
    builds = f"SELECT build_id FROM {schema.ROLLUP_BUILDS_TABLE} {'FINAL' if current_only else ''} WHERE experiment = %(e)s"
    out = {
        t: int(
            store.query(
                f"SELECT count() FROM {t} WHERE experiment = %(e)s AND build_id IN ({builds})",
                {"e": experiment},
            )[0][0]
        )
        for t in schema.ROLLUP_TABLES
    }
    rows = store.query(
        f"SELECT count() FROM {schema.ROLLUP_VALUES_TABLE} WHERE build_id IN ({builds})", {"e": experiment}
    )
    out[schema.ROLLUP_VALUES_TABLE] = int(rows[0][0])
    return out


def runs_of(store: Any, experiment: str) -> Sequence[int]:
    return sorted(_signature(store, experiment))
