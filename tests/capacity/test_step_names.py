"""How a search's steps read (capacity.labels, the capacity page): the report's glue names each
step's run as a capacity step from the stored search, a step replaying now or cut short by a
failure says so, rates read as the search sent them, and a chart with nothing to draw says why.

The stored results are the search's own: capacity.search.run_search over a model deployment
(met up to EDGE req/s) and capacity.service's entries, as execute_search stores them."""

from __future__ import annotations

import re

import pytest

from capacity import search as s
from capacity.labels import search_labels
from capacity.models import CapacitySearch
from capacity.service import searching_entry, variant_result
from dashboards.reports import labelled_catalog
from experiments import services

EDGE = 41.0
COST = {"per_hour": 3.6, "currency": "USD"}


def model_probe(first_run: int):
    """A deployment that meets the target up to EDGE req/s; each step is run ``first_run``, +1..."""
    runs = iter(range(first_run, first_run + 100))

    def probe(rate: float) -> s.StepResult:
        ok = rate <= EDGE
        return s.StepResult(
            rate,
            s.MEETS if ok else s.MISSES,
            600,
            600 if ok else 300,
            run_id=next(runs),
            attainment_lo=0.96 if ok else 0.4,
            attainment_hi=1.0 if ok else 0.6,
            ttft_p50_ms=30.0 * rate / 10,
            ttft_p99_ms=60.0 * rate / 10,
            lag_p99_ms=1.5,
        )

    return probe


def searched(first_run: int = 100) -> dict:
    cap = s.run_search(s.SearchSpec(0.95, start_rps=32.0, max_rps=128.0, min_rps=4.0), model_probe(first_run))
    return variant_result(cap, COST, 93.4)


@pytest.fixture
def exp(document, users):
    exp = services.apply_document(document, actor=users["product"]).experiment
    services.transition(exp, "start", users["product"])
    return exp


def test_bisection_sends_short_rates_and_they_read_as_sent():
    r = searched()
    rates = [st["rate_rps"] for st in r["steps"]]
    assert rates[:3] == [32.0, 64.0, 45.0]  # 45, not sqrt(32 x 64) = 45.254833995939045
    assert all(len(s.rate_text(x)) <= 4 for x in rates), rates
    assert [s.rate_text(x) for x in (128.0, 45.5, 0.05, 45.254833995939045, 1e6)] == [
        "128",
        "45.5",
        "0.05",
        "45.3",
        "1000000",
    ]
    assert s.short_rate(45.254833995939045, 45.0, 45.5) == 45.3  # 45 is the bracket's end: not sent again
    assert r["message"] == f"meets 95.00% at {s.rate_text(r['capacity_rps'])} req/s; not met at " + (
        f"{s.rate_text(r['upper_rps'])} req/s"
    )


@pytest.mark.django_db
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
def test_the_reports_glue_names_every_step_of_a_search_done_running_or_failed(weights_backend, exp):
    done = searched(100)
    CapacitySearch.objects.create(experiment=exp, status="done", result={"fp16": done})
    running = searching_entry(searched(200)["steps"][:2], {"run_id": 202, "rate_rps": 45.0})
    CapacitySearch.objects.create(experiment=exp, status="running", result={"awq-fa2": running})
    failed = searching_entry(searched(300)["steps"][:1], {"run_id": 301, "rate_rps": 64.0})
    CapacitySearch.objects.create(experiment=exp, status="failed", result={"fp16": failed})

    names = search_labels(CapacitySearch.objects.filter(experiment=exp))
    first = done["steps"][0]
    assert names[first["run_id"]] == {
        "label": "capacity step run 100 (fp16 at 32 req/s: meets)",
        "complete": True,
    }
    assert names[101] == {"label": "capacity step run 101 (fp16 at 64 req/s: misses)", "complete": True}
    assert names[202] == {
        "label": "capacity step run 202 (awq-fa2 at 45 req/s: replaying)",
        "complete": False,
    }
    assert names[301] == {
        "label": "capacity step run 301 (fp16 at 64 req/s: cut short, the search failed)",
        "complete": False,
    }
    # through the signal the report's glue sends (capacity's AppConfig connects the receiver)
    catalog = [{"run_id": i, "status": "cancelled", "mode": "mirror", "version": 1} for i in (7, 101, 301)]
    got = {c["run_id"]: (c.get("label"), c.get("complete")) for c in labelled_catalog(exp.key, catalog)}
    assert got == {7: (None, None), 101: (names[101]["label"], True), 301: (names[301]["label"], False)}
    assert labelled_catalog("another-experiment", catalog) == catalog


@pytest.mark.django_db
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
def test_the_page_reads_rates_as_sent_money_as_money_and_names_the_steps(weights_backend, exp, users, client):
    r = searched(100)
    CapacitySearch.objects.create(
        experiment=exp,
        status="done",
        result={"fp16": r},
        params={"target": 0.95, "step_requests": 600, "warmup_s": 2.0},
    )
    client.force_login(users["analyst"])
    html = client.get(f"/capacity/{exp.key}/").content.decode()
    row = re.search(r"<tr><td>fp16</td>(.*?)</tr>", html, re.S).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[:2] == [s.rate_text(r["capacity_rps"]), s.rate_text(r["upper_rps"])]
    assert f"{r['cost']['per_million_requests']:,.2f} USD" in cells and "93" in cells
    assert "not met at (req/s)" in html and "edge below" not in html
    assert re.search(r"\d\.000\b", html.split("<script")[0]) is None
    for st in r["steps"]:
        assert f">capacity step run {st['run_id']}</a>" in html
    assert 'class="empty-chart"' not in html


@pytest.mark.django_db
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
def test_an_empty_chart_says_why_and_a_step_cut_short_says_so(weights_backend, exp, users, client):
    client.force_login(users["analyst"])
    CapacitySearch.objects.create(experiment=exp, status="running", result={})
    html = client.get(f"/capacity/{exp.key}/").content.decode()
    assert html.count('<p class="empty-chart">No step has judged a request yet: the search is running') == 2
    assert "data-figure>" not in html and "application/json" not in html  # nothing handed to plotly
    failed = CapacitySearch.objects.create(
        experiment=exp,
        status="failed",
        error="capacity step at 64 req/s (run 9) failed: boom",
        result={"fp16": searching_entry([], {"run_id": 9, "rate_rps": 64.0})},
    )
    html = client.get(f"/capacity/{exp.key}/?search={failed.pk}").content.decode()
    assert "The search failed before any step judged a request: its error is above." in html
    assert "cut short after 0 steps: the search failed" in html
    assert "<td>cut short, the search failed</td>" in html and ">capacity step run 9</a>" in html


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("weights_backend", ["local"], indirect=True)
@pytest.mark.engine
def test_a_step_whose_run_someone_else_cancels_is_cut_short_not_undecided(
    weights_backend, ch_store, trace, document, users
):
    # Someone cancels the step's run (the replay's own cancel) before it decided: what it judged
    # is no verdict, so the step raises instead of passing for "undecided" (not meeting), and the
    # search that ran it fails with that step named as cut short.
    from capacity.service import Options, step_plan
    from capacity.steps import StepCutShort, run_step
    from workers.models import ReplayRun
    from workers.runs import cancel_run

    for v in document["variants"]:
        v["api"] = "completions"  # the trace's prompts are completions prompts
    exp = services.apply_document(document, actor=users["product"]).experiment
    services.transition(exp, "start", users["product"])
    opts = Options(trace=str(trace), source_format="jsonl", step_requests=100, warmup_s=0.0)
    plan = step_plan(exp, opts, s.SearchSpec(0.95, start_rps=8.0, max_rps=16.0))
    seen: list[int] = []

    def someone_cancels(run_id: int) -> None:
        seen.append(run_id)
        cancel_run(ReplayRun.objects.get(pk=run_id), users["sre"])

    with pytest.raises(
        StepCutShort, match=r"capacity step at 8 req/s \(run \d+\) was cancelled before it decided"
    ) as e:
        run_step(plan, "fp16", 8.0, on_run=someone_cancels)
    assert e.value.run_id == seen[0] and ReplayRun.objects.get(pk=seen[0]).status == "cancelled"
