"""One rollout step's samples from the sample store: per-arm totals under the step's config
revision, so a step's decision uses only traffic routed by that step's weights.

Queries (aggregates only, a few rows per arm however many users): counts (requests, SLA hits,
errors, distinct users for the SRM test); per latency a quantile guardrail reads, a 1 ms
histogram of the successful requests (stats.sequential.quantiles.LatencyHistogram's buckets:
bucket k holds (k-1, k] ms); and, when the plan clusters by user, the per-user moments of each
arm, the SLA report's query (analysis.units.moments_select, unit "user": a request without a
user is a user of its own) under the step's revision: per arm the sums over its users of the
per-user vector [requests, hits, errors, the pre-request covariates (analysis.units.COVARIATES),
their products, their products with hits and with errors] and of the products of its
components, reduced in the store (stats.sequential.arm_snapshot.UserMoments); on a cluster whose
samples are sharded by the unit, on each shard's own table, the shards' moments added up
(analysis.readers.shards). The user-clustered
and covariate-adjusted guardrails need nothing else (stats.clustered.ArmMoments), so a step of
10^6 users is read as one row per arm, not a row per user. The arm's totals are then those
moments' sums, so totals and per-user aggregates come from one snapshot of the table even while
samples arrive.

With an identical_answers guardrail the step also reads the candidate's live requests the gateway
shadowed to the control (samples.schema.FIDELITY_SHADOWS_TABLE, its rows under the step's
revision): grouped by user inside the store (a request without a user is a user of its own) and
reduced to one row, the rows, the compared ones (outcome ok: only those are judged), the
identical ones among them, the users and the sums over users of the products of [compared,
identical] (stats.sequential.arm_snapshot.Shadows). FINAL collapses a batch the gateway wrote
twice: one experiment's step of shadows is a small share of its requests.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from analysis import units
from analysis.definitions import SETUP_ERROR, Filters, Slo
from analysis.readers import shards
from analysis.sql import ASSIGNED_USERS, JUDGED, SAMPLES, hit_expr, metric_ok
from experiments.document import ROLLOUT_LATENCIES
from rollouts import kept
from rollouts.controller import Plan, StepReading
from samples.schema import FIDELITY_SHADOWS_TABLE
from samples.store import StoreError
from stats.clustered import ArmMoments
from stats.sequential.arm_snapshot import ATTAINMENT, ERROR_RATE, ArmSnapshot, Shadows, UserMoments
from stats.sequential.quantiles import LatencyHistogram

EDGES = kept.EDGES  # 0..60 s at 1 ms; slower lands in the overflow bucket
QUERY_SETTINGS = {"max_execution_time": 30}
# The step's samples among the experiment's (the moments query's condition beside the experiment).
REVISION = "config_revision = %(revision)s"


def _where() -> str:
    return f"FROM {SAMPLES} PREWHERE experiment = %(experiment)s WHERE {REVISION}"


# The candidate's shadows in the step, per user (n: compared, y: identical), then over the users.
SHADOWS_SQL = (
    "SELECT sum(rows) AS shadowed, sum(n) AS ok, sum(y) AS identical, countIf(n > 0) AS users, "
    "max(n) AS largest, sum(n * n) AS nn, sum(n * y) AS ny, sum(y * y) AS yy FROM ("
    "SELECT count() AS rows, countIf(outcome = 'ok') AS n, countIf(outcome = 'ok' AND identical = 1) AS y "
    f"FROM {FIDELITY_SHADOWS_TABLE} FINAL PREWHERE experiment = %(experiment)s "
    f"WHERE variant = %(candidate)s AND {REVISION} "
    "GROUP BY cityHash64(user_id, if(user_id = '', request_id, '')))"
)


def shadows_of(row: dict[str, Any], by_user: bool) -> Shadows:
    """Shadows from SHADOWS_SQL's one row; ``by_user``: with the per-user moments."""
    got = {
        k: int(row[k][0]) if row.get(k) else 0 for k in ("shadowed", "ok", "identical", "users", "largest")
    }
    moments = None
    if by_user and got["ok"]:
        nn, ny, yy = (float(row[k][0]) for k in ("nn", "ny", "yy"))
        moments = ArmMoments(
            np.array([got["ok"], got["identical"]], dtype=float),
            np.array([[nn, ny], [ny, yy]]),
            got["users"],
            got["largest"],
            binary=True,
        )
    return Shadows(got["shadowed"], got["ok"], got["identical"], got["users"], moments, by_user)


def user_moments(moments: units.UnitMoments | None) -> UserMoments:
    """One arm's UserMoments from its per-user moments (None: no request in the step), on every
    pre-request covariate of the adjustment: never output tokens or anything else the variant's
    response changes (adjusting on it would bias the difference by the variant's effect)."""
    names = tuple(units.COVARIATES)
    if moments is None:
        return UserMoments(names)
    return UserMoments(names, moments.arm(ATTAINMENT, names), moments.arm(ERROR_RATE, names))


def read_step(
    store: Any,
    experiment: str,
    revision: int,
    plan: Plan,
    slo: Slo,
    *,
    per_user: bool | None = None,
    keep: bool = False,
    now_ms: int | None = None,
    keep_lag_ms: int = kept.KEEP_LAG_MS,
) -> StepReading:
    """The step's StepReading; ``error`` set (never raised) when the store cannot answer.
    ``per_user``: read the per-user aggregates (default: the plan's cluster_by_user).
    ``keep``: through the step's kept per-user sums (rollouts.kept), folded up to ``now_ms``
    (default: now) less ``keep_lag_ms``; else (the default) every request of the step is read
    again.
    The controller reads through them unless ABPLAT_ROLLOUT_KEPT_SUMS is off: a look at a step
    of 34M requests costs 0.5 s through the kept sums against 20 s whole on ClickHouse
    18.16; a small step's costs more through them, but little (0.2 s against 0.05 s at 280k
    requests): bench/RESULTS.md "Rollout looks through kept per-user sums"."""
    params: dict[str, Any] = {"experiment": experiment, "revision": int(revision)}
    arms = (plan.control, plan.candidate)
    if per_user is None:
        per_user = plan.cluster_by_user
    try:
        if keep:
            state = None
            try:
                step = kept.KeptStep(
                    store, experiment, revision, arms, slo, plan.latencies(), lag_ms=keep_lag_ms
                )
                state = step.read(int(time.time() * 1000) if now_ms is None else now_ms)
            except kept.KeptStale:
                pass  # late rows keep arriving: this look reads the whole step
            got = (
                _from_state(state, arms)
                if state is not None
                else _read_whole(store, params, plan, slo, per_user)
            )
        else:
            got = _read_whole(store, params, plan, slo, per_user)
        shadows = None
        if plan.reads_shadows():
            row = store.query_columns(
                SHADOWS_SQL, {**params, "candidate": plan.candidate}, settings=QUERY_SETTINGS
            )
            shadows = shadows_of(row, per_user)
    except (StoreError, OSError, EOFError) as exc:
        return StepReading(error=f"{type(exc).__name__}: {exc}"[:500])
    except Exception as exc:  # a driver's own network error types: still "the store did not answer"
        if type(exc).__module__.split(".")[0] not in ("clickhouse_driver", "chdb", "socket"):
            raise
        return StepReading(error=f"{type(exc).__name__}: {exc}"[:500])
    snaps = {}
    for arm in arms:
        a = got.get(arm, _Arm())
        lat = {name: LatencyHistogram(EDGES, a.hists.get(name, _empty())) for name in plan.latencies()}
        sums, n, hits, errors = None, a.n, a.hits, a.errors
        if a.moments is not None or per_user:
            # The totals of the per-user moments: the same snapshot as the aggregates
            moments = user_moments(a.moments)
            n, hits, errors = moments.requests, moments.events(ATTAINMENT), moments.events(ERROR_RATE)
            sums = moments if per_user else None
        mine = shadows if arm == plan.candidate else None
        snaps[arm] = ArmSnapshot(n, hits, errors, lat, sums, a.setup, mine)
    users = {arm: got.get(arm, _Arm()).users for arm in arms}
    return StepReading(snaps[plan.control], snaps[plan.candidate], users)


@dataclasses.dataclass
class _Arm:
    """One arm of the step as read: counts (when no moments were read), per-user moments,
    setup errors, assigned users, a histogram per latency."""

    n: int = 0
    hits: int = 0
    errors: int = 0
    setup: int = 0
    users: int = 0
    moments: units.UnitMoments | None = None
    hists: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def _empty() -> np.ndarray:
    return np.zeros(EDGES.size + 1, dtype=np.int64)


def _from_state(state: kept.State, arms: tuple[str, str]) -> dict[str, _Arm]:
    out = {}
    for arm in arms:
        a = state.arms.get(arm)
        if a is None:
            continue
        # every unit of the kept sums has a moments row; an arm without one had setup errors alone
        out[arm] = _Arm(setup=a.setup, users=a.users, moments=a.moments, hists=a.hists)
    return out


def _read_whole(store: Any, params: dict[str, Any], plan: Plan, slo: Slo, per_user: bool) -> dict[str, _Arm]:
    """Every request of the step read again: the counts, the per-user moments (``per_user``),
    the histograms."""
    hit, hp = hit_expr(slo)
    arms = (plan.control, plan.candidate)
    cols = store.query_columns(
        # setup errors apart (ArmSnapshot.setup_errors): no guardrail reads them
        f"SELECT variant, countIf({JUDGED}) AS n, countIf({JUDGED} AND outcome != 'ok') AS errors, "
        f"countIf({hit}) AS hits, countIf({SETUP_ERROR}) AS setup, "
        f"{ASSIGNED_USERS} AS users {_where()} GROUP BY variant",
        {**params, **hp},
        settings=QUERY_SETTINGS,
    )
    out = {
        str(v): _Arm(
            int(cols["n"][i]),
            int(cols["hits"][i]),
            int(cols["errors"][i]),
            int(cols["setup"][i]),
            int(cols["users"][i]),
        )
        for i, v in enumerate(cols.get("variant", []))
    }
    if per_user:
        # per shard on a cluster sharded by the unit, else one query (analysis.readers.shards)
        moments = shards.unit_moments(
            store,
            Filters(params["experiment"]),
            slo,
            "user",
            extra=[REVISION],
            params=params,
            settings=QUERY_SETTINGS,
            blocks=kept.BLOCKS,  # what the guardrails read, as the kept sums
        )
        for arm, m in moments.items():
            out.setdefault(arm, _Arm()).moments = m
    for name in plan.latencies():
        if name not in ROLLOUT_LATENCIES:  # the document refuses others; never interpolate one
            raise ValueError(f"unknown latency {name!r}")
        rows = store.query_columns(
            f"SELECT variant, toInt64(least(ceil({name}), {EDGES.size})) AS bucket, count() AS c "
            f"{_where()} AND {metric_ok(name)} GROUP BY variant, bucket",
            params,
            settings=QUERY_SETTINGS,
        )
        for variant, bucket, c in zip(rows["variant"], rows["bucket"], rows["c"], strict=True):
            if variant in arms:
                h = out.setdefault(str(variant), _Arm()).hists.setdefault(name, _empty())
                h[max(0, int(bucket))] += int(c)
    return out
