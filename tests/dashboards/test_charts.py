# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The dashboard's charts and answer rows from a real report (the synthetic split replay): each
chart is a figure or the sentence saying why there is none, decided here and not in the page;
each variant's waterfall adds up to its total."""

from __future__ import annotations

import copy

import pytest

from analysis import definitions as q
from analysis import report as r
from dashboards import charts, summaries
from tests.analysis.fixtures_report import info, loaded_stores, mirror_data, split_data, split_spec  # noqa: F401


@pytest.fixture(scope="module")
def split_report(loaded_stores) -> dict:
    spec = split_spec()
    return r.build_report(loaded_stores["chdb"], info(spec), q.Filters(spec.experiment))


def by_id(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in charts.all_figures(report)}


def test_every_chart_draws_or_says_why_in_a_sentence(split_report):
    got = by_id(split_report)
    assert list(got)[0] == "attainment" and got["attainment"]["section"] == "answer"
    attributed = list(split_report["attribution"]["attainment"])
    assert attributed == ["awq", "awq-fa2"]
    assert [c for c in got if c.startswith("attribution")] == [f"attribution-{v}" for v in attributed]
    # no server metrics in these samples: those two charts say so; every other one has data
    without = {c["id"]: c["empty"] for c in got.values() if "empty" in c}
    assert set(without) == {"server", "phases-server"}
    why = split_report["phases"]["fp16"]["server_split"]["why"]
    assert without["phases-server"] == f"No split by the servers' own queue and prefill: {why}."
    assert all(c["figure"]["data"] for c in got.values() if "figure" in c)

    # mirror-like: no traffic split; nothing missed: no phases to split
    report = copy.deepcopy(split_report)
    report["srm"] = {"applicable": False, "note": "mirror mode: every request goes to every variant"}
    for p in report["phases"].values():
        p["phases"] = {}
    got = by_id(report)
    assert (
        got["srm"]["empty"] == "No traffic split to check: mirror mode: every request goes to every variant."
    )
    assert got["srm"]["title"] == "Did traffic split as the weights say?"
    assert got["phases"]["empty"].startswith("No request missed the SLA")
    assert by_id(split_report)["srm"]["title"].endswith(
        f"(SRM p={split_report['srm']['combined']['p_value']:.3g})"
    )


def test_each_variants_waterfall_reads_left_to_right_and_ends_at_its_total(split_report):
    report = copy.deepcopy(split_report)
    entry = report["attribution"]["attainment"]["awq-fa2"]
    # what no single factor explains gets its own bar before the total
    entry["residual"] = -0.01
    entry["total"] = sum(entry["contributions"].values()) + entry["residual"]
    [trace] = charts.attribution(report, "awq-fa2")["data"]
    factors = list(entry["contributions"])
    assert trace["x"] == [
        *(f"{f}<br>{entry['levels'][f]['control']} → {entry['levels'][f]['variant']}" for f in factors),
        "other<br>(interaction, rest)",
        "total difference",
    ]
    assert trace["measure"] == ["relative"] * (len(factors) + 1) + ["total"]
    assert trace["y"][-1] == pytest.approx(entry["total"] * 100)
    assert sum(trace["y"][:-1]) == pytest.approx(trace["y"][-1])
    assert trace["text"][-1] == f"{entry['total'] * 100:+.2f} pp"
    # a variant that differs in no factor has nothing to draw, and says so
    entry["contributions"], entry["note"] = {}, ""
    assert (
        charts.attribution(report, "awq-fa2")
        == "awq-fa2 differs from the control in no factor: nothing to attribute."
    )


def test_the_answer_rows_follow_the_report_and_read_setup_errors_when_present(split_report):
    answer = summaries.answer(split_report)
    assert [(a["variant"], a["verdict"]) for a in answer["rows"]] == [
        (e["key"], e["verdict"]["verdict"]) for e in split_report["variants"]
    ]
    fp16, awq = answer["rows"][0], answer["rows"][1]
    assert fp16["difference"] == "-" and fp16["control"]
    d = split_report["variants"][1]["vs_control"]["attainment_difference"]
    assert awq["difference"] == f"{d['estimate'] * 100:+.2f} pp [{d['lo'] * 100:+.2f}, {d['hi'] * 100:+.2f}]"
    assert answer["inference"].startswith("Intervals: 95% fixed-horizon, requests as independent draws")
    # the count as a number or as the report's {"n": ...} entry; absent: none shown
    report = copy.deepcopy(split_report)
    report["variants"][0].pop("setup_errors", None)
    report["variants"][1]["setup_errors"] = {"n": 4, "share": 0.001, "by_status": {}}
    report["variants"][2]["setup_errors"] = 3
    assert [a["setup_errors"] for a in summaries.answer(report)["rows"]] == [None, 4, 3]
