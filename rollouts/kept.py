"""A rollout step's per-user sums kept in the sample store between looks, so that a look reads
what arrived since the last one instead of every request of the step again.

Why: a look reduces the step to a few numbers per arm (rollouts/readings.py), but reducing them
from the samples means grouping every request of the step by user each minute: 15 s at 669k
users and 33M requests on a 2-core ClickHouse 18.16 server. Through the kept sums a look at that
size takes 0.5 s at 1,000 req/s arriving (bench/RESULTS.md, "Rollout looks through kept
per-user sums"); what a look costs follows the units the traffic since the last one touches.

What is kept, per (experiment, config revision, spec), in two tables (samples.schema, migration
12):
- rollout_user_sums: per unit (a user; a request without one: analysis.units.CLUSTER_KEY) the
  sums of its requests' vector v (analysis.units.vector_sums of BLOCKS), its setup errors,
  whether the router assigned it (analysis.sql.SRM_SAMPLES), its rows and their sum of
  recorded_ms. Every fold appends one row per unit it saw; a unit's kept sums are the sum of its
  rows.
- rollout_folds: after each fold, one row naming the generation, the fold's number, its
  watermark (every sample of the step recorded at or before it is in the kept rows) and the
  step's state at the watermark (each arm's moments as analysis.units.UnitMoments, setup errors,
  assigned users, latency histograms; the kept rows' count and sum of recorded_ms; the settled
  parts, below).

The index: a look needs the kept sums of the units its new samples touch. Found in
rollout_user_sums, every kept row is read to find theirs (a scan that grows with the step's
users: 0.14-0.17 s of CPU per look at 1.15M kept rows, twice per look). So each generation's user
sums are copied, fold by fold, into a Join-engine table of the store (samples.schema,
ROLLOUT_SUMS_INDEX_PREFIX), which the server keeps in memory and on disk: a look joins its units
on it, at a cost that follows its units alone. It holds 260 B of the server's resident memory per
kept row on 18.16, up to two rows per unit before a compaction (bench/RESULTS.md "Kept sums found
by key"). rollout_user_sums stays the record: compaction reads it, and an index that is missing
(never built on this server, dropped, a server of a cluster other than the one that built it) or
lacks a fold's marker (a copy that stopped) is built again from it before it is read, checked
against the state's count of kept rows. An experiment's indexes other than its current
generation's are dropped with their user sums (_forget_others), and all of them when its rollout
finishes (forget).

A look (``read``):
1. The newest fold row. A fold marks its start in rollout_folds before it writes user sums, and
   a mark with no state after it (a fold that stopped between its writes, whose rows would count
   twice) makes the generation unusable: a new one is built. The index is checked
   (and built again when it must be); user sums that no longer hold the state's rows (removed
   by another spec's look) make the generation unusable too.
2. Fold, when the watermark can move by FOLD_EVERY_MS: the samples recorded after the watermark
   and up to ``now`` less the lag (KEEP_LAG_MS unless told) are summed per unit into the user
   sums and copied into the index, the moments' increment is computed from the units they touch
   alone (their kept rows joined from the index;
   analysis.units.moments_of_vectors: per product, (k + d)_a (k + d)_b - k_a k_b), checked (4.)
   and the new state written. A generation whose rows outnumber its units COMPACT_ABOVE times is
   summed into one row per unit.
3. Read: the state, plus the increment of the samples recorded after the watermark (grouped per
   unit, with those units' kept sums), plus their histograms: beside the fold's own reads when
   the look folds (they need the fold's user sums, not its moments).
4. Check: the samples recorded up to the watermark must still be exactly the kept ones (count
   and sum of recorded_ms). A row stored late (recorded before the watermark, stored after the
   fold), or a duplicate recording removed since, changes that: the state is built again from
   the samples, in a new generation, and read again. Never a stale answer; at worst a look
   costs what it costs without kept sums. Rows that keep arriving late raise KeptStale, and the
   reader reads the whole step instead (rollouts.readings).

Settled parts: a part of the samples table never changes once written; inserts and merges
(a duplicate removed too) make parts of new names (SampleReads.active_parts). The state keeps,
per part whose rows of the step were all recorded by the watermark, their count and recorded_ms
sum. Every read of the samples skips those parts (``_part NOT IN``, pruned without reading): the
new samples are in the others, and the check adds the settled parts' counts to a read of the
others alone. So a look reads the parts written or merged since the last fold, however many
samples the step already has; a merge makes a large part unsettled once, until the next fold
settles it. A merge between the check's listing of the parts and its read counts rows twice or
not at all: every part is read again before the sums are thrown away. On a cluster the
Distributed table has no parts of its own: every look counts every row of the step, and the new
samples' reads prune by send time alone (_after).

The hits depend on the SLO, the vector on analysis.units' layout, the histograms on the plan's
latencies: ``spec`` hashes them, and a change starts sums of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from analysis import units
from analysis.definitions import SETUP_ERROR, Slo
from analysis.readers.base import parallelism, run_queries
from analysis.sql import SAMPLES, SRM_SAMPLES, metric_ok
from experiments.document import ROLLOUT_LATENCIES
from samples.schema import ROLLOUT_FOLDS_TABLE, ROLLOUT_SUMS_INDEX_PREFIX, ROLLOUT_USER_SUMS_TABLE
from samples.store_errors import StoreError, StoreUnavailable
from stats.sequential.arm_snapshot import ATTAINMENT, ERROR_RATE
from stats.sequential.quantiles import latency_edges

FORMAT = 4
# The moments' blocks a step's guardrails read (attainment and error rate, per user and adjusted:
# rollouts.readings.user_moments): "all" alone. Not the "ttft" block's mean TTFT, which no
# guardrail reads; without it a unit's vector has 12 sums, not 22, and the increment 81 of the
# moments' 136 (bench/RESULTS.md "Rollout looks through kept per-user sums").
BLOCKS = units.blocks_of((ATTAINMENT, ERROR_RATE))
EDGES = latency_edges(60_000.0, 1.0)  # 0..60 s at 1 ms; slower lands in the overflow bucket
# Samples recorded in the last KEEP_LAG_MS (the default lag; ABPLAT_ROLLOUT_KEPT_LAG_S) are read
# afresh at every look and never kept. Rows reach the store about a second after their recorded
# time (the gateway's recorder; 5 s more per failed insert it retries), later only after a store
# outage (the spool), and a row stored after the watermark passed its recorded time builds the
# sums again: 30 s leaves room for five retries (and for the gateway hosts' clocks, which stamp
# recorded_ms at each request's end, to differ from the workers' by seconds). A longer lag reads
# more at every look: the lag's traffic is grouped afresh each time (bench/RESULTS.md "How a
# look's cost grows with the traffic").
KEEP_LAG_MS = 30_000
# A request recorded after the watermark was sent at most this long before it (see _after).
SENT_BEFORE_MS = 3_600_000
# A fold moves the watermark by at least this much (a look in between reads from the last one).
FOLD_EVERY_MS = 60_000
# A generation holding more rows than COMPACT_ABOVE per unit (and COMPACT_MIN rows) is summed
# into one row per unit, in a new generation, at the next fold.
COMPACT_ABOVE = 2.0
COMPACT_MIN = 50_000
QUERY_SETTINGS = {"max_execution_time": 30}
# The increment's rows per unit reach its per-arm sums in one block up to 10^6 units or 1 GiB of
# states. Past 10^5 units 18.16 aggregates in two levels and hands the units on in 256 small
# blocks, over which the outer query's products (136 then, of both blocks) cost about three
# times as much (1.3-1.55 s against 0.39-0.57 s at ~114k touched units, bench/RESULTS.md
# "Rollout looks through kept per-user sums"); past the bounds two levels again, whose merge
# needs less memory (a fold after a long pause in the looks; the whole read's per-user query, one
# level at 3.9M units, exceeds a 3.7 GiB query limit).
INCREMENT_SETTINGS = {
    **QUERY_SETTINGS,
    "group_by_two_level_threshold": 1_000_000,
    "group_by_two_level_threshold_bytes": 1 << 30,
}
MOD64 = 1 << 64  # sum(recorded_ms) is a UInt64 sum: it wraps, the same on both sides

_UNIT_COLUMNS = ("variant", "cluster", "assigned", "anon", "setup", "rows", "recorded_sum", "v")
# A generation's index (samples.schema): its user sums' unit, fold, vector and assigned flag in a
# Join-engine table, ALL rows of a unit returned by a join on it. Markers: one row per fold whose
# copy finished, on unit 0 with an empty vector (a unit's vector never is), so that a unit whose
# key is 0 gains nothing from them.
_INDEX_COLUMNS = "cluster UInt64, kfold UInt32, kv Array(Float64), kassigned UInt8"
_INDEX_NAME = re.compile(rf"{ROLLOUT_SUMS_INDEX_PREFIX}[0-9a-f]{{12}}_[0-9a-f]{{16}}")


class KeptStale(Exception):
    """The kept sums could not be made to agree with the samples (rows keep arriving late)."""


@dataclasses.dataclass
class ArmState:
    """One arm's step state: per-user moments, setup errors, assigned users (those with an id,
    and whether a request without one was assigned), a histogram per latency."""

    moments: units.UnitMoments | None = None
    setup: int = 0
    named: int = 0
    anon: bool = False
    hists: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def users(self) -> int:
        """analysis.sql.ASSIGNED_USERS: every request without a user id counts as one user."""
        return self.named + (1 if self.anon else 0)

    def hist(self, latency: str) -> np.ndarray:
        return self.hists.get(latency, np.zeros(EDGES.size + 1, dtype=np.int64))


@dataclasses.dataclass
class State:
    generation: int
    fold: int = 0
    upto_ms: int = 0
    rows: int = 0
    recorded_sum: int = 0
    entries: int = 0  # rows of the user sums in this generation
    units: int = 0  # units among them
    arms: dict[str, ArmState] = dataclasses.field(default_factory=dict)
    # The samples table's parts settled at the watermark: every row of the step in them recorded
    # at or before it. Name -> [rows, recorded_ms sum] of the step's rows in the part.
    parts: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        arms = {}
        for arm, a in self.arms.items():
            arms[arm] = {
                "counts": list(a.moments.counts) if a.moments else None,
                "sums": [float(x) for x in a.moments.sums] if a.moments else None,
                "setup": a.setup,
                "named": a.named,
                "anon": a.anon,
                "hists": {
                    name: [[int(b), int(h[b])] for b in np.flatnonzero(h)] for name, h in a.hists.items()
                },
            }
        body = {k: getattr(self, k) for k in ("rows", "recorded_sum", "entries", "units")}
        return json.dumps(
            {"format": FORMAT, **body, "arms": arms, "parts": self.parts}, separators=(",", ":")
        )

    @classmethod
    def from_json(cls, generation: int, fold: int, upto_ms: int, text: str) -> State:
        body = json.loads(text)
        arms = {}
        for arm, a in body["arms"].items():
            moments = None
            if a["counts"] is not None:
                moments = units.UnitMoments.from_row(a["counts"], a["sums"], BLOCKS)
            hists = {}
            for name, pairs in a["hists"].items():
                h = np.zeros(EDGES.size + 1, dtype=np.int64)
                for b, c in pairs:
                    h[b] = c
                hists[name] = h
            arms[arm] = ArmState(moments, a["setup"], a["named"], a["anon"], hists)
        got = {k: int(body[k]) for k in ("rows", "recorded_sum", "entries", "units")}
        parts = {str(p): [int(n), int(r)] for p, (n, r) in body.get("parts", {}).items()}
        return cls(generation, fold, upto_ms, arms=arms, parts=parts, **got)


@dataclasses.dataclass(frozen=True)
class Increment:
    """What a set of samples adds to the state: per arm an ArmState of increments (the moments'
    by analysis.units.moments_of_vectors), the rows and their recorded_ms sum, units new and
    touched."""

    arms: dict[str, ArmState]
    rows: int = 0
    recorded_sum: int = 0
    new_units: int = 0
    touched: int = 0


@dataclasses.dataclass(frozen=True)
class Tally:
    """The step's samples recorded up to a watermark: their count and recorded_ms sum, and the
    parts settled at it (State.parts)."""

    rows: int
    recorded_sum: int
    parts: dict[str, list[int]]


def add(state: State, inc: Increment, *, into: State | None = None) -> State:
    """state + inc (a new State, or ``into`` filled): moments by UnitMoments.add, the rest
    summed; the generation, fold and watermark are the caller's."""
    out = into or dataclasses.replace(state, arms={})
    out.rows = state.rows + inc.rows
    out.recorded_sum = (state.recorded_sum + inc.recorded_sum) % MOD64
    out.units = state.units + inc.new_units
    out.arms = {}
    for arm in set(state.arms) | set(inc.arms):
        a, b = state.arms.get(arm, ArmState()), inc.arms.get(arm, ArmState())
        if a.moments is None or b.moments is None:
            moments = a.moments or b.moments
        else:
            moments = a.moments.add(b.moments)
        hists = {name: a.hist(name) + b.hist(name) for name in set(a.hists) | set(b.hists)}
        out.arms[arm] = ArmState(moments, a.setup + b.setup, a.named + b.named, a.anon or b.anon, hists)
    return out


def spec_of(arms: Sequence[str], slo: Slo, latencies: Sequence[str]) -> str:
    """What the kept sums depend on, hashed: the arms, the SLO (the hits), the vector's layout
    and covariates, the histograms' latencies and buckets."""
    what = {
        "format": FORMAT,
        "arms": list(arms),
        "slo": sorted(slo.limits().items()),
        "components": [list(k) for k in units.vector_positions(BLOCKS)],
        "covariates": units.COVARIATES,
        "latencies": sorted(latencies),
        "edges": int(EDGES.size),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class KeptStep:
    """One step's kept sums in ``store``: read() is a look."""

    def __init__(
        self,
        store: Any,
        experiment: str,
        revision: int,
        arms: Sequence[str],
        slo: Slo,
        latencies: Sequence[str],
        *,
        lag_ms: int = KEEP_LAG_MS,
    ) -> None:
        if lag_ms < 0:  # a watermark ahead of now would keep rows still being recorded
            raise ValueError(f"the kept sums' lag must be 0 ms or more, not {lag_ms}")
        for name in latencies:
            if name not in ROLLOUT_LATENCIES:  # the document refuses others; never interpolate one
                raise ValueError(f"unknown latency {name!r}")
        self.store = store
        self.lag_ms = int(lag_ms)
        self._experiment_key = _experiment_key(experiment)
        self.arms = tuple(arms)
        self.latencies = tuple(latencies)
        self.spec = spec_of(self.arms, slo, self.latencies)
        self.vector, vparams = units.vector_sums(slo, BLOCKS)
        self.params: dict[str, Any] = {
            "experiment": experiment,
            "revision": int(revision),
            "arms": self.arms,
            "spec": self.spec,
            **vparams,
        }

    # ------------------------------------------------------------------------------ SQL

    def _step(self, *ranges: str, where: Sequence[str] = ()) -> str:
        """FROM the step's samples (its arms, its revision) in ``ranges`` on recorded_ms, and
        ``where``. The ranges go to PREWHERE: a look's new samples are a few granules at the end
        of each run's rows, and only those granules' other columns are read."""
        pre = "".join(f" AND {r}" for r in ranges)
        more = "".join(f" AND {w}" for w in where)
        return (
            f"FROM {SAMPLES} PREWHERE experiment = %(experiment)s AND variant IN %(arms)s{pre} "
            f"WHERE config_revision = %(revision)s{more}"
        )

    def _units_sql(self, *ranges: str, where: Sequence[str] = ()) -> str:
        """Per unit of the step's samples in ``ranges`` (and ``where``): the user sums' columns."""
        return (
            f"SELECT arm AS variant, {', '.join(_UNIT_COLUMNS[1:])} FROM ("
            f"SELECT toString(any(variant)) AS arm, {units.CLUSTER_KEY} AS cluster, "
            f"toUInt8(max({SRM_SAMPLES})) AS assigned, toUInt8(max(user_id = '')) AS anon, "
            f"countIf({SETUP_ERROR}) AS setup, count() AS rows, sum(recorded_ms) AS recorded_sum, "
            f"[{', '.join(self.vector)}] AS v {self._step(*ranges, where=where)} GROUP BY cluster)"
        )

    def _kept_where(self) -> str:
        return (
            "experiment = %(experiment)s AND config_revision = %(revision)s AND spec = %(spec)s "
            "AND generation = %(generation)s"
        )

    def _increment_sql(self, new: str, generation: int) -> str:
        """Per arm, what the units of ``new`` (a query of the user sums' columns, one row per
        unit) add to the kept sums of ``generation`` up to fold %(kept_fold)s. Their kept rows
        come from the generation's index, a join by unit: the cost follows the units of ``new``,
        not the units kept (the MergeTree rows' scan and grouping, every kept row read to find
        theirs, took 0.14-0.17 s of a 0.37-0.40 s increment at 1.15M kept rows;
        bench/RESULTS.md "Kept sums found by key")."""
        counts, sums = units.moments_of_vectors("k", "d", BLOCKS)
        return (
            f"SELECT arm AS variant, {counts} AS counts, {sums} AS sums, sum(setup_d) AS setup_n, "
            "countIf(ka = 0 AND da = 1 AND unnamed = 0) AS named, max(da * unnamed) AS anon_any, "
            "sum(rows_d) AS rows_n, sum(recsum_d) AS recorded_n, countIf(empty(k)) AS new_units, "
            "count() AS touched "
            "FROM (SELECT cluster, any(variant) AS arm, sumForEachIf(kv, kfold <= %(kept_fold)s) AS k, "
            "any(v) AS d, maxIf(kassigned, kfold <= %(kept_fold)s) AS ka, any(assigned) AS da, "
            "any(anon) AS unnamed, any(setup) AS setup_d, any(rows) AS rows_d, "
            f"any(recorded_sum) AS recsum_d FROM ({new}) AS new "
            f"ALL LEFT JOIN {self.index_name(generation)} USING cluster GROUP BY cluster) GROUP BY arm"
        )

    def _first_sql(self) -> str:
        """_increment_sql when nothing is kept yet: the moments of the fold's own rows, one per
        unit (no kept sums to join: 0.26 s at 10^6 units where the join took 4-30 s)."""
        counts, sums = units.moments_of_vectors("v", blocks=BLOCKS)
        return (
            f"SELECT variant, {counts} AS counts, {sums} AS sums, sum(setup) AS setup_n, "
            "countIf(assigned = 1 AND anon = 0) AS named, max(assigned * anon) AS anon_any, "
            "sum(rows) AS rows_n, sum(recorded_sum) AS recorded_n, count() AS new_units, "
            f"count() AS touched FROM {ROLLOUT_USER_SUMS_TABLE} "
            f"WHERE {self._kept_where()} AND fold = %(fold)s GROUP BY variant"
        )

    def _query(
        self, sql: str, params: Mapping[str, Any], settings: Mapping[str, int] = QUERY_SETTINGS
    ) -> dict[str, list[Any]]:
        return self.store.query_columns(sql, {**self.params, **params}, settings=settings)

    def _execute(self, sql: str, params: Mapping[str, Any]) -> None:
        self.store.execute(sql, {**self.params, **params})

    # ------------------------------------------------------------------------------ the index

    def index_name(self, generation: int) -> str:
        """The name of the generation's index: hex digests alone after the prefix, so that no
        name a user gave reaches the SQL."""
        what = f"{self.params['revision']}|{self.spec}|{int(generation)}"
        return f"{ROLLOUT_SUMS_INDEX_PREFIX}{self._experiment_key}_{hashlib.sha256(what.encode()).hexdigest()[:16]}"

    def _index_create(self, generation: int) -> None:
        """The generation's index, empty (one left by an earlier attempt dropped first)."""
        index = self.index_name(generation)
        self._execute(f"DROP TABLE IF EXISTS {index}", {})
        self._execute(f"CREATE TABLE {index} ({_INDEX_COLUMNS}) ENGINE = Join(ALL, LEFT, cluster)", {})

    def _index_add(self, generation: int, first: int, last: int) -> None:
        """The generation's user sums of folds first..last copied into its index, then a marker
        per fold: the folds whose copy finished (_index_folds). A copy that stopped half-way
        leaves no marker, and the index is built again before it is read."""
        index, at = self.index_name(generation), {"generation": generation, "first": first, "last": last}
        self._execute(
            f"INSERT INTO {index} (cluster, kfold, kv, kassigned) SELECT cluster, fold, v, assigned "
            f"FROM {ROLLOUT_USER_SUMS_TABLE} WHERE {self._kept_where()} "
            "AND fold >= %(first)s AND fold <= %(last)s",
            at,
        )
        self._execute(
            f"INSERT INTO {index} (cluster, kfold, kv, kassigned) SELECT toUInt64(0), "
            "toUInt32(%(first)s + number), emptyArrayFloat64(), toUInt8(0) FROM numbers(%(count)s)",
            {**at, "count": last - first + 1},
        )

    def _index_folds(self, generation: int) -> set[int] | None:
        """The folds whose copy into the generation's index finished; None when it has no index
        (never built, dropped, or a server other than the one that built it)."""
        index = self.index_name(generation)
        try:
            cols = self._query(
                "SELECT groupArrayIf(kfold, empty(kv) AND kfold > 0) AS folds "
                f"FROM (SELECT toUInt64(0) AS cluster) AS marker ALL LEFT JOIN {index} USING cluster",
                {},
            )
        except StoreUnavailable:
            raise
        except StoreError:
            there = self._query(
                "SELECT count() AS n FROM system.tables WHERE database = currentDatabase() "
                "AND name = %(index)s",
                {"index": index},
            )
            if int(there["n"][0]):
                raise  # the index is there: the error is another one
            return None
        return {int(f) for f in cols["folds"][0]} if cols.get("folds") else set()

    def _index_ready(self, state: State) -> bool:
        """Whether the state's index holds every fold up to the state's, built again from the
        user sums when not. False when the user sums no longer hold the state's rows (another
        spec or revision of the experiment started since and forgot them, _forget_others): the
        state is then unusable."""
        if state.fold == 0:
            return True
        folds = self._index_folds(state.generation)
        if folds is not None and set(range(1, state.fold + 1)) <= folds:
            return True
        self._index_create(state.generation)
        self._index_add(state.generation, 1, state.fold)
        # counted after the copy: rows removed before it show here, rows removed after it were
        # copied; either way the index never holds less than the state counted without saying so
        cols = self._query(
            f"SELECT count() AS n FROM {ROLLOUT_USER_SUMS_TABLE} WHERE {self._kept_where()} "
            "AND fold <= %(fold)s",
            {"generation": state.generation, "fold": state.fold},
        )
        return int(cols["n"][0]) == state.entries

    # ------------------------------------------------------------------------------ pieces

    def _increment(self, new: str | None, state: State, params: Mapping[str, Any]) -> Increment:
        """What ``new`` (None: the fold's own rows, nothing kept before them) adds to ``state``."""
        sql = self._first_sql() if new is None else self._increment_sql(new, state.generation)
        cols = self._query(
            sql, {"generation": state.generation, "kept_fold": state.fold, **params}, INCREMENT_SETTINGS
        )
        arms: dict[str, ArmState] = {}
        rows = recorded = fresh = touched = 0
        for i, arm in enumerate(cols.get("variant", [])):
            moments = units.UnitMoments.from_row(cols["counts"][i], cols["sums"][i], BLOCKS)
            arms[str(arm)] = ArmState(
                moments, int(cols["setup_n"][i]), int(cols["named"][i]), bool(cols["anon_any"][i])
            )
            rows += int(cols["rows_n"][i])
            recorded += int(cols["recorded_n"][i])
            fresh += int(cols["new_units"][i])
            touched += int(cols["touched"][i])
        return Increment(arms, rows, recorded % MOD64, fresh, touched)

    def _hists(
        self, inc: Increment, *ranges: str, where: Sequence[str] = (), params: Mapping[str, Any]
    ) -> None:
        """The samples' latency histograms in ``ranges`` (and ``where``), into inc's arms (bucket
        k holds (k-1, k] ms: stats.sequential.quantiles.LatencyHistogram)."""
        for name in self.latencies:
            rows = self._query(
                f"SELECT variant, toInt64(least(ceil({name}), {EDGES.size})) AS bucket, count() AS c "
                f"{self._step(*ranges, where=[*where, metric_ok(name)])} GROUP BY variant, bucket",
                params,
            )
            for variant, bucket, c in zip(rows["variant"], rows["bucket"], rows["c"], strict=True):
                arm = inc.arms.setdefault(str(variant), ArmState())
                h = arm.hists.setdefault(name, np.zeros(EDGES.size + 1, dtype=np.int64))
                h[max(0, int(bucket))] += int(c)

    def _tally(self, settled: Mapping[str, Sequence[int]], upto_ms: int) -> Tally:
        """The step's samples recorded up to upto_ms: the settled parts' kept figures (those
        still active) plus one read of every other part, grouped by part. A part read whose rows
        of the step were all recorded by upto_ms is settled from now on, and so is a listed part
        the read found none in. On a cluster (no parts listed) every row is read."""
        listed = self.store.active_parts()
        if listed is None:
            cols = self._query(
                "SELECT count() AS rows, sum(recorded_ms) AS recorded_sum "
                f"{self._step('recorded_ms <= %(upto)s')}",
                {"upto": upto_ms},
            )
            rows = int(cols["rows"][0]) if cols.get("rows") else 0
            recorded = int(cols["recorded_sum"][0]) if cols.get("recorded_sum") else 0
            return Tally(rows, recorded % MOD64, {})
        keep = {p: list(settled[p]) for p in listed if p in settled}
        params: dict[str, Any] = {"upto": upto_ms}
        cols = self._query(
            "SELECT _part AS part, countIf(recorded_ms <= %(upto)s) AS rows, "
            "sumIf(recorded_ms, recorded_ms <= %(upto)s) AS recorded_sum, max(recorded_ms) AS top "
            f"{self._step(where=_skipping(keep, params))} GROUP BY part",
            params,
        )
        parts = dict(keep)
        rows = sum(n for n, _ in keep.values())
        recorded = sum(r for _, r in keep.values())
        for part, n, r, top in zip(
            cols["part"], cols["rows"], cols["recorded_sum"], cols["top"], strict=True
        ):
            rows, recorded = rows + int(n), recorded + int(r)
            if int(top) <= upto_ms:
                parts[str(part)] = [int(n), int(r) % MOD64]
        for part in set(listed) - set(keep) - set(map(str, cols["part"])):
            parts[part] = [0, 0]  # none of the step's rows (or merged away since the listing)
        return Tally(rows, recorded % MOD64, parts)

    def _check(self, want: State, tally: Tally | None = None) -> dict[str, list[int]] | None:
        """The parts settled at want's watermark when the samples recorded up to it are exactly
        the kept ones (``tally`` of them, or read now), None when they are not. A part merged
        between the listing and the read is counted twice or not at all: before giving up,
        every part is read again."""
        tally = tally or self._tally(want.parts, want.upto_ms)
        if (tally.rows, tally.recorded_sum) != (want.rows, want.recorded_sum) and want.parts:
            tally = self._tally({}, want.upto_ms)
        return tally.parts if (tally.rows, tally.recorded_sum) == (want.rows, want.recorded_sum) else None

    def newest(self) -> State | None:
        """The newest usable state of this step, or None (none kept, or an unfinished fold).
        The newest row of the step's folds, a state before the mark of its own fold's start:
        a mark alone is a fold that began (and may have written user sums, which would count
        twice) and never wrote its state."""
        cols = self._query(
            f"SELECT generation, fold, upto_ms, state FROM {ROLLOUT_FOLDS_TABLE} "
            "WHERE experiment = %(experiment)s AND config_revision = %(revision)s AND spec = %(spec)s "
            "ORDER BY generation DESC, fold DESC, state = '' LIMIT 1",
            {},
        )
        if not cols.get("generation") or cols["state"][0] == "":
            return None
        return State.from_json(
            int(cols["generation"][0]), int(cols["fold"][0]), int(cols["upto_ms"][0]), cols["state"][0]
        )

    def _write_fold_row(self, generation: int, fold: int, upto_ms: int, text: str) -> None:
        self._execute(
            f"INSERT INTO {ROLLOUT_FOLDS_TABLE} (experiment, config_revision, spec, generation, fold, "
            "upto_ms, state) SELECT %(experiment)s, %(revision)s, %(spec)s, %(generation)s, %(fold)s, "
            "%(upto)s, %(state)s",
            {"generation": generation, "fold": fold, "upto": upto_ms, "state": text},
        )

    def _write_state(self, state: State) -> None:
        self._write_fold_row(state.generation, state.fold, state.upto_ms, state.to_json())

    def _forget_others(self, generation: int) -> None:
        """Drop the user sums of every other generation, revision and spec of the experiment
        (a mutation, applied in the background): a step reads its own generation alone."""
        self._execute(
            f"ALTER TABLE {ROLLOUT_USER_SUMS_TABLE} DELETE WHERE experiment = %(experiment)s AND NOT "
            "(config_revision = %(revision)s AND spec = %(spec)s AND generation = %(generation)s)",
            {"generation": generation},
        )
        _drop_indexes(self.store, self._experiment_key, keep=self.index_name(generation))

    def fold(self, state: State, upto_ms: int) -> tuple[State | None, Increment]:
        """Keep the samples recorded in (state.upto_ms, upto_ms]: the mark of the fold's start,
        their per-unit sums as fold state.fold + 1 (and in the index), then the state at upto_ms
        (written last: until then the fold is a mark alone, which newest() refuses), once checked
        against the samples (_check, after the histograms' read: a row stored late in between is
        counted there). None when they disagree: nothing written but the mark and the fold's user
        sums, which newest() refuses.
        Beside the fold's own reads, what the samples recorded after upto_ms add to the new
        state (_since_queries): they need its user sums, not its moments."""
        nxt = state.fold + 1
        at = {"generation": state.generation, "fold": nxt, "after": state.upto_ms, "upto": upto_ms}
        self._write_fold_row(state.generation, nxt, upto_ms, "")  # begun: newest() refuses it alone
        ranges = (*_after(state.upto_ms, at), "recorded_ms <= %(upto)s")
        skip = _skipping(state.parts, at)
        self._execute(
            f"INSERT INTO {ROLLOUT_USER_SUMS_TABLE} (experiment, config_revision, spec, generation, fold, "
            f"{', '.join(_UNIT_COLUMNS)}) SELECT %(experiment)s, %(revision)s, %(spec)s, %(generation)s, "
            f"%(fold)s, {', '.join(_UNIT_COLUMNS)} FROM ({self._units_sql(*ranges, where=skip)})",
            at,
        )
        if state.fold == 0:
            self._index_create(state.generation)
        new = (
            f"SELECT {', '.join(_UNIT_COLUMNS)} FROM {ROLLOUT_USER_SUMS_TABLE} "
            f"WHERE {self._kept_where()} AND fold = %(fold)s"
        )
        hists, after_hists = Increment({}), Increment({})
        ahead = dataclasses.replace(state, fold=nxt, upto_ms=upto_ms)
        since = self._since_queries(ahead, after_hists)
        read_since = since["since"]

        def copy_then_since() -> Increment:
            # the since increment reads the index with this fold's rows: copied first, beside
            # the fold's own reads (its increment reads the index up to the fold before)
            self._index_add(state.generation, nxt, nxt)
            return read_since()

        got = run_queries(
            parallelism(self.store),
            {
                "inc": lambda: self._increment(new if state.entries else None, state, at),
                "hists": lambda: self._hists(hists, *ranges, where=skip, params=at),
                "since": copy_then_since,
                "since_hists": since["since_hists"],
            },
        )
        inc = _with_hists(got["inc"], hists)
        after = _with_hists(got["since"], after_hists)
        out = add(state, inc)
        out.fold, out.upto_ms = nxt, upto_ms
        out.entries = state.entries + inc.touched
        parts = self._check(out)
        if parts is None:
            return None, after
        out.parts = parts
        self._write_state(out)
        if out.entries > max(COMPACT_MIN, COMPACT_ABOVE * max(out.units, 1)):
            out = self.compact(out)
        return out, after

    def compact(self, state: State) -> State:
        """The generation's rows summed per unit into a new generation (fold 1, the same
        watermark and state) and its index, then the old rows dropped. When the new generation
        holds fewer units than the state counts (its user sums removed since their index was
        built: _index_ready), ``state`` unchanged, its index dropped: the next look builds the
        sums anew rather than fold through a record that lost rows."""
        gen = next_generation(state.generation)
        cols = ", ".join(c for c in _UNIT_COLUMNS if c not in ("variant", "cluster", "v"))
        sums = ", ".join(
            f"{'max' if c in ('assigned', 'anon') else 'sum'}({c})"
            for c in _UNIT_COLUMNS
            if c not in ("variant", "cluster", "v")
        )
        self._execute(
            f"INSERT INTO {ROLLOUT_USER_SUMS_TABLE} (experiment, config_revision, spec, generation, fold, "
            f"variant, cluster, {cols}, v) SELECT %(experiment)s, %(revision)s, %(spec)s, %(new)s, 1, "
            f"any(variant), cluster, {sums}, sumForEach(v) FROM {ROLLOUT_USER_SUMS_TABLE} "
            f"WHERE {self._kept_where()} AND fold <= %(fold)s GROUP BY cluster",
            {"generation": state.generation, "fold": state.fold, "new": gen},
        )
        cols = self._query(
            f"SELECT count() AS n FROM {ROLLOUT_USER_SUMS_TABLE} WHERE {self._kept_where()}",
            {"generation": gen},
        )
        if int(cols["n"][0]) != state.units:
            self._execute(f"DROP TABLE IF EXISTS {self.index_name(state.generation)}", {})
            return state
        out = dataclasses.replace(state, generation=gen, fold=1, entries=state.units)
        self._index_create(gen)
        self._index_add(gen, 1, 1)
        self._write_state(out)
        self._forget_others(gen)
        return out

    # ------------------------------------------------------------------------------ a look

    def _since_queries(self, state: State, hists: Increment) -> dict[str, Callable[[], Any]]:
        """The reads of what the samples recorded after the state's watermark add to it (the
        user sums up to state.fold): "since", the increment, and "since_hists", histograms put
        into ``hists``. They read the parts not settled in the state."""
        at = {"generation": state.generation, "after": state.upto_ms, "upto": state.upto_ms}
        after = _after(state.upto_ms, at)
        skip = _skipping(state.parts, at)
        return {
            "since": lambda: self._increment(self._units_sql(*after, where=skip), state, at),
            "since_hists": lambda: self._hists(hists, *after, where=skip, params=at),
        }

    def _since(self, state: State) -> tuple[Increment, bool]:
        """What the samples recorded after the state's watermark add to it, and whether the
        samples up to it are still the kept ones: three reads of the samples' unsettled parts,
        side by side when the store takes queries at once."""
        hists = Increment({})
        got = run_queries(
            parallelism(self.store),
            {**self._since_queries(state, hists), "tally": lambda: self._tally(state.parts, state.upto_ms)},
        )
        return _with_hists(got["since"], hists), self._check(state, got["tally"]) is not None

    def read(self, now_ms: int) -> State:
        """The step's state now: kept sums folded as far as now_ms less the lag allows, plus
        what was recorded after them, checked against the samples (module docstring).
        Raises KeptStale when the kept sums disagree with the samples twice in a row."""
        state = self.newest()
        if state is not None and not self._index_ready(state):
            state = None
        upto = int(now_ms) - self.lag_ms
        for _attempt in range(2):
            if state is None:
                gen = next_generation(0)
                self._forget_others(gen)
                state = State(gen)
            if upto - state.upto_ms >= FOLD_EVERY_MS or (state.fold == 0 and upto > state.upto_ms):
                folded, inc = self.fold(state, upto)
                if folded is not None:  # checked as it was folded
                    return add(folded, inc)
            else:
                inc, agree = self._since(state)
                if agree:
                    return add(state, inc)
            state = None  # stored late or removed since: build again from the samples
        raise KeptStale(
            "the step's kept sums disagree with its samples after a rebuild: rows recorded more "
            f"than {self.lag_ms / 1000:g} s ago keep arriving"
        )


def forget(store: Any, experiment: str) -> None:
    """Remove every kept sum of ``experiment``, whose rollout finished: its user sums and fold
    rows (mutations, applied in the background) and its indexes, which would otherwise hold the
    server's memory until the experiment's next rollout."""
    for table in (ROLLOUT_USER_SUMS_TABLE, ROLLOUT_FOLDS_TABLE):
        store.execute(
            f"ALTER TABLE {table} DELETE WHERE experiment = %(experiment)s", {"experiment": experiment}
        )
    _drop_indexes(store, _experiment_key(experiment))


def _experiment_key(experiment: str) -> str:
    """What an experiment's index names hold of its name: a digest, never the name itself."""
    return hashlib.sha256(experiment.encode()).hexdigest()[:12]


def _drop_indexes(store: Any, experiment_key: str, keep: str = "") -> None:
    """Drop the indexes of the experiment whose key this is, but ``keep``."""
    names = store.query_columns(
        "SELECT name FROM system.tables WHERE database = currentDatabase() AND startsWith(name, %(prefix)s)",
        {"prefix": f"{ROLLOUT_SUMS_INDEX_PREFIX}{experiment_key}_"},
        settings=QUERY_SETTINGS,
    )
    for name in names.get("name", []):
        if name != keep and _INDEX_NAME.fullmatch(name):
            store.execute(f"DROP TABLE IF EXISTS {name}", {})


def _skipping(settled: Mapping[str, Any], params: dict[str, Any]) -> list[str]:
    """The condition "not in a settled part" (none when nothing is settled), its parameter put
    in ``params``. _part goes in WHERE: 18.16 refuses it in PREWHERE, and skips the parts
    either way without reading them."""
    if not settled:
        return []
    params["settled"] = tuple(sorted(settled))
    return ["_part NOT IN %(settled)s"]


def _with_hists(inc: Increment, hists: Increment) -> Increment:
    """inc with the histograms read beside it put into its arms."""
    for arm, h in hists.arms.items():
        inc.arms.setdefault(arm, ArmState()).hists.update(h.hists)
    return inc


def _after(upto_ms: int, params: dict[str, Any]) -> tuple[str, ...]:
    """The conditions "recorded after ``upto_ms``", its parameters put in ``params``: with a
    bound on the send time SENT_BEFORE_MS earlier, which prunes every part of the table holding
    older samples alone (the partition key's min-max index is kept per part). A row recorded
    after the watermark but sent before that bound is missed here and counted by the check at
    the next fold: a rebuild, never a lost row."""
    params["after"] = int(upto_ms)
    if upto_ms <= 0:
        return ("recorded_ms > %(after)s",)
    params["sent_from"] = max(0, (int(upto_ms) - SENT_BEFORE_MS) // 1000)
    return ("recorded_ms > %(after)s", "sent_at >= toDateTime(%(sent_from)s)")


def next_generation(after: int) -> int:
    """A generation number above ``after`` and above every one made earlier on any host whose
    clock is not far behind: the time in ms, shifted, with random low bits."""
    return max(after + 1, (int(time.time() * 1000) << 12) | random.getrandbits(12))
