"""The SampleReader interface: every query the SLA report needs, whatever the data lives in.

Implementations: ``raw.RawReader`` (the samples table), ``merged.MergedReader`` (finished runs
from their rollups, ``rollup.RollupReader``, the other runs from the samples, results added up).
``merged.reader_for`` picks one for a report; the report asks it and never chooses per query.
Readers get a store object (samples.store.SampleStore: ``query``, ``query_columns``,
``parallel_queries``) and import no driver and no Django.

Result shapes (what the report reads):
- summary: {variant: {"n", "errors", "hits", "first_ms", "last_ms", "metric_n": {metric: n},
  "modes": {mode: n}, "phase_n", "phase_sums": {phase: total ms}, "itl_requests",
  "itl_unrecorded"}} (metric_n of itl_ms counts gaps; definitions.GAP_REQUESTS);
- a histogram (analysis.sql.Hist): {variant: (sorted keys, counts, largest value per key)},
  keyed by analysis.sql.HIST_KEYS[metric];
- order statistics: {variant: {1-based rank: exact value}};
- segment cells: [{"variant", "rev", "pb", "ib", "tb", "n", "hits", "first_ms"}];
- srm users: [{"rev", "variant", "n"}] distinct users per config revision in split mode;
- p99 over time: {variant: [(bucket start unix s, n, p99)]};
- mirror pairs: {"cells": {both_hit, control_only, variant_only, both_miss}, "diff_values",
  "diff_counts"};
- fidelity pairs: {"moments", "kinds"} (analysis.answer_fidelity), "examples" when asked;
- fidelity scores: {variant: {"moments", "outcomes"}} of the teacher-forced KL
  (analysis.answer_fidelity.kl_rows);
- fidelity shadows: {variant: {"moments", "kinds"}} of the gateway's live shadows
  (analysis.answer_fidelity.shadow_rows);
- failures: {variant: {outcome: {"n", "http_status", "example"}}} of the requests not 'ok';
- setup errors: {variant: {http status: {"n", "example"}}} of the setup errors
  (definitions.SETUP_ERROR), which every other query leaves out (analysis.sql.JUDGED);
- unit moments: {variant: analysis.units.UnitMoments}, the per-user (or per-request) moments of
  the clustered and adjusted statistics;
- data version: ((run_id, rows, sum(recorded_ms), max(recorded_ms)), ...) in run order.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from analysis.definitions import GAP_REQUESTS, METRICS, MODES, PHASE_COLUMNS, PHASES, Filters, Slo
from analysis.phases import phases_from_sums
from analysis.sql import Hist
from analysis.units import UnitMoments

Summary = dict[str, dict[str, Any]]
DataVersion = tuple[tuple[int, int, int, int], ...]


class SampleReader(Protocol):
    source: str  # "samples" | "rollup" | "rollup+samples": the report's timing.source
    p99_note: str  # appended to the p99 chart's note ("" for exact quantileExact values)
    parallel_queries: int  # how many queries the store runs at once

    def summary(self, f: Filters, slo: Slo) -> Summary: ...

    def histograms(self, f: Filters) -> dict[str, dict[str, tuple[list[int], list[int], list[float]]]]:
        """{metric: histogram} for ttft_ms (the CDF and the rank test) and every metric whose
        order statistics this reader locates through a histogram."""
        ...

    def order_statistics(
        self,
        f: Filters,
        metric: str,
        ranks: Mapping[str, Sequence[int]],
        counts: Mapping[str, int],
        hist: Hist | None,
    ) -> dict[str, dict[int, float]]:
        """Exact values at 1-based ranks; counts are summary()["metric_n"][metric] per variant,
        hist is histograms()[metric] when the reader returned one."""
        ...

    def segment_cells(self, f: Filters, slo: Slo, bucket_s: int) -> list[dict[str, Any]]: ...

    def srm_users(self, f: Filters) -> list[dict[str, Any]]: ...

    def p99_over_time(self, f: Filters, bucket_s: int) -> dict[str, list[tuple[int, int, float]]]: ...

    def mirror_pairs(self, f: Filters, slo: Slo, control: str, variant: str) -> dict[str, Any]: ...

    def fidelity_pairs(
        self, f: Filters, unit: str, control: str, variant: str, *, examples: bool = False
    ) -> dict[str, Any]:
        """{"moments": row or None, "kinds": rows} of analysis.answer_fidelity's pairs_select,
        and with ``examples`` "examples": the rows of its examples_select."""
        ...

    def fidelity_scores(self, f: Filters, unit: str, control: str) -> dict[str, dict[str, Any]]:
        """{variant: {"moments", "outcomes"}} of analysis.answer_fidelity's kl_select and
        kl_outcomes_select (the scoring pass's table), the control's own rows included."""
        ...

    def fidelity_shadows(self, f: Filters, unit: str, control: str) -> dict[str, dict[str, Any]]:
        """{variant: {"moments", "kinds"}} of analysis.answer_fidelity's shadows_select and
        shadow_kinds_select (the gateway's live answers against the control's)."""
        ...

    def failures(self, f: Filters) -> dict[str, dict[str, dict[str, Any]]]: ...

    def setup_errors(self, f: Filters) -> dict[str, dict[int, dict[str, Any]]]: ...

    def unit_moments(self, f: Filters, slo: Slo, unit: str) -> dict[str, UnitMoments]:
        """{variant: moments} with users (unit "user") or requests (unit "request") as the
        independent unit (analysis.units)."""
        ...

    def data_version(self, experiment: str) -> DataVersion: ...


# ---------------------------------------------------------------------------------------------
# Running independent queries together

# Up to three pools for the process, created on first use (and again in a forked child): the
# report's jobs run in the first, the parts a reader merges (rollup + raw) in the second, a
# cluster's shards (analysis.readers.shards) in the next free one, so a job waiting for its
# parts never starves the pool its parts need. Their threads keep their store
# connections between reports: clickhouse-driver clients are not thread-safe and the server
# store keeps one per thread; chDB serializes queries itself (parallel_queries = 1).
POOL_THREADS = 4
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_pid = 0
_pools_guard = threading.Lock()
_local = threading.local()


def _executor(level: int) -> ThreadPoolExecutor:
    global _pools_pid
    with _pools_guard:
        if _pools_pid != os.getpid():
            _pools.clear()
            _pools_pid = os.getpid()
        if level not in _pools:

            def mark() -> None:
                _local.level = level

            _pools[level] = ThreadPoolExecutor(
                max_workers=POOL_THREADS, thread_name_prefix=f"sla-report-{level}", initializer=mark
            )
        return _pools[level]


def parallelism(store: Any) -> int:
    """How many queries a reader may run at once through ``store``: its parallel_queries
    (samples.store_base.StoreBase), at least 1; 1 for a wrapper that does not say."""
    return max(int(getattr(store, "parallel_queries", 1)), 1)


def run_queries(parallel: int, jobs: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run independent query jobs, concurrently when the store allows it (parallel > 1);
    {name: result}. Jobs may call run_queries twice more (a merged reader's parts, then a
    cluster's shards: analysis.readers.shards); deeper runs inline."""
    level = getattr(_local, "level", 0) + 1
    if parallel <= 1 or len(jobs) <= 1 or level > 3:
        return {name: fn() for name, fn in jobs.items()}
    pool = _executor(level)
    futures = {name: pool.submit(fn) for name, fn in jobs.items()}
    return {name: fut.result() for name, fut in futures.items()}


def histogram_rows(rows: Iterable[Sequence[Any]]) -> dict[str, Hist]:
    """(variant, bucket key, count, top value) rows, in key order, as {variant: Hist}."""
    out: dict[str, Hist] = {}
    for variant, key, count, top in rows:
        keys, counts, tops = out.setdefault(variant, ([], [], []))
        keys.append(int(key))
        counts.append(int(count))
        tops.append(float(top))
    return out


# A failure's example message in reports, at most this long: enough to say what broke, and a
# variant's error body that quotes the prompt shows analysts no more than its start.
FAILURE_EXAMPLE_CHARS = 300
Failures = dict[str, dict[Any, dict[str, Any]]]


def failure_rows(rows: Iterable[Sequence[Any]]) -> Failures:
    """(variant, outcome, n, http status, error) rows as SampleReader.failures:
    {variant: {outcome: {"n", "http_status", "example"}}}."""
    out: Failures = {}
    for v, outcome, n, status, example in rows:
        out.setdefault(str(v), {})[str(outcome)] = {
            "n": int(n),
            "http_status": int(status),
            "example": str(example)[:FAILURE_EXAMPLE_CHARS],
        }
    return out


def setup_error_rows(rows: Iterable[Sequence[Any]]) -> Failures:
    """(variant, http status, n, error) rows as SampleReader.setup_errors:
    {variant: {http status: {"n", "example"}}}."""
    out: Failures = {}
    for v, status, n, example in rows:
        out.setdefault(str(v), {})[int(status)] = {
            "n": int(n),
            "example": str(example)[:FAILURE_EXAMPLE_CHARS],
        }
    return out


def merge_failures(*parts: Failures) -> Failures:
    """failures or setup_errors of disjoint runs added up: counts add; the status and example
    of a class are the first part's that has the class (each is any one of its requests')."""
    out: Failures = {}
    for part in parts:
        for v, classes in part.items():
            mine = out.setdefault(v, {})
            for key, entry in classes.items():
                if key in mine:
                    mine[key] = {**mine[key], "n": mine[key]["n"] + entry["n"]}
                else:
                    mine[key] = dict(entry)
    return out


def p99_rows(rows: Iterable[Sequence[Any]]) -> dict[str, list[tuple[int, int, float]]]:
    """(variant, bucket start unix s, n, p99) rows, in bucket order, as the p99 chart's series:
    {variant: [(bucket start, n, p99)]}."""
    out: dict[str, list[tuple[int, int, float]]] = {}
    for variant, tb, n, p99 in rows:
        out.setdefault(variant, []).append((int(tb), int(n), float(p99)))
    return out


def summary_rows(cols: Mapping[str, Sequence[Any]], n_column: str = "n") -> Summary:
    """{variant: summary} from the columns of a summary query (variant, n_column, errors, hits,
    first_ms, last_ms, n_<metric>, n_<GAP_REQUESTS name>, mode_<mode>; phase_n and s_<phase> when
    present)."""
    out: Summary = {}
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
            **{name: int(row[f"n_{name}"]) for name in GAP_REQUESTS},
        }
        if "phase_n" in row:
            out[variant]["phase_n"] = int(row["phase_n"])
            out[variant]["phase_sums"] = phases_from_sums(
                {name: float(row[f"s_{name}"]) for name in PHASE_COLUMNS}
            )
    return out


def with_phases(counts: Summary, phases: Mapping[str, Mapping[str, Any]]) -> Summary:
    """Summary rows of the raw samples completed with their miss phase sums (a variant without
    misses gets phase_n 0 and zero sums), in place; returns counts."""
    for v, s in counts.items():
        s.update(phases.get(v, {"phase_n": 0, "phase_sums": dict.fromkeys(PHASES, 0.0)}))
    return counts
