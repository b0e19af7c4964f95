"""SLA report and dashboard page over 1M and 10M synthetic samples in the ClickHouse server.

    scripts/clickhouse.sh start
    .venv/bin/python bench/bench_report.py [--sizes 1000000,10000000] [--reuse]

Loads each size into database abplat_bench (table reloaded unless --reuse and the row count
matches), then times: the whole report (build_report), its dedup choice (FINAL vs argMax per
key on the summary query, side by side), and the dashboard page rendered by Django's test
client (bytes of HTML; plotly.js is a separate, cached-for-a-year asset, reported once).
Targets: report < 1 s at 10M, page < 2 s, page < 1 MB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

URL = os.environ.get("ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench")


def timed(fn, repeat: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000000,10000000")
    ap.add_argument("--reuse", action="store_true")
    args = ap.parse_args()

    import django

    django.setup()
    from django.conf import settings
    from django.test import Client
    from django.test.utils import override_settings, setup_test_environment

    from dashboards import queries as q
    from dashboards import report as r
    from samples import synthetic
    from samples.factory import _cache
    from samples.store import ClickHouseServerBackend

    store = ClickHouseServerBackend(URL, send_receive_timeout=600)
    store.migrate()
    from samples import schema

    # idempotent: another bench may have dropped the table while keeping the migration record
    store.execute(schema.CREATE_SAMPLES_TABLE)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        spec = synthetic.SyntheticSpec(
            n=size, seed=1, variants=synthetic.demo_variants(),
            factor_effects=synthetic.DEMO_FACTOR_EFFECTS, config_revisions=(1, 2),
            duplicate_rate=0.001,
        )  # fmt: skip
        have = store.query("SELECT count() FROM samples")[0][0]
        if not (args.reuse and have == size + round(size * spec.duplicate_rate)):
            store.execute("TRUNCATE TABLE samples")
            t = time.perf_counter()
            data = synthetic.generate(spec)
            gen_s = time.perf_counter() - t
            t = time.perf_counter()
            synthetic.insert(store, data, chunk_rows=1_000_000)
            print(
                f"loaded {data.n_rows} rows: generate {gen_s:.1f} s, insert {time.perf_counter() - t:.1f} s"
            )
            del data
        exp = r.ExperimentInfo(
            "ttft-opt", "bench", q.Slo(200.0), 0.9,
            [r.VariantInfo(v.key, v.control, v.weight, v.factors) for v in spec.variants],
        )  # fmt: skip
        f = q.Filters("ttft-opt")
        report_s, rep = timed(lambda: r.build_report(store, exp, f), repeat=2)  # noqa: B023
        final_s, _ = timed(lambda: store.query(
            "SELECT variant, count(), countIf(outcome = 'ok' AND ttft_ms < 200) "
            "FROM samples FINAL WHERE experiment = 'ttft-opt' GROUP BY variant"), repeat=2)  # fmt: skip
        argmax_s, _ = timed(lambda: store.query(
            "SELECT variant, count(), countIf(o = 'ok' AND t < 200) FROM (SELECT variant, "
            "argMax(outcome, recorded_ms) AS o, argMax(ttft_ms, recorded_ms) AS t FROM samples "
            "WHERE experiment = 'ttft-opt' GROUP BY variant, run_id, seq, request_id) "
            "GROUP BY variant"), repeat=2)  # fmt: skip

        # the page, through Django, against a throwaway SQLite experiment row
        page_s, page_bytes, js_bytes = _page(
            settings, Client, override_settings, setup_test_environment, _cache
        )
        rows.append((size, report_s, final_s, argmax_s, page_s, page_bytes, js_bytes, rep["timing"]))
        print(f"{size}: report {report_s:.2f} s, FINAL {final_s:.2f} s, argMax {argmax_s:.2f} s, "
              f"page {page_s:.2f} s {page_bytes} B", flush=True)  # fmt: skip
    print()
    print(
        f"{'samples':>10} {'report s':>9} {'FINAL s':>8} {'argMax s':>9} {'page s':>7} {'page kB':>8} {'plotly.js gz kB (once)':>23}"
    )
    for size, rep_s, fin, arg, page_s, pb, jb, _ in rows:
        print(
            f"{size:>10} {rep_s:>9.2f} {fin:>8.2f} {arg:>9.2f} {page_s:>7.2f} {pb / 1024:>8.0f} {jb / 1024:>23.0f}"
        )
    print("targets: report < 1 s at 10M, page < 2 s, page < 1 MB; FINAL vs argMax = dedup choice")


def _page(settings, Client, override_settings, setup_test_environment, cache):
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import utils
    from django.test.utils import setup_databases, teardown_databases

    if not getattr(utils, "_TestState", None) or not hasattr(utils._TestState, "saved_data"):
        setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False)
    try:
        from experiments.models import Experiment, Variant

        e = Experiment.objects.create(key="ttft-opt", name="bench", sla_ttft_ms=200, sla_target=0.9)
        for i, (k, w, fac) in enumerate([
            ("fp16", 34, {"quantization": "none", "attention": "sdpa"}),
            ("awq", 33, {"quantization": "awq", "attention": "sdpa"}),
            ("awq-fa2", 33, {"quantization": "awq", "attention": "flash_attn_2"}),
        ]):  # fmt: skip
            Variant.objects.create(experiment=e, key=k, position=i, control=i == 0, weight=w,
                                   endpoint="http://127.0.0.1:1/v1", model="m", factors=fac)  # fmt: skip
        user = User.objects.create_superuser("bench", password="x")
        with override_settings(CLICKHOUSE_URL=URL, ROOT_URLCONF="bench.bench_report_urls"):
            cache.clear()
            c = Client()
            c.force_login(user)
            page_s, resp = timed(lambda: c.get("/dashboards/ttft-opt/"), repeat=2)
            assert resp.status_code == 200, resp.content[:500]
            from dashboards.views import plotly_url

            js = c.get(plotly_url(), HTTP_ACCEPT_ENCODING="gzip")
        return page_s, len(resp.content), len(js.content)
    finally:
        teardown_databases(old, verbosity=0)
        connection.close()


if __name__ == "__main__":
    main()
