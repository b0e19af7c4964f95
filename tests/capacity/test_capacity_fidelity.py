"""The capacity page carries, beside what each variant carries and costs, the share of its answers
identical to the control's from the experiment's mirror replay, and draws one against the other."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from capacity import search as s
from capacity.models import CapacitySearch
from capacity.service import variant_result
from dashboards.summaries import identical_text
from experiments import services
from samples import synthetic

RATES = {"fp16": 0.0, "awq": 0.06, "awq-fa2": 0.08}


def capacity(edge: float) -> dict:
    def probe(rate: float) -> s.StepResult:
        ok = rate <= edge
        return s.StepResult(rate, s.MEETS if ok else s.MISSES, 600, 600 if ok else 300, run_id=int(rate))

    cap = s.run_search(s.SearchSpec(0.95, start_rps=32.0, max_rps=128.0, min_rps=4.0), probe)
    return variant_result(cap, {"per_hour": 3.6, "currency": "USD"}, 93.4)


@pytest.fixture
def exp(document, users):
    exp = services.apply_document(document, actor=users["product"]).experiment
    services.transition(exp, "start", users["product"])
    return exp


@pytest.mark.django_db
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
def test_the_page_shows_identical_answers_beside_capacity_and_draws_them(
    weights_backend, exp, users, client, sample_store
):
    client.force_login(users["analyst"])
    result = {"fp16": capacity(20.0), "awq-fa2": capacity(50.0)}
    CapacitySearch.objects.create(experiment=exp, status="done", result=result, params={"target": 0.95})
    # no mirror replay yet: no column, no chart, nothing said
    html = client.get(f"/capacity/{exp.key}/").content.decode()
    assert "answers identical" not in html and "capacity-fidelity" not in html

    variants = [dataclasses.replace(v, divergence_rate=RATES[v.key]) for v in synthetic.demo_variants()]
    data = synthetic.generate(
        synthetic.SyntheticSpec(
            experiment=exp.key, mode="mirror", n=600, seed=4, variants=variants, answers=True
        )
    )
    synthetic.insert(sample_store, data)
    html = client.get(f"/capacity/{exp.key}/").content.decode()
    from dashboards.reports import report_for_params

    _f, report = report_for_params(exp, {"mode": "mirror"}, [])
    fid = {v["key"]: v["fidelity"] for v in report["variants"]}
    assert "<th>answers identical to fp16 [95% CI]</th>" in html
    row = re.search(r"<tr><td>awq-fa2</td>(.*?)</tr>", html, re.S).group(1)
    assert f'<td class="identical">{identical_text(fid["awq-fa2"])}</td>' in row
    assert '<td class="identical">reference</td>' in re.search(
        r"<tr><td>fp16</td>(.*?)</tr>", html, re.S
    ).group(1)
    figure = json.loads(
        re.search(r'<script id="capacity-fidelity" type="application/json">(.*?)</script>', html, re.S).group(
            1
        )
    )
    points = {t["name"]: (t["x"][0], t["y"][0]) for t in figure["data"]}
    assert points == {
        "fp16": (1.0, result["fp16"]["capacity_rps"]),
        "awq-fa2": (fid["awq-fa2"]["identical"]["estimate"], result["awq-fa2"]["capacity_rps"]),
    }
    err = next(t for t in figure["data"] if t["name"] == "awq-fa2")["error_x"]
    ident = fid["awq-fa2"]["identical"]
    assert err["arrayminus"][0] == pytest.approx(ident["estimate"] - ident["lo"])
    assert err["array"][0] == pytest.approx(ident["hi"] - ident["estimate"])
    # the buttons switch the y axis to the cost per million requests, in the traces' order
    restyle, relayout = figure["layout"]["updatemenus"][0]["buttons"][1]["args"]
    costs = [result[t["name"]]["cost"]["per_million_requests"] for t in figure["data"]]
    assert restyle["y"] == [[c] for c in costs]
    assert relayout == {
        "yaxis.title.text": "cost per 1M requests (USD)",
        "yaxis.range": [0.0, 1.25 * max(costs)],
    }
    assert figure["layout"]["yaxis"]["range"] == [0.0, 1.25 * max(result[v]["capacity_rps"] for v in result)]
    assert (
        "from the mirror replay&#x27;s report (run " in html
        or "from the mirror replay's report (run " in html
    )


def test_the_commands_table_carries_the_identical_share_and_says_whence():
    from capacity.management.commands.capacity import render_table

    result = {"fp16": capacity(20.0), "awq-fa2": capacity(50.0)}
    for r in result.values():
        r["search_s"] = 3.0
    doc = {"experiment": "ttft-opt", "target": 0.95, "ranking": ["awq-fa2", "fp16"], "variants": result}
    plain = render_table(doc).splitlines()
    assert "identical" not in plain[1]  # no mirror replay: no column
    doc.update(
        control="fp16",
        fidelity={"fp16": None, "awq-fa2": {"identical": {"estimate": 0.9345}}},
        fidelity_note="answers identical to the control's: from the mirror replay's report (run 1)",
    )
    lines = render_table(doc).splitlines()
    assert lines[1].endswith(" identical") and len(lines[1]) == len(plain[1]) + 11
    assert lines[3].startswith("awq-fa2") and lines[3].endswith(" 93.5%")
    assert lines[4].startswith("fp16") and lines[4].endswith(" ref")
    assert lines[-1] == "  answers identical to the control's: from the mirror replay's report (run 1)"
