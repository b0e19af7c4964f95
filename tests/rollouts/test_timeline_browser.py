"""The rollout timeline, the rollout admin and every other admin list in headless Chromium,
from a real rollout that started and then rolled back on a breach: nothing overlaps or is cut at
1400 and 1000 px (tests/browser.layout_problems) and the pages log no error."""

from __future__ import annotations

import pytest

from rollouts import service
from tests.browser import ARTIFACTS, NARROW, WIDE, at_widths, launch, log_in, watch_errors
from tests.rollouts.conftest import insert_step
from tests.rollouts.test_service import KEY, started, stored_weights


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)  # the page reads no weights
@pytest.mark.engine
def test_the_rollout_timeline_and_every_admin_list_read_cleanly(
    live_server, weights_backend, ch_store, rollout_document, users
):
    from playwright.sync_api import sync_playwright

    started(rollout_document)
    service.look(KEY, interval_s=0)
    _, revision = stored_weights()
    insert_step(ch_store, KEY, revision, {"fp16": [100.0] * 270, "awq-fa2": [400.0] * 30})
    service.look(KEY, interval_s=0)  # the candidate breaches its guardrail: rolled back
    errors: list[str] = []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": WIDE, "height": 1000})
            watch_errors(page, errors)
            log_in(page, live_server.url, "root", f"/rollouts/{KEY}/")
            assert page.inner_text("#rollout-status") == "rolled_back"
            assert page.locator(".action-rollback").count() == 1 and page.locator(".breach").count() >= 1
            assert at_widths(page) == {WIDE: [], NARROW: []}
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "rollout-timeline.png"), full_page=True)
            page.goto(f"{live_server.url}/admin/rollouts/rolloutstate/")
            assert page.locator(f'a[href="/rollouts/{KEY}/"]').count() >= 1
            assert at_widths(page) == {WIDE: [], NARROW: []}
            page.locator("#result_list tbody tr th a, #result_list tbody tr td a").first.click()
            page.wait_for_load_state()
            assert "/change/" in page.url
            assert at_widths(page) == {WIDE: [], NARROW: []}
            # every other admin list, with what this rollout left in the database (experiments,
            # audit entries, weights): none cuts a column or overlaps its filter
            page.goto(f"{live_server.url}/admin/")
            lists = page.eval_on_selector_all(
                "#content-main th[scope=row] a", "links => links.map(a => a.href)"
            )
            assert len(lists) >= 8, lists
            changes = 0
            for url in lists:
                page.goto(url)
                assert at_widths(page) == {WIDE: [], NARROW: []}, url
                # and the change page of its first row, where the list has one
                rows = page.locator("#result_list tbody tr th a")
                if rows.count():
                    rows.first.click()
                    page.wait_for_load_state()
                    assert "/change/" in page.url, page.url
                    assert at_widths(page) == {WIDE: [], NARROW: []}, page.url
                    changes += 1
            assert changes >= 5, changes  # experiments, variants, audit entries, users, rollouts, ...
        finally:
            browser.close()
    assert errors == [], f"console errors: {errors}"
