"""On the web and the command line, live traffic (mode live, the gateway's runs) is a
source the analyst sees listed beside the replays and picks by mode."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from django.core.management import call_command

from samples import synthetic

pytestmark = pytest.mark.django_db

LIVE_RUN = 10**12 + 1  # gateway.models.LIVE_RUN_ID_BASE + the LiveRun's pk
T0 = synthetic.DEFAULT_START_MS


def load(store, run_id: int, mode: str, n: int, start_ms: float) -> None:
    """n requests; a live run is split by the weights as the gateway's traffic is, its rows
    saying mode live."""
    spec = synthetic.SyntheticSpec(
        mode="split",
        n=n,
        seed=run_id % 10_000,
        run_id=run_id,
        duration_s=60.0,
        variants=synthetic.demo_variants(),
        start_unix_ms=start_ms,
    )
    columns = synthetic.generate(spec).columns
    columns["mode"] = np.full(len(columns["mode"]), mode, dtype=object)
    store.insert_columns(columns)


@pytest.fixture
def replay_and_live(sample_store, experiment):
    load(sample_store, 1, "split", 300, T0)
    sample_store.record_run(1, "ttft-opt", "split", "done")
    load(sample_store, LIVE_RUN, "live", 200, T0 + 120_000)  # newer; no catalog row
    return sample_store


def total(doc) -> int:
    return sum(v["n"] for v in doc["variants"])


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html))


def test_the_page_lists_live_beside_the_replays_and_reads_each_by_mode(client, users, replay_and_live):
    client.force_login(users["analyst"])
    html = client.get("/dashboards/ttft-opt/").content.decode()
    assert '<option value="live" >live</option>' in html  # the mode choice
    page = text(html)
    assert f"Runs read: {LIVE_RUN} (live) · mode live (the latest completed run ({LIVE_RUN}))" in page
    assert "split runs [1] are available with mode=split" in page
    assert (
        f"Sources: replay (replays): 1 split (not read) · read the split runs ; live (real users, through the gateway): {LIVE_RUN} live"
        in page
    )
    assert '<a href="?mode=split">read the split runs</a>' in html
    html = client.get("/dashboards/ttft-opt/?mode=split").content.decode()
    page = text(html)
    assert "Runs read: 1 (done) · mode split (filter)" in page
    assert f"live (real users, through the gateway): {LIVE_RUN} live (not read) · read the live runs" in page
    assert '<option value="split" selected>split</option>' in html
    html = client.get("/dashboards/ttft-opt/?mode=live").content.decode()
    assert '<option value="live" selected>live</option>' in html
    assert f"Runs read: {LIVE_RUN} (live)" in text(html)


def test_the_api_and_sla_report_read_live_traffic_by_mode(client_for, replay_and_live):
    api = client_for("analyst")
    doc = api.get("/api/experiments/ttft-opt/report").json()
    assert total(doc) == 200 and doc["modes"] == {"live": 200}
    assert doc["runs"]["available_modes"] == {"split": [1]}
    assert total(api.get("/api/experiments/ttft-opt/report?mode=split").json()) == 300
    live = api.get("/api/experiments/ttft-opt/report?mode=live").json()
    assert total(live) == 200 and live["runs"]["mode_source"] == "filter"
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--mode", "live", stdout=out)
    assert f"runs read: {LIVE_RUN} (live); mode live (filter)" in out.getvalue()
    out = io.StringIO()
    call_command("sla_report", "ttft-opt", "--mode", "live", "--json", stdout=out)
    assert total(json.loads(out.getvalue())) == 200
