"""The fault matrix: every report surface renders every fault, none is a 500,
and the numbers say what happened.

Faults (variant ``awq`` unless named) x modes (split, mirror) x surfaces (report dict, dashboard
page, every CSV export, the report API, ``sla_report`` text and ``--json``). The full matrix runs
on synthetic rows shaped like what the replay records for each fault (samples.synthetic, then the
faulty arm's columns replaced): one experiment per cell in one server database. Two cells also
run for real: a mirror replay through simulators with ``awq`` on a port where nothing listens,
and with ``awq`` asking for a model the server does not have (HTTP 404): a wrong model name.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import socket
import time
import uuid

import numpy as np
import pytest
from django.core.management import call_command

from analysis.definitions import Filters
from dashboards import tables
from dashboards.reports import report_for
from samples import factory, synthetic
from samples.backends.clickhouse import ClickHouseServerBackend
from tests.plugin import server_url_for

LATENCY = (
    "connect_ms",
    "ttfb_ms",
    "first_byte_ms",
    "ttft_event_ms",
    "ttft_ms",
    "itl_mean_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_max_ms",
    "tpot_ms",
    "e2e_ms",
)
# fault -> (the arm it hits, outcome, HTTP status, error message, keeps headers time)
FAULTS = {
    "down": ("awq", "connect_error", 0, "connect: [Errno 111] Connection refused", False),
    "wrong_model": (
        "awq",
        "http_4xx",
        404,
        "404: The model `nope` does not exist. This simulator serves `tiny-llama` "
        "(start it with --model NAME, or --experiment KEY to serve each variant's model).",
        True,
    ),
    "all_5xx": ("awq", "http_5xx", 500, "500 Internal Server Error", True),
    "in_stream": ("awq", "engine_error", 200, "engine error: EngineDeadError", True),
    "zero": ("awq", None, 0, "", False),
    "one_per_arm": (None, None, 0, "", False),
    "control_down": ("fp16", "connect_error", 0, "connect: [Errno 111] Connection refused", False),
}
MODES = ("split", "mirror")
N = 24


def cell_key(fault: str, mode: str) -> str:
    return f"fm-{fault.replace('_', '-')}-{mode}"


def cell_columns(fault: str, mode: str, run_id: int) -> dict[str, np.ndarray]:
    arm, outcome, status, message, headers = FAULTS[fault]
    spec = synthetic.SyntheticSpec(
        experiment=cell_key(fault, mode),
        mode="mirror" if fault == "one_per_arm" else mode,
        n=1 if fault == "one_per_arm" else N,
        seed=run_id,
        run_id=run_id,
        variants=synthetic.demo_variants(),
        duration_s=30.0,
    )
    cols = {k: v.copy() for k, v in synthetic.generate(spec).columns.items()}
    if fault == "one_per_arm":  # one request per arm, in either mode
        cols["mode"][:] = mode
        cols["outcome"][:] = "ok"
        return cols
    pick = cols["variant"] == arm
    if outcome is None:  # the arm has no sample at all
        return {k: v[~pick] for k, v in cols.items()}
    cols["outcome"][pick] = outcome
    cols["http_status"][pick] = status
    cols["error"][pick] = message
    cols["output_tokens"][pick] = 0
    for c in LATENCY:
        cols[c] = cols[c].astype(float)
        if not (headers and c == "ttfb_ms") and not (outcome == "engine_error" and c.startswith("tt")):
            cols[c][pick] = np.nan  # an in-stream error came after headers and a first token
    return cols


def expected_arm(fault: str, mode: str) -> dict:
    """What the report must say about the faulty arm."""
    arm, outcome, _status, _msg, _h = FAULTS[fault]
    if fault == "one_per_arm":
        return {}
    if outcome is None:
        return {"key": arm, "n": 0}
    if outcome == "http_4xx" and _status not in (408, 429):  # a setup error: counted apart, never judged
        return {"key": arm, "setup": _status}
    return {"key": arm, "errors_all": True, "outcome": outcome}


@pytest.fixture(scope="module")
def matrix_db(clickhouse_server):
    """One server database holding every synthetic cell, each its own experiment (and run)."""
    db = f"abplat_test_fm_{uuid.uuid4().hex[:8]}"
    store = ClickHouseServerBackend(server_url_for(db))
    store.migrate()
    run_id = 100
    for fault in FAULTS:
        for mode in MODES:
            run_id += 1
            store.insert_columns(cell_columns(fault, mode, run_id))
    yield db
    store.execute(f"DROP DATABASE IF EXISTS {db}")
    store.close()


@pytest.fixture
def matrix(db, settings, matrix_db, document, users):
    """The Django experiments of every cell, the app's store pointed at the matrix database."""
    from experiments.services import apply_document

    settings.CLICKHOUSE_URL = server_url_for(matrix_db)
    factory._cache.clear()
    for fault in FAULTS:
        for mode in MODES:
            doc = copy.deepcopy(document)
            doc["key"] = cell_key(fault, mode)
            doc["sla"] = {"ttft_ms": 200, "tpot_ms": 50, "target": 0.9}
            apply_document(doc, actor=users["product"])
    yield
    factory._cache.clear()


def check_report(rep: dict, fault: str, mode: str) -> None:
    json.dumps(rep, allow_nan=False)  # finite numbers or null only
    by = {v["key"]: v for v in rep["variants"]}
    assert list(by) == ["fp16", "awq", "awq-fa2"]
    assert rep["modes"] == {mode: sum(v["n"] for v in rep["variants"])}
    want = expected_arm(fault, mode)
    if not want:  # one sample per arm
        assert [v["n"] for v in rep["variants"]] == [1, 1, 1]
        for v in rep["variants"]:
            assert v["verdict"]["verdict"] in ("not enough data", "misses")
            assert all(e["n"] in (0, 1) for e in v["percentiles"]["ttft_ms"])
        return
    arm = by[want["key"]]
    healthy = [v for k, v in by.items() if k != want["key"]]
    assert all(v["n"] > 0 and v["errors"] < v["n"] for v in healthy)
    if want.get("n") == 0:
        assert (arm["n"], arm["attainment"], arm["vs_control"]) == (0, None, None)
        assert arm["verdict"]["verdict"] == "not enough data"
        return
    if want.get("setup"):
        check_setup_arm(rep, arm, want["setup"], N if mode == "mirror" else None)
        return
    assert arm["n"] > 0 and arm["errors"] == arm["n"] and arm["hits"] == 0
    assert arm["attainment"]["estimate"] == 0.0 and arm["error_rate"] == 1.0
    assert arm["failures"] == {
        want["outcome"]: {"n": arm["n"], "http_status": FAULTS[fault][2], "example": FAULTS[fault][3]}
    }
    assert arm["verdict"]["verdict"] in ("misses", "not enough data")
    assert all(e["value"] is None for e in arm["percentiles"]["ttft_ms"])  # no successful latency
    if fault == "control_down":
        for v in healthy[1:]:  # every success beats a control that never answered
            vs = v["vs_control"]
            assert vs["attainment_difference"]["estimate"] > 0 and vs["mann_whitney_ttft"] is None
            assert vs["p99_ttft_difference"] is None
            if mode == "mirror":
                assert vs["paired"]["wilcoxon_ttft"] is None
    else:
        vs = arm["vs_control"]
        assert vs["attainment_difference"]["estimate"] < 0 and vs["mann_whitney_ttft"] is None
        if mode == "mirror":
            paired = vs["paired"]
            assert paired["attainment"]["variant_attainment"] == 0.0 and paired["wilcoxon_ttft"] is None


def check_setup_arm(rep: dict, arm: dict, status: int, requests: int | None) -> None:
    """A variant that refused every request as configured (a wrong model): nothing judged, the
    requests counted apart with their status, a banner, no comparison and no attribution."""
    setup = arm["setup_errors"]
    assert setup["n"] > 0 and (requests is None or setup["n"] == requests)
    assert list(setup["by_status"]) == [str(status)] and setup["by_status"][str(status)]["n"] == setup["n"]
    assert (arm["n"], arm["errors"], arm["attainment"], arm["vs_control"]) == (0, 0, None, None)
    assert arm["verdict"]["verdict"] == "cannot be judged" and arm["failures"] == {}
    assert [b for b in rep["banners"] if b.startswith(f"Setup errors on variant {arm['key']}: {setup['n']} ")]
    assert all(arm["key"] not in rep["attribution"][q] for q in ("attainment", "p99_ttft_ms"))


def check_surfaces(client, key: str, rep: dict, fault: str) -> None:
    """The page, every CSV, the API and sla_report (text, --json) for one experiment."""
    page = client.get(f"/dashboards/{key}/")
    assert page.status_code == 200, page.content[:500]
    html = page.content.decode()
    assert 'id="chart-attainment"' in html and "Runs read:" in html
    want = expected_arm(fault, "")
    if want.get("outcome"):
        assert 'id="failures"' in html and want["outcome"] in html
    if want.get("setup"):
        assert "Setup errors on variant" in html and "cannot be judged" in html
    for table in tables.TABLES:
        resp = client.get(f"/dashboards/{key}/export/{table}.csv")
        assert resp.status_code == 200, (table, resp.content[:300])
        text = resp.content.decode()
        assert text.splitlines()[0] == ",".join(tables.COLUMNS[table]), table  # header, even when empty
        got = list(csv.DictReader(io.StringIO(text)))
        assert len(got) == len(tables.rows(rep, table)), table
    api = client.get(f"/api/experiments/{key}/report")
    assert api.status_code == 200
    out, js = io.StringIO(), io.StringIO()
    call_command("sla_report", key, stdout=out)
    call_command("sla_report", key, "--json", stdout=js)
    text = out.getvalue()
    assert "TTFT < 200 ms" in text and "runs read:" in text
    if want.get("outcome"):
        assert "Failures by error class" in text and want["outcome"] in text
    if want.get("setup"):
        assert "!! Setup errors on variant" in text and "cannot be judged" in text
    docs = [api.json(), json.loads(js.getvalue()), copy.deepcopy(rep)]
    for doc in docs:
        doc.pop("generated_at"), doc.pop("timing")
    assert docs[0] == docs[1] == docs[2]


@pytest.mark.django_db
def test_every_fault_renders_on_every_surface(client, users, matrix):
    client.force_login(users["analyst"])
    t0 = time.monotonic()
    for fault in FAULTS:
        for mode in MODES:
            key = cell_key(fault, mode)
            from experiments.models import Experiment

            rep = report_for(Experiment.objects.get(key=key), Filters(key))
            check_report(rep, fault, mode)
            check_surfaces(client, key, rep, fault)
    assert time.monotonic() - t0 < 60


# ---- a wrong model name, for real: a mirror replay through simulators ------------------------


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


@pytest.mark.parametrize("fault", ["down", "wrong_model"])
@pytest.mark.django_db(transaction=True)
@pytest.mark.engine
def test_a_mirror_replay_with_a_broken_variant_reports_what_broke(
    fault, client, db, document, sims, users, sample_store, settings
):
    from experiments import services

    for v in document["variants"]:
        v["endpoint"], v["api"] = sims[v["key"]].url + "/v1", "chat"
    awq = document["variants"][1]
    if fault == "down":
        awq["endpoint"] = f"http://127.0.0.1:{_dead_port()}/v1"
    else:
        awq["model"] = "nope"
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    out = io.StringIO()
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        "data/traces/azure_llm_2023_code.csv",
        "--limit",
        "20",
        "--mode",
        "mirror",
        "--arrival",
        "poisson",
        "--rate",
        "10",
        "--no-preflight",
        "--yes",
        stdout=out,
    )
    rep = report_for(experiment, Filters("ttft-opt"))
    by = {v["key"]: v for v in rep["variants"]}
    judged_awq = 0 if fault == "wrong_model" else 20
    assert (by["fp16"]["n"], by["awq"]["n"], by["awq-fa2"]["n"]) == (20, judged_awq, 20), out.getvalue()
    arm = by["awq"]
    if fault == "wrong_model":  # a setup error: the 404 names the model the simulator serves
        check_setup_arm(rep, arm, 404, 20)
        assert "does not exist" in arm["setup_errors"]["by_status"]["404"]["example"]
    else:
        assert (arm["errors"], arm["hits"], arm["attainment"]["estimate"]) == (20, 0, 0.0)
        assert list(arm["failures"]) == ["connect_error"] and arm["failures"]["connect_error"]["n"] == 20
        assert arm["vs_control"]["paired"]["wilcoxon_ttft"] is None
    client.force_login(users["analyst"])
    check_surfaces(client, "ttft-opt", rep, fault)
