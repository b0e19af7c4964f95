"""Setup errors in a rollout step: does the candidate refuse, as configured, requests the
control serves (``setup_error_check``)?

Setup errors (a 4xx but 408 and 429: an unknown model, auth, a bad request) are no measure of
the serving change: an arm's reading keeps them apart (``ArmSnapshot.setup_errors``) and no
guardrail reads them. stats.sequential.guardrails.decide halts the step for a person when this
check flags the candidate (never a rollback, never a promotion).
"""

from __future__ import annotations

import dataclasses

from stats._common import AsDict
from stats.sequential._base import DEFAULT_ALPHA, SequentialInterval
from stats.sequential.arm_snapshot import ArmSnapshot
from stats.sequential.means import MeanSequence, difference_interval


@dataclasses.dataclass(frozen=True, slots=True)
class SetupErrorCheck(AsDict):
    """The candidate's setup errors against the control's (``setup_error_check``)."""

    control: int  # setup errors
    candidate: int
    control_share: float | None  # of the requests the arm answered (judged + setup errors)
    candidate_share: float | None
    interval: SequentialInterval  # candidate - control share, anytime-valid at alpha
    flagged: bool  # the candidate's share is shown above the control's
    message: str


def setup_error_check(
    control: ArmSnapshot, candidate: ArmSnapshot, alpha: float = DEFAULT_ALPHA
) -> SetupErrorCheck:
    """Does the candidate refuse, as configured, requests the control serves?

    The share of setup errors among the requests each arm answered, candidate - control, through
    the exact per-arm sequences at alpha/2 (stats.sequential.means.difference_interval):
    flagged when its lower bound is above 0, at any look. Both arms get the same clients (the
    router assigns users at random), so a client's bad requests fall on both alike and a few of
    them on one arm move no bound; a candidate answering every request 401 while the control
    serves them is flagged within its first requests."""
    c = MeanSequence(n=control.n + control.setup_errors, hits=control.setup_errors, alpha=alpha)
    v = MeanSequence(n=candidate.n + candidate.setup_errors, hits=candidate.setup_errors, alpha=alpha)
    iv = difference_interval(c, v, alpha)
    flagged = candidate.setup_errors > 0 and iv.lo is not None and iv.lo > 0
    share_c = c.hits / c.n if c.n else None
    share_v = v.hits / v.n if v.n else None
    message = ""
    if flagged:
        message = (
            f"the candidate answered {v.hits} of {v.n} requests ({share_v:.1%}) with a setup error "
            f"(a 4xx but 408 and 429), the control {c.hits} of {c.n}: it refuses, as configured, "
            "requests the control serves; check its model name, auth and request format"
        )
    return SetupErrorCheck(c.hits, v.hits, share_c, share_v, iv, flagged, message)
