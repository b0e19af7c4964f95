"""SLA report and dashboard page over 1M and 10M synthetic samples in the ClickHouse server.

    scripts/clickhouse.sh start
    .venv/bin/python bench/bench_report.py [--sizes 1000000,10000000] [--reuse]

Each size lives in its own database (abplat_bench_1m, abplat_bench_10m): loaded through
SampleStore.insert_columns with 0.1% older duplicate recordings, then SampleStore.deduplicate()
as a finished replay does (the dedup contract). --reuse skips the load when the table already
holds exactly that many rows.

Times, median of 3:
- report COLD: build_report, no cache (every query runs);
- report HOT: report_for through Django's cache (locmem), data unchanged: one data_version scan;
- page COLD / HOT: the dashboard through Django's test client, cache cleared / warm;
- baseline, side by side: one pass of the old design (a FROM samples FINAL summary), which the
  old report ran ~6 times.
Bytes: the page's HTML (plotly.js is a separate asset cached for a year, reported once).
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

BASE_URL = os.environ.get("ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench")


def timed(fn, repeat: int = 3, before=None) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def size_label(size: int) -> str:
    return f"{size // 1_000_000}m" if size % 1_000_000 == 0 else str(size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000000,10000000")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import django

    django.setup()

    from dashboards import queries as q
    from dashboards import report as r
    from samples import synthetic
    from samples.store import ClickHouseServerBackend

    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        url = f"{BASE_URL}_{size_label(size)}"
        store = ClickHouseServerBackend(url, send_receive_timeout=900)
        store.migrate()
        spec = synthetic.SyntheticSpec(
            n=size, seed=1, variants=synthetic.demo_variants(),
            factor_effects=synthetic.DEMO_FACTOR_EFFECTS, config_revisions=(1, 2),
            duplicate_rate=0.001,
        )  # fmt: skip
        have = store.query("SELECT count() FROM samples")[0][0]
        if not (args.reuse and have == size):
            store.execute("TRUNCATE TABLE samples")
            t = time.perf_counter()
            data = synthetic.generate(spec)
            gen_s = time.perf_counter() - t
            t = time.perf_counter()
            synthetic.insert(store, data, chunk_rows=1_000_000)
            ins_s = time.perf_counter() - t
            del data
            t = time.perf_counter()
            removed = store.deduplicate()
            print(
                f"loaded {size} (+{removed} duplicates) into {store.database}: generate {gen_s:.1f} s, "
                f"insert {ins_s:.1f} s, deduplicate {time.perf_counter() - t:.1f} s",
                flush=True,
            )
        exp = r.ExperimentInfo(
            "ttft-opt", "bench", q.Slo(200.0), 0.9,
            [r.VariantInfo(v.key, v.control, v.weight, v.factors) for v in spec.variants],
        )  # fmt: skip
        f = q.Filters("ttft-opt")
        cold_s, rep = timed(lambda: r.build_report(store, exp, f), args.repeat)  # noqa: B023
        final_s, _ = timed(lambda: store.query(  # noqa: B023
            "SELECT variant, count(), countIf(outcome = 'ok' AND ttft_ms < 200) "
            "FROM samples FINAL WHERE experiment = 'ttft-opt' GROUP BY variant"), args.repeat)  # fmt: skip
        version_s, _ = timed(lambda: q.data_version(store, "ttft-opt"), args.repeat)  # noqa: B023
        page = _page(url, args.repeat)
        rows.append((size, cold_s, page["report_hot_s"], page["cold_s"], page["hot_s"], page["bytes"],
                     page["js_bytes"], final_s, version_s))  # fmt: skip
        print(
            f"{size}: report cold {cold_s:.2f} s, hot {page['report_hot_s']:.3f} s; page cold "
            f"{page['cold_s']:.2f} s, hot {page['hot_s']:.3f} s, {page['bytes']} B; one FINAL pass "
            f"(old design x6) {final_s:.2f} s; data_version {version_s:.3f} s",
            flush=True,
        )
        store.close()
    print()
    head = (
        f"{'samples':>10} {'report cold s':>13} {'report hot s':>12} {'page cold s':>11} "
        f"{'page hot s':>10} {'page kB':>7} {'plotly.js gz kB':>15} {'old FINAL pass s':>16}"
    )
    print(head)
    for size, cold, rhot, pcold, phot, pb, jb, fin, _ in rows:
        print(
            f"{size:>10} {cold:>13.2f} {rhot:>12.3f} {pcold:>11.2f} {phot:>10.3f} {pb / 1024:>7.0f} "
            f"{jb / 1024:>15.0f} {fin:>16.2f}"
        )
    print("targets: report < 1 s at 10M, page < 2 s, page < 1 MB")
    print("ratio report cold / one old FINAL pass: " + ", ".join(
        f"{size}: {cold / fin:.2f}" for size, cold, *_r, fin, _v in rows))  # fmt: skip


def _page(url: str, repeat: int) -> dict[str, float]:
    from django.contrib.auth.models import User
    from django.core.cache import cache
    from django.db import connection
    from django.test import Client, utils
    from django.test.utils import (
        override_settings,
        setup_databases,
        setup_test_environment,
        teardown_databases,
    )

    from dashboards import queries as q
    from dashboards.report import report_for
    from samples.factory import _cache

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
        with override_settings(CLICKHOUSE_URL=url, ROOT_URLCONF="bench.bench_report_urls"):
            _cache.clear()
            c = Client()
            c.force_login(user)
            cold_s, resp = timed(lambda: c.get("/dashboards/ttft-opt/"), repeat, before=cache.clear)
            assert resp.status_code == 200, resp.content[:500]
            hot_s, resp = timed(lambda: c.get("/dashboards/ttft-opt/"), repeat)
            assert resp.status_code == 200, resp.content[:500]
            report_hot_s, rep = timed(lambda: report_for(e, q.Filters("ttft-opt")), repeat)
            assert rep["timing"]["cache"] == "hit", rep["timing"]
            from dashboards.views import plotly_url

            js = c.get(plotly_url(), HTTP_ACCEPT_ENCODING="gzip")
        return {"cold_s": cold_s, "hot_s": hot_s, "report_hot_s": report_hot_s,
                "bytes": len(resp.content), "js_bytes": len(js.content)}  # fmt: skip
    finally:
        teardown_databases(old, verbosity=0)
        connection.close()


if __name__ == "__main__":
    main()
