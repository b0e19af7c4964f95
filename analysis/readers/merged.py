"""MergedReader: finished runs from their rollups, the other runs from the raw samples, the
results added up; and ``reader_for``, which picks the reader of a report.

Which runs a report reads from their rollup (report_scope): those whose build
- still matches the samples' row count and sum(recorded_ms) (a late row, a replaced recording
  or a delete makes it stale),
- was made for the experiment's current SLO (hits and miss phases depend on it) and by this
  version of the rollup format (analysis.definitions.FORMAT_VERSION).
The other runs in scope (still replaying, stale) are read from the raw samples beside them and
added in: counts and histograms add up, the exact ranks read the values of both (UNION ALL).
With a time window (the rollup's cells are 10 s wide; a window cuts through them), or no run
with a current build, the whole report reads the raw samples (RawReader). The numbers are the
same either way (tests compare the paths); only the speed differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from analysis import units
from analysis.definitions import GAP_REQUESTS, METRICS, Filters, Slo, build_spec
from analysis.readers.base import (
    DataVersion,
    Failures,
    SampleReader,
    Summary,
    merge_failures,
    run_queries,
    with_phases,
)
from analysis.readers.raw import RawReader
from analysis.readers.rollup import RollupReader
from analysis.sql import Hist, where
from analysis.units import UnitMoments
from samples import schema


@dataclasses.dataclass(frozen=True)
class Scope:
    """How a report reads its runs: builds (run -> build id) from the rollups, live (runs with
    no current build: still replaying, changed since, built before this format) from the raw
    samples."""

    builds: Mapping[int, int]
    live: tuple[int, ...] = ()


def report_scope(store: Any, f: Filters, slo: Slo, version: DataVersion | None = None) -> Scope | None:
    """Which runs in scope have a current rollup (same format version, this SLO, the samples
    unchanged since); None when none has, or a time window is set (read it all raw).

    version: the experiment's RawReader.data_version when the caller already read it (the
    report cache's key); the rollups are then checked against the data that key describes."""
    if f.since is not None or f.until is not None:
        return None
    if version is None:
        live = RawReader(store).signature(f.experiment, f.run_id)
    else:
        live = {r: (n, total) for r, n, total, _ in version if f.run_id is None or r == f.run_id}
    if f.runs is not None:  # the runs the report chose (analysis.runs)
        live = {r: sig for r, sig in live.items() if r in f.runs}
    if not live:
        return None
    cond, params = where(Filters(f.experiment, run_id=f.run_id))
    rows = store.query(
        f"SELECT run_id, build_id, spec, rows, recorded_sum FROM {schema.ROLLUP_BUILDS_TABLE} FINAL WHERE {cond}",
        params,
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


def reader_for(
    store: Any, f: Filters, slo: Slo, version: DataVersion | None = None, use_rollup: bool = True
) -> SampleReader:
    """The reader of one report: merged when some run in scope has a current rollup, else raw.
    use_rollup=False reads the raw samples even where finished runs have rollups (the same
    numbers, slower; for checking the rollups)."""
    scope = report_scope(store, f, slo, version) if use_rollup else None
    return RawReader(store) if scope is None else MergedReader(store, scope)


def merge_summaries(*parts: Mapping[str, Mapping[str, Any]]) -> Summary:
    """Per-variant summaries (SampleReader.summary shape) of disjoint runs, added up."""
    out: Summary = {}
    for part in parts:
        for v, s in part.items():
            if v not in out:
                out[v] = {
                    **s,
                    "metric_n": dict(s["metric_n"]),
                    "modes": dict(s["modes"]),
                    "phase_sums": dict(s["phase_sums"]),
                }
                continue
            o = out[v]
            for k in ("n", "errors", "hits", "phase_n", *GAP_REQUESTS):
                o[k] += s[k]
            o["first_ms"], o["last_ms"] = min(o["first_ms"], s["first_ms"]), max(o["last_ms"], s["last_ms"])
            for group in ("metric_n", "modes", "phase_sums"):
                for k, x in s[group].items():
                    o[group][k] = o[group].get(k, 0) + x
    return out


def merge_histograms(*parts: Hist) -> dict[str, tuple[list[int], list[int], list[float]]]:
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


class MergedReader:
    """The SampleReader of a scope with rollups: scope.builds from RollupReader, scope.live
    (runs without a current build) from RawReader, added up per query."""

    p99_note = "; from the rollup, the largest TTFT of the 1 ms bucket holding that rank"

    def __init__(self, store: Any, scope: Scope) -> None:
        self.scope = scope
        self.rollup = RollupReader(store, scope.builds)
        self.raw = RawReader(store)
        self.parallel_queries = self.raw.parallel_queries
        self.source = "rollup+samples" if scope.live else "rollup"

    def _live(self, f: Filters) -> Filters | None:
        return dataclasses.replace(f, runs=self.scope.live) if self.scope.live else None

    def summary(self, f: Filters, slo: Slo) -> Summary:
        live = self._live(f)
        jobs = {"rollup": lambda: self.rollup.summary(f)}
        if live is not None:
            jobs["counts"] = lambda: self.raw.counts(live, slo)
            jobs["phases"] = lambda: self.raw.phase_sums(live, slo)
        got = run_queries(self.parallel_queries, jobs)
        raw = with_phases(got["counts"], got["phases"]) if live is not None else {}
        return merge_summaries(got["rollup"], raw)

    def histograms(self, f: Filters) -> dict[str, dict[str, tuple[list[int], list[int], list[float]]]]:
        """Every metric's histogram (the rollup keeps them all), the live runs' added."""
        live = self._live(f)
        jobs = {"rollup": lambda: self.rollup.histograms(f)}
        if live is not None:
            for m in METRICS:
                jobs[m] = lambda m=m: self.raw.histogram(live, m)
        got = run_queries(self.parallel_queries, jobs)
        return {m: merge_histograms(got["rollup"][m], got.get(m, {})) for m in METRICS}

    def order_statistics(
        self,
        f: Filters,
        metric: str,
        ranks: Mapping[str, Sequence[int]],
        counts: Mapping[str, int],
        hist: Hist | None,
    ) -> dict[str, dict[int, float]]:
        if hist is None:
            raise ValueError(f"MergedReader.order_statistics: {metric} needs its histogram")
        return self.rollup.order_statistics(f, metric, hist, ranks, self._live(f))

    def segment_cells(self, f: Filters, slo: Slo, bucket_s: int) -> list[dict[str, Any]]:
        live = self._live(f)
        out = self.rollup.segment_cells(f, bucket_s)
        return out + self.raw.segment_cells(live, slo, bucket_s) if live is not None else out

    def srm_users(self, f: Filters) -> list[dict[str, Any]]:
        # distinct users of one run come from its rollup; over several runs a user may appear in
        # more than one, so they are counted over all the samples in scope
        users = None if self.scope.live else self.rollup.srm_users(f)
        return self.raw.srm_users(f) if users is None else users

    def failures(self, f: Filters) -> Failures:
        """The builds' failure classes and the live runs', added up."""
        live = self._live(f)
        rolled = self.rollup.failures(f)
        return rolled if live is None else merge_failures(rolled, self.raw.failures(live))

    def setup_errors(self, f: Filters) -> Failures:
        """As failures: the builds' setup errors and the live runs', added up."""
        live = self._live(f)
        rolled = self.rollup.setup_errors(f)
        return rolled if live is None else merge_failures(rolled, self.raw.setup_errors(live))

    def p99_over_time(self, f: Filters, bucket_s: int) -> dict[str, list[tuple[int, int, float]]]:
        return self.rollup.p99_over_time(f, bucket_s, self._live(f))

    def unit_moments(self, f: Filters, slo: Slo, unit: str) -> dict[str, UnitMoments]:
        """Per request: the rollups' moments and the live runs', added up. Per user: the one
        build's when the scope is one finished run, else from the samples (a user may appear in
        several runs, as for srm_users)."""
        live = self._live(f)
        if unit == "user":
            got = None if live is not None else self.rollup.unit_moments(f, unit)
            return self.raw.unit_moments(f, slo, unit) if got is None else got
        jobs = {"rollup": lambda: self.rollup.unit_moments(f, unit)}
        if live is not None:
            jobs["raw"] = lambda: self.raw.unit_moments(live, slo, unit)
        got_parts = run_queries(self.parallel_queries, jobs)
        if got_parts["rollup"] is None:  # not in this code's layout: all from the samples
            return self.raw.unit_moments(f, slo, unit)
        return units.merge(got_parts["rollup"], got_parts.get("raw", {}))

    def mirror_pairs(self, f: Filters, slo: Slo, control: str, variant: str) -> dict[str, Any]:
        """From the samples: pairs are per request, a rollup keeps none."""
        return self.raw.mirror_pairs(f, slo, control, variant)

    def fidelity_pairs(
        self, f: Filters, unit: str, control: str, variant: str, *, examples: bool = False
    ) -> dict[str, Any]:
        """From the samples: answers are compared per request, a rollup keeps none."""
        return self.raw.fidelity_pairs(f, unit, control, variant, examples=examples)

    def fidelity_scores(self, f: Filters, unit: str, control: str) -> dict[str, dict[str, Any]]:
        """From the scoring pass's table: a rollup keeps no scores."""
        return self.raw.fidelity_scores(f, unit, control)

    def fidelity_shadows(self, f: Filters, unit: str, control: str) -> dict[str, dict[str, Any]]:
        """From the gateway's shadows table: a rollup keeps no shadows."""
        return self.raw.fidelity_shadows(f, unit, control)

    def data_version(self, experiment: str) -> DataVersion:
        return self.raw.data_version(experiment)
