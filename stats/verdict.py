"""Verdict against the SLA target, and the sample size needed to reach one."""

from __future__ import annotations

import dataclasses

from stats._common import DEFAULT_CONF, AsDict, check_counts, z_of
from stats.proportions import Interval, wilson_centre_half, wilson_interval


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict(AsDict):
    verdict: str  # "meets" | "misses" | "not enough data"
    target: float
    attainment: Interval | None
    n: int
    n_needed: int | None  # total samples needed to decide, when not enough data
    message: str


MEETS, MISSES, NOT_ENOUGH = "meets", "misses", "not enough data"


def _wilson_excludes(p: float, n: int, target: float, z: float) -> bool:
    centre, half = wilson_centre_half(p, n, z)
    return centre - half >= target if p >= target else centre + half < target


def sample_size_to_decide(p: float, target: float, conf: float = DEFAULT_CONF) -> int | None:
    """Smallest n at which a Wilson interval around an observed share ``p`` excludes ``target``.

    None when p == target: no sample size can separate an estimate from itself.
    """
    if not (0 <= p <= 1 and 0 < target < 1):
        raise ValueError(f"sample_size_to_decide: need 0<=p<=1 and 0<target<1, got {p}, {target}")
    if p == target:
        return None
    z = z_of(conf)
    hi = 1
    while not _wilson_excludes(p, hi, target, z):
        hi *= 2
        if hi > 1 << 62:
            return None
    lo = hi // 2
    while lo + 1 < hi:  # invariant: lo does not exclude (or is 0), hi does
        mid = (lo + hi) // 2
        if _wilson_excludes(p, mid, target, z):
            hi = mid
        else:
            lo = mid
    return hi


def sla_verdict(hits: int, n: int, target: float, conf: float = DEFAULT_CONF) -> Verdict:
    """Meets when the whole Wilson interval is >= target, misses when it is below, else undecided.

    The sample size needed assumes the observed attainment stays where it is: the interval
    width shrinks like 1/sqrt(n) until it no longer straddles the target.
    """
    check_counts(hits, n, "sla_verdict")
    if not (0 < target < 1):
        raise ValueError(f"sla_verdict: target must be a share strictly in (0, 1), got {target}")
    if n == 0:
        return Verdict(NOT_ENOUGH, target, None, 0, None, "no samples yet")
    ci = wilson_interval(hits, n, conf)
    if ci.lo >= target:
        return Verdict(
            MEETS,
            target,
            ci,
            n,
            None,
            f"attainment {ci.estimate:.2%} (CI {ci.lo:.2%}-{ci.hi:.2%}) meets {target:.2%}",
        )
    if ci.hi < target:
        return Verdict(
            MISSES,
            target,
            ci,
            n,
            None,
            f"attainment {ci.estimate:.2%} (CI {ci.lo:.2%}-{ci.hi:.2%}) misses {target:.2%}",
        )
    need = sample_size_to_decide(ci.estimate, target, conf)
    if need is None:
        msg = f"attainment {ci.estimate:.2%} equals the target; more data will not decide it"
    else:
        msg = (
            f"CI {ci.lo:.2%}-{ci.hi:.2%} straddles {target:.2%}; about {need} samples "
            f"({max(need - n, 1)} more) needed if attainment stays at {ci.estimate:.2%}"
        )
        need = max(need, n + 1)
    return Verdict(NOT_ENOUGH, target, ci, n, need, msg)
