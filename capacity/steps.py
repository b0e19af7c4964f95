"""A capacity search step as a replay: one variant alone, at one rate, stopped by the sequential
test as soon as its verdict is clear (capacity/search.py).

Each step is a mirror replay run whose only target is the variant (ReplayRequest ``targets``,
submitted to the replay service, workers.service), so every step's samples are an ordinary run:
the report, the dashboard and ``sla_report --run ID`` read any step. Every variant's steps
replay the same requests (the same trace rows, user population and arrival seed), only faster
or slower: the search compares deployments on one request sequence.

While the run replays, the step looks at its samples every ``look_s`` (waiting on the run's
handle, so the run's end wakes it at once) and cancels the run once the confidence sequence
decides, or once it can no longer say "meets" before its cap (capacity.search.can_still_meet).
A look judges the settled prefix of the schedule after the warm-up (requests scheduled in the
first ``warmup_s`` start on an empty server and say nothing about steady state):
analysis.step_counts says which requests that is, and why.

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
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction

from analysis.definitions import Slo
from analysis.step_counts import settled_counts
from capacity.search import (
    MEETS,
    MISSES,
    UNDECIDED,
    StepResult,
    can_still_meet,
    rate_text,
    step_sequence,
    step_verdict,
)
from experiments.models import Experiment
from replay.arrivals import Arrival
from samples.factory import sample_store
from samples.store import StoreError
from workers.models import ReplayRun
from workers.runs import ReplayRequest
from workers.service import submit

log = logging.getLogger(__name__)
ARRIVALS = ("poisson", "gamma", "recorded")


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


class StepCutShort(RuntimeError):
    """A step's run failed, or was cancelled by someone other than the step: it has no verdict."""

    def __init__(self, message: str, run_id: int) -> None:
        super().__init__(message)
        self.run_id = run_id


def run_step(
    plan: StepPlan,
    variant: str,
    rate: float,
    *,
    first: bool = False,
    on_look: Callable[[dict], None] | None = None,
    on_run: Callable[[int], None] | None = None,
) -> StepResult:
    """Replay ``variant`` alone at ``rate`` until the verdict is clear or the cap is reached.
    ``on_run(run_id)``: called once the step's run exists, before it replays. A run that fails,
    or that anyone but the step cancels, raises StepCutShort."""
    t0 = time.monotonic()
    request = ReplayRequest(
        plan.experiment,
        source=plan.trace,
        local_paths=plan.local_paths,
        source_format=plan.source_format,
        mode="mirror",
        targets=(variant,),
        arrival=plan.arrival_at(rate),
        limit=plan.max_requests,
        seed=plan.seed,
        actor=plan.actor,
        confirm=True,
        check_variants=first,
        shards=plan.shards,
    )
    # The run starts when this transaction commits (durable: the outermost, or it never would):
    # named (on_run), its schedule read (its shard reuses the parse) and the sample store opened
    # (warm for writing) before it sends.
    with transaction.atomic(durable=True):
        handle = submit(request)
        if on_run:
            on_run(handle.run_id)
        order = handle.send_order(after_s=plan.warmup_s)
        store = sample_store()
    run = handle.run

    def counts() -> dict[str, Any]:
        return settled_counts(
            store, plan.slo, experiment=plan.experiment.key, run_id=run.pk, variant=variant, order=order
        )

    verdict = UNDECIDED
    futile = False
    stopped_here = False  # the step cancelled its run itself (decided, or could no longer meet)
    got: dict[str, Any] = {"n": 0, "hits": 0, "setup_errors": 0}
    while True:
        ended = handle.ended()
        try:
            got = counts()
        except (StoreError, OSError) as exc:
            log.warning("capacity step run %s: the sample store did not answer: %s", run.pk, exc)
        else:
            verdict = step_verdict(got["hits"], got["n"], plan.target, plan.alpha)
            if verdict == UNDECIDED and not can_still_meet(
                got["hits"], got["n"], got["left"], plan.target, plan.alpha
            ):
                futile = True
            if on_look:
                on_look({"run": run.pk, "rate": rate, "verdict": verdict, **got})
            if (verdict in (MEETS, MISSES) or futile) and not run.cancel_requested and not run.is_final:
                handle.cancel()  # decided: the rest of the schedule would only cost time
                stopped_here = True
        if ended:
            break
        handle.wait(plan.look_s)  # the next look, or the run's end, whichever comes first
    handle.wait()  # its thread in this process, if any, has returned: the row as the run left it
    if handle.failure or run.status == ReplayRun.Status.FAILED:
        why = handle.failure or run.error
        raise StepCutShort(f"capacity step at {rate_text(rate)} req/s (run {run.pk}) failed: {why}", run.pk)
    if run.status == ReplayRun.Status.CANCELLED and not stopped_here:
        # someone cancelled the run (the replay's cancel): what it judged is not a verdict
        raise StepCutShort(
            f"capacity step at {rate_text(rate)} req/s (run {run.pk}) was cancelled before it decided", run.pk
        )
    got = counts()  # every sample is durable now
    if got["setup_errors"] and not got["n"]:
        raise StepCutShort(
            f"capacity step at {rate_text(rate)} req/s (run {run.pk}): {variant} answered every request with a "
            "setup error (a 4xx such as a wrong model name or credentials), so it measures no capacity: "
            f"sla_report {plan.experiment.key} --run {run.pk} shows the statuses",
            run.pk,
        )
    verdict = step_verdict(got["hits"], got["n"], plan.target, plan.alpha)
    lo, hi = (
        step_sequence(got["hits"], got["n"], plan.target, plan.alpha).bounds() if got["n"] else (None, None)
    )
    lag = got["lag_p99_ms"]
    if lag is None:  # nothing judged: the shards' own figure, warm-up and all
        lag = handle.lag_p99_ms()
    return StepResult(
        rate_rps=float(rate),
        verdict=verdict,
        n=got["n"],
        hits=got["hits"],
        lag_p99_ms=lag,
        ttft_p50_ms=got["ttft_p50_ms"],
        ttft_p99_ms=got["ttft_p99_ms"],
        attainment_lo=lo,
        attainment_hi=hi,
        seconds=time.monotonic() - t0,
        run_id=run.pk,
        output_tokens_mean=got["output_tokens_mean"],
        note=_note(verdict, got, futile),
    )


def _note(verdict: str, got: dict[str, Any], futile: bool) -> str:
    notes = [_undecided(got, futile)] if verdict == UNDECIDED else []
    if got["setup_errors"]:
        notes.append(f"{got['setup_errors']} setup error(s) left out (sla_report names their statuses)")
    return "; ".join(notes)


def _undecided(got: dict[str, Any], futile: bool) -> str:
    if futile:
        return (
            f"undecided after {got['n']} requests: {got['n'] - got['hits']} missed, so it could no longer "
            "meet the target before the step's cap"
        )
    return f"undecided after {got['n']} requests (the step's cap)"
