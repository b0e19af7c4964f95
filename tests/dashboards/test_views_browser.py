# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The dashboard and the experiment admin in headless Chromium, on real report data (split and
mirror replays, live traffic): the answer comes first, every chart has data or a sentence saying
why not, nothing overlaps or is cut at 1400 and at 1000 px, and the page logs no error.

Each page is loaded once and checked at both widths (the charts follow the window's size)."""

from __future__ import annotations

import pytest

from samples.factory import _cache as store_cache
from tests.analysis.fixtures_report import loaded_stores, mirror_data, server_url_for, split_data  # noqa: F401
from tests.browser import ARTIFACTS, NARROW, SETTLED, WIDE, at_widths, launch, log_in, watch_errors
from tests.dashboards.test_live_source import LIVE_RUN, T0, load

# The method tables the other tests and analysts read by id: on the page, folded.
FOLDED_IDS = (
    "fixed-horizon-table",
    "per-user",
    "per-user-means",
    "adjusted-differences",
    "anytime",
    "anytime-intervals",
    "percentiles",
    "itl-note",
)


def check_dashboard(page, base: str, key: str, query: str, shot: str) -> dict:
    """Load one experiment's dashboard once and check it against its report; returns the report."""
    report = page.request.get(f"{base}/api/experiments/{key}/report{query}").json()
    page.goto(f"{base}/dashboards/{key}/{query}")
    page.wait_for_function(SETTLED, timeout=60_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
    assert at_widths(page) == {WIDE: [], NARROW: []}, key

    # 1. The answer first: the page's first section, under the banners; a verdict per variant
    # as the report says, its attainment and difference to the control drawn with their intervals.
    order = page.evaluate(
        """() => [...document.querySelectorAll('h2, .banner, details.method')].map(e =>
             e.classList.contains('banner') ? 'banner' : e.tagName === 'DETAILS' ? 'method' : e.textContent.trim())"""
    )
    first = [x for x in order if x != "banner"][0]
    assert first == "Does each variant meet the SLA?", order
    assert order.index(first) == len(report["banners"]), order  # the banners, then the answer
    assert order.index("Why") == order.index(first) + 1, order  # the why right under it
    assert order.index("method") > order.index("Method and detail") > order.index("Why"), order
    verdicts = page.eval_on_selector_all(
        "#verdicts tr[data-variant]",
        "rows => rows.map(r => [r.dataset.variant, r.querySelector('td.verdict').textContent.trim()])",
    )
    assert verdicts == [[e["key"], e["verdict"]["verdict"]] for e in report["variants"]]
    forest = page.evaluate("() => document.getElementById('chart-attainment').data")
    assert forest[0]["x"] == pytest.approx([e["attainment"]["estimate"] * 100 for e in report["variants"]])
    compared = [e for e in report["variants"] if e["vs_control"]]
    assert forest[1]["x"] == pytest.approx(
        [e["vs_control"]["attainment_difference"]["estimate"] * 100 for e in compared]
    )
    assert forest[1]["error_x"]["array"] == pytest.approx(
        [
            (
                e["vs_control"]["attainment_difference"]["hi"]
                - e["vs_control"]["attainment_difference"]["estimate"]
            )
            * 100
            for e in compared
        ]
    )
    inference = page.text_content("#inference")
    assert "fixed-horizon" in inference and "the ones the verdict reads" in inference

    # 2. Why: a waterfall per variant, left to right, ending at the variant's total.
    for v, entry in report["attribution"]["attainment"].items():
        [trace] = page.evaluate(f"() => document.getElementById('chart-attribution-{v}').data")
        assert trace["type"] == "waterfall" and trace["measure"][-1] == "total"
        assert set(trace["measure"][:-1]) == {"relative"} and trace["x"][-1] == "total difference"
        assert trace["y"][-1] == pytest.approx(entry["total"] * 100)
        assert sum(trace["y"][:-1]) == pytest.approx(trace["y"][-1])
        assert [x.split("<br>")[0] for x in trace["x"][: len(entry["contributions"])]] == list(
            entry["contributions"]
        )

    # 3. The method tables are on the page with their ids, folded (mirror mode has no adjusted
    # differences: the arms share their users).
    not_folded = page.evaluate(
        "ids => ids.filter(id => !document.getElementById(id)?.closest('details:not([open])'))",
        list(FOLDED_IDS),
    )
    assert not_folded == (["adjusted-differences"] if report["runs"]["mode"] == "mirror" else [])
    return report


def empty_sentence(page, chart: str) -> str | None:
    return page.evaluate(f"() => document.querySelector('#chart-{chart} .empty-chart')?.textContent")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True, serialized_rollback=True)
@pytest.mark.engine
def test_split_and_mirror_dashboards_and_the_admin_read_cleanly(
    live_server, settings, loaded_stores, users, experiment, document
):
    from playwright.sync_api import sync_playwright

    from experiments.services import apply_document

    apply_document({**document, "key": "ttft-mirror"}, actor=users["product"])
    settings.CLICKHOUSE_URL = server_url_for(loaded_stores["server"].database)
    store_cache.clear()
    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": WIDE, "height": 1000})
            watch_errors(page, errors)
            log_in(page, live_server.url, "root", "/dashboards/ttft-opt/")

            split = check_dashboard(page, live_server.url, "ttft-opt", "", "dashboard-split.png")
            assert split["runs"]["mode"] == "split" and empty_sentence(page, "srm") is None
            assert page.locator("#chart-cdf .scatterlayer .trace").count() == 3

            mirror = check_dashboard(page, live_server.url, "ttft-mirror", "", "dashboard-mirror.png")
            assert mirror["runs"]["mode"] == "mirror"
            # every variant sees every request: no split to check, and the page says so
            assert empty_sentence(page, "srm") == f"No traffic split to check: {mirror['srm']['note']}."

            # the experiment list keeps its last column inside the page at both widths, and so
            # does the change page
            page.goto(f"{live_server.url}/admin/experiments/experiment/")
            assert page.locator("#result_list th.column-dashboard").is_visible()
            assert at_widths(page) == {WIDE: [], NARROW: []}
            page.click("#result_list a:text('ttft-mirror')")
            page.wait_for_selector("#experiment_form")
            assert at_widths(page) == {WIDE: [], NARROW: []}
        finally:
            browser.close()
    store_cache.clear()
    assert errors == [], f"console errors: {errors}"


@pytest.mark.browser
@pytest.mark.django_db(transaction=True, serialized_rollback=True)
@pytest.mark.parametrize("sample_store", ["server"], indirect=True)
def test_the_live_dashboard_reads_cleanly(live_server, sample_store, users, experiment):
    from playwright.sync_api import sync_playwright

    load(sample_store, LIVE_RUN, "live", 1200, T0)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": WIDE, "height": 1000})
            watch_errors(page, errors)
            log_in(page, live_server.url, "ana", "/dashboards/ttft-opt/")
            live = check_dashboard(page, live_server.url, "ttft-opt", "?mode=live", "dashboard-live.png")
            assert live["runs"]["mode"] == "live" and sum(v["n"] for v in live["variants"]) == 1200
        finally:
            browser.close()
    assert errors == [], f"console errors: {errors}"
