"""What a capacity step judges at a look (capacity/steps.py): the settled prefix of its run's
planned schedule, read from the sample store it is handed.

The longest run of the schedule, in planned send order, whose every request has its final row
in the store, stopping before the first one that has none yet (in flight, or finished but not
yet written) or that the step's own stop cancelled. Fast requests finish first and slow ones
(the misses) are the ones still in flight at a look, so counting whatever has arrived would
lean toward hits; a prefix of the schedule is a fixed sequence observed in order, which is what
the anytime-valid sequence (capacity.search) is valid for. A request cancelled by the step's
stop was cut short by the search, not by the deployment: it is never judged (the prefix ends
before it), while errors and timeouts are misses like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from analysis.definitions import SETUP_ERROR, Slo
from analysis.sql import SAMPLES, hit_expr
from stats.quantiles import nearest_rank

QUERY_SETTINGS = {"max_execution_time": 30}


def settled_counts(
    store, slo: Slo, *, experiment: str, run_id: int, variant: str, order: Sequence[int]
) -> dict[str, Any]:
    """n, hits, TTFT p50/p99, mean output tokens and schedule lag p99 of the settled prefix of
    ``order`` (the seqs a step judges, in planned send order) among ``variant``'s samples of the
    run; ``left``: the judged requests after it (not yet known, or never). A setup error
    (analysis.definitions.SETUP_ERROR: the variant refusing the request as asked) is left out of
    the verdict as the report leaves it out, and counted in ``setup_errors``."""
    hit, hp = hit_expr(slo)
    rows = store.query(
        f"SELECT seq, outcome, {hit}, ttft_ms, output_tokens, recorded_ms, schedule_lag_ms, {SETUP_ERROR} "
        f"FROM {SAMPLES} "
        "PREWHERE run_id = %(run)s WHERE experiment = %(experiment)s AND variant = %(variant)s",
        {"run": int(run_id), "experiment": experiment, "variant": variant, **hp},
        settings=QUERY_SETTINGS,
    )
    latest: dict[int, tuple] = {}  # a redelivered request may have two rows: the latest wins
    for row in rows:
        if row[0] not in latest or row[5] > latest[row[0]][5]:
            latest[row[0]] = row
    judged = []
    setup_errors = 0
    for seq in order:
        row = latest.get(seq)
        if row is None or row[1] == "cancelled":
            break
        if row[7]:
            setup_errors += 1
            continue
        judged.append(row)
    ttft = sorted(r[3] for r in judged if r[1] == "ok" and r[3] is not None)
    tokens = [r[4] for r in judged if r[1] == "ok"]
    lags = sorted(r[6] for r in judged if r[6] is not None)
    return {
        "n": len(judged),
        "hits": sum(1 for r in judged if r[2]),
        "left": len(order) - len(judged) - setup_errors,
        "setup_errors": setup_errors,
        "ttft_p50_ms": float(nearest_rank(ttft, 0.5)) if ttft else None,
        "ttft_p99_ms": float(nearest_rank(ttft, 0.99)) if ttft else None,
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        # the generator's lag while the step was judged: what could have moved its verdict
        "lag_p99_ms": float(nearest_rank(lags, 0.99)) if lags else None,
    }
