"""One rollout step's samples from the sample store: per-arm totals under the step's config
revision, so a step's decision uses only traffic routed by that step's weights.

Two queries (aggregates only): counts (requests, SLA hits, errors, distinct users for the SRM
test) and, per latency a quantile guardrail reads, a 1 ms histogram of the successful requests
(stats.sequential.quantiles.LatencyHistogram's buckets: bucket k holds (k-1, k] ms).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from analysis.definitions import Slo
from analysis.sql import ASSIGNED_USERS, SAMPLES, hit_expr, metric_ok
from experiments.document import ROLLOUT_LATENCIES
from rollouts.controller import Plan, StepReading
from samples.store import StoreError
from stats.sequential.guardrails import ArmSnapshot
from stats.sequential.quantiles import LatencyHistogram, latency_edges

EDGES = latency_edges(60_000.0, 1.0)  # 0..60 s at 1 ms; slower lands in the overflow bucket
QUERY_SETTINGS = {"max_execution_time": 30}


def _where() -> str:
    return f"FROM {SAMPLES} PREWHERE experiment = %(experiment)s WHERE config_revision = %(revision)s"


def read_step(store: Any, experiment: str, revision: int, plan: Plan, slo: Slo) -> StepReading:
    """The step's StepReading; ``error`` set (never raised) when the store cannot answer."""
    params: dict[str, Any] = {"experiment": experiment, "revision": int(revision)}
    hit, hp = hit_expr(slo)
    arms = (plan.control, plan.candidate)
    try:
        cols = store.query_columns(
            f"SELECT variant, count() AS n, countIf(outcome != 'ok') AS errors, countIf({hit}) AS hits, "
            f"{ASSIGNED_USERS} AS users {_where()} GROUP BY variant",
            {**params, **hp},
            settings=QUERY_SETTINGS,
        )
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
        snaps[arm] = ArmSnapshot(n, hits, errors, lat)
    users = {arm: got.get(arm, (0, 0, 0, 0))[3] for arm in arms}
    return StepReading(snaps[plan.control], snaps[plan.candidate], users)
