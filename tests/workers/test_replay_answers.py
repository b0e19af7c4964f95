"""The privacy switch end to end on eager Celery: a mirror replay through simulated variants keeps
each successful answer's text only where the experiment's document allows it
(``fidelity: {store_answers: true}``), and the report then shows a few diverged answers; on chDB
and the ClickHouse server."""

import dataclasses
import io

import pytest
from django.core.management import call_command

from analysis.definitions import Filters
from dashboards import reports as report
from experiments import services
from fidelity.fingerprints import output_fp
from workers.models import ReplayRun

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


def replay(*args) -> str:
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, *args, stdout=out)
    return out.getvalue()


def stored(sample_store, run: ReplayRun) -> list[tuple]:
    return sample_store.query(
        "SELECT variant, seq, outcome, output_fp, token_fps, answer_text FROM samples FINAL "
        "WHERE run_id = %(r)s ORDER BY seq, variant",
        {"r": run.pk},
    )


@pytest.mark.django_db(transaction=True)
def test_a_mirror_replay_stores_no_answer_text_by_default(running, sample_store):
    assert running.fidelity_store_answers is False
    replay("--limit", "20", "--speed", "200", "--mode", "mirror")
    run = ReplayRun.objects.get()
    rows = stored(sample_store, run)
    assert run.status == "done" and len(rows) == 60
    # fingerprinted, as every mirror replay's answers are; no text
    assert all(outcome == "ok" and fp != 0 and text == "" for _v, _s, outcome, fp, _fps, text in rows)


@pytest.mark.django_db(transaction=True)
def test_a_mirror_replay_stores_each_whole_answer_where_the_document_allows_it(
    running, document, users, sample_store
):
    document["fidelity"] = {"store_answers": True}
    changed = services.apply_document(document, actor=users["product"], reason="examples for the review")
    assert changed.changes == ["fidelity.store_answers: False -> True"]  # audited, while running
    replay("--limit", "20", "--speed", "200", "--mode", "mirror")
    mirror = ReplayRun.objects.get()
    rows = stored(sample_store, mirror)
    assert mirror.status == "done" and len(rows) == 60
    for _variant, _seq, outcome, fp, _fps, text in rows:
        # the whole answer: the text its fingerprint was taken of (the simulator's are far below the cap)
        assert outcome == "ok" and text and output_fp([text]) == fp
    assert any(not text.isascii() for *_rest, text in rows)  # the fast profile's multi-byte tokens
    # a split replay compares no answers: it keeps neither fingerprints nor texts
    replay("--limit", "10", "--speed", "200")
    split = ReplayRun.objects.exclude(pk=mirror.pk).get()
    assert {(fp, text) for *_r, fp, _fps, text in stored(sample_store, split)} == {(0, "")}


@pytest.mark.django_db(transaction=True)
def test_the_report_shows_where_real_answers_part(db, document, users, sample_store):
    """Simulators whose awq departs from the reference answer on half the requests: the
    report's examples are the stored texts of the first diverged requests, cut around the
    first character that differs, at the token where their fingerprints part."""
    from simulator.profiles import PROFILES
    from simulator.serve import start_in_thread

    fast = PROFILES["fast"]
    profiles = {
        "fp16": fast,
        "awq": dataclasses.replace(fast, name="fast-diverging", seed=5, divergence_rate=0.5),
        "awq-fa2": fast,
    }
    sims = {key: start_in_thread(p, model="tiny-llama") for key, p in profiles.items()}
    try:
        for v in document["variants"]:
            v["endpoint"], v["api"] = sims[v["key"]].url + "/v1", "chat"
        document["fidelity"] = {"store_answers": True}
        experiment = services.apply_document(document, actor=users["product"]).experiment
        services.transition(experiment, "start", users["product"])
        replay("--limit", "30", "--speed", "200", "--mode", "mirror")
    finally:
        for h in sims.values():
            h.stop()
    run = ReplayRun.objects.get()
    assert run.status == "done"
    by = {(v, s): (fps, text) for v, s, _o, _fp, fps, text in stored(sample_store, run)}
    diverged = sorted(s for (v, s), (fps, _t) in by.items() if v == "awq" and fps != by[("fp16", s)][0])
    assert len(diverged) >= 3
    # the experiment's switch, as the report is told it (dashboards.reports.experiment_info)
    exp = report.experiment_info(experiment)
    assert exp.store_answers is True
    fid = {
        v["key"]: v["fidelity"]
        for v in report.build_report(sample_store, exp, Filters("ttft-opt"))["variants"]
    }
    assert fid["awq-fa2"]["diverged"] == 0 and fid["awq-fa2"]["examples"] == []
    awq = fid["awq"]
    assert awq["store_answers"] is True and awq["diverged"] == len(diverged)
    assert [e["seq"] for e in awq["examples"]] == diverged[:3]
    for ex in awq["examples"]:
        (c_fps, c_text), (v_fps, v_text) = by[("fp16", ex["seq"])], by[("awq", ex["seq"])]
        assert ex["position"] == next(i for i, (a, b) in enumerate(zip(c_fps, v_fps)) if a != b)
        start, char = ex["start"], ex["char"]
        assert c_text[:char] == v_text[:char] and c_text[char] != v_text[char]
        assert (
            ex["control"]["text"] == c_text[start : char + 160]
            and ex["variant"]["text"] == v_text[start : char + 160]
        )
        assert not ex["control"]["capped"] and not ex["variant"]["capped"]
    # the path of the page, the API and sla_report reads the switch the same way
    _filters, through = report.report_for_params(experiment, {"mode": "mirror"}, [])
    shown = next(v for v in through["variants"] if v["key"] == "awq")["fidelity"]
    assert shown["store_answers"] is True and shown["examples"] == awq["examples"]
    # sla_report prints each example from the first character that differs
    from dashboards.management.commands.sla_report import render_text

    text = render_text(through).splitlines()
    for ex in awq["examples"]:
        c_text, v_text = by[("fp16", ex["seq"])][1], by[("awq", ex["seq"])][1]
        assert (
            f"  awq         run {run.pk} request {ex['seq']} parts at token {ex['position']}: "
            f"fp16 {c_text[ex['char'] : ex['char'] + 40]!r}, awq {v_text[ex['char'] : ex['char'] + 40]!r}"
        ) in text
