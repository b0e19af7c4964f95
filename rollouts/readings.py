"""One rollout step's samples from the sample store: per-arm totals under the step's config
revision, so a step's decision uses only traffic routed by that step's weights.

Queries (aggregates only): counts (requests, SLA hits, errors, distinct users for the SRM test);
per latency a quantile guardrail reads, a 1 ms histogram of the successful requests
(stats.sequential.quantiles.LatencyHistogram's buckets: bucket k holds (k-1, k] ms); and, when
the plan clusters by user, one row per arm and user (``GROUP BY variant, user``; a request
without a user is a user of its own) with what the user-clustered and covariate-adjusted
guardrails need (stats.sequential.guardrails.UserSums): requests, hits, errors, and the sums of
the pre-request covariates (COVARIATES), of their products, and of their products with hits and
with errors. The arm's totals are then the sums of those rows, so totals and per-user
aggregates come from one snapshot of the table even while samples arrive.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from analysis.definitions import Slo
from analysis.sql import ASSIGNED_USERS, SAMPLES, hit_expr, metric_ok
from experiments.document import ROLLOUT_LATENCIES
from rollouts.controller import Plan, StepReading
from samples.store import StoreError
from stats.sequential.guardrails import ArmSnapshot, UserSums
from stats.sequential.quantiles import LatencyHistogram, latency_edges

EDGES = latency_edges(60_000.0, 1.0)  # 0..60 s at 1 ms; slower lands in the overflow bucket
QUERY_SETTINGS = {"max_execution_time": 30}
# The pre-request covariates of the adjustment, as Float64 SQL: both fixed by the client before
# the router picks a variant. Never output tokens, or anything else the variant's response
# changes: adjusting on it would bias the difference by the variant's effect on it.
COVARIATES: dict[str, str] = {
    "prompt_tokens": "toFloat64(prompt_tokens)",
    "max_tokens": "toFloat64(max_tokens)",
}
# A request's user: its user id, or the request itself when it came without one (live traffic
# served before a user is known: each such request is independent of the others). Hashed:
# grouping on a 64-bit key is faster than on the strings, and a collision (~3e-6 at 10^7 users)
# merges two users into one cluster, as if their requests were alike.
USER_KEY = "cityHash64(user_id, if(user_id = '', request_id, ''))"


def _where() -> str:
    return f"FROM {SAMPLES} PREWHERE experiment = %(experiment)s WHERE config_revision = %(revision)s"


def per_user_sql(hit: str) -> str:
    """SELECT per (variant, user) of the UserSums columns, ``hit`` the SLA hit expression."""
    err = "outcome != 'ok'"
    x = list(COVARIATES.values())
    cols = ["variant", "count() AS n", f"countIf({hit}) AS hits", f"countIf({err}) AS errors"]
    cols += [f"sum({e}) AS x{k}" for k, e in enumerate(x)]
    cols += [f"sum({x[k]} * {x[m]}) AS xx{k}{m}" for k in range(len(x)) for m in range(k, len(x))]
    cols += [f"sumIf({e}, {hit}) AS xh{k}" for k, e in enumerate(x)]
    cols += [f"sumIf({e}, {err}) AS xe{k}" for k, e in enumerate(x)]
    return f"SELECT {', '.join(cols)} {_where()} GROUP BY variant, {USER_KEY}"


def user_sums(rows: dict[str, list[Any]], arm: str) -> UserSums:
    """One arm's UserSums from the per-user query's columns."""
    variant = np.asarray(rows.get("variant", []), dtype=object)
    mine = variant == arm
    p = len(COVARIATES)

    def col(name: str, dtype: Any = float) -> np.ndarray:
        return np.asarray(rows.get(name, []), dtype=dtype)[mine] if mine.any() else np.zeros(0, dtype)

    g = int(mine.sum())
    sum_xx = np.zeros((g, p, p))
    for k in range(p):
        for m in range(k, p):
            sum_xx[:, k, m] = sum_xx[:, m, k] = col(f"xx{k}{m}")
    return UserSums(
        n=col("n", np.int64),
        hits=col("hits", np.int64),
        errors=col("errors", np.int64),
        covariates=tuple(COVARIATES),
        sum_x=np.stack([col(f"x{k}") for k in range(p)], axis=-1).reshape(g, p),
        sum_xx=sum_xx,
        sum_x_hits=np.stack([col(f"xh{k}") for k in range(p)], axis=-1).reshape(g, p),
        sum_x_errors=np.stack([col(f"xe{k}") for k in range(p)], axis=-1).reshape(g, p),
    )


def read_step(
    store: Any, experiment: str, revision: int, plan: Plan, slo: Slo, *, per_user: bool | None = None
) -> StepReading:
    """The step's StepReading; ``error`` set (never raised) when the store cannot answer.
    ``per_user``: read the per-user aggregates (default: the plan's cluster_by_user)."""
    params: dict[str, Any] = {"experiment": experiment, "revision": int(revision)}
    hit, hp = hit_expr(slo)
    arms = (plan.control, plan.candidate)
    if per_user is None:
        per_user = plan.cluster_by_user
    users_rows: dict[str, list[Any]] | None = None
    try:
        cols = store.query_columns(
            f"SELECT variant, count() AS n, countIf(outcome != 'ok') AS errors, countIf({hit}) AS hits, "
            f"{ASSIGNED_USERS} AS users {_where()} GROUP BY variant",
            {**params, **hp},
            settings=QUERY_SETTINGS,
        )
        if per_user:
            users_rows = store.query_columns(per_user_sql(hit), {**params, **hp}, settings=QUERY_SETTINGS)
        hists: dict[str, dict[str, np.ndarray]] = {}
        for name in plan.latencies():
            if name not in ROLLOUT_LATENCIES:  # the document refuses others; never interpolate one
                raise ValueError(f"unknown latency {name!r}")
            rows = store.query_columns(
                f"SELECT variant, toInt64(least(ceil({name}), {EDGES.size})) AS bucket, count() AS c "
                f"{_where()} AND {metric_ok(name)} GROUP BY variant, bucket",
                params,
                settings=QUERY_SETTINGS,
            )
            per = {arm: np.zeros(EDGES.size + 1, dtype=np.int64) for arm in arms}
            for variant, bucket, c in zip(rows["variant"], rows["bucket"], rows["c"], strict=True):
                if variant in per:
                    per[variant][max(0, int(bucket))] += int(c)
            hists[name] = per
    except (StoreError, OSError, EOFError) as exc:
        return StepReading(error=f"{type(exc).__name__}: {exc}"[:500])
    except Exception as exc:  # a driver's own network error types: still "the store did not answer"
        if type(exc).__module__.split(".")[0] not in ("clickhouse_driver", "chdb", "socket"):
            raise
        return StepReading(error=f"{type(exc).__name__}: {exc}"[:500])
    got = {
        v: (int(cols["n"][i]), int(cols["hits"][i]), int(cols["errors"][i]), int(cols["users"][i]))
        for i, v in enumerate(cols.get("variant", []))
    }
    snaps = {}
    for arm in arms:
        n, hits, errors, _ = got.get(arm, (0, 0, 0, 0))
        lat = {name: LatencyHistogram(EDGES, per[arm]) for name, per in hists.items()}
        sums = None
        if users_rows is not None:
            # The totals of the per-user rows: the same snapshot as the aggregates
            sums = user_sums(users_rows, arm)
            n, hits, errors = int(sums.n.sum()), int(sums.hits.sum()), int(sums.errors.sum())
        snaps[arm] = ArmSnapshot(n, hits, errors, lat, sums)
    users = {arm: got.get(arm, (0, 0, 0, 0))[3] for arm in arms}
    return StepReading(snaps[plan.control], snaps[plan.candidate], users)
