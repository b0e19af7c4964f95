"""ABPLAT_ROLLOUT_INTERVAL_S and ABPLAT_ROLLOUT_KEPT_LAG_S are read strictly, like every setting
(checked in this process on a dict: that a refused setting stops a process with one line is
tested in tests/foundation/test_settings.py)."""

import pytest

from abplat.config import settings_from
from tests.foundation.test_settings import refusal


@pytest.mark.parametrize("value", ["0", "soon", "-5"])
def test_a_bad_rollout_interval_stops_start_naming_the_variable(tmp_path, value):
    assert "ABPLAT_ROLLOUT_INTERVAL_S" in refusal(
        {"ABPLAT_ROLLOUT_INTERVAL_S": value, "ABPLAT_VAR": str(tmp_path)}
    )


def test_the_beat_schedule_runs_the_controller_every_interval():
    """Wiring only (the interval this process was configured with, the default 60 s);
    tests/rollouts/test_beat.py runs real beats at another interval."""
    from django.conf import settings

    from abplat.celery import app

    entry = app.conf.beat_schedule["rollouts"]
    assert entry["task"] == "rollouts.tasks.rollout_tick"
    assert float(entry["schedule"]) == float(settings.ROLLOUT_INTERVAL_S) == 60.0


@pytest.mark.parametrize("value", ["4", "3601", "2m", "-30"])
def test_a_kept_sums_lag_out_of_range_stops_start_naming_the_variable(tmp_path, value):
    message = refusal({"ABPLAT_ROLLOUT_KEPT_LAG_S": value, "ABPLAT_VAR": str(tmp_path)})
    assert "ABPLAT_ROLLOUT_KEPT_LAG_S" in message and repr(value) in message


def test_the_kept_sums_lag_defaults_to_the_kept_sums_own_and_takes_whole_seconds(tmp_path):
    from rollouts import kept

    assert settings_from({"ABPLAT_VAR": str(tmp_path)})["ROLLOUT_KEPT_LAG_S"] * 1000 == kept.KEEP_LAG_MS
    assert (
        settings_from({"ABPLAT_ROLLOUT_KEPT_LAG_S": "30", "ABPLAT_VAR": str(tmp_path)})["ROLLOUT_KEPT_LAG_S"]
        == 30
    )
