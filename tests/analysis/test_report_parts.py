"""The SLA report's parts, called directly on small hand-made inputs: the keys build_report puts
together (analysis.report_sections, analysis.control_comparisons, analysis.setup_errors). The
whole report over real samples is tested in the other test_report_* modules."""

from __future__ import annotations

import pytest

from analysis import report
from analysis.control_comparisons import attribution, compare_with_control
from analysis.definitions import SETUP_CHECK_DEFAULT, SETUP_CHECKS, Slo
from analysis.experiment_info import ExperimentInfo, VariantInfo
from analysis.report_sections import (
    cdf_points,
    iso,
    mix_rate_entry,
    mode_counts,
    runs_entry,
    srm_entry,
    srm_parts,
    values_from_histogram,
)
from analysis.setup_errors import UNJUDGED, setup_banner, setup_errors_entry, unjudged_verdict


def experiment(**over) -> ExperimentInfo:
    return ExperimentInfo(
        key="e",
        name="e",
        slo=Slo(200.0),
        target=0.9,
        variants=[VariantInfo("a", True, 50, {"q": "none"}), VariantInfo("b", False, 50, {"q": "awq"})],
        **over,
    )


def test_the_report_module_still_offers_its_input_and_verdict_names():
    assert report.ExperimentInfo is ExperimentInfo and report.VariantInfo is VariantInfo
    assert report.UNJUDGED == UNJUDGED == "cannot be judged"


def test_iso_writes_utc_with_a_z():
    assert iso(0) == "1970-01-01T00:00:00Z"
    assert iso(1.5) == "1970-01-01T00:00:01.500000Z"


def test_srm_parts_count_users_per_revision_with_that_revisions_weights():
    exp = experiment(weights_by_revision={2: {"a": 90, "b": 10}})
    counts = [
        {"rev": 1, "variant": "a", "n": 5},
        {"rev": 1, "variant": "b", "n": 7},
        {"rev": 1, "variant": "a", "n": 1},
        {"rev": 2, "variant": "b", "n": 3},
        {"rev": 2, "variant": "c", "n": 99},  # not read: left out
    ]
    assert srm_parts(exp, counts, ["a", "b"]) == [
        ("1", {"a": 6, "b": 7}, {"a": 50.0, "b": 50.0}),
        ("2", {"b": 3}, {"a": 90.0, "b": 10.0}),
    ]
    # a variant filter reads only some variants: only their weights are compared
    assert srm_parts(exp, counts, ["a"]) == [("1", {"a": 6}, {"a": 50.0})]


@pytest.mark.parametrize(
    "parts, modes, note",
    [
        ([("1", {"a": 1, "b": 1}, {"a": 50.0, "b": 50.0})], {"mirror": 4}, "mirror mode"),
        ([], {"live": 3}, "no live request was assigned by the router"),
        ([], {"split": 3}, "no samples"),
    ],
)
def test_srm_is_not_applicable_without_a_split_to_check(parts, modes, note):
    entry = srm_entry(experiment(), parts, modes)
    assert entry["applicable"] is False and entry["flagged"] is False and note in entry["note"]
    assert entry["weights_source"] == experiment().weights_source


def test_srm_flags_a_split_far_from_the_weights():
    entry = srm_entry(experiment(), [("1", {"a": 1000, "b": 500}, {"a": 50.0, "b": 50.0})], {"split": 1500})
    assert entry["applicable"] is True and entry["flagged"] is True and entry["message"]


def test_nothing_is_compared_without_the_control():
    exp = experiment()
    summ = {"b": {"n": 10, "hits": 9, "metric_n": {"ttft_ms": 10}}}
    assert compare_with_control(exp, summ, ["b"], None, {}, {}) == {}
    assert mix_rate_entry({}, "a", ["b"]) == {}
    by_key = {"b": {"n": 10, "factors": {"q": "awq"}}}
    assert attribution(exp, by_key, ["b"])["note"] == (
        "needs the control and at least one other variant with samples"
    )


def test_runs_entry_without_a_catalog_selection_says_the_caller_chose():
    entry = runs_entry(None, {"split": 3})
    assert entry.pop("mode_source") == "caller" and entry.pop("mode") is None
    assert entry.pop("available_modes") == {}
    assert entry == dict.fromkeys(("read", "not_read", "statuses", "notes"), [])


def test_modes_cdf_and_rank_test_input_come_from_the_summary_and_histogram():
    summ = {"a": {"modes": {"split": 3, "mirror": 0}}, "b": {"modes": {"split": 2, "live": 1}}}
    assert mode_counts(summ) == {"split": 5, "live": 1}
    # TTFT keys in 0.1 ms, counts, and each bucket's largest value
    hist = {"a": ([10, 20, 30], [1, 2, 1], [1.0, 2.0, 3.0]), "empty": ([], [], [])}
    points = cdf_points(hist, levels=(0.25, 0.5, 0.75, 1.0))
    assert points == {"a": {"ttft_ms": [1.0, 2.0, 3.0], "share": [0.25, 0.75, 1.0]}}
    assert values_from_histogram(hist) == {"a": ([1.0, 2.0, 3.0], [1, 2, 1]), "empty": ([], [])}


def test_setup_errors_entry_verdict_and_banner():
    entry = setup_errors_entry({404: {"n": 3, "example": "no such model"}, 599: {"n": 1, "example": "x"}}, 4)
    assert entry["n"] == 4 and entry["share"] == 0.5
    assert entry["by_status"]["404"] == {"n": 3, "example": "no such model", "check": SETUP_CHECKS[404]}
    assert entry["by_status"]["599"]["check"] == SETUP_CHECK_DEFAULT
    assert setup_errors_entry({}, 10)["share"] == 0.0
    verdict = unjudged_verdict(entry, 0.9)
    assert verdict["verdict"] == UNJUDGED and verdict["attainment"] is None and verdict["n"] == 0
    assert "every request (4) was a setup error (404 x3, 599 x1)" in verdict["message"]
    banner = setup_banner("b", False, entry)
    assert banner.startswith("Setup errors on variant b: 4 requests (50.0% of those it answered)")
    assert f"Check {SETUP_CHECKS[404]}; {SETUP_CHECK_DEFAULT}" in banner
    assert setup_banner("a", True, entry).startswith("Setup errors on control a:")
