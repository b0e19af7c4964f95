# ruff: noqa: F811 - pytest fixtures imported from fixtures_report are re-bound as arguments
"""The dashboard in headless Chromium: every chart renders with data, no console errors."""

from __future__ import annotations

import pytest

from samples.factory import _cache as store_cache
from tests.analysis.fixtures_report import loaded_stores, mirror_data, server_url_for, split_data  # noqa: F401
from tests.browser import ARTIFACTS, launch, watch_errors

CHARTS = ("attainment", "cdf", "percentiles", "p99-time", "attribution", "phases", "seg-prompt",
          "seg-inflight", "srm")  # fmt: skip


@pytest.mark.browser
@pytest.mark.django_db(transaction=True, serialized_rollback=True)
@pytest.mark.engine
def test_dashboard_renders_every_chart_in_chromium(live_server, settings, loaded_stores, users, experiment):
    from playwright.sync_api import sync_playwright

    settings.CLICKHOUSE_URL = server_url_for(loaded_stores["server"].database)
    store_cache.clear()
    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            watch_errors(page, errors)
            page.goto(f"{live_server.url}/admin/login/?next=/dashboards/ttft-opt/")
            page.fill("#id_username", "ana")
            page.fill("#id_password", "pw-ana")
            page.click("input[type=submit]")
            page.wait_for_url("**/dashboards/ttft-opt/", timeout=60_000)
            page.wait_for_function(
                f"document.querySelectorAll('[data-chart] .main-svg').length >= {len(CHARTS)}",
                timeout=60_000,
            )
            for chart in CHARTS:
                traces = page.evaluate(
                    "id => (document.getElementById('chart-' + id).data || []).length", chart
                )
                assert traces >= 1, f"chart {chart} has no traces"
                assert page.locator(f"#chart-{chart} .main-svg").count() >= 1, chart
            # the CDF really drew a line per variant
            assert page.locator("#chart-cdf .scatterlayer .trace").count() == 3
            assert "Verdict per variant" in page.content()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    store_cache.clear()
    assert errors == [], f"console errors: {errors}"
