"""End to end: a trace replayed through the simulator (eager Celery) stores every
inter-token gap of every request, output tokens - 1 of them, and the report pools exactly those."""

import io

import numpy as np
import pytest
from django.core.management import call_command

from analysis.definitions import Filters
from dashboards import reports as report
from stats.quantiles import REPORT_QUANTILES
from workers.models import ReplayRun

pytestmark = pytest.mark.engine

TRACE = "data/traces/azure_llm_2023_code.csv"


@pytest.mark.django_db(transaction=True)
def test_a_replay_stores_one_gap_per_output_token_after_the_first(running, sample_store):
    out = io.StringIO()
    call_command("replay", "ttft-opt", "--trace", TRACE, "--limit", "60", "--speed", "200", stdout=out)
    run = ReplayRun.objects.get()
    assert run.status == "done", (run.error, out.getvalue())
    rows = sample_store.query(
        "SELECT variant, outcome, output_tokens, usage_reported, chunks, itl_gaps_us, itl_mean_ms, itl_max_ms "
        "FROM samples FINAL WHERE run_id = %(r)s",
        {"r": run.pk},
    )
    assert len(rows) == 60 and {r[1] for r in rows} == {"ok"}
    for _v, _o, tokens, usage, chunks, gaps, mean_ms, max_ms in rows:
        assert usage == 1 and tokens >= 2
        assert len(gaps) == tokens - 1 == chunks - 1  # one token a chunk: a gap after each but the first
        assert all(isinstance(g, int) and g >= 0 for g in gaps)
        # whole microseconds of the same clock the per-request statistics come from
        assert abs(np.mean(gaps) / 1000 - mean_ms) <= 0.00051 and abs(max(gaps) / 1000 - max_ms) <= 0.00051
    # the report pools exactly these gaps, per variant
    exp = report.experiment_info(running)
    rep = report.build_report(sample_store, exp, Filters("ttft-opt"), use_rollup=False)
    for entry in rep["variants"]:
        pooled = np.sort(
            np.concatenate([np.asarray(r[5], dtype=np.float64) for r in rows if r[0] == entry["key"]])
        )
        pooled /= 1000.0
        assert entry["itl"]["gaps"] == pooled.size and entry["itl"]["requests_without_gaps"] == 0
        for est, quant in zip(entry["percentiles"]["itl_ms"], REPORT_QUANTILES, strict=True):
            assert est["n"] == pooled.size
            assert est["value"] == np.quantile(pooled, quant, method="inverted_cdf")
    fast = report.build_report(sample_store, exp, Filters("ttft-opt"))
    assert fast["timing"]["source"] == "rollup"
    assert [v["percentiles"]["itl_ms"] for v in fast["variants"]] == [
        v["percentiles"]["itl_ms"] for v in rep["variants"]
    ]
