import pytest

from experiments import lifecycle


@pytest.mark.parametrize(
    "action, current, target",
    [
        ("start", "draft", "running"),
        ("pause", "running", "paused"),
        ("resume", "paused", "running"),
        ("conclude", "running", "concluded"),
        ("conclude", "paused", "concluded"),
    ],
)
def test_allowed_transitions(action, current, target):
    assert lifecycle.target_of(action, current) == target


@pytest.mark.parametrize(
    "action, current",
    [
        ("start", "running"),
        ("pause", "draft"),
        ("resume", "running"),
        ("conclude", "draft"),
        ("start", "concluded"),
        ("resume", "concluded"),
        ("explode", "draft"),
    ],
)
def test_forbidden_transitions_say_why(action, current):
    with pytest.raises(lifecycle.TransitionError) as info:
        lifecycle.target_of(action, current)
    assert action in str(info.value)


def test_allowed_actions():
    assert lifecycle.allowed_actions("paused") == ["resume", "conclude"]
    assert lifecycle.allowed_actions("concluded") == []
