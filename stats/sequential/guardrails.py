"""The rollout decision from guardrails read through anytime-valid sequences.

A guardrail is a metric of the candidate arm, or its difference to the control, against a
limit (the experiment document's ``rollout.guardrails``):

    {metric: attainment, at_least: 0.992}              candidate attainment >= 0.992
    {metric: error_rate, at_most_over_control: 0.005}  candidate - control error rate <= 0.005
    {metric: p99_ttft_ms, at_most_over_control: 20}    candidate p99 - control p99 <= 20 ms

Metrics: ``attainment`` (share of requests meeting the SLA, errors count as misses),
``error_rate``, and a quantile ``p<NN>_<latency>`` (p99_ttft_ms: the 0.99 quantile of the arm's
``ttft_ms`` latencies). Rules: at_least, at_most (the candidate's value), at_least_over_control,
at_most_over_control (candidate - control).

The guarantee, per rollout step (one config revision, counts from that step only): with k
guardrails at overall ``alpha``, each is read through a sequence at alpha/k (a difference
through per-arm sequences at alpha/(2k)). With probability >= 1 - alpha every sequence holds at
every look of the step at once, so

    P(any guardrail is declared breached at any look while it actually holds) <= alpha,

and likewise for "ok" (shown to hold) while it actually fails, however often the controller
looks and whenever it stops. Across the steps of a rollout the error rates add up (a union
bound): give each step alpha / steps to bound the whole rollout. Breaches are decided at any
look, before min_samples: the sequences allow it. Assumes requests are independent draws within
each arm during the step (a latency profile that drifts within a step is read as its average).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from stats._common import AsDict
from stats.sequential._base import DEFAULT_ALPHA, DEFAULT_PRIOR, SequentialInterval, check_alpha
from stats.sequential.means import MeanSequence, difference_interval
from stats.sequential.quantiles import quantile_difference_interval
from stats.sequential.srm import SrmCheck

ATTAINMENT, ERROR_RATE = "attainment", "error_rate"
AT_LEAST, AT_MOST = "at_least", "at_most"
AT_LEAST_OVER, AT_MOST_OVER = "at_least_over_control", "at_most_over_control"
RULES = (AT_LEAST, AT_MOST, AT_LEAST_OVER, AT_MOST_OVER)
_QUANTILE_METRIC = re.compile(r"^p(\d{1,2}(?:\.\d+)?)_([a-z][a-z0-9_]*)$")

BREACH, OK, UNCLEAR = "breach", "ok", "unclear"  # per guardrail
HALT, PASS, UNDECIDED = "halt", "pass", "undecided"  # the decision (and BREACH)
NO_BREACH, ALL_CONFIRMED = "no_breach", "all_confirmed"  # promote_on


class QuantileSource(Protocol):
    """An arm's latencies: LatencyHistogram or SortedLatencies."""

    @property
    def n(self) -> int: ...

    def quantile_interval(
        self, q: float, alpha: float = ..., prior: tuple[float, float] = ...
    ) -> SequentialInterval: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Guardrail(AsDict):
    metric: str
    rule: str
    threshold: float

    def __post_init__(self) -> None:
        where = f"guardrail {self.metric!r}"
        if self.rule not in RULES:
            raise ValueError(f"{where}: rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t):
            raise ValueError(f"{where}: {self.rule} must be a finite number, got {t!r}")
        object.__setattr__(self, "threshold", float(t))
        if self.metric in (ATTAINMENT, ERROR_RATE):
            low = -1.0 if self.over_control else 0.0
            if not low <= t <= 1.0:
                raise ValueError(f"{where}: {self.rule} must be a share in [{low:g}, 1], got {t!r}")
        elif self.quantile is None:
            raise ValueError(
                f"guardrail metric must be {ATTAINMENT}, {ERROR_RATE} or a quantile like p99_ttft_ms, "
                f"got {self.metric!r}"
            )

    @property
    def over_control(self) -> bool:
        return self.rule in (AT_LEAST_OVER, AT_MOST_OVER)

    @property
    def quantile(self) -> tuple[float, str] | None:
        """(q, latency name) for a quantile metric: p99_ttft_ms -> (0.99, "ttft_ms")."""
        m = _QUANTILE_METRIC.match(self.metric)
        if not m:
            return None
        q = float(m.group(1)) / 100.0
        return (q, m.group(2)) if 0.0 < q < 1.0 else None

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any], where: str = "guardrail") -> Guardrail:
        """From the document's form: {"metric": "attainment", "at_least": 0.992}."""
        if not isinstance(spec, Mapping) or "metric" not in spec:
            raise ValueError(f"{where}: must be a mapping with a metric and one rule, got {spec!r}")
        rules = [k for k in spec if k != "metric"]
        if len(rules) != 1:
            raise ValueError(f"{where}: needs exactly one of {', '.join(RULES)}, got {sorted(rules)}")
        try:
            return cls(str(spec["metric"]), rules[0], spec[rules[0]])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ArmSnapshot:
    """One arm's totals in the current step: requests, SLA hits (errors count as misses), errors,
    and latency sources by name for quantile guardrails (e.g. {"ttft_ms": LatencyHistogram})."""

    n: int
    hits: int
    errors: int
    latencies: Mapping[str, QuantileSource] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("n", "hits", "errors"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"ArmSnapshot: {name} must be an integer count >= 0, got {v!r}")
        if self.hits + self.errors > self.n:
            raise ValueError(
                f"ArmSnapshot: hits ({self.hits}) + errors ({self.errors}) exceed n ({self.n}); "
                "errors count as misses, so a request cannot be both"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class GuardrailCheck(AsDict):
    metric: str
    rule: str
    threshold: float
    status: str  # breach | ok | unclear
    interval: SequentialInterval  # of the candidate's value, or of candidate - control
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutDecision(AsDict):
    decision: str  # breach | halt | pass | undecided
    reason: str
    alpha: float
    checks: list[GuardrailCheck]
    srm: SrmCheck | None
    n_control: int
    n_candidate: int
    elapsed_s: float
    min_samples: int
    min_duration_s: float
    promote_on: str


def _fmt(metric: str, x: float | None) -> str:
    if x is None:
        return "inf"
    return f"{x:.3%}" if metric in (ATTAINMENT, ERROR_RATE) else f"{x:.1f}"


def _status(rule: str, threshold: float, iv: SequentialInterval) -> str:
    if rule in (AT_LEAST, AT_LEAST_OVER):
        if iv.hi is not None and iv.hi < threshold:
            return BREACH
        return OK if iv.lo is not None and iv.lo >= threshold else UNCLEAR
    if iv.lo is not None and iv.lo > threshold:
        return BREACH
    return OK if iv.hi is not None and iv.hi <= threshold else UNCLEAR


def check_guardrail(
    guardrail: Guardrail,
    control: ArmSnapshot,
    candidate: ArmSnapshot,
    alpha: float = DEFAULT_ALPHA,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> GuardrailCheck:
    """One guardrail at level ``alpha`` (``decide`` passes alpha / number of guardrails)."""
    check_alpha(alpha, "check_guardrail")
    g = guardrail
    quantile = g.quantile
    if quantile is None:
        key = "hits" if g.metric == ATTAINMENT else "errors"
        cand = MeanSequence(candidate.n, getattr(candidate, key), alpha, prior)
        if g.over_control:
            ctrl = MeanSequence(control.n, getattr(control, key), alpha, prior)
            iv = difference_interval(ctrl, cand, alpha)
        else:
            iv = cand.interval()
    else:
        q, name = quantile
        sources = []
        arms = (
            (("control", control), ("candidate", candidate))
            if g.over_control
            else (("candidate", candidate),)
        )
        for arm_name, arm in arms:
            if name not in arm.latencies:
                raise ValueError(
                    f"check_guardrail: {g.metric} needs the {arm_name} arm's {name!r} latencies; "
                    f"it has {sorted(arm.latencies)}"
                )
            sources.append(arm.latencies[name])
        if g.over_control:
            iv = quantile_difference_interval(
                sources[0].quantile_interval(q, alpha / 2.0, prior),
                sources[1].quantile_interval(q, alpha / 2.0, prior),
            )
        else:
            iv = sources[0].quantile_interval(q, alpha, prior)
    status = _status(g.rule, g.threshold, iv)
    what = f"candidate - control {g.metric}" if g.over_control else f"candidate {g.metric}"
    limit = {AT_LEAST: ">=", AT_MOST: "<=", AT_LEAST_OVER: ">=", AT_MOST_OVER: "<="}[g.rule]
    message = (
        f"{what} {_fmt(g.metric, iv.estimate) if iv.estimate is not None else 'n/a'} "
        f"(anytime {1 - alpha:.4g} interval {_fmt(g.metric, iv.lo) if iv.lo is not None else '-inf'}"
        f" to {_fmt(g.metric, iv.hi)}), limit {limit} {_fmt(g.metric, g.threshold)}: "
        + {BREACH: "breached", OK: "holds", UNCLEAR: "not decided yet"}[status]
    )
    return GuardrailCheck(g.metric, g.rule, g.threshold, status, iv, message)


def decide(
    guardrails: Sequence[Guardrail],
    control: ArmSnapshot,
    candidate: ArmSnapshot,
    *,
    alpha: float = DEFAULT_ALPHA,
    min_samples: int = 0,
    min_duration_s: float = 0.0,
    elapsed_s: float = 0.0,
    srm: SrmCheck | None = None,
    promote_on: str = NO_BREACH,
    prior: tuple[float, float] = DEFAULT_PRIOR,
) -> RolloutDecision:
    """halt, breach, pass or undecided for one rollout step, with the numbers that decided it.

    1. halt: the sequential SRM test flags the split (``srm``, from SrmSequence.check()): the
       arms are not what the weights say, so no guardrail can be trusted.
    2. breach: any guardrail breached with confidence (at any look, no minimum).
    3. undecided: an arm has fewer than ``min_samples`` or the step is younger than
       ``min_duration_s``.
    4. pass: with promote_on="no_breach" (the rollout default: promote unless harm is shown),
       once the minimums are met; with "all_confirmed", only when every guardrail is shown to
       hold (a stronger claim that needs much more traffic), else undecided.
    """
    check_alpha(alpha, "decide")
    if not guardrails:
        raise ValueError("decide: no guardrails given")
    if promote_on not in (NO_BREACH, ALL_CONFIRMED):
        raise ValueError(f"decide: promote_on must be {NO_BREACH} or {ALL_CONFIRMED}, got {promote_on!r}")
    if isinstance(min_samples, bool) or not isinstance(min_samples, numbers.Integral) or min_samples < 0:
        raise ValueError(f"decide: min_samples must be an integer >= 0, got {min_samples!r}")
    for name, v in (("min_duration_s", min_duration_s), ("elapsed_s", elapsed_s)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"decide: {name} must be a finite number of seconds >= 0, got {v!r}")
    each = alpha / len(guardrails)
    checks = [check_guardrail(g, control, candidate, each, prior) for g in guardrails]

    def result(decision: str, reason: str) -> RolloutDecision:
        return RolloutDecision(
            decision, reason, alpha, checks, srm, control.n, candidate.n,
            float(elapsed_s), int(min_samples), float(min_duration_s), promote_on,
        )  # fmt: skip

    if srm is not None and srm.flagged:
        return result(HALT, srm.message)
    breached = [c for c in checks if c.status == BREACH]
    if breached:
        return result(BREACH, "; ".join(c.message for c in breached))
    waiting = []
    for arm, snap in (("control", control), ("candidate", candidate)):
        if snap.n < min_samples:
            waiting.append(f"{arm} has {snap.n} of {min_samples} samples")
    if elapsed_s < min_duration_s:
        waiting.append(f"step has run {elapsed_s:.0f} of {min_duration_s:.0f} s")
    if waiting:
        return result(UNDECIDED, "no breach; waiting: " + ", ".join(waiting))
    unclear = [c for c in checks if c.status != OK]
    if promote_on == ALL_CONFIRMED and unclear:
        return result(UNDECIDED, "no breach; not yet shown to hold: " + "; ".join(c.message for c in unclear))
    if promote_on == ALL_CONFIRMED:
        return result(PASS, "every guardrail shown to hold: " + "; ".join(c.message for c in checks))
    return result(PASS, "no guardrail breached after the minimum samples and duration")
