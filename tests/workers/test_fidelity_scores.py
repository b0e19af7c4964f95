"""The scoring pass end to end on eager Celery: a mirror replay through simulated variants whose
logits carry a known noise (simulator/logprobs.py) ends, the pass scores a share of its requests
by teacher forcing, and the report's mean KL per answer token is the simulator's truth within its
interval; a variant that refuses prompt_logprobs gives error rows, a pass run again replaces its
rows, and an experiment that scores nothing says so. On chDB and the ClickHouse server."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
from django.core.management import call_command

from analysis.definitions import Filters
from dashboards import reports as report
from dashboards import summaries
from experiments import services
from fidelity import scores
from simulator import answers, logprobs, tokens
from workers.fidelity_scores import score_run
from workers.models import ReplayRun

pytestmark = pytest.mark.engine

USERS = 12
REQUESTS = 48
K = 20


def write_log(path) -> str:
    """A traffic log of short completions prompts (scoring reads every prompt position: short
    prompts keep the simulator's scoring quick), 12 users, 24 tokens an answer."""
    lines = [
        json.dumps(
            {
                "timestamp": i * 0.01,
                "user_id": f"u{i % USERS}",
                "prompt": f"request {i} of the fidelity test: say something about item {i * 7}",
                "max_tokens": 24,
            }
        )
        for i in range(REQUESTS)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def replay(log: str, *options: str) -> ReplayRun:
    out = io.StringIO()
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        log,
        "--format",
        "jsonl",
        "--speed",
        "50",
        "--mode",
        "mirror",
        *options,
        stdout=out,
    )
    return ReplayRun.objects.latest("pk")


@pytest.fixture(scope="module")
def noisy_sims():
    """fp16 as the control (the model's own logits), awq and awq-fa2 with the demo profiles'
    logit noise, on the fast profile's latency; awq-fa2 refuses prompt_logprobs
    (--max-logprobs 0) where a test asks for it."""
    from simulator.profiles import PROFILES
    from simulator.serve import start_in_thread

    fast = PROFILES["fast"]
    made = {
        "fp16": start_in_thread(fast, model="tiny-llama"),
        "awq": start_in_thread(
            dataclasses.replace(fast, name="fast-awq", seed=7, logit_noise=PROFILES["awq"].logit_noise),
            model="tiny-llama",
        ),
        "awq-fa2": start_in_thread(
            dataclasses.replace(
                fast, name="fast-awq-fa2", seed=9, logit_noise=PROFILES["awq-fa2"].logit_noise
            ),
            model="tiny-llama",
        ),
        "refusing": start_in_thread(fast, model="tiny-llama", max_logprobs=0),
    }
    yield made
    for h in made.values():
        h.stop()


def start(document, users, sims, *, share: float, refusing: bool = False, api: str = "completions"):
    for v in document["variants"]:
        handle = sims["refusing"] if refusing and v["key"] == "awq-fa2" else sims[v["key"]]
        v["endpoint"], v["api"] = handle.url + "/v1", api
    document["fidelity"] = {"score_share": share, "score_top_k": K}
    experiment = services.apply_document(document, actor=users["product"]).experiment
    services.transition(experiment, "start", users["product"])
    return experiment


def score_rows(sample_store, run_id: int) -> list[tuple]:
    return sample_store.query(
        "SELECT variant, seq, user_id, outcome, error, positions, kl_sum, kl_max, top1_agree, top_k "
        "FROM fidelity_scores FINAL WHERE run_id = %(r)s ORDER BY seq, variant",
        {"r": run_id},
    )


def expected_kl(prompt_ids: list[int], answer_ids: list[int], noise: float, k: int) -> float:
    """The simulator's truth, from its model of next-token distributions, independently of the
    pass: per answer position, the expected top-k truncated KL(control || variant) when the
    variant's logits carry N(0, noise²) noise, to second order in the noise. With p the control's
    distribution, S its top k and R the rest, the coarsened KL is ½ Σ_b P_b (Δ_b - Δ̄)² over the
    buckets b (each token of S, and R), where Δ_i = ε_i for a token and Δ_R = Σ_R p_j ε_j / P_R;
    its expectation is noise²/2 · (P_S + Σ_R p_j² / P_R - Σ_i p_i²). Averaged over the
    positions."""
    from simulator.profiles import PROFILES

    base = PROFILES["fast"]
    ids = prompt_ids + answer_ids
    out = []
    contexts = list(logprobs.contexts(ids[:-1], base))
    for j in range(len(prompt_ids), len(ids)):
        p = [math.exp(v) for v in logprobs.distribution(contexts[j - 1], base)]
        order = sorted(range(len(p)), key=lambda i: -p[i])
        top, rest = order[:k], order[k:]
        p_s = sum(p[i] for i in top)
        p_r = sum(p[i] for i in rest)
        tail = sum(p[i] ** 2 for i in rest) / p_r if p_r > 0 else 0.0
        out.append(noise**2 / 2 * (p_s + tail - sum(v * v for v in p)))
    return sum(out) / len(out)


@pytest.mark.django_db(transaction=True)
def test_the_pass_measures_the_simulators_known_kl(document, users, sample_store, noisy_sims, tmp_path):
    from simulator.profiles import PROFILES

    experiment = start(document, users, noisy_sims, share=1.0)
    run = replay(write_log(tmp_path / "log.jsonl"))
    assert run.status == "done"
    rows = score_rows(sample_store, run.pk)
    # every request of the run, once per variant, the control's own row included
    assert len(rows) == REQUESTS * 3
    assert {r[3] for r in rows} == {"ok"}, {r[4] for r in rows}
    assert all(r[5] == 24 and r[9] == K for r in rows)
    control_rows = [r for r in rows if r[0] == "fp16"]
    # the control against itself: KL 0 and its own greedy tokens, every position
    assert all(r[6] == 0.0 and r[8] == 24 for r in control_rows)
    entry = report.build_report(sample_store, report.experiment_info(experiment), Filters("ttft-opt"))
    fid = {v["key"]: v["fidelity"] for v in entry["variants"]}
    for key in ("awq", "awq-fa2"):
        kl = fid[key]["kl"]
        # the truth: each scored request's expected KL (its prompt's and answer's ids as the
        # simulator tokenizes them), averaged over the requests
        truths = []
        for seq in range(REQUESTS):
            prompt = f"request {seq} of the fidelity test: say something about item {seq * 7}"
            prompt_ids = tokens.prompt_ids("bytes4", prompt=prompt)
            reference = answers.answer(answers.prompt_key(prompt=prompt_ids), PROFILES["fast"], 24)
            answer_ids = [tokens.answer_id(t) for t in reference.texts]
            truths.append(expected_kl(prompt_ids, answer_ids, PROFILES[key].logit_noise, K))
        truth = sum(truths) / len(truths)
        assert kl["low"] <= truth <= kl["high"]
        assert kl["requests_scored"] == REQUESTS and kl["requests_failed"] == 0
        assert kl["top_k"] == K and kl["control_noise"] == 0.0
        assert kl["interval"]["clusters"] == USERS  # the users, as the identical share's
        assert kl["tokens_scored"] == REQUESTS * 24 and 0.9 < kl["top1_agreement"] <= 1.0
        assert kl["max"] > kl["mean"] and fid[key]["kl_note"] == kl["truncation"]
    # the pure rows of the awq variant add up to the report's mean
    awq = [r for r in rows if r[0] == "awq"]
    assert fid["awq"]["kl"]["mean"] == pytest.approx(sum(r[6] / r[5] for r in awq) / len(awq), rel=1e-9)
    # sla_report's line per variant
    from dashboards.management.commands.sla_report import render_text

    text = render_text(entry).splitlines()
    kl = fid["awq"]["kl"]
    assert any(
        line.startswith(f"  awq: KL {kl['mean']:.3g} nats per answer token [95% CI {kl['low']:.3g}-")
        and f"from fp16, top-{K} truncated ({REQUESTS} requests, {REQUESTS * 24:,} tokens)" in line
        and line.endswith("fp16 against itself 0")
        for line in text
    ), text
    # the dashboard page: the answers' detail carries each variant's KL with its interval and line
    from django.test import Client

    client = Client()
    client.force_login(users["product"])
    page = client.get("/dashboards/ttft-opt/").content.decode()
    assert '<details class="method" id="answers">' in page
    for key in ("awq", "awq-fa2"):
        row = page.split(f'<tr data-variant="{key}">', 2)[-1].split("</tr>")[0]
        assert f'<td class="iv kl">{summaries.kl_text(fid[key])}</td>' in row
    assert page.count('<p class="sub kl-line">') == 2


@pytest.mark.django_db(transaction=True)
def test_half_the_requests_a_refusing_variant_and_a_second_pass(
    document, users, sample_store, noisy_sims, tmp_path, monkeypatch
):
    """Share 0.5: the requests hashed under it, about half, the same on every pass; awq-fa2's
    server refuses prompt_logprobs: its rows say so and the report counts them as not scored;
    running the pass again replaces the rows instead of adding to them."""
    experiment = start(document, users, noisy_sims, share=0.5, refusing=True)
    run = replay(write_log(tmp_path / "log.jsonl"))
    picked = scores.choose(run.pk, range(REQUESTS), 0.5)
    assert abs(len(picked) - REQUESTS / 2) <= 12  # 3.5 standard deviations of Binomial(48, 1/2)
    rows = score_rows(sample_store, run.pk)
    assert sorted({r[1] for r in rows}) == picked and len(rows) == 3 * len(picked)
    by = {(r[0], r[1]): r for r in rows}
    for seq in picked:
        assert by[("awq", seq)][3] == "ok" and by[("fp16", seq)][3] == "ok"
        outcome, error = by[("awq-fa2", seq)][3:5]
        assert outcome == "no_prompt_logprobs" and "the server refuses prompt_logprobs" in error
        assert "greater than max allowed: 0" in error  # the server's own words
    assert {r[2] for r in rows} == {f"u{s % USERS}" for s in picked}

    def kl_of(rep):
        return {v["key"]: (v["fidelity"] or {}).get("kl") for v in rep["variants"]}

    info = report.experiment_info(experiment)
    first = kl_of(report.build_report(sample_store, info, Filters("ttft-opt")))
    assert first["awq"]["requests_scored"] == len(picked) and first["awq"]["requests_failed"] == 0
    refused = first["awq-fa2"]
    assert (refused["requests_scored"], refused["requests_failed"], refused["mean"]) == (0, len(picked), None)
    assert refused["failures"]["no_prompt_logprobs"]["n"] == len(picked)
    assert "the server refuses prompt_logprobs" in refused["note"]
    # while another replay sends to the same servers, the pass puts itself off
    fields = ReplayRun.objects.filter(pk=run.pk).values().get()
    other = ReplayRun.objects.create(**{**fields, "id": None, "status": "running"})
    queued = []
    monkeypatch.setattr(score_run, "apply_async", lambda args, **kw: queued.append((args, kw)))
    assert score_run(run.pk) == 0 and queued == [((run.pk, 0, 1), {"countdown": 60})]
    other.delete()
    # a second pass (a redelivered task, a pass by hand): the same requests, rows replaced
    assert score_run(run.pk) == 3 * len(picked)
    assert len(score_rows(sample_store, run.pk)) == 3 * len(picked)
    again = kl_of(report.build_report(sample_store, info, Filters("ttft-opt")))
    assert again["awq"]["requests_scored"] == len(picked)
    assert again["awq"]["mean"] == pytest.approx(first["awq"]["mean"], rel=1e-12)
    from dashboards.management.commands.sla_report import render_text

    text = render_text(report.build_report(sample_store, info, Filters("ttft-opt")))
    assert (
        f"  awq-fa2: KL not measured: {len(picked)} requests picked, none scored (no_prompt_logprobs" in text
    )


@pytest.mark.django_db(transaction=True)
def test_an_experiment_that_scores_nothing_says_so(document, users, sample_store, noisy_sims, tmp_path):
    from analysis import answer_fidelity as af

    experiment = start(document, users, noisy_sims, share=0.0)
    run = replay(write_log(tmp_path / "log.jsonl"))
    assert run.status == "done" and score_rows(sample_store, run.pk) == []
    rep = report.build_report(sample_store, report.experiment_info(experiment), Filters("ttft-opt"))
    for v in rep["variants"][1:]:
        assert v["fidelity"]["compared"] == REQUESTS
        assert v["fidelity"]["kl"] is None and v["fidelity"]["kl_note"] == af.NO_KL_SHARE_0
    from dashboards.management.commands.sla_report import render_text

    assert f"  KL divergence: {af.NO_KL_SHARE_0}" in render_text(rep)
    # by hand: refused while the share is 0, then the run is scored once it is set
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="scores nothing"):
        call_command("score_fidelity", str(run.pk))
    type(experiment).objects.filter(pk=experiment.pk).update(fidelity_score_share=1.0)
    experiment.refresh_from_db()
    cached = report.report_for(experiment, Filters("ttft-opt"), sample_store)  # cached before the pass
    assert cached["variants"][1]["fidelity"]["kl"] is None
    out = io.StringIO()
    call_command("score_fidelity", str(run.pk), "--json", stdout=out)
    assert json.loads(out.getvalue()) == {
        "runs": [{"run_id": run.pk, "picked": REQUESTS, "rows": 3 * REQUESTS}]
    }
    # the cached report is not served once the scores are written (the same samples, new scores)
    rep = report.report_for(experiment, Filters("ttft-opt"), sample_store)
    assert rep["timing"]["cache"] == "miss"
    assert [v["fidelity"]["kl"]["requests_scored"] for v in rep["variants"][1:]] == [REQUESTS, REQUESTS]


@pytest.mark.django_db(transaction=True)
def test_chat_requests_are_scored_on_the_prompt_ids_the_chat_template_gave(
    document, users, sample_store, noisy_sims, tmp_path
):
    """Chat variants: the control's answer comes from its chat API (the server applies the chat
    template and returns the templated prompt's ids), and those ids + the answer are scored on
    every variant's completions API."""
    experiment = start(document, users, noisy_sims, share=1.0, api="chat")
    run = replay(write_log(tmp_path / "log.jsonl"), "--limit", "12", "--wrap-prompt")
    rows = score_rows(sample_store, run.pk)
    assert len(rows) == 36 and {r[3] for r in rows} == {"ok"}, {r[4] for r in rows}
    assert all(r[5] == 24 for r in rows)
    rep = report.build_report(sample_store, report.experiment_info(experiment), Filters("ttft-opt"))
    kl = {v["key"]: v["fidelity"]["kl"] for v in rep["variants"][1:]}
    assert kl["awq"]["control_noise"] == 0.0 and 0 < kl["awq"]["mean"] < kl["awq-fa2"]["mean"] * 3
    # the control unreachable on a second pass: every picked request keeps a row per variant,
    # saying why, and the report counts them as not scored
    from experiments.models import Variant

    Variant.objects.filter(experiment=experiment, key="fp16").update(endpoint="http://127.0.0.1:9/v1")
    assert score_run(run.pk) == 36
    rows = score_rows(sample_store, run.pk)
    assert {r[3] for r in rows} == {"control_error"} and len(rows) == 36
    assert all(r[4].startswith("the control's answer: ConnectError") for r in rows), rows[0]
    rep = report.build_report(sample_store, report.experiment_info(experiment), Filters("ttft-opt"))
    kl = {v["key"]: v["fidelity"]["kl"] for v in rep["variants"][1:]}
    assert (kl["awq"]["requests_scored"], kl["awq"]["requests_failed"], kl["awq"]["mean"]) == (0, 12, None)
    assert kl["awq"]["failures"]["control_error"]["n"] == 12


@pytest.mark.django_db(transaction=True)
def test_synthetic_prompts_are_scored_as_the_run_planned_them(
    document, users, sample_store, noisy_sims, monkeypatch
):
    """An Azure trace gives token counts, not text: the pass sends the control the prompt the run
    planned for it (replay.calibration, stored with the run), so its greedy answer is the one the
    run compared (the same fingerprint), and scored under itself every token is its most likely."""
    from fidelity.fingerprints import output_fp
    from workers import fidelity_scores

    answers_seen = []
    parse = fidelity_scores.parse_answer
    monkeypatch.setattr(
        fidelity_scores, "parse_answer", lambda r: answers_seen.append(parse(r)) or answers_seen[-1]
    )
    experiment = start(document, users, noisy_sims, share=1.0)
    out = io.StringIO()
    call_command(
        "replay",
        "ttft-opt",
        "--trace",
        "data/traces/azure_llm_2023_conv.csv",
        "--limit",
        "3",
        "--speed",
        "50",
        "--mode",
        "mirror",
        stdout=out,
    )
    run = ReplayRun.objects.latest("pk")
    assert run.prompt_plan  # calibrated on the simulators' /tokenize
    rows = score_rows(sample_store, run.pk)
    assert len(rows) == 9 and {r[3] for r in rows} == {"ok"}, {r[4] for r in rows}
    fp16 = [r for r in rows if r[0] == "fp16"]
    sent = sample_store.query(
        "SELECT seq, output_tokens, output_fp FROM samples FINAL WHERE run_id = %(r)s AND variant = 'fp16'",
        {"r": run.pk},
    )
    assert all(
        r[5] == dict((s, n) for s, n, _fp in sent)[r[1]] and r[8] == r[5] and r[6] == 0.0 for r in fp16
    )
    # the pass's answers are the run's: the same texts, so the same prompts were sent
    assert sorted(output_fp([tokens.decode(t) for t in a.answer_ids]) for a in answers_seen) == sorted(
        fp for _s, _n, fp in sent
    )
    rep = report.build_report(sample_store, report.experiment_info(experiment), Filters("ttft-opt"))
    assert next(v for v in rep["variants"] if v["key"] == "awq")["fidelity"]["kl"]["mean"] > 0
