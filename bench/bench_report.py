"""SLA report and dashboard page over 1M and 10M synthetic samples in the ClickHouse server.

    scripts/clickhouse.sh start
    .venv/bin/python bench/bench_report.py [--sizes 1000000,10000000] [--reuse] [--live N]
    .venv/bin/python bench/bench_report.py --quick     # 20k samples, 1 repeat, the same tables

Samples carry no inter-token gaps (synthetic gaps=False, as rows recorded before gaps were kept), so
the figures stay comparable with earlier runs and 10M samples fit in memory (with gaps they
would be ~1.3 billion values); --gaps adds them (~135 per successful request), and --quick
always does. What the gaps cost: bench/bench_itl.py.

Each size lives in its own database (abplat_bench_1m, abplat_bench_10m): loaded through
SampleStore.insert_columns with 0.1% older duplicate recordings, then SampleStore.deduplicate()
and the run's report rollup (analysis.rollup.build_run_rollup), as a finished replay does.
--reuse skips the load when the table already holds exactly that many rows (the rollup is
rebuilt every time, and timed).

Times, median of 3:
- report COLD: build_report, no cache, every query runs; from the run's rollup (the path a
  finished run takes), and from the raw samples (use_rollup=False: the baseline, the path of a
  run still replaying or a time window), side by side;
- report HOT: report_for through Django's cache (locmem), data unchanged: one data_version scan;
- page COLD / HOT: the dashboard through Django's test client, cache cleared / warm;
- rollup build: once per finished run, in the replay's finish step.
- --live N: then a second run of N samples without a rollup (as a run still replaying) is added,
  the report over both timed (rollup + raw live run, and all raw), and the run deleted again.
Bytes: the page's HTML (plotly.js is a separate asset cached for a year, reported once).
Targets: report < 1 s at 10M, page < 2 s, page < 1 MB.

Checks (any failure prints `bench FAILED: <what and where>` to stderr and exits 1): the ClickHouse
server answers; the table holds exactly the samples loaded; the rollup holds them all; the report
counts per variant equal the table's; the report from the rollup (and from rollup + live run)
equals the report from the raw samples; the hot report and page come from the cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

BASE_URL = os.environ.get("ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench")


def check(ok: object, what: str) -> None:
    if not ok:
        raise BenchFailed(what)


def same_numbers(a, b, path: str = "") -> str | None:
    """Where two reports differ ("" path = equal): floats to 1e-9 relative, except the p99 chart
    (the rollup's value is within its 1 ms bucket) and timing/generated_at/the chart note."""
    import math

    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{path}: keys differ"
        for k in a:
            if k in ("timing", "generated_at") or f"{path}.{k}" == ".timeseries.note":
                continue
            if (d := same_numbers(a[k], b[k], f"{path}.{k}")) is not None:
                return d
        return None
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (d := same_numbers(x, y, f"{path}[{i}]")) is not None:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float):
        tol = 1.0 if ".p99_ttft_ms." in path and path.endswith(".p99") else 1e-9 * max(1.0, abs(a))
        return None if (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol else f"{path}: {a} != {b}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


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
    ap.add_argument("--quick", action="store_true", help="smoke run: 20k samples (+5k live), 1 repeat")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--live",
        type=int,
        default=0,
        help="also add a second run of N samples without a rollup (a run still replaying) and time "
        "the report over both (rollup + raw), then delete it",
    )
    ap.add_argument("--gaps", action="store_true", help="samples with inter-token gaps")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeat, args.live, args.gaps = "20000", 1, args.live or 5000, True
    sys.exit(run_checked(run, args))


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()

    from analysis import report as r
    from analysis import rollup
    from analysis.definitions import Filters, Slo
    from analysis.readers.raw import RawReader
    from samples import synthetic
    from samples.backends.clickhouse import ClickHouseServerBackend
    from stats import quantiles

    rows = []
    live_rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        url = f"{BASE_URL}_{size_label(size)}"
        store = ClickHouseServerBackend(url, send_receive_timeout=900)
        try:
            store.migrate()
        except Exception as e:  # noqa: BLE001 - the precondition, named
            raise BenchFailed(f"ClickHouse server at {url} not usable: {type(e).__name__}: {e}") from None
        spec = synthetic.SyntheticSpec(
            n=size,
            seed=1,
            variants=synthetic.demo_variants(),
            factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
            config_revisions=(1, 2),
            duplicate_rate=0.001,
            gaps=args.gaps,
        )
        have, with_gaps = store.query("SELECT count(), countIf(notEmpty(itl_gaps_us)) FROM samples")[0]
        if not (args.reuse and have == size and bool(with_gaps) == args.gaps):
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
        have = store.query("SELECT count() FROM samples")[0][0]
        check(have == size, f"{store.database}: the samples table holds {have} rows after loading {size}")
        slo = Slo(200.0)
        t = time.perf_counter()
        built = rollup.build_run_rollup(store, "ttft-opt", spec.run_id, slo)
        build_s = time.perf_counter() - t
        check(
            built is not None and built.rows == size, f"rollup of run {spec.run_id}: {built} != {size} rows"
        )
        # time the report as it runs in steady state: after the previous build's rows (from an
        # earlier bench run) have been deleted (ALTER ... DELETE runs in the background)
        deadline = time.monotonic() + 300
        while rollup.rollup_rows(store, "ttft-opt", current_only=False) != rollup.rollup_rows(
            store, "ttft-opt"
        ):
            if time.monotonic() > deadline:
                print("warning: earlier rollup rows are still being deleted", flush=True)
                break
            time.sleep(1)
        print(
            f"rollup of run {spec.run_id}: {built.rows} samples in {build_s:.1f} s, "
            f"rows {rollup.rollup_rows(store, 'ttft-opt')}",
            flush=True,
        )
        exp = r.ExperimentInfo(
            "ttft-opt",
            "bench",
            slo,
            0.9,
            [r.VariantInfo(v.key, v.control, v.weight, v.factors) for v in spec.variants],
        )
        f = Filters("ttft-opt")
        per_variant = dict(store.query("SELECT variant, count() FROM samples GROUP BY variant"))
        # side by side, alternating: rollup, raw, rollup, raw, ...
        fast, raw = [], []
        reports = {}
        for _ in range(args.repeat):
            for out, use in ((fast, True), (raw, False)):
                quantiles._quantile_ci_ranks.cache_clear()  # cold: the in-process rank cache too
                t = time.perf_counter()
                rep = r.build_report(store, exp, f, use_rollup=use)
                out.append(time.perf_counter() - t)
                want = "rollup" if use else "samples"
                check(rep["timing"]["source"] == want, f"{size}: report source {rep['timing']} (want {want})")
                reports[use] = rep
        check_report(reports[True], reports[False], per_variant, f"{size} samples")
        cold_s, raw_s = statistics.median(fast), statistics.median(raw)
        version_s, _ = timed(lambda: RawReader(store).data_version("ttft-opt"), args.repeat)  # noqa: B023
        page = dashboard_page(url, args.repeat)
        rows.append(
            (
                size,
                cold_s,
                raw_s,
                page["report_hot_s"],
                page["cold_s"],
                page["hot_s"],
                page["bytes"],
                page["js_bytes"],
                build_s,
            )
        )
        print(
            f"{size}: report cold {cold_s:.3f} s from the rollup, {raw_s:.2f} s from raw samples; "
            f"hot {page['report_hot_s']:.3f} s; page cold {page['cold_s']:.2f} s, hot {page['hot_s']:.3f} s, "
            f"{page['bytes']} B; data_version {version_s:.3f} s",
            flush=True,
        )
        if args.live:
            live_rows.append((size, *_with_live_run(store, spec, exp, f, args.live, args.repeat)))
        store.close()
    for size, n_live, mixed_s, raw_s in live_rows:
        print(
            f"\n{size:,} finished + {n_live:,} live samples: report cold {mixed_s:.3f} s "
            f"(rollup + raw live run), {raw_s:.2f} s from raw samples ({raw_s / mixed_s:.1f}x)"
        )
    print()
    print(
        "| samples | report COLD s (rollup) | report COLD s (raw samples, baseline) | raw / rollup "
        "| report HOT s | page COLD s | page HOT s | page HTML kB | plotly.js gzip kB | rollup build s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, cold, raw_s, rhot, pcold, phot, pb, jb, build_s in rows:
        print(
            f"| {size:,} | {cold:.3f} | {raw_s:.2f} | {raw_s / cold:.1f}x | {rhot:.3f} | {pcold:.2f} | "
            f"{phot:.3f} | {pb / 1024:.0f} | {jb / 1024:.0f} | {build_s:.1f} |"
        )
    print("targets: report < 1 s at 10M, page < 2 s, page < 1 MB")


def check_report(fast: dict, raw: dict, per_variant: dict, where: str) -> None:
    """The report counts what the table holds, and the rollup path equals the raw path."""
    got = {v["key"]: v["n"] for v in raw["variants"]}
    check(got == per_variant, f"{where}: report n per variant {got} != samples per variant {per_variant}")
    diff = same_numbers(raw, fast)
    check(diff is None, f"{where}: the report from the rollup differs from the raw report at {diff}")


def _with_live_run(store, spec, exp, f, n: int, repeat: int) -> tuple[int, float, float]:
    """Add run 2 (n samples, no rollup) beside the finished one, time the report both ways,
    delete run 2 again. Returns (n, median rollup + raw, median raw)."""
    import dataclasses

    from analysis import report as r
    from samples import synthetic
    from stats import quantiles

    live = dataclasses.replace(
        spec,
        run_id=2,
        n=n,
        seed=2,
        duplicate_rate=0.0,
        start_unix_ms=spec.start_unix_ms + spec.duration_s * 1000,
    )
    synthetic.insert(store, synthetic.generate(live), chunk_rows=1_000_000)
    try:
        mixed, raw, reports = [], [], {}
        for _ in range(repeat):
            for out, use in ((mixed, True), (raw, False)):
                quantiles._quantile_ci_ranks.cache_clear()
                t = time.perf_counter()
                rep = r.build_report(store, exp, f, use_rollup=use)
                out.append(time.perf_counter() - t)
                want = "rollup+samples" if use else "samples"
                check(
                    rep["timing"]["source"] == want, f"live run: report source {rep['timing']} (want {want})"
                )
                reports[use] = rep
        per_variant = dict(store.query("SELECT variant, count() FROM samples GROUP BY variant"))
        check_report(reports[True], reports[False], per_variant, f"{spec.n} + {n} live samples")
        return n, statistics.median(mixed), statistics.median(raw)
    finally:
        store.execute("ALTER TABLE samples DELETE WHERE run_id = 2")
        deadline = time.monotonic() + 300
        while (
            store.query("SELECT count() FROM samples WHERE run_id = 2")[0][0] and time.monotonic() < deadline
        ):
            time.sleep(0.5)


def dashboard_page(url: str, repeat: int, cluster: str = "") -> dict[str, float]:
    """The dashboard of experiment ttft-opt (this bench's three variants) over the store at url
    (through the Distributed tables of ``cluster`` when given), in a fresh test database: page
    cold (cache cleared) and hot, the hot report_for, the page's and plotly.js's bytes."""
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

    from analysis.definitions import Filters
    from dashboards.reports import report_for
    from samples.factory import _cache

    if not getattr(utils, "_TestState", None) or not hasattr(utils._TestState, "saved_data"):
        setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False)
    try:
        from experiments.models import Experiment, Team, Variant

        team = Team.objects.get_or_create(name="default")[0]  # every experiment belongs to a team
        e = Experiment.objects.create(
            key="ttft-opt", name="bench", team=team, sla_ttft_ms=200, sla_target=0.9
        )
        for i, (k, w, fac) in enumerate(
            [
                ("fp16", 34, {"quantization": "none", "attention": "sdpa"}),
                ("awq", 33, {"quantization": "awq", "attention": "sdpa"}),
                ("awq-fa2", 33, {"quantization": "awq", "attention": "flash_attn_2"}),
            ]
        ):
            Variant.objects.create(
                experiment=e,
                key=k,
                position=i,
                control=i == 0,
                weight=w,
                endpoint="http://127.0.0.1:1/v1",
                model="m",
                factors=fac,
            )
        user = User.objects.create_superuser("bench", password="x")
        with override_settings(
            CLICKHOUSE_URL=url, CLICKHOUSE_CLUSTER=cluster
        ):  # the project's own URLs (abplat/urls.py)
            _cache.clear()
            c = Client()
            c.force_login(user)
            cold_s, resp = timed(lambda: c.get("/dashboards/ttft-opt/"), repeat, before=cache.clear)
            check(resp.status_code == 200, f"page cold: HTTP {resp.status_code} {resp.content[:300]!r}")
            hot_s, resp = timed(lambda: c.get("/dashboards/ttft-opt/"), repeat)
            check(resp.status_code == 200, f"page hot: HTTP {resp.status_code} {resp.content[:300]!r}")
            # warm the entry of this in-memory experiment (its unsaved sla_ttft_ms is an int, the
            # page's from the database a float: another cache key), then every timed call hits
            report_for(e, Filters("ttft-opt"))
            report_hot_s, rep = timed(lambda: report_for(e, Filters("ttft-opt")), repeat)
            check(rep["timing"]["cache"] == "hit", f"hot report not from the cache: {rep['timing']}")
            from dashboards.views import plotly_url

            js = c.get(plotly_url(), HTTP_ACCEPT_ENCODING="gzip")
            check(js.status_code == 200 and js.content, f"plotly.js asset: HTTP {js.status_code}")
        return {
            "cold_s": cold_s,
            "hot_s": hot_s,
            "report_hot_s": report_hot_s,
            "bytes": len(resp.content),
            "js_bytes": len(js.content),
        }
    finally:
        teardown_databases(old, verbosity=0)
        connection.close()


if __name__ == "__main__":
    main()
