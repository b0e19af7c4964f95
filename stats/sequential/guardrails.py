"""The rollout decision from guardrails read through anytime-valid sequences.

A guardrail (``Guardrail``, stats.sequential.guardrail_spec) is a metric of the candidate arm, or
its difference to the control, against a limit (the experiment document's
``rollout.guardrails``):

    {metric: attainment, at_least: 0.992}              candidate attainment >= 0.992
    {metric: error_rate, at_most_over_control: 0.005}  candidate - control error rate <= 0.005
    {metric: p99_ttft_ms, at_most_over_control: 20}    candidate p99 - control p99 <= 20 ms
    {metric: identical_answers, at_least: 0.95}        candidate's answers identical to the
                                                       control's on >= 95% of shadowed requests

Metrics: ``attainment`` (share of requests meeting the SLA, errors count as misses),
``error_rate``, a quantile ``p<NN>_<latency>`` (p99_ttft_ms: the 0.99 quantile of the arm's
``ttft_ms`` latencies), and ``identical_answers`` (of the candidate's live requests shadowed to
the control whose comparison came back, the share whose answers were identical: ArmSnapshot.
shadows). Rules: at_least, at_most (the candidate's value), at_least_over_control,
at_most_over_control (candidate - control; not for identical_answers, already a comparison).

Inference, per guardrail (``GuardrailCheck.inference``): attainment and error rate are read
``user-clustered`` (``user-clustered, adjusted`` on the pre-request covariates) when the arms
carry per-user aggregates and enough users and events, else through the exact sequence for
independent ``requests`` (stats.sequential.share_reading says when and how; ``inference_note``
says why not clustered or adjusted); identical_answers likewise, a one-arm share with the
candidate's shadows for requests, never adjusted (its check carries their ``counts``). Quantile
guardrails are read through ``order statistics``, always: per request (not clustered) and not
adjusted, since subtracting a covariate term leaves a mean where it is but moves a quantile to
another quantity (stats.adjusted). An arm's reading is
an ``ArmSnapshot`` (stats.sequential.arm_snapshot).

Setup errors (a 4xx but 408 and 429: an unknown model, auth, a bad request) are no measure of
the serving change: an arm's reading keeps them apart (``ArmSnapshot.setup_errors``) and no
guardrail reads them, so a client's bad requests never roll a candidate back. They are checked
on their own (stats.sequential.setup_errors, ``setup_error_check``): a candidate whose share of
them is shown above the control's refuses, as configured, what the control serves, and the step
halts for a person (never a rollback, never a promotion). A step never passes with no judged
request in an arm.

An identical_answers guardrail must be shown to hold before a step passes (``MUST_HOLD``), even
under promote_on="no_breach": the gateway shadows only a share of the candidate's requests, so
min_samples says nothing of how many answers were compared, and "no breach shown" on a handful
of them would promote answers nobody checked. Its sequence decides when there are enough: with
none compared it never passes.

The guarantee, per rollout step (one config revision, counts from that step only): with k
guardrails at overall ``alpha``, each gets a = alpha/k. Without per-user aggregates it is read
through one sequence at a (a difference through per-arm sequences at a/2). With them,
attainment, error rate and identical answers hold two sequences: the clustered one at
``CLUSTERED_SHARE`` * a (share_reading) and the exact one at the rest; each look reads one of
them, and a false breach at any look needs one of the two to miss the truth at some look, so
the union bound gives a again. With
probability >= 1 - alpha every sequence holds at every look of the step at once, so

    P(any guardrail is declared breached at any look while it actually holds) <= alpha,

and likewise for "ok" (shown to hold) while it actually fails, however often the controller
looks and whenever it stops. Across the steps of a rollout the error rates add up (a union
bound): give each step alpha / steps to bound the whole rollout. Breaches are decided at any
look, before min_samples: the sequences allow it.

What each part rests on: the exact sequences assume requests independent within each arm (too
narrow when users send many alike requests: bench/bench_sequential.py measures how much); the
clustered ones assume users independent and are asymptotic (the plug-in variance must be close
to the truth, hence the minimum users and events; bench/bench_sequential.py measures the A/A
false rollback rate with heavy-tailed users looked at every 30 s). A latency profile that drifts
within a step is read as its average.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from stats._common import AsDict
from stats.sequential._base import DEFAULT_ALPHA, DEFAULT_PRIOR, SequentialInterval, check_alpha
from stats.sequential.adjusted import DEFAULT_MIN_CLUSTERS, DEFAULT_TARGET_N
from stats.sequential.arm_snapshot import ATTAINMENT, ERROR_RATE, IDENTICAL_ANSWERS, ArmSnapshot
from stats.sequential.guardrail_spec import AT_LEAST, AT_LEAST_OVER, AT_MOST, AT_MOST_OVER, Guardrail
from stats.sequential.quantiles import quantile_difference_interval
from stats.sequential.setup_errors import SetupErrorCheck, setup_error_check
from stats.sequential.share_reading import REQUESTS, GuardrailReading, read_share
from stats.sequential.srm import SrmCheck

BREACH, OK, UNCLEAR = "breach", "ok", "unclear"  # per guardrail
HALT, PASS, UNDECIDED = "halt", "pass", "undecided"  # the decision (and BREACH)
NO_BREACH, ALL_CONFIRMED = "no_breach", "all_confirmed"  # promote_on
ORDER_STATISTICS = "order statistics"  # GuardrailCheck.inference of a quantile (shares: share_reading)
# Metrics a step passes only once shown to hold, whatever promote_on says (module docstring).
MUST_HOLD = (IDENTICAL_ANSWERS,)


@dataclasses.dataclass(frozen=True, slots=True)
class GuardrailCheck(AsDict):
    metric: str
    rule: str
    threshold: float
    status: str  # breach | ok | unclear
    interval: SequentialInterval  # of the candidate's value, or of candidate - control
    message: str
    inference: str = REQUESTS  # requests | user-clustered | user-clustered, adjusted | order statistics
    inference_note: str | None = None  # why not clustered or adjusted, when it could have been
    variance_reduction: float | None = None  # adjusted: 1 - V_adjusted / V_unadjusted (clustered)
    covariates: tuple[str, ...] = ()  # adjusted: the covariates used
    # identical_answers: the candidate's shadows (shadowed, ok, identical, users); None otherwise
    counts: dict[str, int] | None = None


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
    setup: SetupErrorCheck | None = None


def _fmt(metric: str, x: float | None) -> str:
    if x is None:
        return "inf"
    return f"{x:.3%}" if metric in (ATTAINMENT, ERROR_RATE, IDENTICAL_ANSWERS) else f"{x:.1f}"


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
    *,
    adjust: bool = True,
    min_clusters: int = DEFAULT_MIN_CLUSTERS,
    target_n: float = DEFAULT_TARGET_N,
) -> GuardrailCheck:
    """One guardrail at level ``alpha`` (``decide`` passes alpha / number of guardrails).

    ``adjust``: a share's difference to the control is regression-adjusted on the covariates
    the per-user aggregates carry; ``min_clusters`` and ``target_n`` are the clustered
    sequences' (stats.sequential.adjusted), fixed before the data like everything here.
    """
    check_alpha(alpha, "check_guardrail")
    g = guardrail
    quantile = g.quantile
    if quantile is None:
        read = read_share(g, control, candidate, alpha, prior, adjust, min_clusters, target_n)
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
        read = GuardrailReading(iv, ORDER_STATISTICS, "a quantile: per request, not clustered, not adjusted")
    iv = read.interval
    status = _status(g.rule, g.threshold, iv)
    what = f"candidate - control {g.metric}" if g.over_control else f"candidate {g.metric}"
    limit = {AT_LEAST: ">=", AT_MOST: "<=", AT_LEAST_OVER: ">=", AT_MOST_OVER: "<="}[g.rule]
    how = read.inference
    if read.variance_reduction is not None:
        how += f" on {', '.join(read.covariates)}, variance {-read.variance_reduction:+.0%}"
    counts = None
    if g.metric == IDENTICAL_ANSWERS:
        assert candidate.shadows is not None  # read_share refuses a reading without them
        counts = candidate.shadows.counts()
        how += (
            f"; {counts['identical']} identical of {counts['ok']} compared from {counts['users']} users, "
            f"{counts['shadowed'] - counts['ok']} of {counts['shadowed']} shadowed not compared"
        )
    message = (
        f"{what} {_fmt(g.metric, iv.estimate) if iv.estimate is not None else 'n/a'} "
        f"(anytime {1 - iv.alpha:.4g} interval {_fmt(g.metric, iv.lo) if iv.lo is not None else '-inf'}"
        f" to {_fmt(g.metric, iv.hi)}, {how}), limit {limit} {_fmt(g.metric, g.threshold)}: "
        + {BREACH: "breached", OK: "holds", UNCLEAR: "not decided yet"}[status]
    )
    return GuardrailCheck(
        g.metric,
        g.rule,
        g.threshold,
        status,
        iv,
        message,
        read.inference,
        read.note,
        read.variance_reduction,
        read.covariates,
        counts,
    )


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
    adjust: bool = True,
    min_clusters: int = DEFAULT_MIN_CLUSTERS,
    target_n: float = DEFAULT_TARGET_N,
) -> RolloutDecision:
    """halt, breach, pass or undecided for one rollout step, with the numbers that decided it.

    1. halt: the sequential SRM test flags the split (``srm``, from SrmSequence.check()): the
       arms are not what the weights say, so no guardrail can be trusted; or the candidate
       answers setup errors the control does not (``setup_error_check``): it is misconfigured,
       a person must look (never a rollback: no guardrail saw those requests, and never a
       promotion).
    2. breach: any guardrail breached with confidence (at any look, no minimum).
    3. undecided: an arm has fewer than ``min_samples`` requests, or none, or the step is
       younger than ``min_duration_s``. Setup errors are not among those requests: a step
       never passes on requests no guardrail could judge.
    4. pass: with promote_on="no_breach" (the rollout default: promote unless harm is shown),
       once the minimums are met and every ``MUST_HOLD`` guardrail (identical_answers) is shown
       to hold; with "all_confirmed", only when every guardrail is shown to hold (a stronger
       claim that needs much more traffic), else undecided.

    ``adjust``, ``min_clusters``, ``target_n``: how attainment and error rate are read when the
    arms carry per-user aggregates (``check_guardrail``).
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
    checks = [
        check_guardrail(
            g, control, candidate, each, prior, adjust=adjust, min_clusters=min_clusters, target_n=target_n
        )
        for g in guardrails
    ]

    setup = None
    if control.setup_errors or candidate.setup_errors:
        setup = setup_error_check(control, candidate, alpha)

    def result(decision: str, reason: str) -> RolloutDecision:
        return RolloutDecision(
            decision,
            reason,
            alpha,
            checks,
            srm,
            control.n,
            candidate.n,
            float(elapsed_s),
            int(min_samples),
            float(min_duration_s),
            promote_on,
            setup,
        )

    if srm is not None and srm.flagged:
        return result(HALT, srm.message)
    if setup is not None and setup.flagged:
        return result(HALT, setup.message)
    breached = [c for c in checks if c.status == BREACH]
    if breached:
        return result(BREACH, "; ".join(c.message for c in breached))
    waiting = []
    for arm, snap in (("control", control), ("candidate", candidate)):
        if snap.n < max(min_samples, 1):
            also = f" (and {snap.setup_errors} setup errors, not judged)" if snap.setup_errors else ""
            waiting.append(f"{arm} has {snap.n} of {max(min_samples, 1)} samples{also}")
    if elapsed_s < min_duration_s:
        waiting.append(f"step has run {elapsed_s:.0f} of {min_duration_s:.0f} s")
    if waiting:
        return result(UNDECIDED, "no breach; waiting: " + ", ".join(waiting))
    unclear = [c for c in checks if c.status != OK and (promote_on == ALL_CONFIRMED or c.metric in MUST_HOLD)]
    if unclear:
        return result(UNDECIDED, "no breach; not yet shown to hold: " + "; ".join(c.message for c in unclear))
    if promote_on == ALL_CONFIRMED:
        return result(PASS, "every guardrail shown to hold: " + "; ".join(c.message for c in checks))
    shown = [c.message for c in checks if c.metric in MUST_HOLD]
    return result(
        PASS,
        "no guardrail breached after the minimum samples and duration" + "".join(f"; {m}" for m in shown),
    )
