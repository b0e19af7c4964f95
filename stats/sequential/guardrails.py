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

Inference, per guardrail (``GuardrailCheck.inference``):

- ``user-clustered`` / ``user-clustered, adjusted``: attainment and error rate when the arms
  carry per-user aggregates (``ArmSnapshot.per_user``: a row per user, UserSums, or those rows
  reduced over the users in the store, UserMoments; the experiment's
  ``analysis.cluster_by_user``). The router randomizes users and a user's requests are alike,
  so the independent unit is the user: the candidate's value through the normal-mixture
  sequence of its ratio mean with the user-clustered variance
  (stats.sequential.adjusted.clustered_mean_sequence), a difference to the control through the
  same boundary on the difference, regression-adjusted on the pre-request covariates the
  aggregates carry (prompt_tokens, max_tokens) unless ``adjust`` is off
  (adjusted_difference_look; a covariate constant over the step is left out, ``covariates``
  names those used, ``variance_reduction`` what they bought). Asymptotic: these need
  ``min_clusters`` users and ``MIN_EVENTS`` requests of each outcome in every arm they read;
  before that a look reads the exact sequence below.
- ``requests``: the beta-binomial mixture sequence of stats.sequential.means, exact for
  independent requests. Used for attainment and error rate when the reading has no per-user
  aggregates, and in a clustered reading for the looks with too few users or events
  (``inference_note`` says which arm).
- ``order statistics``: quantile guardrails, always. Per request (not clustered) and not
  adjusted: subtracting a covariate term leaves a mean where it is but moves a quantile to
  another quantity (stats.adjusted).

The guarantee, per rollout step (one config revision, counts from that step only): with k
guardrails at overall ``alpha``, each gets a = alpha/k. Without per-user aggregates it is read
through one sequence at a (a difference through per-arm sequences at a/2). With them, attainment
and error rate hold two sequences: the clustered one at ``CLUSTERED_SHARE`` * a and the exact
one at the rest; each look reads one of them, and a false breach at any look needs one of the two
to miss the truth at some look, so the union bound gives a again. With probability >= 1 - alpha
every sequence holds at every look of the step at once, so

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
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from stats._common import AsDict
from stats.adjusted import ArmData
from stats.clustered import ArmMoments, ClusterSums
from stats.sequential._base import DEFAULT_ALPHA, DEFAULT_PRIOR, SequentialInterval, check_alpha
from stats.sequential.adjusted import (
    DEFAULT_MIN_CLUSTERS,
    DEFAULT_TARGET_N,
    adjusted_difference_look,
    clustered_difference_sequence,
    clustered_mean_sequence,
)
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
# GuardrailCheck.inference
REQUESTS, CLUSTERED, ADJUSTED = "requests", "user-clustered", "user-clustered, adjusted"
ORDER_STATISTICS = "order statistics"

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


SHARES = {ATTAINMENT: "hits", ERROR_RATE: "errors"}  # the per-request 0/1 value of each share


def _int_array(x: Any, where: str, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.number)) or arr.dtype == bool:
        raise ValueError(f"{where}: {name} must be one count per user, got {arr.dtype} of shape {arr.shape}")
    if arr.size and (not np.isfinite(arr).all() or (arr != np.floor(arr)).any() or arr.min() < 0):
        raise ValueError(f"{where}: {name} must be whole counts >= 0")
    return arr.astype(np.int64)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class UserSums:
    """One arm's per-user aggregates in the step: ``GROUP BY user`` (a request without a user is a
    user of its own) of the requests, SLA hits and errors, and for the regression adjustment the
    per-user sums of the pre-request covariates (``covariates``: their names), of their products,
    and of their products with hits and with errors. Exactly what stats.clustered.ClusterSums
    and stats.adjusted.ArmData need, for either share."""

    n: np.ndarray  # (G,) requests
    hits: np.ndarray  # (G,)
    errors: np.ndarray  # (G,)
    covariates: tuple[str, ...] = ()
    sum_x: np.ndarray | None = None  # (G, p)
    sum_xx: np.ndarray | None = None  # (G, p, p), symmetric
    sum_x_hits: np.ndarray | None = None  # (G, p)
    sum_x_errors: np.ndarray | None = None  # (G, p)

    def __post_init__(self) -> None:
        where = "UserSums"
        n = _int_array(self.n, where, "n")
        hits, errors = _int_array(self.hits, where, "hits"), _int_array(self.errors, where, "errors")
        if hits.shape != n.shape or errors.shape != n.shape:
            raise ValueError(f"{where}: n, hits and errors need one count per user each")
        if (hits + errors > n).any():
            raise ValueError(f"{where}: a user's hits + errors exceed their requests (errors are misses)")
        names = tuple(str(c) for c in self.covariates)
        g, p = n.size, len(names)
        arrays = {"sum_x": (g, p), "sum_xx": (g, p, p), "sum_x_hits": (g, p), "sum_x_errors": (g, p)}
        for name, shape in arrays.items():
            value = getattr(self, name)
            if value is None:
                if p:
                    raise ValueError(f"{where}: covariates {names} named but no {name} given")
                value = np.zeros(shape)
            value = np.asarray(value, dtype=float)
            if value.shape != shape:
                raise ValueError(f"{where}: {name} has shape {value.shape}, expected {shape}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "hits", hits)
        object.__setattr__(self, "errors", errors)
        object.__setattr__(self, "covariates", names)

    @property
    def users(self) -> int:
        return int((self.n > 0).sum())

    @property
    def requests(self) -> int:
        return int(self.n.sum())

    def events(self, metric: str) -> int:
        """Requests whose share value is 1 (attainment: hits; error_rate: errors)."""
        return int(self.values(metric).sum())

    def values(self, metric: str) -> np.ndarray:
        """Per-user sums of the share's 0/1 value (attainment: hits; error_rate: errors)."""
        return self.hits if SHARES[metric] == "hits" else self.errors

    def reduced(self) -> UserMoments:
        """These rows summed over the users, as a store returns them (UserMoments)."""
        if not self.n.sum():
            return UserMoments(self.covariates)
        shares = {}
        for metric in (ATTAINMENT, ERROR_RATE):
            xy = self.sum_x_hits if SHARES[metric] == "hits" else self.sum_x_errors
            shares[metric] = ArmMoments.from_clusters(
                self.n, self.values(metric), self.sum_x, self.sum_xx, xy, None, self.covariates, binary=True
            )
        return UserMoments(self.covariates, shares[ATTAINMENT], shares[ERROR_RATE])

    def clustered_source(self, metric: str) -> ClusterSums:
        """What the clustered sequences of the share take (``cluster_sums``)."""
        return self.cluster_sums(metric)

    def adjusted_source(self, metric: str, keep: Sequence[int]) -> ArmData:
        """What the adjusted sequence of the share takes (``arm_data``)."""
        return self.arm_data(metric, keep)

    def cluster_sums(self, metric: str) -> ClusterSums:
        return ClusterSums(self.n, self.values(metric).astype(float), binary=True)

    def arm_data(self, metric: str, keep: Sequence[int]) -> ArmData:
        """ArmData of the share adjusted on the covariates at positions ``keep``."""
        ix = list(keep)
        xy = self.sum_x_hits if SHARES[metric] == "hits" else self.sum_x_errors
        assert self.sum_x is not None and self.sum_xx is not None and xy is not None  # __post_init__
        y = self.values(metric).astype(float)
        return ArmData(
            n=self.n,
            sum_y=y,
            sum_x=self.sum_x[:, ix],
            sum_xx=self.sum_xx[:, ix][:, :, ix],
            sum_xy=xy[:, ix],
            sum_yy=y,  # a 0/1 value is its own square
            covariates=tuple(self.covariates[i] for i in ix),
        )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class UserMoments:
    """One arm's per-user aggregates in the step reduced over its users: what UserSums holds a
    row per user of, summed in the store instead (rollouts.readings reads one row per arm
    however many users there are). Per share, stats.clustered.ArmMoments of the per-user vector
    [n, y, x, xy, xx] (``moment_layout``) on the covariates ``covariates``, y the share's 0/1
    value: ``attainment`` (hits) and ``error_rate`` (errors). Every guardrail reads the same
    numbers from it as from the per-user rows, to rounding. Both None: no request in the step."""

    covariates: tuple[str, ...]
    attainment: ArmMoments | None = None
    error_rate: ArmMoments | None = None

    def __post_init__(self) -> None:
        where = "UserMoments"
        names = tuple(str(c) for c in self.covariates)
        arms = (self.attainment, self.error_rate)
        if (arms[0] is None) != (arms[1] is None):
            raise ValueError(f"{where}: attainment and error_rate moments come together (or neither)")
        if arms[0] is not None and arms[1] is not None:
            for metric, arm in zip((ATTAINMENT, ERROR_RATE), arms, strict=True):
                if not isinstance(arm, ArmMoments) or not arm.binary or arm.covariates != names:
                    raise ValueError(f"{where}: {metric} must be 0/1 ArmMoments on the covariates {names}")
            a, e = arms
            if (a.n, a.clusters, a.largest) != (e.n, e.clusters, e.largest):
                raise ValueError(f"{where}: attainment and error_rate moments are of different users")
            if a.total[1] + e.total[1] > a.n:
                raise ValueError(f"{where}: hits + errors exceed the requests (errors are misses)")
        object.__setattr__(self, "covariates", names)

    def _arm(self, metric: str) -> ArmMoments | None:
        return self.attainment if SHARES[metric] == "hits" else self.error_rate

    @property
    def users(self) -> int:
        return 0 if self.attainment is None else self.attainment.clusters

    @property
    def requests(self) -> int:
        return 0 if self.attainment is None else self.attainment.n

    def events(self, metric: str) -> int:
        """Requests whose share value is 1 (attainment: hits; error_rate: errors)."""
        arm = self._arm(metric)
        return 0 if arm is None else round(float(arm.total[1]))

    def _present(self, metric: str) -> ArmMoments:
        arm = self._arm(metric)
        if arm is None:
            raise ValueError(f"UserMoments: no request in this arm, no {metric} to read")
        return arm

    def clustered_source(self, metric: str) -> ArmMoments:
        """The share's moments without covariates: what the clustered sequences take."""
        return self._present(metric).select(())

    def adjusted_source(self, metric: str, keep: Sequence[int]) -> ArmMoments:
        """The share's moments on the covariates at positions ``keep``: the adjusted sequence's."""
        return self._present(metric).select([self.covariates[i] for i in keep])


PerUser = UserSums | UserMoments


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ArmSnapshot:
    """One arm's totals in the current step: requests, SLA hits (errors count as misses), errors,
    latency sources by name for quantile guardrails (e.g. {"ttft_ms": LatencyHistogram}), and
    optionally the per-user aggregates those totals add up from (``per_user``: attainment and
    error rate are then read with users as the independent unit)."""

    n: int
    hits: int
    errors: int
    latencies: Mapping[str, QuantileSource] = dataclasses.field(default_factory=dict)
    per_user: PerUser | None = None

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
        u = self.per_user
        if u is not None:
            if not isinstance(u, UserSums | UserMoments):
                raise ValueError(
                    f"ArmSnapshot: per_user must be UserSums or UserMoments, got {type(u).__name__}"
                )
            sums = (u.requests, u.events(ATTAINMENT), u.events(ERROR_RATE))
            if sums != (self.n, self.hits, self.errors):
                raise ValueError(
                    f"ArmSnapshot: the per-user aggregates add up to n, hits, errors = {sums}, "
                    f"not the totals {(self.n, self.hits, self.errors)}"
                )


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


class _Read(NamedTuple):
    """A share guardrail's interval and how it was read."""

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


def _exact(
    g: Guardrail, control: ArmSnapshot, candidate: ArmSnapshot, alpha: float, prior: tuple[float, float]
) -> SequentialInterval:
    """The beta-binomial sequence of the share (of the difference: per-arm sequences at alpha/2)."""
    key = SHARES[g.metric]
    cand = MeanSequence(candidate.n, getattr(candidate, key), alpha, prior)
    if not g.over_control:
        return cand.interval()
    ctrl = MeanSequence(control.n, getattr(control, key), alpha, prior)
    return difference_interval(ctrl, cand, alpha)


def _too_few(metric: str, arms: Sequence[tuple[str, PerUser]], min_clusters: int) -> str | None:
    """Why the clustered sequence may not read this look yet (None: it may)."""
    why = []
    for label, u in arms:
        events = u.events(metric)
        others = u.requests - events
        if u.users < min_clusters:
            why.append(f"{label} has {u.users} users of the {min_clusters}")
        elif min(events, others) < MIN_EVENTS:
            what = {ATTAINMENT: ("hits", "misses"), ERROR_RATE: ("errors", "successes")}[metric]
            why.append(f"{label} has {events} {what[0]} and {others} {what[1]}, not {MIN_EVENTS} of each")
    if not why:
        return None
    return (
        "too few for the user-clustered sequence (" + "; ".join(why) + "): the exact sequence reads this look"
    )


def _adjusted(
    metric: str, control: PerUser, candidate: PerUser, alpha: float, target_n: float, min_clusters: int
) -> _Read | None:
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
        return _Read(iv, ADJUSTED, note, look.variance_reduction, c.covariates or ())
    return None


def _share(
    g: Guardrail,
    control: ArmSnapshot,
    candidate: ArmSnapshot,
    alpha: float,
    prior: tuple[float, float],
    adjust: bool,
    min_clusters: int,
    target_n: float,
) -> _Read:
    """Attainment or error rate: clustered (and adjusted) when the arms carry per-user
    aggregates and enough users, else the exact sequence (module docstring)."""
    arms = (("control", control), ("candidate", candidate)) if g.over_control else (("candidate", candidate),)
    sums: list[tuple[str, PerUser]] = []
    for label, arm in arms:
        if arm.per_user is None:  # the whole guardrail alpha to the exact sequence, as always
            note = "no per-user aggregates in this reading: requests read as independent draws"
            return _Read(_exact(g, control, candidate, alpha, prior), REQUESTS, note)
        sums.append((label, arm.per_user))
    if len({type(u) for _label, u in sums}) > 1:
        raise TypeError(
            "check_guardrail: the arms' per-user aggregates must be of one kind (UserSums or UserMoments)"
        )
    short = _too_few(g.metric, sums, min_clusters)
    if short is not None:
        return _Read(_exact(g, control, candidate, alpha * (1.0 - CLUSTERED_SHARE), prior), REQUESTS, short)
    a = alpha * CLUSTERED_SHARE
    cand = sums[-1][1]
    if not g.over_control:
        iv = clustered_mean_sequence(cand.clustered_source(g.metric), a, target_n, min_clusters)
        return _Read(_clip(iv, 0.0, 1.0), CLUSTERED)
    ctrl = sums[0][1]
    note = "adjustment off (the experiment's analysis.adjust)"
    if adjust:
        read = _adjusted(g.metric, ctrl, cand, a, target_n, min_clusters)
        if read is not None:
            return read
        note = "no pre-request covariate varies in this step: not adjusted"
    iv = clustered_difference_sequence(
        ctrl.clustered_source(g.metric), cand.clustered_source(g.metric), a, target_n, min_clusters
    )
    return _Read(_clip(iv, -1.0, 1.0), CLUSTERED, note)


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
        read = _share(g, control, candidate, alpha, prior, adjust, min_clusters, target_n)
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
        read = _Read(iv, ORDER_STATISTICS, "a quantile: per request, not clustered, not adjusted")
    iv = read.interval
    status = _status(g.rule, g.threshold, iv)
    what = f"candidate - control {g.metric}" if g.over_control else f"candidate {g.metric}"
    limit = {AT_LEAST: ">=", AT_MOST: "<=", AT_LEAST_OVER: ">=", AT_MOST_OVER: "<="}[g.rule]
    how = read.inference
    if read.variance_reduction is not None:
        how += f" on {', '.join(read.covariates)}, variance {-read.variance_reduction:+.0%}"
    message = (
        f"{what} {_fmt(g.metric, iv.estimate) if iv.estimate is not None else 'n/a'} "
        f"(anytime {1 - iv.alpha:.4g} interval {_fmt(g.metric, iv.lo) if iv.lo is not None else '-inf'}"
        f" to {_fmt(g.metric, iv.hi)}, {how}), limit {limit} {_fmt(g.metric, g.threshold)}: "
        + {BREACH: "breached", OK: "holds", UNCLEAR: "not decided yet"}[status]
    )
    return GuardrailCheck(
        g.metric, g.rule, g.threshold, status, iv, message,
        read.inference, read.note, read.variance_reduction, read.covariates,
    )  # fmt: skip


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
       arms are not what the weights say, so no guardrail can be trusted.
    2. breach: any guardrail breached with confidence (at any look, no minimum).
    3. undecided: an arm has fewer than ``min_samples`` or the step is younger than
       ``min_duration_s``.
    4. pass: with promote_on="no_breach" (the rollout default: promote unless harm is shown),
       once the minimums are met; with "all_confirmed", only when every guardrail is shown to
       hold (a stronger claim that needs much more traffic), else undecided.

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
