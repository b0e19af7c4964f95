"""SLA capacity search, pure: the highest request rate at which a variant meets its SLA target
with confidence, found by bracketing then bisection, each step stopped by a sequential test.

No framework, no I/O: the glue (capacity/steps.py) runs each step as a replay and hands back a
``StepResult``; ``Search`` says which rate to try next and, at the end, the ``Capacity``.

The search
1. Bracket: start at ``start_rps``; double after a step that meets the target, halve after one
   that does not, until one rate meets and a higher one does not (or ``max_rps`` meets, or
   ``min_rps`` does not).
2. Bisect the bracket at its geometric middle until its upper end is within ``rel_tol`` of its
   lower end, or ``max_steps`` steps were run.
Every rate the search computes (a doubling, a halving, a middle) is sent as the shortest decimal
within ``RATE_ROUNDING`` of it (``short_rate``: 45 for 45.25, 22.6 for 22.63), strictly inside
the bracket and within [min_rps, max_rps]: a step, its run and its result read "45 req/s", never
"45.254833995939045", and the bisection loses nothing it would notice (rel_tol is 5%).

A step's verdict (``step_verdict``): the step replays at one rate and looks at its attainment
after every batch through an anytime-valid confidence sequence (stats.sequential.means, its
mixture centred on the target: ``step_sequence``), so the replay stops as soon as "meets" (the
sequence's lower bound is at or above the target) or "misses" (its upper bound is below) is
clear, and far from the edge that is quick: the search spends its time near the edge. A step that can no longer say "meets" before its request cap,
even if every request left met the SLA (``can_still_meet``), stops then as "undecided" too: near
the edge that saves running the cap out. A step that reaches its request cap undecided is an
"undecided" step (the one word for a step that did not decide): the search treats it as not meeting (a capacity is claimed only for rates that meet with
confidence), so the bracket's upper end may be a rate that meets the target by a hair.

Error budget: ``alpha`` is split evenly over ``max_steps`` (the union bound), so with probability
at least 1 - alpha every verdict of the search is right at once, and the capacity it reports
meets the target.

The load generator: a step whose own schedule lag p99 (over the requests it judged, after the
warm-up) exceeds ``lag_limit_ms`` measured the replay, not the variant: it is void. A void step
is run once more at the same rate (``next_rate``; ``void_retries``): a lag spike of a moment
(another process taking the core, a cold start) must not end the search at the first rate it
tried. A retry that is not void supersedes it (the void step then counts nowhere: not in the
bracket, not in the result's message); a second void step at the same rate makes that rate the
generator's limit: its verdict does not count, the search goes no higher, and the result says
the generator limited it (``limited_by == "generator"``).

How much lag a step may have (``default_lag_limit_ms``). The schedule lag (how late the replay
sent a request against its plan) is the generator's own symptom: its event loop was held, or
waited for a core. It can distort a step in two ways, and each by no more than the lag itself,
in milliseconds of latency:
1. Reading: a token that arrives while the loop is held is stamped when the loop gets to it,
   up to the stall later.
2. Load: the server sees each request up to the lag later than planned. In a first-come,
   first-served queue, delaying arrivals by at most d moves no departure by more than d
   (departures are monotone in arrival times), so each latency, measured from the request's
   actual send, moves by at most d as well.
So a lag can change a request's verdict only if its latency lies within the lag of an SLO
threshold, and a lag small against the tightest threshold cannot change a step's verdict. The
default limit is ``max(LAG_FLOOR_MS, LAG_SHARE_OF_SLO x the tightest threshold)``: 10 ms for a
200 ms TTFT SLO (the lag moves the verdict of a request only within 5% of it, and the p99 says
99% of requests lagged less), 5 ms for any threshold up to 100 ms. A TPOT threshold counts at
its own value: a stall adds to one gap of a request, which is all of a two-token answer's TPOT.
The limit does not depend on the step's rate: by 2. a stall at a higher rate delays more
requests but none by more, and a generator that cannot keep up with the rate at all lags more
and more as the step goes on (hundreds of ms and more), past any of these limits. An explicit
limit (``--lag-limit``, the API's and the admin's ``lag_limit``) overrides the default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from stats._common import AsDict
from stats.sequential.means import MeanSequence

MEETS, MISSES, UNDECIDED = "meets", "misses", "undecided"
VERDICTS = (MEETS, MISSES, UNDECIDED)
# What the page, the command and the messages call Capacity.upper_rps: the lowest rate tried,
# above the capacity, that did not meet the target with confidence (it missed, or stayed
# undecided, or was void).
NOT_MET_AT = "not met at"
# Why the search stopped where it did (Capacity.limited_by).
BY_SLA, BY_GENERATOR, BY_MAX_RATE, BY_MIN_RATE, BY_STEPS = "sla", "generator", "max_rate", "min_rate", "steps"


# The step's mixture (stats.sequential.means) is centred on the SLA target with the weight of
# this many requests: Beta(target * w, (1 - target) * w). Any prior fixed before the step's data
# keeps the sequence valid; this one puts its mass where the question is (is attainment above or
# below the target?) instead of spreading it over [0, 1] (the default Beta(1, 1)). At 99.2% and
# alpha 0.025 a step says "meets" after 670 requests with no miss (uniform prior: 1,360), 1,000
# with one (1,720), and "misses" at 97% attainment after 320 (420); at a 90% target both ask
# about the same as the uniform prior (tests/capacity/test_search.py pins these and the
# sequence's validity at the target).
STEP_PRIOR_WEIGHT = 100.0

# How far a rate the search computes may move to read as a short decimal (short_rate).
RATE_ROUNDING = 0.01


def short_rate(x: float, lo: float | None = None, hi: float | None = None) -> float:
    """``x`` as the shortest decimal (fewest significant digits) within RATE_ROUNDING of it and,
    when given, strictly between ``lo`` and ``hi``; ``x`` itself when none is."""
    for digits in range(1, 16):
        r = float(f"{x:.{digits}g}")
        if abs(r - x) <= RATE_ROUNDING * x and (lo is None or r > lo) and (hi is None or r < hi):
            return r
    return x


def rate_text(rps: float) -> str:
    """A rate as people read it: 128, 45.5, 0.05 (never "128.000"); a rate stored before rates
    were rounded (short_rate) at three significant digits."""
    for digits in range(1, 7):
        text = f"{rps:.{digits}g}"
        if float(text) == rps:
            break
    else:
        text = f"{rps:.3g}"
    return f"{float(text):.0f}" if "e+" in text else text


# The default lag limit (the module docstring): at least LAG_FLOOR_MS, else this share of the
# tightest SLO threshold.
LAG_FLOOR_MS = 5.0
LAG_SHARE_OF_SLO = 0.05


def default_lag_limit_ms(*thresholds_ms: float | None) -> float:
    """The schedule lag p99 above which a step is void, for SLO thresholds ``thresholds_ms``
    (ms; None: no such SLO): max(LAG_FLOOR_MS, LAG_SHARE_OF_SLO x the smallest)."""
    given = [float(t) for t in thresholds_ms if t is not None]
    if any(not (math.isfinite(t) and t > 0) for t in given):
        raise ValueError(f"SLO thresholds must be finite numbers of ms > 0, got {given!r}")
    return max(LAG_FLOOR_MS, LAG_SHARE_OF_SLO * min(given)) if given else LAG_FLOOR_MS


def step_sequence(hits: int, n: int, target: float, alpha: float) -> MeanSequence:
    """The confidence sequence a step at ``target`` is judged by (its prior: STEP_PRIOR_WEIGHT)."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"the SLA target must be strictly between 0 and 1, got {target!r}")
    w = STEP_PRIOR_WEIGHT
    return MeanSequence(n=n, hits=hits, alpha=alpha, prior=(target * w, (1.0 - target) * w))


def step_verdict(hits: int, n: int, target: float, alpha: float) -> str:
    """meets / misses / undecided for attainment ``hits / n`` against ``target``, anytime-valid
    at ``alpha``: may be asked after every batch of a step."""
    if n <= 0:
        return UNDECIDED
    lo, hi = step_sequence(hits, n, target, alpha).bounds()
    if lo >= target:
        return MEETS
    if hi < target:
        return MISSES
    return UNDECIDED


def can_still_meet(hits: int, n: int, left: int, target: float, alpha: float) -> bool:
    """Whether a step that judged ``hits`` of ``n`` could still say "meets" before its cap, were
    every one of the ``left`` requests it has yet to judge to meet the SLA. When not, the step
    can only end "misses" or "undecided", which the search treats alike (not meeting): it may
    stop at once (futility), and no claim of the search becomes weaker by it."""
    return step_verdict(hits + max(left, 0), n + max(left, 0), target, alpha) == MEETS


@dataclasses.dataclass(frozen=True)
class SearchSpec:
    target: float  # the SLA target: the share of requests that must meet every SLO
    start_rps: float
    max_rps: float
    min_rps: float = 0.05
    rel_tol: float = 0.05  # stop when the bracket's ends are within 5% of each other
    max_steps: int = 12
    alpha: float = 0.05  # for the whole search: alpha / max_steps per step
    # the replay's own schedule lag p99 above which a step is void (default_lag_limit_ms)
    lag_limit_ms: float = LAG_FLOOR_MS
    void_retries: int = 1  # a void step is run this many times more at its rate before it counts

    def __post_init__(self) -> None:
        if not 0.0 < self.target < 1.0:
            raise ValueError(f"target must be strictly between 0 and 1, got {self.target!r}")
        for name in ("start_rps", "max_rps", "min_rps", "rel_tol", "lag_limit_ms"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int | float) or not (math.isfinite(x) and x > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
        if not self.min_rps <= self.start_rps <= self.max_rps:
            raise ValueError(
                f"rates must satisfy min_rps <= start_rps <= max_rps, got {self.min_rps:g} <= "
                f"{self.start_rps:g} <= {self.max_rps:g}"
            )
        if (
            isinstance(self.max_steps, bool)
            or not isinstance(self.max_steps, int)
            or not 2 <= self.max_steps <= 100
        ):
            raise ValueError(f"max_steps must be an integer from 2 to 100, got {self.max_steps!r}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be strictly between 0 and 1, got {self.alpha!r}")
        if isinstance(self.void_retries, bool) or self.void_retries not in range(4):
            raise ValueError(f"void_retries must be an integer from 0 to 3, got {self.void_retries!r}")

    @property
    def step_alpha(self) -> float:
        return self.alpha / self.max_steps


@dataclasses.dataclass(frozen=True)
class StepResult(AsDict):
    """One step: the rate replayed and what it measured (after the warm-up it discards)."""

    rate_rps: float
    verdict: str
    n: int
    hits: int
    lag_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    attainment_lo: float | None = None
    attainment_hi: float | None = None
    seconds: float = 0.0
    run_id: int | None = None
    output_tokens_mean: float | None = None
    note: str = ""
    counted: bool = True  # False: a void step that its retry at the same rate superseded (Search)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def attainment(self) -> float | None:
        return self.hits / self.n if self.n else None

    def generator_limited(self, limit_ms: float) -> bool:
        return self.lag_p99_ms is not None and self.lag_p99_ms > limit_ms


@dataclasses.dataclass(frozen=True)
class Capacity(AsDict):
    """The search's answer: ``capacity_rps`` meets the target with confidence (None: not even
    ``min_rps`` did); the true edge lies in [capacity_rps, upper_rps) (upper None: above every
    rate tried). ``knee_rps``: the lowest rate tried whose p99 TTFT is at least twice that of
    the lowest rate tried (None: none was). ``steps``: every step in the order run, a void one
    with a note saying so (and whether a retry superseded it); ``lag_limit_ms``: the limit they
    were judged by."""

    capacity_rps: float | None
    upper_rps: float | None
    limited_by: str
    steps: tuple[StepResult, ...]
    knee_rps: float | None
    message: str
    lag_limit_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:  # steps as dicts, in the order run
        d = super().as_dict()
        d["steps"] = [s.as_dict() for s in self.steps]
        return d


class Search:
    """The search's state: ``next_rate()`` until it returns None, ``record()`` after each step."""

    def __init__(self, spec: SearchSpec) -> None:
        self.spec = spec
        self.steps: list[StepResult] = []
        self._stopped: str | None = None

    # the bracket: the highest rate that met the target, the lowest that did not (or was void),
    # among the steps that count (``_counted``)
    def _lo(self) -> float | None:
        ok = [s.rate_rps for s in self._counted() if s.verdict == MEETS and not self._void(s)]
        return max(ok) if ok else None

    def _hi(self) -> float | None:
        bad = [s.rate_rps for s in self._counted() if s.verdict != MEETS or self._void(s)]
        return min(bad) if bad else None

    def _void(self, s: StepResult) -> bool:
        return s.generator_limited(self.spec.lag_limit_ms)

    def _superseded(self, i: int) -> bool:
        """Whether step ``i`` is void and a later step at its rate is not (its retry)."""
        s = self.steps[i]
        return self._void(s) and any(
            t.rate_rps == s.rate_rps and not self._void(t) for t in self.steps[i + 1 :]
        )

    def _counted(self) -> list[StepResult]:
        return [s for i, s in enumerate(self.steps) if not self._superseded(i)]

    def _retry(self) -> float | None:
        """The rate of the last step again, when it was void and its rate has had fewer than
        ``void_retries`` retries."""
        if not self.steps or not self._void(last := self.steps[-1]):
            return None
        voids = sum(1 for s in self.steps if s.rate_rps == last.rate_rps and self._void(s))
        return last.rate_rps if voids <= self.spec.void_retries else None

    def record(self, step: StepResult) -> None:
        self.steps.append(step)

    def next_rate(self) -> float | None:
        """The rate of the next step, or None: the search is over (``result()``)."""
        sp = self.spec
        if self._stopped:
            return None
        if len(self.steps) >= sp.max_steps:
            self._stopped = BY_STEPS
            return None
        if (again := self._retry()) is not None:
            return again  # the generator lagged: once more before the rate counts as its limit
        lo, hi = self._lo(), self._hi()
        if lo is not None and hi is not None and hi <= lo:
            # a lower rate failed where a higher one met (noise, or a void step): trust the
            # conservative end; nothing in between is worth more steps
            self._stopped = BY_SLA
            return None
        if not self.steps:
            return sp.start_rps
        if hi is None:  # everything tried met: go up
            if lo >= sp.max_rps:
                self._stopped = BY_MAX_RATE
                return None
            return min(sp.max_rps, short_rate(lo * 2.0, lo))
        if lo is None:  # nothing met yet: go down
            if hi <= sp.min_rps:
                self._stopped = BY_MIN_RATE
                return None
            return max(sp.min_rps, short_rate(hi / 2.0, None, hi))
        if hi <= lo * (1.0 + sp.rel_tol):
            self._stopped = BY_SLA
            return None
        return short_rate(math.sqrt(lo * hi), lo, hi)

    def result(self) -> Capacity:
        sp = self.spec
        lo, hi = self._lo(), self._hi()
        void = [s for s in self._counted() if self._void(s)]
        limited_by = self._stopped or BY_STEPS
        if void and hi is not None and any(s.rate_rps == hi for s in void):
            limited_by = BY_GENERATOR
        knee = _knee(self._counted())
        t = f"{sp.target:.2%}"
        if lo is None:
            message = f"no rate tried meets {t} with confidence (lowest tried {rate_text(min_rate(self.steps))} req/s)"
        elif limited_by == BY_GENERATOR:
            worst = max(s.lag_p99_ms or 0.0 for s in void if s.rate_rps == hi)
            message = (
                f"meets {t} at {rate_text(lo)} req/s; the load generator could not go higher (its schedule "
                f"lag p99 reached {worst:.1f} ms at {rate_text(hi)} req/s, over {sp.lag_limit_ms:g} ms): "
                "add workers or shards to search above it"
            )
        elif hi is None:
            why = "the step budget ran out" if limited_by == BY_STEPS else "max_rps"
            message = f"meets {t} at every rate tried, up to {rate_text(lo)} req/s ({why})"
        else:
            # NOT_MET_AT: the lowest rate that did not meet with confidence (missed or undecided)
            message = f"meets {t} at {rate_text(lo)} req/s; {NOT_MET_AT} {rate_text(hi)} req/s"
        steps = tuple(self._noted(i) for i in range(len(self.steps)))
        return Capacity(lo, hi, limited_by, steps, knee, message, sp.lag_limit_ms)

    def _noted(self, i: int) -> StepResult:
        """Step ``i`` as the result shows it: a void one says so, and whether it counted."""
        s = self.steps[i]
        if not self._void(s):
            return s
        why = f"the load generator lagged (schedule lag p99 {s.lag_p99_ms:.1f} ms, over {self.spec.lag_limit_ms:g} ms)"
        superseded = self._superseded(i)
        why = f"not counted: {why}; run again at this rate" if superseded else f"void: {why}"
        return dataclasses.replace(s, note=f"{why}; {s.note}" if s.note else why, counted=not superseded)


def min_rate(steps: Sequence[StepResult]) -> float:
    return min((s.rate_rps for s in steps), default=math.nan)


def _knee(steps: Sequence[StepResult]) -> float | None:
    have = sorted((s.rate_rps, s.ttft_p99_ms) for s in steps if s.ttft_p99_ms is not None)
    if len(have) < 2:
        return None
    base = have[0][1]
    return next((r for r, p99 in have[1:] if base > 0 and p99 >= 2.0 * base), None)


def run_search(spec: SearchSpec, probe: Any) -> Capacity:
    """Drive a search with ``probe(rate_rps) -> StepResult`` (the glue's replay, or a model)."""
    search = Search(spec)
    while (rate := search.next_rate()) is not None:
        search.record(probe(rate))
    return search.result()


@dataclasses.dataclass(frozen=True)
class Cost(AsDict):
    """What a variant's capacity costs: its deployment's price per hour at SLA capacity."""

    per_hour: float
    currency: str
    per_million_requests: float | None
    per_million_output_tokens: float | None
    capacity_per_currency_hour: float | None  # req/s of SLA capacity per unit of price per hour


def cost_at_capacity(
    capacity_rps: float | None, per_hour: float, currency: str, output_tokens_mean: float | None
) -> Cost:
    """Price per million requests (and output tokens) when the deployment runs at capacity."""
    if not capacity_rps:
        return Cost(per_hour, currency, None, None, None)
    per_request = per_hour / (capacity_rps * 3600.0)
    per_token = per_request / output_tokens_mean if output_tokens_mean else None
    return Cost(
        per_hour,
        currency,
        per_request * 1e6,
        None if per_token is None else per_token * 1e6,
        capacity_rps / per_hour if per_hour > 0 else None,
    )
