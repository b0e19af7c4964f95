"""analysis.sql.run_conditions: the one reading of a filter's runs, shared by the samples'
queries and the server metrics' (an empty choice of runs reads nothing, not everything)."""

from __future__ import annotations

from analysis import server_metrics
from analysis.definitions import Filters
from analysis.sql import run_conditions


def test_one_run_a_set_of_runs_no_run_and_no_restriction():
    params: dict = {}
    assert run_conditions(Filters("e", run_id=3), params) == ["run_id = %(run_id)s"] and params == {
        "run_id": 3
    }
    params = {}
    assert run_conditions(Filters("e", runs=(1, 2)), params) == ["run_id IN %(runs)s"]
    assert params == {"runs": (1, 2)}
    assert run_conditions(Filters("e", runs=()), {}) == ["run_id != run_id"]  # no empty IN list
    assert run_conditions(Filters("e"), {}) == []


def test_the_server_metrics_read_the_runs_alike():
    where, params = server_metrics._where(Filters("e", runs=()), ())
    assert "run_id != run_id" in where and "runs" not in params
    where, params = server_metrics._where(Filters("e", run_id=7), ())
    assert "run_id = %(run_id)s" in where and params["run_id"] == 7
