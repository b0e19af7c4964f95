"""How a share guardrail (attainment, error rate, identical answers) is read: the candidate's
share, or its difference to the control, as an anytime-valid interval and the inference behind
it (``GuardrailReading``; stats.sequential.guardrails.check_guardrail reports it as
``GuardrailCheck.inference``).

``identical_answers`` is a one-arm share like the candidate's attainment, read the same way from
the candidate's shadows (ArmSnapshot.shadows, stats.sequential.arm_snapshot.Shadows): of its
live requests shadowed to the control and compared (outcome ok), the share whose answers were
identical; with ``by_user`` its units are the users (their per-user moments of [requests,
identical]), so a user who sends many alike requests counts as one draw, not many.

- ``user-clustered`` / ``user-clustered, adjusted``: when the arms carry per-user aggregates
  (``ArmSnapshot.per_user``: a row per user, UserSums, or those rows reduced over the users in
  the store, UserMoments; the experiment's ``analysis.cluster_by_user``). The router randomizes
  users and a user's requests are alike, so the independent unit is the user: the candidate's
  value through the normal-mixture sequence of its ratio mean with the user-clustered variance
  (stats.sequential.adjusted.clustered_mean_sequence), a difference to the control through the
  same boundary on the difference, regression-adjusted on the pre-request covariates the
  aggregates carry (prompt_tokens, max_tokens) unless ``adjust`` is off
  (adjusted_difference_look; a covariate constant over the step is left out, ``covariates``
  names those used, ``variance_reduction`` what they bought). Asymptotic: these need
  ``min_clusters`` users and ``MIN_EVENTS`` requests of each outcome in every arm they read;
  before that a look reads the exact sequence below.
- ``requests``: the beta-binomial mixture sequence of stats.sequential.means, exact for
  independent requests. Used when the reading has no per-user aggregates, and in a clustered
  reading for the looks with too few users or events (the reading's ``note`` says which arm).

With per-user aggregates a guardrail's alpha is shared: ``CLUSTERED_SHARE`` of it to the
clustered sequence, the rest to the exact one (the guarantee: stats.sequential.guardrails).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from stats.sequential._base import SequentialInterval
from stats.sequential.adjusted import (
    adjusted_difference_look,
    clustered_difference_sequence,
    clustered_mean_sequence,
)
from stats.sequential.arm_snapshot import (
    ATTAINMENT,
    ERROR_RATE,
    IDENTICAL_ANSWERS,
    SHARES,
    ArmSnapshot,
    PerUser,
    Shadows,
)
from stats.sequential.guardrail_spec import Guardrail
from stats.sequential.means import MeanSequence, difference_interval

# GuardrailCheck.inference of a share
REQUESTS, CLUSTERED, ADJUSTED = "requests", "user-clustered", "user-clustered, adjusted"


# The clustered sequence's share of a guardrail's alpha when its arms carry per-user aggregates;
# the rest goes to the exact sequence, which reads the looks before the clustered one may (too few
# users or events). Most to the clustered sequence, which reads nearly every look of a step; at
# a tenth of the alpha the exact one still rolls back a candidate that fails outright within its
# first minutes.
CLUSTERED_SHARE = 0.9
# Requests of each outcome (hits and misses, errors and successes) every arm needs before the
# clustered sequence reads a share: with fewer the share's sampling distribution is far from
# normal and its plug-in variance unreliable (0 errors: a variance of 0).
MIN_EVENTS = 10


class GuardrailReading(NamedTuple):
    """A guardrail's interval and how it was read: a share's here (read_share), a quantile's in
    stats.sequential.guardrails.check_guardrail."""

    interval: SequentialInterval
    inference: str
    note: str | None = None
    variance_reduction: float | None = None
    covariates: tuple[str, ...] = ()


def _clip(iv: SequentialInterval, low: float, high: float) -> SequentialInterval:
    """A share's bounds within its range (the truth is in it, so clipping costs no coverage)."""
    lo = None if iv.lo is None else min(max(iv.lo, low), high)
    hi = None if iv.hi is None else min(max(iv.hi, low), high)
    return dataclasses.replace(iv, lo=lo, hi=hi)


def _exact_difference(
    g: Guardrail, control: ArmSnapshot, candidate: ArmSnapshot, alpha: float, prior: tuple[float, float]
) -> SequentialInterval:
    """The beta-binomial sequence of the difference: per-arm sequences at alpha/2."""
    key = SHARES[g.metric]
    cand = MeanSequence(candidate.n, getattr(candidate, key), alpha, prior)
    ctrl = MeanSequence(control.n, getattr(control, key), alpha, prior)
    return difference_interval(ctrl, cand, alpha)


# What a share's 0/1 value is called, for the notes: (value 1, value 0).
OUTCOMES = {
    ATTAINMENT: ("hits", "misses"),
    ERROR_RATE: ("errors", "successes"),
    IDENTICAL_ANSWERS: ("identical answers", "different ones"),
}


def _too_few(metric: str, arms: Sequence[tuple[str, PerUser | Shadows]], min_clusters: int) -> str | None:
    """Why the clustered sequence may not read this look yet (None: it may)."""
    why = []
    for label, u in arms:
        events = u.events(metric)
        others = u.requests - events
        if u.users < min_clusters:
            why.append(f"{label} has {u.users} users of the {min_clusters}")
        elif min(events, others) < MIN_EVENTS:
            what = OUTCOMES[metric]
            why.append(f"{label} has {events} {what[0]} and {others} {what[1]}, not {MIN_EVENTS} of each")
    if not why:
        return None
    return (
        "too few for the user-clustered sequence (" + "; ".join(why) + "): the exact sequence reads this look"
    )


def _adjusted(
    metric: str, control: PerUser, candidate: PerUser, alpha: float, target_n: float, min_clusters: int
) -> GuardrailReading | None:
    """The adjusted difference on the covariates that vary: all of them, else the first one
    that does alone (a replay that asks every request for the same max_tokens); None when none
    does."""
    p = len(control.covariates)
    if control.covariates != candidate.covariates or p == 0:
        return None
    for keep in [tuple(range(p))] + ([(k,) for k in range(p)] if p > 1 else []):
        c, v = control.adjusted_source(metric, keep), candidate.adjusted_source(metric, keep)
        try:
            look = adjusted_difference_look(c, v, alpha, target_n, min_clusters)
        except ValueError:  # constant or collinear over this step's requests
            continue
        left = [name for i, name in enumerate(control.covariates) if i not in keep]
        note = f"{', '.join(left)} constant or collinear in this step: left out" if left else None
        iv = _clip(look.interval, -1.0, 1.0)
        return GuardrailReading(iv, ADJUSTED, note, look.variance_reduction, c.covariates or ())
    return None


NO_USERS = "no per-user aggregates in this reading: requests read as independent draws"


def _one_arm(
    metric: str,
    n: int,
    events: int,
    per_user: PerUser | Shadows | None,
    alpha: float,
    prior: tuple[float, float],
    min_clusters: int,
    target_n: float,
) -> GuardrailReading:
    """One arm's share (``events`` of ``n``) against a fixed limit: the clustered sequence of its
    ratio mean when ``per_user`` is given and has enough users and events (at CLUSTERED_SHARE of
    alpha, the exact sequence at the rest reading the looks before that), else the exact one."""
    if per_user is None:  # the whole guardrail alpha to the exact sequence
        return GuardrailReading(MeanSequence(n, events, alpha, prior).interval(), REQUESTS, NO_USERS)
    short = _too_few(metric, [("candidate", per_user)], min_clusters)
    if short is not None:
        iv = MeanSequence(n, events, alpha * (1.0 - CLUSTERED_SHARE), prior).interval()
        return GuardrailReading(iv, REQUESTS, short)
    source = per_user.clustered_source(metric)
    iv = clustered_mean_sequence(source, alpha * CLUSTERED_SHARE, target_n, min_clusters)
    return GuardrailReading(_clip(iv, 0.0, 1.0), CLUSTERED)


def read_share(
    g: Guardrail,
    control: ArmSnapshot,
    candidate: ArmSnapshot,
    alpha: float,
    prior: tuple[float, float],
    adjust: bool,
    min_clusters: int,
    target_n: float,
) -> GuardrailReading:
    """Attainment, error rate or identical answers: clustered (and adjusted) when the arms carry
    per-user aggregates and enough users, else the exact sequence (this module's docstring)."""
    if g.metric == IDENTICAL_ANSWERS:
        shadows = candidate.shadows
        if shadows is None:
            raise ValueError(
                "check_guardrail: identical_answers needs the candidate's shadowed requests "
                "(ArmSnapshot.shadows); it has none"
            )
        per_user = shadows if shadows.by_user else None
        return _one_arm(
            g.metric, shadows.ok, shadows.identical, per_user, alpha, prior, min_clusters, target_n
        )
    if not g.over_control:
        events = getattr(candidate, SHARES[g.metric])
        return _one_arm(
            g.metric, candidate.n, events, candidate.per_user, alpha, prior, min_clusters, target_n
        )
    sums: list[tuple[str, PerUser]] = []
    for label, arm in (("control", control), ("candidate", candidate)):
        if arm.per_user is None:  # the whole guardrail alpha to the exact sequence, as always
            return GuardrailReading(
                _exact_difference(g, control, candidate, alpha, prior), REQUESTS, NO_USERS
            )
        sums.append((label, arm.per_user))
    if len({type(u) for _label, u in sums}) > 1:
        raise TypeError(
            "check_guardrail: the arms' per-user aggregates must be of one kind (UserSums or UserMoments)"
        )
    short = _too_few(g.metric, sums, min_clusters)
    if short is not None:
        iv = _exact_difference(g, control, candidate, alpha * (1.0 - CLUSTERED_SHARE), prior)
        return GuardrailReading(iv, REQUESTS, short)
    a = alpha * CLUSTERED_SHARE
    cand, ctrl = sums[1][1], sums[0][1]
    note = "adjustment off (the experiment's analysis.adjust)"
    if adjust:
        read = _adjusted(g.metric, ctrl, cand, a, target_n, min_clusters)
        if read is not None:
            return read
        note = "no pre-request covariate varies in this step: not adjusted"
    iv = clustered_difference_sequence(
        ctrl.clustered_source(g.metric), cand.clustered_source(g.metric), a, target_n, min_clusters
    )
    return GuardrailReading(_clip(iv, -1.0, 1.0), CLUSTERED, note)
