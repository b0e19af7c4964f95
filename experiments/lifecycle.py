"""Experiment lifecycle: which status may follow which. Pure."""

from __future__ import annotations

DRAFT, RUNNING, PAUSED, CONCLUDED = "draft", "running", "paused", "concluded"
STATUSES = (DRAFT, RUNNING, PAUSED, CONCLUDED)

# action -> (statuses it may start from, status it leads to)
ACTIONS: dict[str, tuple[frozenset[str], str]] = {
    "start": (frozenset({DRAFT}), RUNNING),
    "pause": (frozenset({RUNNING}), PAUSED),
    "resume": (frozenset({PAUSED}), RUNNING),
    "conclude": (frozenset({RUNNING, PAUSED}), CONCLUDED),
}


class TransitionError(ValueError):
    pass


def target_of(action: str, current: str) -> str:
    """The status ``action`` leads to from ``current``, or a TransitionError saying why not."""
    if action not in ACTIONS:
        raise TransitionError(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
    sources, target = ACTIONS[action]
    if current not in sources:
        raise TransitionError(
            f"cannot {action} an experiment that is {current}; "
            f"{action} applies to: {', '.join(sorted(sources))}"
        )
    return target


def allowed_actions(current: str) -> list[str]:
    return [a for a, (sources, _) in ACTIONS.items() if current in sources]
