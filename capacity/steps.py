"""A capacity search step as a replay: one variant alone, at one rate, stopped by the sequential
test as soon as its verdict is clear (capacity/search.py).

Each step is a mirror replay run whose only target is the variant (workers.runs.create_run
``targets``), so every step's samples are an ordinary run: the report, the dashboard and
``sla_report --run ID`` read any step. Every variant's steps replay the same requests (the same
trace rows, user population and arrival seed), only faster or slower: the search compares
deployments on one request sequence.

While the run replays, the step reads its samples from the store every ``look_s`` (after the
warm-up: requests scheduled in the first ``warmup_s`` start on an empty server and say nothing
about steady state) and cancels the run once the confidence sequence decides, or once it can no
longer say "meets" before its cap (capacity.search.can_still_meet).

Which requests a look judges (``_counts``): the longest run of the schedule, in planned send
order, whose every request has its final row in the store, stopping before the first one that
has none yet (in flight, or finished but not yet written) or that the step's own stop cancelled.
Fast requests finish first and slow ones (the misses) are the ones still in flight at a look, so
counting whatever has arrived would lean toward hits; a prefix of the schedule is a fixed
sequence observed in order, which is what the anytime-valid sequence is valid for. A request
cancelled by the step's stop was cut short by the search, not by the deployment: it is never
judged (the prefix ends before it), while errors and timeouts are misses like any other.

The step's schedule lag p99 (``StepResult.lag_p99_ms``, by which the search decides whether
the load generator, not the variant, was measured) is taken over the same judged requests: a
lag in the warm-up (connections opening, the process's first batch written) delays requests
no verdict rests on. Only a step that judged nothing falls back on its shards' figure, which
covers the whole run. The step opens the sample store before the replay starts: the embedded
store (chDB) loads what its first sample insert needs when it is opened
(samples.backends.chdb), so a step's first batch loads nothing while the replay sends.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import connections

from analysis.definitions import Slo
from analysis.sql import SAMPLES, hit_expr
from capacity.search import MEETS, MISSES, UNDECIDED, StepResult, can_still_meet, step_sequence, step_verdict
from experiments.models import Experiment
from replay.arrivals import Arrival
from samples.factory import sample_store
from samples.store import StoreError
from stats.quantiles import nearest_rank
from workers.models import ReplayRun
from workers.runs import cancel_run, create_run
from workers.shard import run_requests
from workers.tasks import start_replay

log = logging.getLogger(__name__)
ARRIVALS = ("poisson", "gamma", "recorded")
QUERY_SETTINGS = {"max_execution_time": 30}


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every step of one search shares."""

    experiment: Experiment
    trace: str
    source_format: str | None
    slo: Slo
    target: float
    alpha: float  # per step (SearchSpec.step_alpha)
    max_requests: int  # a step's cap: undecided after this many is "undecided"
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0
    warmup_s: float = 5.0
    look_s: float = 1.0
    trace_rate: float | None = None  # recorded arrivals: the trace's own rate (speed = rate / it)
    local_paths: bool = True
    actor: Any = None
    shards: int | None = None

    def arrival_at(self, rate: float) -> Arrival:
        if self.arrival == "recorded":
            if not self.trace_rate:
                raise ValueError("recorded arrivals need the trace's own rate")
            return Arrival(mode="recorded", speed=rate / self.trace_rate, seed=self.seed)
        cv = self.cv if self.arrival == "gamma" else 1.0
        return Arrival(mode=self.arrival, rate=rate, cv=cv, seed=self.seed)


def judged_order(run: ReplayRun, warmup_s: float) -> list[int]:
    """The seqs of the run's requests a step judges (sent at or after the warm-up), in planned
    send order: the run's own schedule, as its shards compute it (workers.shard)."""
    loaded = run_requests(run)
    offsets = Arrival(**run.arrival).offsets([r.offset_s for r in loaded.requests])
    if offsets is None:  # closed loop: sent in the trace's order
        return [r.seq for r in loaded.requests]
    planned = sorted(zip(offsets, (r.seq for r in loaded.requests), strict=True))
    return [seq for offset, seq in planned if offset >= warmup_s]


def _counts(store, plan: StepPlan, run_id: int, variant: str, order: list[int]) -> dict[str, Any]:
    """n, hits, TTFT p50/p99, mean output tokens and schedule lag p99 of the settled prefix of
    ``order`` (the module docstring); ``left``: the judged requests after it (not yet known, or
    never)."""
    hit, hp = hit_expr(plan.slo)
    rows = store.query(
        f"SELECT seq, outcome, {hit}, ttft_ms, output_tokens, recorded_ms, schedule_lag_ms FROM {SAMPLES} "
        "PREWHERE run_id = %(run)s WHERE experiment = %(experiment)s AND variant = %(variant)s",
        {"run": int(run_id), "experiment": plan.experiment.key, "variant": variant, **hp},
        settings=QUERY_SETTINGS,
    )
    latest: dict[int, tuple] = {}  # a redelivered request may have two rows: the latest wins
    for row in rows:
        if row[0] not in latest or row[5] > latest[row[0]][5]:
            latest[row[0]] = row
    judged = []
    for seq in order:
        row = latest.get(seq)
        if row is None or row[1] == "cancelled":
            break
        judged.append(row)
    ttft = sorted(r[3] for r in judged if r[1] == "ok" and r[3] is not None)
    tokens = [r[4] for r in judged if r[1] == "ok"]
    lags = sorted(r[6] for r in judged if r[6] is not None)
    return {
        "n": len(judged),
        "hits": sum(1 for r in judged if r[2]),
        "left": len(order) - len(judged),
        "ttft_p50_ms": float(nearest_rank(ttft, 0.5)) if ttft else None,
        "ttft_p99_ms": float(nearest_rank(ttft, 0.99)) if ttft else None,
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        # the generator's lag while the step was judged: what could have moved its verdict
        "lag_p99_ms": float(nearest_rank(lags, 0.99)) if lags else None,
    }


def run_step(plan: StepPlan, variant: str, rate: float, *, first: bool = False,
             on_look: Callable[[dict], None] | None = None) -> StepResult:  # fmt: skip
    """Replay ``variant`` alone at ``rate`` until the verdict is clear or the cap is reached."""
    t0 = time.monotonic()
    run = create_run(
        plan.experiment, source=plan.trace, local_paths=plan.local_paths, source_format=plan.source_format,
        mode="mirror", targets=[variant], arrival=plan.arrival_at(rate), limit=plan.max_requests,
        population_seed=plan.seed, actor=plan.actor, enqueue=False, confirm=True, check_variants=first,
        shard_count=plan.shards,
    )  # fmt: skip
    order = judged_order(run, plan.warmup_s)  # before the replay starts: its shard reuses the parse
    eager = settings.CELERY_TASK_ALWAYS_EAGER
    store = sample_store()  # opened (and warm for writing) before the step's clock starts
    failure: list[BaseException] = []
    worker = None
    if eager:

        def work():
            try:
                start_replay(run.pk)
            except BaseException as exc:  # noqa: BLE001 - reported below, with the run
                log.exception("capacity step run %s failed", run.pk)
                failure.append(exc)
            finally:
                connections.close_all()

        worker = threading.Thread(target=work, name=f"abplat-capacity-{run.pk}")
        worker.start()
    else:
        start_replay.delay(run.pk)
    verdict = UNDECIDED
    futile = False
    got: dict[str, Any] = {"n": 0, "hits": 0}
    while True:
        run.refresh_from_db()
        final = run.is_final or (worker is not None and not worker.is_alive())
        try:
            got = _counts(store, plan, run.pk, variant, order)
        except (StoreError, OSError) as exc:
            log.warning("capacity step run %s: the sample store did not answer: %s", run.pk, exc)
        else:
            verdict = step_verdict(got["hits"], got["n"], plan.target, plan.alpha)
            if verdict == UNDECIDED and not can_still_meet(got["hits"], got["n"], got["left"], plan.target,
                                                           plan.alpha):  # fmt: skip
                futile = True
            if on_look:
                on_look({"run": run.pk, "rate": rate, "verdict": verdict, **got})
            if (verdict in (MEETS, MISSES) or futile) and not run.cancel_requested and not run.is_final:
                cancel_run(run)  # decided: the rest of the schedule would only cost time
        if final:
            break
        time.sleep(plan.look_s)
    if worker is not None:
        worker.join()
    run.refresh_from_db()
    if failure or run.status == ReplayRun.Status.FAILED:
        why = failure[0] if failure else run.error
        raise RuntimeError(f"capacity step at {rate:g} req/s (run {run.pk}) failed: {why}")
    got = _counts(store, plan, run.pk, variant, order)  # every sample is durable now
    verdict = step_verdict(got["hits"], got["n"], plan.target, plan.alpha)
    lo, hi = (
        step_sequence(got["hits"], got["n"], plan.target, plan.alpha).bounds() if got["n"] else (None, None)
    )
    lag = got["lag_p99_ms"]
    if lag is None:  # nothing judged: the shards' own figure, warm-up and all
        lags = [x for x in run.shards.values_list("lag_p99_ms", flat=True) if x is not None]
        lag = max(lags) if lags else None
    return StepResult(
        rate_rps=float(rate), verdict=verdict, n=got["n"], hits=got["hits"], lag_p99_ms=lag,
        ttft_p50_ms=got["ttft_p50_ms"], ttft_p99_ms=got["ttft_p99_ms"], attainment_lo=lo, attainment_hi=hi,
        seconds=time.monotonic() - t0, run_id=run.pk, output_tokens_mean=got["output_tokens_mean"],
        note="" if verdict != UNDECIDED else _undecided(got, futile),
    )  # fmt: skip


def _undecided(got: dict[str, Any], futile: bool) -> str:
    if futile:
        return (f"undecided after {got['n']} requests: {got['n'] - got['hits']} missed, so it could no longer "
                "meet the target before the step's cap")  # fmt: skip
    return f"undecided after {got['n']} requests (the step's cap)"
