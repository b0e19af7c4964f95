"""ITL over all gaps: what keeping every inter-token gap costs on disk, and what the
report's ITL becomes on a replay of the demo profiles.

    scripts/clickhouse.sh start
    .venv/bin/python bench/bench_itl.py [--samples 100000] [--limit 1100 --speed 35]
    .venv/bin/python bench/bench_itl.py --quick     # 5k samples, a 60-request replay at the demo's 35x

1. Storage: --samples synthetic samples (samples.synthetic, the demo's three arms; output tokens
   uniform in 16..255, so ~135 gaps a successful request) into the ClickHouse server twice, in two
   databases: with their gaps, and without (gaps=False, as rows recorded before the column). Both
   OPTIMIZE ... FINAL'd into whole parts, then the bytes of every column on disk from
   system.parts_columns (active parts; compressed data + marks): bytes per sample of itl_gaps_us,
   of the rest of the row, and per gap; the run's rollup (analysis.rollup) and its rollup_gaps
   rows against the gaps they stand for; the report's time from the raw samples and from the
   rollup, each with and without gaps.
2. The demo: `manage.py demo --no-serve --json` (what `make demo` runs: --limit requests of
   the demo's chat-sized slice of the code trace at --speed, by default the demo's own 1,100 at
   35x (workers/demo.py LIMIT, SPEED), to the fp16 / awq / awq-fa2 simulator profiles at once
   (mirror), eager Celery; its capacity search skipped) into a third database; then per variant, from the stored samples of its replay run: the old itl_ms (the
   per-request mean ITL, itl_mean_ms), the pooled ITL over every gap and TPOT, p50 and p99
   (nearest rank), beside the report's, and the bytes of the run's gaps on disk.

Checks (any failure prints `bench FAILED: <what and where>` and exits 1): the server answers;
each table holds the samples loaded; every successful synthetic request has output_tokens - 1
gaps stored and the baseline none; the report's ITL n and percentiles equal numpy's over the
stored gaps, from the raw samples and from the rollup alike; rollup_gaps counts every gap; the
demo replay finishes with every request ok, output_tokens - 1 gaps per request, and the report's
ITL and TPOT equal the ones computed here. The three databases are dropped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

# The demo's own load (workers/demo.py LIMIT and SPEED; tests/bench checks they agree).
DEMO_LIMIT, DEMO_SPEED = 1100, 35.0
DEFAULT_URL = os.environ.get(
    "ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench"
)


def check(ok: object, what: str) -> None:
    if not ok:
        raise BenchFailed(what)


def with_database(url: str, suffix: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + suffix))


def open_store(url: str):
    from samples.backends.clickhouse import ClickHouseServerBackend
    from samples.store import StoreError

    store = ClickHouseServerBackend(url, tries=1, send_receive_timeout=600)
    try:
        store.ensure_database()
        store.execute(f"DROP DATABASE IF EXISTS {store.database}")
        store.ensure_database()
        store.migrate()
    except StoreError as exc:
        raise BenchFailed(f"ClickHouse server at {store.url_safe} is not usable: {exc}") from None
    return store


@contextlib.contextmanager
def scratch_store(url: str) -> Iterator[Any]:
    """open_store(url), its database dropped afterwards whatever happened (no bench leaves one)."""
    store = open_store(url)
    try:
        yield store
    finally:
        try:
            store.execute(f"DROP DATABASE IF EXISTS {store.database}")
        finally:
            store.close()


def column_bytes(store, table: str = "samples") -> dict[str, tuple[int, int]]:
    """{column: (bytes on disk, uncompressed bytes)} of a table's active parts."""
    rows = store.query(
        "SELECT column, sum(column_bytes_on_disk), sum(column_data_uncompressed_bytes) FROM system.parts_columns "
        "WHERE database = %(db)s AND table = %(t)s AND active GROUP BY column",
        {"db": store.database, "t": table},
    )
    return {c: (int(disk), int(raw)) for c, disk, raw in rows}


def table_bytes(store, table: str) -> tuple[int, int]:
    """(rows, bytes on disk) of a table's active parts."""
    rows = store.query(
        "SELECT sum(rows), sum(bytes_on_disk) FROM system.parts WHERE database = %(db)s AND table = %(t)s AND active",
        {"db": store.database, "t": table},
    )
    return int(rows[0][0] or 0), int(rows[0][1] or 0)


def pooled_check(report, gaps_by_variant, where: str) -> None:
    """The report's itl_ms equals numpy's nearest rank over the stored gaps, and its n their count."""
    import numpy as np

    from stats.quantiles import REPORT_QUANTILES

    for entry in report["variants"]:
        gaps = np.sort(gaps_by_variant.get(entry["key"], np.zeros(0)))
        for est, q in zip(entry["percentiles"]["itl_ms"], REPORT_QUANTILES, strict=True):
            check(
                est["n"] == gaps.size,
                f"{where}, {entry['key']}: itl_ms n {est['n']} != {gaps.size} gaps stored",
            )
            if gaps.size:
                want = float(np.quantile(gaps, q, method="inverted_cdf"))
                check(
                    est["value"] == want,
                    f"{where}, {entry['key']}: itl_ms {est['label']} {est['value']} != {want}",
                )


def stored_gaps(store, where_sql: str = "1") -> dict[str, object]:
    """{variant: every gap (ms) of its successful requests} as stored."""
    import numpy as np

    rows = store.query(
        f"SELECT variant, groupArray(g) FROM (SELECT variant, arrayJoin(itl_gaps_us) AS g FROM samples "
        f"WHERE outcome = 'ok' AND {where_sql}) GROUP BY variant"
    )
    return {v: np.asarray(g, dtype=np.float64) / 1000.0 for v, g in rows}


def storage(args) -> list[dict]:
    import dataclasses

    import numpy as np

    from analysis import report as r
    from analysis import rollup
    from analysis.definitions import Filters, Slo
    from samples import synthetic

    spec = synthetic.SyntheticSpec(
        n=args.samples,
        seed=14,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        duration_s=3600.0,
    )
    slo = Slo(200.0)
    exp = r.ExperimentInfo(
        spec.experiment,
        "bench",
        slo,
        0.9,
        [r.VariantInfo(v.key, v.control, v.weight, v.factors) for v in spec.variants],
    )
    out = []
    for label, gaps in (("with gaps", True), ("without gaps (older rows)", False)):
        with scratch_store(with_database(args.clickhouse_url, "_itl" if gaps else "_itl_none")) as store:
            t = time.perf_counter()
            data = synthetic.generate(dataclasses.replace(spec, gaps=gaps))
            gen_s = time.perf_counter() - t
            t = time.perf_counter()
            synthetic.insert(store, data, chunk_rows=10_000)
            ins_s = time.perf_counter() - t
            c = data.columns
            ok = c["outcome"] == "ok"
            lengths = np.fromiter(map(len, c["itl_gaps_us"]), dtype=np.int64, count=c["itl_gaps_us"].size)
            n_gaps = int(lengths.sum())
            if gaps:
                check(
                    (lengths[ok] == c["output_tokens"][ok].astype(np.int64) - 1).all(),
                    f"{label}: gaps != tokens - 1",
                )
            else:
                check(n_gaps == 0, f"{label}: {n_gaps} gaps in a dataset without gaps")
            store.execute("OPTIMIZE TABLE samples FINAL")
            ((have, stored),) = store.query("SELECT count(), sum(length(itl_gaps_us)) FROM samples")
            check(
                have == args.samples, f"{label}: the samples table holds {have} rows, {args.samples} loaded"
            )
            check(stored == n_gaps, f"{label}: {stored} gaps stored, {n_gaps} generated")
            cols = column_bytes(store)
            gap_disk, gap_raw = cols["itl_gaps_us"]
            rest = sum(d for name, (d, _) in cols.items() if name != "itl_gaps_us")
            t = time.perf_counter()
            built = rollup.build_run_rollup(store, spec.experiment, spec.run_id, slo)
            build_s = time.perf_counter() - t
            check(built is not None and built.rows == args.samples, f"{label}: rollup of {built}")
            gap_rows, gap_table = table_bytes(store, "rollup_gaps")
            values_rows, values_table = table_bytes(store, "rollup_values")
            ((counted,),) = store.query("SELECT sum(n) FROM rollup_gaps")
            check(int(counted or 0) == int(lengths[ok].sum()), f"{label}: rollup_gaps counts {counted} gaps")
            f = Filters(spec.experiment)
            times = {}
            reports = {}
            for use in (False, True):
                t = time.perf_counter()
                reports[use] = r.build_report(store, exp, f, use_rollup=use)
                times[use] = time.perf_counter() - t
            pooled = stored_gaps(store)
            for use in (False, True):
                pooled_check(reports[use], pooled, f"{label}, {'rollup' if use else 'raw'} report")
            out.append(
                {
                    "label": label,
                    "samples": args.samples,
                    "gaps": n_gaps,
                    "gen_s": gen_s,
                    "insert_s": ins_s,
                    "gap_disk": gap_disk,
                    "gap_raw": gap_raw,
                    "rest_disk": rest,
                    "build_s": build_s,
                    "rollup_gaps_rows": gap_rows,
                    "rollup_gaps_bytes": gap_table,
                    "rollup_values_rows": values_rows,
                    "rollup_values_bytes": values_table,
                    "raw_s": times[False],
                    "rollup_s": times[True],
                }
            )
    return out


def demo_options(args) -> list[str]:
    return ["--limit", str(args.limit), "--speed", f"{args.speed:g}"]


def demo(args) -> dict:
    """`manage.py demo --no-serve --json` into its own database; per variant the old and new ITL."""
    import numpy as np

    from stats.quantiles import nearest_rank

    url = with_database(args.clickhouse_url, "_itl_demo")
    with scratch_store(url) as store:  # a fresh database, dropped at the end
        with tempfile.TemporaryDirectory(prefix="abplat-bench-itl-") as var:
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("ABPLAT_")},
                "ABPLAT_VAR": var,
                "ABPLAT_DEBUG": "true",
                "ABPLAT_ENV_FILE": "",
                "ABPLAT_CLICKHOUSE_URL": url,
                "PYTHONPATH": str(ROOT),
            }
            cmd = [
                sys.executable,
                "manage.py",
                "demo",
                "--no-serve",
                "--json",
                "--no-progress",
                *demo_options(args),
            ]
            # A demo that searches capacity too: its replay only. Read from the command's source, not
            # its --help (another Django start-up).
            if "--capacity-steps" in (ROOT / "workers" / "management" / "commands" / "demo.py").read_text():
                cmd += ["--capacity-steps", "0"]
            t = time.perf_counter()
            done = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            wall = time.perf_counter() - t
        if done.returncode != 0:
            raise BenchFailed(f"manage.py demo exited {done.returncode}: {done.stderr.strip()[-600:]}")
        doc = json.loads(done.stdout)
        report = doc["report"]
        run = doc["replay"]["run"]
        rows = store.query(
            "SELECT variant, outcome, output_tokens, itl_gaps_us, itl_mean_ms, tpot_ms FROM samples FINAL "
            "WHERE run_id = %(r)s",
            {"r": int(run["run"])},
        )
        want = int(run["expected_samples"])
        check(
            len(rows) == want > 0, f"demo: {len(rows)} samples stored for run {run['run']}, expected {want}"
        )
        bad = [o for _v, o, *_ in rows if o != "ok"]
        check(not bad, f"demo: {len(bad)} requests not ok ({sorted(set(bad))})")
        for v, _o, tokens, gaps, _m, _t in rows:
            check(len(gaps) == tokens - 1, f"demo, {v}: {len(gaps)} gaps stored for {tokens} output tokens")
        pooled = {}
        # bytes of whole parts, as in part 1, of the demo's run alone (a capacity search adds runs):
        # its rows copied into a table of the same shape, merged into one part
        store.execute("CREATE TABLE samples_demo_run AS samples")
        store.execute(
            "INSERT INTO samples_demo_run SELECT * FROM samples WHERE run_id = %(r)s", {"r": int(run["run"])}
        )
        store.execute("OPTIMIZE TABLE samples_demo_run FINAL")
        cols = column_bytes(store, "samples_demo_run")
        out = {
            "wall_s": wall,
            "variants": [],
            "gap_disk": cols["itl_gaps_us"][0],
            "rest_disk": sum(d for name, (d, _) in cols.items() if name != "itl_gaps_us"),
            "gaps": sum(len(row[3]) for row in rows),
            "samples": len(rows),
        }
        by_key = {e["key"]: e for e in report["variants"]}
        for v in by_key:
            mine = [row for row in rows if row[0] == v]
            gaps = np.sort(np.concatenate([np.asarray(row[3], dtype=np.float64) for row in mine]) / 1000.0)
            pooled[v] = gaps
            means = sorted(row[4] for row in mine if row[4] is not None)
            tpot = sorted(row[5] for row in mine if row[5] is not None)
            entry = {
                "variant": v,
                "requests": len(mine),
                "gaps": int(gaps.size),
                "mean_p50": nearest_rank(means, 0.5),
                "mean_p99": nearest_rank(means, 0.99),
                "itl_p50": nearest_rank(gaps, 0.5),
                "itl_p99": nearest_rank(gaps, 0.99),
                "tpot_p50": nearest_rank(tpot, 0.5),
                "tpot_p99": nearest_rank(tpot, 0.99),
            }
            got = {e["label"]: e["value"] for e in by_key[v]["percentiles"]["tpot_ms"]}
            check(
                (got["p50"], got["p99"]) == (entry["tpot_p50"], entry["tpot_p99"]),
                f"demo, {v}: report TPOT {got}",
            )
            out["variants"].append(entry)
        pooled_check(report, pooled, "demo report")
        return out


def run(args) -> None:
    print(
        f"bench_itl: python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print("command: " + shlex.join([".venv/bin/python", "bench/bench_itl.py", *sys.argv[1:]]))
    t0 = time.perf_counter()
    stored = storage(args)
    print(
        f"\nStorage: {args.samples:,} synthetic samples (demo arms, ~135 gaps per successful request) in "
        "the ClickHouse server, OPTIMIZE FINAL, system.parts_columns (compressed data + marks)"
    )
    print(
        "| samples | gaps | itl_gaps_us B/sample | B/gap | uncompressed B/gap | rest of the row B/sample "
        "| row B/sample | rollup_gaps rows (B) | rollup_values rows (B) | rollup build s | report raw s | report rollup s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in stored:
        per = s["gap_disk"] / s["samples"]  # an empty array still costs its offset: ~0.04 B compressed
        per_gap = s["gap_disk"] / s["gaps"] if s["gaps"] else float("nan")
        raw_gap = s["gap_raw"] / s["gaps"] if s["gaps"] else float("nan")
        print(
            f"| {s['label']} | {s['gaps']:,} | {per:.2f} | {per_gap:.2f} | {raw_gap:.2f} | "
            f"{s['rest_disk'] / s['samples']:.1f} | {(s['gap_disk'] + s['rest_disk']) / s['samples']:.1f} | "
            f"{s['rollup_gaps_rows']:,} ({s['rollup_gaps_bytes']:,}) | {s['rollup_values_rows']:,} "
            f"({s['rollup_values_bytes']:,}) | {s['build_s']:.2f} | {s['raw_s']:.2f} | {s['rollup_s']:.2f} |"
        )
    d = demo(args)
    print(
        f"\nThe demo: `manage.py demo --no-serve --json {shlex.join(demo_options(args))}` "
        f"({d['wall_s']:.0f} s), fp16 / awq / awq-fa2 profiles; every request ok, "
        "output_tokens - 1 gaps each; ms, nearest rank, from the stored samples (= the report's)"
    )
    print(
        "| variant | requests | gaps | per-request mean ITL p50 / p99 (old itl_ms) | ITL all gaps p50 / p99 (new itl_ms) "
        "| TPOT p50 / p99 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for e in d["variants"]:
        print(
            f"| {e['variant']} | {e['requests']} | {e['gaps']:,} | {e['mean_p50']:.2f} / {e['mean_p99']:.2f} | "
            f"{e['itl_p50']:.3f} / {e['itl_p99']:.3f} | {e['tpot_p50']:.2f} / {e['tpot_p99']:.2f} |"
        )
    print(
        f"\nThe demo run's samples on disk (OPTIMIZE FINAL, one part of {d['samples']} rows): itl_gaps_us "
        f"{d['gap_disk'] / d['samples']:.1f} B/sample, {d['gap_disk'] / d['gaps']:.2f} B/gap "
        f"({d['gaps'] / d['samples']:.1f} gaps a request); the rest of the row {d['rest_disk'] / d['samples']:.1f} "
        "B/sample (a part this small is mostly marks and headers)"
    )
    print(f"\nbench_itl: done in {time.perf_counter() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100_000, help="synthetic samples for the storage part")
    ap.add_argument("--limit", type=int, default=DEMO_LIMIT, help="demo: requests of its slice to replay")
    ap.add_argument("--speed", type=float, default=DEMO_SPEED, help="demo: time compression of the slice")
    ap.add_argument("--timeout", type=float, default=900.0, help="demo: seconds before it counts as hung")
    ap.add_argument("--clickhouse-url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    ap.add_argument("--quick", action="store_true", help="smoke run: 5k samples, a 60-request demo at 35x")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.limit, args.speed, args.timeout = 5_000, 60, DEMO_SPEED, 150.0
    if args.samples < 100 or args.limit < 10 or args.speed <= 0:
        ap.error("--samples >= 100, --limit >= 10 and --speed > 0")
    sys.exit(run_checked(run, args))


if __name__ == "__main__":
    main()
