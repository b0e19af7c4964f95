"""Per-run rollups of the SLA report: built once when a run ends, read instead of raw samples.

A finished run's samples no longer change (the dedup contract, see analysis.readers.raw), so
everything additive the report needs from them is summed once, at the end of the run, into the
rollup tables (samples.schema migration 2): counts, SLO hits and phase sums per cell, value
histograms per metric and every value sorted by its bucket, a TTFT histogram per 10 s for the
p99 chart (and per coarser time bucket, for long runs), distinct users for SRM, the failed
requests by class, and the per-user and per-request moments of the clustered and
adjusted statistics (analysis.units: a few rows per variant however many users the run had). The pooled inter-token gaps (itl_ms, definitions.GAP_METRICS)
get a histogram of gaps at the other metrics' resolution and, instead of a row per gap, each
distinct gap value per bucket with its count (rollup_gaps): the same exact ranks as the raw
samples give, from a table a few hundred times smaller than the gaps.
A report then reads a few thousand rollup rows, and the exact order statistics read only the
values of the histogram buckets that hold the ranks, from a table of every value sorted by
(build, variant, metric, bucket), through its primary index.

Reading them: analysis.readers.rollup (RollupReader); which runs a report reads from their
rollup and how the rest is added in: analysis.readers.merged (report_scope, MergedReader).

Runs unchanged on ClickHouse 18.16 and chDB (INSERT ... SELECT, ALTER ... DELETE).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from analysis import units
from analysis.definitions import (
    GAP_METRICS,
    GAP_REQUESTS,
    GRAIN_SQL,
    INFLIGHT_EDGES,
    METRICS,
    PHASE_COLUMNS,
    PHASE_ROWS,
    PROMPT_TOKEN_EDGES,
    SERIES_KEY,
    SERIES_LEVELS_S,
    SETUP_ERROR,
    Filters,
    Slo,
    build_spec,
)
from analysis.readers.raw import RawReader
from analysis.sql import (
    DISTINCT_USERS,
    GAP,
    HIST_KEYS,
    JUDGED,
    SRM_SAMPLES,
    bucket_sql,
    gap_table,
    hit_expr,
    metric_count,
    metric_ok,
)
from samples import schema

log = logging.getLogger(__name__)


class RollupStale(RuntimeError):
    """The run's samples changed while its rollup was being built; nothing was published."""


@dataclasses.dataclass(frozen=True)
class Build:
    run_id: int
    build_id: int
    rows: int


def _signature(store: Any, experiment: str, run_id: int | None = None) -> dict[int, tuple[int, int]]:
    """{run_id: (rows, sum(recorded_ms))} of the samples of an experiment (or of one run)."""
    return RawReader(store).signature(experiment, run_id)


# ---------------------------------------------------------------------------------------------
# Build


def build_run_rollup(store: Any, experiment: str, run_id: int, slo: Slo) -> Build | None:
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
    run_scope = f"FROM {schema.SAMPLES_TABLE} PREWHERE experiment = %(e)s AND run_id = %(r)s"
    # every table but the SRM users leaves the setup errors out, as the raw reads (sql.JUDGED)
    scope = f"{run_scope} WHERE {JUDGED}"
    hit, hp = hit_expr(slo)
    params.update(hp)
    miss_phase = f"NOT {hit} AND {PHASE_ROWS}"
    metric_counts = ", ".join(
        [metric_count(m) for m in METRICS] + [f"countIf({cond})" for cond in GAP_REQUESTS.values()]
    )
    phase_sums = ", ".join(f"sumIf({expr}, {miss_phase})" for expr in PHASE_COLUMNS.values())
    # the cells' columns named: migration 5 added some after the ones before them
    cell_columns = ", ".join(
        "experiment run_id build_id variant mode rev pb ib tb n errors hits".split()
        + [f"n_{m}" for m in METRICS]
        + [f"n_{name}" for name in GAP_REQUESTS]
        + ["first_ms", "last_ms", "phase_n"]
        + [f"s_{name}" for name in PHASE_COLUMNS]
    )
    gap_scope = {
        m: f"FROM {gap_table(m)} PREWHERE experiment = %(e)s AND run_id = %(r)s WHERE {JUDGED}"
        for m in GAP_METRICS
    }
    statements = [
        f"""
        INSERT INTO {schema.ROLLUP_CELLS_TABLE} ({cell_columns})
        SELECT {head}, toString(variant), toString(mode), config_revision,
               toUInt8({bucket_sql("prompt_tokens", PROMPT_TOKEN_EDGES)}) AS pb,
               toUInt8({bucket_sql("in_flight", INFLIGHT_EDGES)}) AS ib,
               {GRAIN_SQL} AS tb,
               count(), countIf(outcome != 'ok'), countIf({hit}), {metric_counts},
               min(sent_unix_ms), max(sent_unix_ms), countIf({miss_phase}), {phase_sums}
        {scope}
        GROUP BY variant, mode, config_revision, pb, ib, tb
        """,
        f"""
        INSERT INTO {schema.ROLLUP_SERIES_TABLE}
        SELECT {head}, toString(variant), {GRAIN_SQL} AS tb,
               {SERIES_KEY} AS k, count(), max(assumeNotNull(ttft_ms))
        {scope} AND {metric_ok("ttft_ms")}
        GROUP BY variant, tb, k
        """,
        f"""
        INSERT INTO {schema.ROLLUP_USERS_TABLE}
        SELECT {head}, config_revision, toString(variant), {DISTINCT_USERS}
        {run_scope} WHERE {SRM_SAMPLES}
        GROUP BY config_revision, variant
        """,
        # the failed requests by class, as RawReader.failures and setup_errors read them
        f"""
        INSERT INTO {schema.ROLLUP_FAILURES_TABLE}
        SELECT {head}, toString(variant), 'failure', toString(outcome), any(http_status), count(), any(error)
        {scope} AND outcome != 'ok'
        GROUP BY variant, outcome
        """,
        f"""
        INSERT INTO {schema.ROLLUP_FAILURES_TABLE}
        SELECT {head}, toString(variant), 'setup', '', http_status, count(), any(error)
        {run_scope} WHERE {SETUP_ERROR}
        GROUP BY variant, http_status
        """,
    ]
    # the p99 chart's coarser levels, each summed from the one below (10 s: rollup_series)
    of_build = "experiment = %(e)s AND run_id = %(r)s AND build_id = %(b)s"
    below = f"SELECT variant, tb, k, n, top FROM {schema.ROLLUP_SERIES_TABLE} WHERE {of_build}"
    for g in SERIES_LEVELS_S:
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_SERIES_LEVELS_TABLE}
            SELECT {head}, {g}, variant, intDiv(tb, {g}) * {g} AS tb2, k, sum(n), max(top)
            FROM ({below})
            GROUP BY variant, tb2, k
            """
        )
        below = (
            f"SELECT variant, tb, k, n, top FROM {schema.ROLLUP_SERIES_LEVELS_TABLE} "
            f"WHERE {of_build} AND g = {g}"
        )
    for metric in GAP_METRICS:
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_HIST_TABLE}
            SELECT {head}, toString(variant), '{metric}', {HIST_KEYS[metric]} AS k, count(), max({GAP}) / 1000
            {gap_scope[metric]} AND outcome = 'ok'
            GROUP BY variant, k
            """
        )
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_GAPS_TABLE} (build_id, variant, k, v, n)
            SELECT %(b)s, variant, {HIST_KEYS[metric]} AS k, {GAP} AS v, count()
            {gap_scope[metric]} AND outcome = 'ok'
            GROUP BY variant, k, v
            """
        )
    for metric, column in METRICS.items():
        if metric in GAP_METRICS:
            continue
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_HIST_TABLE}
            SELECT {head}, toString(variant), '{metric}', {HIST_KEYS[metric]} AS k, count(),
                   max(assumeNotNull({column}))
            {scope} AND {metric_ok(column)}
            GROUP BY variant, k
            """
        )
        statements.append(
            f"""
            INSERT INTO {schema.ROLLUP_VALUES_TABLE}
            SELECT %(b)s, variant, '{metric}', {HIST_KEYS[metric]}, assumeNotNull({column})
            {scope} AND {metric_ok(column)}
            """
        )
    # the per-unit moments (analysis.units): per user and per request, a few rows per variant
    for unit in units.UNITS:
        select, mp = units.moments_select(
            Filters(experiment, run_id=run_id), slo, unit, head=("%(b)s", f"'{unit}'")
        )
        statements.append(
            f"INSERT INTO {schema.ROLLUP_MOMENTS_TABLE} (build_id, unit, variant, counts, sums) {select}"
        )
        params.update(mp)
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
            for table in schema.ROLLUP_BUILD_TABLES:
                store.execute(f"ALTER TABLE {table} DELETE WHERE build_id IN %(old)s", {"old": tuple(old)})
    except Exception as e:  # noqa: BLE001 - garbage rows are harmless; say so and go on
        log.warning("rollup of run %s: could not delete old rows: %s", run_id, e)


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
    for table in schema.ROLLUP_BUILD_TABLES:
        rows = store.query(f"SELECT count() FROM {table} WHERE build_id IN ({builds})", {"e": experiment})
        out[table] = int(rows[0][0])
    return out


def runs_of(store: Any, experiment: str) -> Sequence[int]:
    return sorted(_signature(store, experiment))
