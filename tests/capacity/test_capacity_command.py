"""End to end: `manage.py capacity` against a simulator with a known saturation point.

The deployment serves one request at a time (max_num_seqs 1) in two 25 ms steps (the first
token, then the second and last), so under evenly spaced arrivals it keeps up exactly to
20 req/s: below, every first token comes 25 ms after its request; above, the queue grows
without bound and TTFT with it. The search must find 20 req/s within 10%, store every step
as a replay run the report can read, and price the capacity."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command

from capacity.models import CapacitySearch
from experiments import services
from simulator.latency import Profile
from simulator.serve import start_in_thread
from workers.models import ReplayRun

EDGE = Profile(
    name="capacity-edge", prefill_ms_per_token=0.0, prefill_base_ms=0.0, decode_base_ms=25.0,
    decode_ms_per_seq=0.0, max_num_seqs=1,
)  # fmt: skip
SATURATION_RPS = 1000.0 / (2 * 25.0)  # two steps of 25 ms per request, one at a time


@pytest.fixture
def edge_sim():
    h = start_in_thread(EDGE, model="tiny-llama")
    yield h
    h.stop()


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "even.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": i * 0.1, "prompt": "Say two words.", "max_tokens": 2}) + "\n" for i in range(600)
    ))  # fmt: skip
    return path


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
def test_the_search_finds_a_known_saturation_point_within_10_percent(
    weights_backend, ch_store, edge_sim, trace, document, users
):
    document["sla"] = {"ttft_ms": 200, "target": 0.95}
    document["variants"] = [
        {"key": "edge", "control": True, "weight": 100, "endpoint": edge_sim.url + "/v1", "model": "tiny-llama",
         "api": "completions", "cost": {"per_hour": 3.6, "currency": "USD"}},
        # a second deployment, not searched here (--variants edge)
        {"key": "other", "weight": 0, "endpoint": edge_sim.url + "/v1", "model": "tiny-llama", "api": "completions"},
    ]  # fmt: skip
    exp = services.apply_document(document, actor=users["product"]).experiment
    services.transition(exp, "start", users["product"])
    out = io.StringIO()
    call_command(
        "capacity", exp.key, "--trace", str(trace), "--format", "jsonl", "--arrival", "recorded",
        "--start-rate", "16", "--max-rate", "64", "--min-rate", "2", "--step-requests", "600",
        "--warmup", "2", "--tolerance", "0.05", "--variants", "edge", "--json",
        # a 2-core CI machine running other tests lags a few ms: this test is about the edge
        "--lag-limit", "50", stdout=out, stderr=io.StringIO(),
    )  # fmt: skip
    doc = json.loads(out.getvalue())
    assert list(doc["variants"]) == ["edge"] and doc["ranking"] == ["edge"]
    r = doc["variants"]["edge"]
    assert r["capacity_rps"] is not None, r["message"]
    assert abs(r["capacity_rps"] - SATURATION_RPS) <= 0.10 * SATURATION_RPS, r
    assert r["upper_rps"] <= r["capacity_rps"] * 1.05 + 1e-9 and r["limited_by"] == "sla", r
    # below the edge every request meets; above it most miss
    for step in r["steps"]:
        if step["rate_rps"] <= 0.9 * SATURATION_RPS:
            assert step["verdict"] == "meets", step
        if step["rate_rps"] >= 1.2 * SATURATION_RPS:
            assert step["verdict"] == "misses", step
    # each step is a mirror run of this variant alone, stopped once decided
    runs = {run.pk: run for run in ReplayRun.objects.filter(pk__in=[s["run_id"] for s in r["steps"]])}
    assert len(runs) == len(r["steps"])
    for step in r["steps"]:
        run = runs[step["run_id"]]
        assert run.mode == "mirror" and run.targets == ["edge"]
        assert run.status in ("done", "cancelled") and run.samples_recorded >= step["n"]
    assert any(run.status == "cancelled" for run in runs.values())  # the sequential stop
    # the usual report reads any step
    rep = io.StringIO()
    some = r["steps"][0]["run_id"]
    call_command("sla_report", exp.key, "--run", str(some), "--status", "all", "--json", stdout=rep)
    assert json.loads(rep.getvalue())["variants"][0]["n"] == runs[some].samples_recorded
    # cost at capacity: 3.6 USD/h at C req/s
    c = r["cost"]
    assert c["per_million_requests"] == pytest.approx(3.6 / (r["capacity_rps"] * 3600) * 1e6)
    assert c["per_million_output_tokens"] == pytest.approx(c["per_million_requests"] / 2, rel=0.01)
    stored = CapacitySearch.objects.get(pk=doc["search"])
    assert stored.status == "done" and stored.result["edge"]["capacity_rps"] == r["capacity_rps"]


@pytest.mark.django_db
def test_the_command_names_what_is_wrong(document, users):
    from django.core.management.base import CommandError

    exp = services.apply_document(document, actor=users["product"]).experiment
    with pytest.raises(CommandError, match="no experiment with key 'nope'"):
        call_command("capacity", "nope", "--trace", "x.csv")
    with pytest.raises(CommandError, match="--cv applies to --arrival gamma"):
        call_command("capacity", exp.key, "--trace", "x.csv", "--cv", "2")
    with pytest.raises(CommandError, match=r"--variants: no variant \['zzz'\]"):
        call_command("capacity", exp.key, "--trace", "x.csv", "--variants", "zzz")
    with pytest.raises(CommandError, match="min_rps <= start_rps <= max_rps"):
        call_command("capacity", exp.key, "--trace", "x.csv", "--start-rate", "100", "--max-rate", "10")
    assert not CapacitySearch.objects.exists()  # nothing recorded for a refused search
