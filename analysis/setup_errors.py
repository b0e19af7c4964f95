"""Setup errors in the SLA report: a variant's "setup_errors" entry, the verdict of a variant
whose every request was one, and the banner naming what to check (docs/report-json.md).

A setup error (analysis.definitions.SETUP_ERROR) is a request the variant refused as configured
or called; it is left out of every figure of the report and counted apart here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from analysis.definitions import SETUP_CHECK_DEFAULT, SETUP_CHECKS

SETUP_NOTE = (
    "requests the variant answered with a setup error (a 4xx but 408 and 429: an unknown model, "
    "auth, a bad request): a measure of how it is configured or called, not of the serving change; "
    "left out of n, errors, error_rate, hits, attainment, percentiles, comparisons, segments, phases "
    "and attribution"
)
UNJUDGED = "cannot be judged"


def setup_errors_entry(by_status: Mapping[int, Mapping[str, Any]], judged: int) -> dict[str, Any]:
    """A variant's "setup_errors" (docs/report-json.md): how many, their share of every request
    it answered (judged + setup errors), and per HTTP status the count, one example message and
    what to check."""
    n = sum(int(e["n"]) for e in by_status.values())
    return {
        "n": n,
        "share": n / (n + judged) if n else 0.0,
        "by_status": {
            str(status): {
                "n": int(e["n"]),
                "example": e["example"],
                "check": SETUP_CHECKS.get(int(status), SETUP_CHECK_DEFAULT),
            }
            for status, e in sorted(by_status.items())
        },
        "note": SETUP_NOTE,
    }


def unjudged_verdict(setup: Mapping[str, Any], target: float) -> dict[str, Any]:
    """The verdict of a variant whose every request was a setup error: no request measured the
    serving, so there is no attainment to hold against the target (not a 0% "misses")."""
    statuses = ", ".join(f"{st} x{e['n']}" for st, e in setup["by_status"].items())
    return {
        "verdict": UNJUDGED,
        "target": target,
        "attainment": None,
        "n": 0,
        "n_needed": None,
        "message": (
            f"every request ({setup['n']}) was a setup error ({statuses}): nothing measured the "
            "serving; fix how the variant is configured or called, then read it again"
        ),
    }


def setup_banner(variant: str, control: bool, setup: Mapping[str, Any]) -> str:
    """One banner line per variant with setup errors: what, how many, what to check."""
    parts = []
    checks: list[str] = []
    for status, e in setup["by_status"].items():
        parts.append(f"{e['n']} x {status} (e.g. {e['example'][:120]!r})")
        checks += [] if e["check"] in checks else [e["check"]]
    who = f"control {variant}" if control else f"variant {variant}"
    return (
        f"Setup errors on {who}: {setup['n']} requests ({setup['share']:.1%} of those it answered) "
        f"refused as configured or called: {'; '.join(parts)}. Left out of its SLA figures and of every "
        f"comparison, never blamed on a factor. Check {'; '.join(checks)}"
    )
