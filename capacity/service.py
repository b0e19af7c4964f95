"""Search an experiment's variants for their SLA capacity, one after the other, on the same
request sequence; price each at capacity; store the result (models.CapacitySearch)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.conf import settings
from django.utils import timezone

from analysis.definitions import QueryError, slo_of
from capacity.models import CapacitySearch
from capacity.search import (
    Capacity,
    SearchSpec,
    cost_at_capacity,
    default_lag_limit_ms,
    rate_text,
    run_search,
)
from capacity.steps import ARRIVALS, StepPlan, run_step
from dashboards.reports import report_for_params
from experiments.models import Experiment
from replay.sources import load_requests
from samples.store import StoreError
from workers.runs import ReplayError, resolve_source

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Options:
    trace: str
    source_format: str | None = None
    variants: Sequence[str] = ()
    arrival: str = "poisson"
    cv: float = 1.0
    start_rps: float | None = None  # default: max_rps / 4
    # a first rate per variant (others start at start_rps): e.g. from a replay that just ran
    start_rps_by: dict[str, float] = dataclasses.field(default_factory=dict)
    max_rps: float = 50.0
    min_rps: float = 0.05
    rel_tol: float = 0.05
    max_steps: int = 12
    alpha: float = 0.05
    step_requests: int = 2000
    warmup_s: float = 5.0
    seed: int = 0
    # the schedule lag p99 above which a step is void; None: derived from the experiment's SLO
    # (capacity.search.default_lag_limit_ms)
    lag_limit_ms: float | None = None
    local_paths: bool = True


def trace_rate(trace: str, source_format: str | None, limit: int, local_paths: bool) -> float:
    """The trace's own request rate over its first ``limit`` requests (recorded arrivals)."""
    src = resolve_source(trace, local_paths=local_paths)
    fmt = source_format or (src.trace.format if src.trace else "azure")
    try:
        loaded = load_requests(
            src.path,
            fmt,
            limit=limit,
            name=src.label,
            max_bytes=settings.TRACE_MAX_BYTES if src.in_trace_dir else None,
            max_line_bytes=settings.TRACE_MAX_LINE_BYTES,
        )
    except (OSError, ValueError) as exc:  # SourceError is a ValueError: line and field named
        raise ReplayError(str(exc)) from None
    offsets = sorted(r.offset_s for r in loaded.requests)
    if len(offsets) < 2 or offsets[-1] <= offsets[0]:
        raise ReplayError(f"{src.label}: recorded arrivals need at least two requests at different times")
    return (len(offsets) - 1) / (offsets[-1] - offsets[0])


def create_search(experiment: Experiment, opts: Options, *, actor=None) -> CapacitySearch:
    """Check everything a search needs and record it (status running); nothing is sent yet."""
    keys = [v.key for v in experiment.variants.order_by("position")]
    chosen = list(dict.fromkeys(opts.variants)) or keys
    unknown = sorted(set(chosen) - set(keys))
    if unknown:
        raise ReplayError(
            f"--variants: no variant {unknown} in {experiment.key!r} (it has {', '.join(keys)})"
        )
    if experiment.status != Experiment.Status.RUNNING:
        raise ReplayError(
            f"experiment {experiment.key!r} is {experiment.status}: only running experiments replay"
        )
    if opts.arrival not in ARRIVALS:
        raise ReplayError(f"--arrival must be one of {', '.join(ARRIVALS)}, got {opts.arrival!r}")
    unknown = sorted(set(opts.start_rps_by) - set(chosen))
    if unknown:
        raise ReplayError(f"--start-rates: {unknown} not searched here (searching {', '.join(chosen)})")
    if opts.step_requests < 50:
        raise ReplayError(f"--step-requests must be at least 50, got {opts.step_requests}")
    if not 0 <= opts.warmup_s <= 600:
        raise ReplayError(f"--warmup must be 0 to 600 s, got {opts.warmup_s:g}")
    spec = search_spec(experiment, opts)
    for key in opts.start_rps_by:
        variant_spec(spec, opts, key)
    if opts.arrival == "recorded":  # the trace must be readable and have a rate of its own
        trace_rate(opts.trace, opts.source_format, opts.step_requests, opts.local_paths)
    return CapacitySearch.objects.create(
        experiment=experiment,
        params={
            **dataclasses.asdict(opts),
            "variants": chosen,
            "start_rps": spec.start_rps,
            "target": spec.target,
            "lag_limit_ms": spec.lag_limit_ms,
        },
        started_by=actor if getattr(actor, "pk", None) else None,
    )


def search_spec(experiment: Experiment, opts: Options) -> SearchSpec:
    try:
        lag_limit = opts.lag_limit_ms
        if lag_limit is None:  # scaled to what a lag could distort (capacity/search.py)
            lag_limit = default_lag_limit_ms(*slo_of(experiment).limits().values())
        return SearchSpec(
            target=experiment.sla_target,
            start_rps=opts.start_rps or opts.max_rps / 4.0,
            max_rps=opts.max_rps,
            min_rps=opts.min_rps,
            rel_tol=opts.rel_tol,
            max_steps=opts.max_steps,
            alpha=opts.alpha,
            lag_limit_ms=lag_limit,
        )
    except ValueError as exc:
        raise ReplayError(str(exc)) from None


def variant_spec(spec: SearchSpec, opts: Options, key: str) -> SearchSpec:
    """The search of one variant: ``spec`` from the variant's own first rate, if it has one."""
    if key not in opts.start_rps_by:
        return spec
    try:
        return dataclasses.replace(spec, start_rps=float(opts.start_rps_by[key]))
    except (TypeError, ValueError) as exc:
        raise ReplayError(f"--start-rates {key}: {exc}") from None


def step_plan(experiment: Experiment, opts: Options, spec: SearchSpec, *, actor=None) -> StepPlan:
    """What every step of a search of ``experiment`` shares (capacity.steps.run_step)."""
    rate_of_trace = None
    if opts.arrival == "recorded":
        rate_of_trace = trace_rate(opts.trace, opts.source_format, opts.step_requests, opts.local_paths)
    return StepPlan(
        experiment=experiment,
        trace=opts.trace,
        source_format=opts.source_format,
        slo=slo_of(experiment),
        target=spec.target,
        alpha=spec.step_alpha,
        max_requests=opts.step_requests,
        arrival=opts.arrival,
        cv=opts.cv,
        seed=opts.seed,
        warmup_s=opts.warmup_s,
        trace_rate=rate_of_trace,
        local_paths=opts.local_paths,
        actor=actor,
    )


def options_of(record: CapacitySearch) -> Options:
    names = {f.name for f in dataclasses.fields(Options)}
    return Options(**{k: v for k, v in record.params.items() if k in names})


def execute_search(record: CapacitySearch, *, say: Callable[[str], None] = lambda _: None) -> CapacitySearch:
    """Search every variant of the record, one after the other; the record holds the result
    (each variant's as soon as it is known) and ends done or failed.

    While a variant is searched, its entry holds the steps so far and the step replaying now
    (``searching_entry``), so the report names every step's run as a capacity step
    (capacity.labels) from the moment the run exists."""
    experiment, opts = record.experiment, options_of(record)
    spec = search_spec(experiment, opts)
    plan = step_plan(experiment, opts, spec, actor=record.started_by)
    costs = {v.key: v.cost for v in experiment.variants.all()}
    out: dict[str, Any] = {}

    def keep() -> None:
        CapacitySearch.objects.filter(pk=record.pk).update(result=out)

    try:
        for i, key in enumerate(record.params["variants"]):
            t0 = time.monotonic()
            first = [i == 0]
            out[key] = searching_entry([])

            def probe(rate: float, key: str = key, first: list = first) -> Any:
                say(f"{key}: step at {rate_text(rate)} req/s ...")

                def started(run_id: int) -> None:
                    out[key] = searching_entry(out[key]["steps"], {"run_id": run_id, "rate_rps": float(rate)})
                    keep()

                step = run_step(plan, key, rate, first=first[0], on_run=started)
                first[0] = False
                out[key] = searching_entry([*out[key]["steps"], step.as_dict()])
                keep()
                att = "-" if step.attainment is None else f"{step.attainment:.2%}"
                lag = "-" if step.lag_p99_ms is None else f"{step.lag_p99_ms:.2f}"
                if step.generator_limited(spec.lag_limit_ms):
                    lag += f", over the limit of {spec.lag_limit_ms:g}"
                say(
                    f"{key}: {rate_text(rate)} req/s {step.verdict} (attainment {att} of {step.n}, "
                    f"lag p99 {lag} ms, run {step.run_id}, {step.seconds:.1f} s)"
                )
                return step

            cap = run_search(variant_spec(spec, opts, key), probe)
            out[key] = variant_result(cap, costs.get(key), time.monotonic() - t0)
            keep()
            say(f"{key}: {cap.message}")
    except BaseException as exc:
        record.status, record.error, record.result = CapacitySearch.Status.FAILED, str(exc)[:2000], out
        record.finished_at = timezone.now()
        record.save()
        raise
    record.status, record.result, record.finished_at = CapacitySearch.Status.DONE, out, timezone.now()
    record.save()
    return record


def search_experiment(
    experiment: Experiment, opts: Options, *, actor=None, say: Callable[[str], None] = lambda _: None
) -> CapacitySearch:
    """create_search then execute_search, in this process (the command line)."""
    return execute_search(create_search(experiment, opts, actor=actor), say=say)


def searching_entry(steps: list[dict[str, Any]], now: dict[str, Any] | None = None) -> dict[str, Any]:
    """A variant's entry while it is searched: its steps so far (StepResult.as_dict) and the
    step replaying now ({run_id, rate_rps}, None between steps); variant_result replaces it.
    A search that fails keeps it: ``searching`` then names the step it cut short."""
    done = f"{len(steps)} step{'s' if len(steps) != 1 else ''} so far"
    return {"steps": steps, "searching": now, "message": f"searching: {done}"}


def variant_result(cap: Capacity, cost: dict | None, seconds: float) -> dict[str, Any]:
    """One variant's stored result: the search's answer, the search time and cost at capacity."""
    at = [s for s in cap.steps if s.rate_rps == cap.capacity_rps]
    tokens = at[0].output_tokens_mean if at else None
    priced = cost_at_capacity(cap.capacity_rps, cost["per_hour"], cost["currency"], tokens) if cost else None
    return {**cap.as_dict(), "search_s": seconds, "cost": priced.as_dict() if priced else None}


def ranking(result: dict[str, Any]) -> list[str]:
    """Variants by SLA capacity per unit of price (unpriced ones after, by capacity)."""

    def key(item):
        v, r = item
        per = (r.get("cost") or {}).get("capacity_per_currency_hour")
        return (per is None, -(per or 0.0), -(r.get("capacity_rps") or 0.0), v)

    return [v for v, _ in sorted(result.items(), key=key)]


def mirror_fidelity(experiment: Any) -> tuple[dict[str, Any], str]:
    """({variant: report variants[].fidelity}, a note) of the experiment's latest mirror replay:
    the capacity steps replay each variant alone, so what each answers against the control comes
    from the mirror run's report (cached like the dashboard's). ({}, why) when it cannot be read."""
    try:
        _filters, report = report_for_params(experiment, {"mode": "mirror"}, [])
    except (QueryError, StoreError) as exc:
        return {}, f"answers against the control: not available ({exc})"
    runs = ", ".join(str(r["run_id"]) for r in (report.get("runs") or {}).get("read", []))
    fidelity = {v["key"]: v.get("fidelity") for v in report["variants"]}
    if not any(fidelity.values()):
        return {}, ""
    return fidelity, f"answers identical to the control's: from the mirror replay's report (run {runs})"
