"""The SLA report, the dashboard page and a rollout look at 100M samples of a million users, on
one ClickHouse server and on the two-shard test cluster (docs/clickhouse-cluster.md).

    scripts/clickhouse.sh start && scripts/clickhouse_cluster.sh start
    B="flock /tmp/abplat-bench.lock .venv/bin/python -u bench/bench_scale.py"
    $B load --target server --minutes 12        # again until it prints "loaded: all", or:
    $B fill --target server --minutes 12        # the rest as copies of the writer's rows
    $B load --target cluster --minutes 0.6      # the writer's rate through the Distributed table
    $B fill --target cluster --minutes 14       # the rest of the server's rows, copied
    $B rollup --target server; $B rollup --target cluster
    ABPLAT_DEBUG=true $B measure --target server; ABPLAT_DEBUG=true $B measure --target cluster
    $B shards; $B hosts; $B kept; $B index --looks 6000000:4000000; $B layout --zstd-url clickhouse://default:@127.0.0.1:19301
    .venv/bin/python bench/bench_scale.py table
    ABPLAT_DEBUG=true .venv/bin/python bench/bench_scale.py all --quick   # 200k samples, every stage

The run: --rows samples (default 10^8) of --users users (default 10^6) in split mode, the demo's
three variants, two config revisions (the first and second half of the run), no inter-token gaps
(as bench_report.py), no duplicate recordings (deduplicating 10^8 rows is an OPTIMIZE FINAL of
whole partitions, not what is measured here). Users are heavy-tailed (samples.synthetic:
lognormal request rates, sigma 1; each user keeps one arm and a TTFT factor of their own),
generated in chunks of --chunk rows (samples.synthetic.generate_chunks) so memory stays bounded.

Stages, each short enough to run under the shared bench lock:
- load: chunk after chunk through the project's writer (SampleStore.insert_columns: the columnar
  validator, then one INSERT per chunk; on the cluster through its Distributed table with
  insert_distributed_sync), until the table holds --rows or --minutes have passed. It resumes
  where the table stands (the chunks are deterministic, so the server and the cluster get the
  same rows) and adds its rows and seconds to var/bench_scale_load.json: the insert rate.
- fill: the rest of the rows without the Python writer, inside ClickHouse: on the server, copies
  of the writer's rows under the next seqs (fill's docstring); on the cluster, the server's rows
  it lacks (INSERT ... SELECT FROM remote() into the Distributed table): the same rows on both.
- rollup: the run's report rollup (analysis.rollup.build_run_rollup), as a finished run's.
- measure: bytes per sample on disk (system.parts, per column from system.columns); one cold
  report from the rollup and one from the raw samples (use_rollup=False), each with its slowest
  queries (on a cluster, a shard's own queries prefixed by its port), the two compared number
  by number; the dashboard page cold and hot; a rollout look (rollouts.readings.read_step, a
  plan clustering by user, an attainment and a p99 guardrail) at the step of revision 1 (~10^6
  users) and at a step of ~10^3 users (a table of its own, --small-rows samples of
  --small-users users, loaded on first use).
- shards: the raw report's per-user moments query (analysis.units.moments_select) on the server,
  through the cluster's Distributed table, per shard as the report reads it (each shard's local
  table side by side, the per-arm moments added: analysis.readers.shards; the cluster's samples
  must be sharded by the unit, samples.cluster.SAMPLES_SHARDING_KEY) and on each shard's local
  table alone: what the cluster's time is made of when both shards share this machine's two
  cores. A cluster database made before the samples were sharded by user must be dropped and
  loaded again (load/fill) for the per-shard path to be measured.
- hosts: the raw report, the per-user moments query and the rollout look at revision 1 (as
  measure's) with each ClickHouse server pinned to a core of its own (taskset on its pid
  file's process), as hosts of one core each: the single
  server on core 0, then the cluster's shards on cores 0 and 1; every server gets both cores back
  at the end. The cluster's ratio against one server as two hosts against one would show it,
  which two shards sharing this machine's cores cannot.
- kept: rollout looks through the step's kept per-user sums (rollouts.kept) against the whole
  read (measure's look): the first kept look, which builds them, then --kept-looks a minute apart
  while --rate requests a second arrive, at revision 1 and at measure's look tables (those alone
  with --own-tables), the sums kept --lag seconds behind; each kept reading checked equal to the
  whole one.
- index: the memory a rollout step's index of kept sums (rollouts.kept) holds on the server: the
  server's resident memory (its pid file's process: the project's own server) that dropping the
  index of the last --looks table's step (--looks 6000000:4000000: ~10^6 users) frees, after a
  first kept look built it; per kept row.
- layout: the first --layout-rows samples copied into tables of other sorting keys, lz4 (the
  server's) and zstd (a server configured for it: 18.16 has no column CODEC clause), each merged
  to one part per partition: bytes per sample and the moments query's time on each.
- table: every figure recorded so far (var/bench_scale_results.json) as one table.
Each timed figure is one run. Checks (bench FAILED on stderr, exit 1): every table holds the
rows it should; the report counts every sample; the raw and rollup reports agree; the page
answers 200; the rollout reading has no error and counts the step's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_report import check, check_report, dashboard_page  # noqa: E402
from bench.benchlib import BenchFailed, run_checked  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "abplat.settings")

ROOT = Path(__file__).resolve().parents[1]
# The server's URL; a database in it (the quick test's) names this bench's databases.
_URL = urllib.parse.urlsplit(
    os.environ.get("ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000")
)
SERVER_URL = urllib.parse.urlunsplit(_URL._replace(path=""))
DATABASE = _URL.path.strip("/") or "abplat_bench_scale"
CLUSTER_URL = os.environ.get("ABPLAT_BENCH_CLUSTER_URL", "clickhouse://default:@127.0.0.1:19101")
CLUSTER = os.environ.get("ABPLAT_BENCH_CLUSTER", "abplat_test_cluster")
EXPERIMENT = "ttft-opt"
VAR = Path(os.environ.get("ABPLAT_VAR") or ROOT / "var")
LOAD_LOG = VAR / "bench_scale_load.json"


def spec_for(rows: int, users: int, seed: int = 1):
    from samples import synthetic

    return synthetic.SyntheticSpec(
        experiment=EXPERIMENT,
        n=rows,
        seed=seed,
        variants=synthetic.demo_variants(),
        factor_effects=synthetic.DEMO_FACTOR_EFFECTS,
        config_revisions=(1, 2),
        gaps=False,
        users=users,
        user_sigma=0.3,
        duration_s=30 * 24 * 3600.0 * rows / 1e9,  # 1B samples a month
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "stage",
        nargs="?",
        default="all",
        choices=(
            "load",
            "fill",
            "rollup",
            "measure",
            "shards",
            "hosts",
            "kept",
            "index",
            "layout",
            "shapes",
            "table",
            "all",
        ),
    )
    ap.add_argument("--against", default="HEAD", help="shapes: the revision whose moments query to time")
    ap.add_argument("--layout-rows", type=int, default=10_000_000, help="layout: samples copied per layout")
    ap.add_argument("--zstd-url", default="", help="layout: a server compressing parts with zstd")
    ap.add_argument("--target", choices=("server", "cluster"), default="server")
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=2_000_000)
    ap.add_argument("--minutes", type=float, default=12.0, help="load: stop after the chunk that passes this")
    ap.add_argument(
        "--looks",
        default="150000:1500,6000000:1500,6000000:4000000",
        help="measure: more rollout steps, each SAMPLES:USERS in a table of its own",
    )
    ap.add_argument("--database", default=DATABASE)
    ap.add_argument("--raw-only", action="store_true", help="measure: no rollup report, no page")
    ap.add_argument(
        "--rate", default="1000", help="kept: live requests a second between looks (several: comma-separated)"
    )
    ap.add_argument(
        "--lag",
        default="30",
        help="kept: the kept sums' lag in seconds, ABPLAT_ROLLOUT_KEPT_LAG_S (comma-separated)",
    )
    ap.add_argument("--kept-looks", type=int, default=5, help="kept: looks after the first, a minute apart")
    ap.add_argument(
        "--own-tables", action="store_true", help="kept: the look tables alone, not the 100M run's step"
    )
    ap.add_argument("--quick", action="store_true", help="200k samples of 2,000 users, every stage")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.users, args.chunk, args.looks, args.layout_rows = (
            200_000,
            2000,
            70_000,
            "20000:300",
            50_000,
        )
        args.database += "_quick" if args.database == "abplat_bench_scale" else ""
        args.rate = "20"
    sys.exit(run_checked(run, args))


def run(args: argparse.Namespace) -> None:
    import django

    django.setup()
    stages = ("load", "rollup", "measure", "shards", "kept") if args.stage == "all" else (args.stage,)
    targets = ("server", "cluster") if args.stage == "all" else (args.target,)
    if args.stage == "table":
        table(args.database)
        return
    steps = {
        "load": load,
        "fill": fill,
        "rollup": build_rollup,
        "measure": measure,
        "shards": shards,
        "hosts": hosts,
        "kept": kept,
        "index": index_memory,
        "layout": layout,
        "shapes": shapes,
    }
    for stage in stages:
        for target in (
            targets if stage not in ("shards", "hosts", "kept", "index", "layout", "shapes") else ("server",)
        ):
            steps[stage](args, target)
    if args.quick:  # the cluster's databases: nobody else drops them
        cluster = open_store(args, "cluster")
        for srv in cluster.servers():
            for (name,) in srv.query(
                f"SELECT name FROM system.databases WHERE startsWith(name, '{args.database}')"
            ):
                srv.execute(f"DROP DATABASE IF EXISTS {name}")
        cluster.close()


def open_store(args: argparse.Namespace, target: str, database: str | None = None):
    from samples.backends.clickhouse import ClickHouseServerBackend
    from samples.backends.cluster import ClickHouseClusterBackend

    db = database or args.database
    try:
        if target == "cluster":
            store = ClickHouseClusterBackend(f"{CLUSTER_URL}/{db}", CLUSTER, send_receive_timeout=1800)
        else:
            store = ClickHouseServerBackend(f"{SERVER_URL}/{db}", send_receive_timeout=1800)
        store.migrate()
    except Exception as e:  # noqa: BLE001 - the precondition, named
        raise BenchFailed(f"ClickHouse {target} for {db} not usable: {type(e).__name__}: {e}") from None
    return store


def url_of(args: argparse.Namespace, target: str) -> str:
    return f"{CLUSTER_URL if target == 'cluster' else SERVER_URL}/{args.database}"


# ---------------------------------------------------------------------------------------------
# load


def load(args: argparse.Namespace, target: str) -> None:
    from samples import synthetic

    store = open_store(args, target)
    have = store.query("SELECT count() FROM samples")[0][0]
    check(have % args.chunk == 0 or have == args.rows, f"{target}: {have} rows, not a whole number of chunks")
    spec = spec_for(args.rows, args.users)
    log = json.loads(LOAD_LOG.read_text()) if LOAD_LOG.exists() else {}
    key = f"{target}/{args.database}/{args.rows}/{args.chunk}"
    if have == 0:
        log[key] = {"rows": 0, "insert_s": 0.0, "generate_s": 0.0}
    entry = log.setdefault(key, {"rows": 0, "insert_s": 0.0, "generate_s": 0.0})
    started = time.monotonic()
    rows = ins_s = gen_s = 0.0
    # the chunks of the whole run from the first one the table lacks: the same seeds as one load
    t = time.perf_counter()
    for data in synthetic.generate_chunks(spec, args.chunk, first_chunk=have // args.chunk):
        gen_s += time.perf_counter() - t
        t = time.perf_counter()
        synthetic.insert(store, data, chunk_rows=args.chunk)
        ins_s += time.perf_counter() - t
        rows += data.n_rows
        print(
            f"{target}: +{data.n_rows:,} rows in {time.perf_counter() - t:.1f} s "
            f"({have + int(rows):,} of {args.rows:,})",
            flush=True,
        )
        del data
        if time.monotonic() - started > args.minutes * 60:
            break
        t = time.perf_counter()
    entry["rows"] += int(rows)
    entry["insert_s"] += ins_s
    entry["generate_s"] += gen_s
    LOAD_LOG.parent.mkdir(exist_ok=True)
    LOAD_LOG.write_text(json.dumps(log, indent=1))
    now = store.query("SELECT count() FROM samples")[0][0]
    check(now == have + rows, f"{target}: the table holds {now} rows after loading {have} + {int(rows)}")
    rate = entry["rows"] / entry["insert_s"] if entry["insert_s"] else float("nan")
    print(
        f"{target}: this run {int(rows):,} rows, insert {ins_s:.1f} s, generate {gen_s:.1f} s; "
        f"whole load so far {entry['rows']:,} rows at {rate:,.0f} rows/s through insert_columns "
        f"(generation {entry['generate_s']:.0f} s apart)",
        flush=True,
    )
    print(f"loaded: {'all' if now == args.rows else f'{now:,} of {args.rows:,}'}", flush=True)
    store.close()


def fill(args: argparse.Namespace, target: str) -> None:
    """The rows past those the writer loaded, without a second pass through Python. On the
    server: copies of the writer's rows (seqs [0, B)) as the next seqs (seq + k B, their request
    ids, send times shifted by k B requests' share of the run, the revision of their place in the
    run, as generate_chunks gives them): the same users and their arms, each user's request count
    scaled alike. On the cluster: the server's rows it lacks, read through remote() into the
    Distributed table (sharded as the writer's were): the same rows on both."""
    from samples import columns as colmod

    store = open_store(args, target)
    have = store.query("SELECT count() FROM samples")[0][0]
    cols = list(colmod.COLUMN_NAMES)
    if target == "cluster":
        server = f"remote('{SERVER_URL.rsplit('@', 1)[1]}', {args.database}, samples)"

        def statement(done: int) -> str:
            last = min(done + 20_000_000, args.rows)
            return (
                f"INSERT INTO samples ({', '.join(cols)}) SELECT {', '.join(cols)} FROM {server} "
                f"WHERE seq >= {done} AND seq < {last}"
            )
    else:
        spec = spec_for(args.rows, args.users)
        base = written(args)  # the writer's rows: the first seqs
        check(base > 0 and base % args.chunk == 0, f"server: {base} rows from the writer, not whole chunks")
        per_request_ms = spec.duration_s * 1000.0 / spec.n
        n_chunks = -(-args.rows // args.chunk)

        def statement(done: int) -> str:
            shift = done * per_request_ms  # the copy of seq s lands at seq s + done
            chunk = f"intDiv(seq + {done}, {args.chunk})"
            expr = {
                "seq": f"seq + {done}",
                "request_id": f"concat('r{spec.run_id}-', toString(seq + {done}), '-', variant)",
                "config_revision": f"toInt64(1 + intDiv((2 * {chunk} + 1) * 2, {2 * n_chunks}))",
                # as samples.synthetic derives them from the send time
                "sent_at": f"toDateTime(toUInt32(floor((sent_unix_ms + {shift}) / 1000)))",
                "sent_unix_ms": f"sent_unix_ms + {shift}",
                "scheduled_offset_ms": f"scheduled_offset_ms + {shift}",
                "recorded_ms": f"toUInt64(floor(sent_unix_ms + {shift} + 10000))",
            }
            return (
                f"INSERT INTO samples ({', '.join(cols)}) SELECT {', '.join(expr.get(c, c) for c in cols)} "
                f"FROM samples WHERE seq < {min(base, args.rows - done)}"
            )

    started = time.monotonic()
    while have < args.rows and time.monotonic() - started < args.minutes * 60:
        t = time.perf_counter()
        store.execute(statement(have))
        now = store.query("SELECT count() FROM samples")[0][0]
        print(
            f"{target}: copied {now - have:,} rows in {time.perf_counter() - t:.1f} s ({now:,})", flush=True
        )
        check(now > have, f"{target}: the copy added no rows")
        have = now
    record(args.database, target, {"copied_rows": args.rows - written(args, target)})
    print(f"loaded: {'all' if have == args.rows else f'{have:,} of {args.rows:,}'}", flush=True)
    store.close()


def written(args: argparse.Namespace, target: str = "server") -> int:
    """Rows the writer loaded into this database (var/bench_scale_load.json)."""
    log = json.loads(LOAD_LOG.read_text()) if LOAD_LOG.exists() else {}
    return int(log.get(f"{target}/{args.database}/{args.rows}/{args.chunk}", {}).get("rows", 0))


def build_rollup(args: argparse.Namespace, target: str) -> None:
    from analysis import rollup
    from analysis.definitions import Slo

    store = open_store(args, target)
    t = time.perf_counter()
    built = rollup.build_run_rollup(store, EXPERIMENT, 1, Slo(200.0))
    build_s = time.perf_counter() - t
    check(
        built is not None and built.rows == args.rows,
        f"{target}: rollup of run 1: {built} != {args.rows} rows",
    )
    record(args.database, target, {"rollup_build_s": build_s})
    print(f"{target}: rollup of {built.rows:,} samples built in {build_s:.1f} s", flush=True)
    store.close()


def record(database: str, target: str, figures: dict) -> None:
    path = VAR / "bench_scale_results.json"
    got = json.loads(path.read_text()) if path.exists() else {}
    got.setdefault(database, {}).setdefault(target, {}).update(figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(got, indent=1))


def disk_bytes(store, target: str) -> tuple[int, int, int, list[tuple[str, int]]]:
    """(rows, compressed bytes, uncompressed bytes, [(column, compressed bytes)] largest first) of
    the samples table's active parts, summed over every server of a cluster."""
    servers = store.servers() if target == "cluster" else [store]
    table = "samples_local" if target == "cluster" else "samples"
    rows = comp = raw = 0
    per: dict[str, int] = {}
    for srv in servers:
        r, c, u = srv.query(
            "SELECT sum(rows), sum(data_compressed_bytes), sum(data_uncompressed_bytes) FROM system.parts "
            f"WHERE database = '{store.database}' AND table = '{table}' AND active"
        )[0]
        rows, comp, raw = rows + r, comp + c, raw + u
        for name, b in srv.query(
            "SELECT name, data_compressed_bytes FROM system.columns "
            f"WHERE database = '{store.database}' AND table = '{table}'"
        ):
            per[name] = per.get(name, 0) + b
    return rows, comp, raw, sorted(per.items(), key=lambda kv: -kv[1])


def experiment_info():
    from analysis import report as r
    from analysis.definitions import Slo
    from samples import synthetic

    return r.ExperimentInfo(
        EXPERIMENT,
        "bench",
        Slo(200.0),
        0.9,
        [r.VariantInfo(v.key, v.control, v.weight, v.factors) for v in synthetic.demo_variants()],
    )


def timing_queries(store) -> list[tuple[float, str]]:
    """Time every SELECT the store runs from now on (wall seconds, the SQL's start), until
    untime(store); the report runs some at once, so their times overlap. On a cluster, also
    those its shards run on their own tables (analysis.readers.shards), named by their port."""
    spent: list[tuple[float, str]] = []
    for s in (store, *(store.servers() if hasattr(store, "servers") else ())):
        inner = s._select
        label = "" if s is store else f"[{s._conn_kwargs['port']}] "

        def select(sql, settings=None, inner=inner, label=label):
            t = time.perf_counter()
            try:
                return inner(sql, settings)
            finally:
                spent.append((time.perf_counter() - t, label + " ".join(sql.split())[:110]))

        s._select = select
    return spent


def untime(store) -> None:
    """Stop timing_queries: the class's _select again, on the store and its servers."""
    for s in (store, *(store.servers() if hasattr(store, "servers") else ())):
        s.__dict__.pop("_select", None)


def rollout_plan():
    from rollouts.controller import Plan
    from stats.sequential.guardrail_spec import Guardrail

    return Plan(
        candidate="awq",
        control="fp16",
        steps=(5, 50, 100),
        min_samples=100,
        min_duration_s=0.0,
        guardrails=(Guardrail("attainment", "at_least", 0.9), Guardrail("p99_ttft_ms", "at_most", 1000.0)),
        on_breach="rollback",
        notify=(),
        alpha=0.05,
        cluster_by_user=True,
    )


def rollout_look(store, revision: int) -> tuple[float, int, int]:
    """(seconds, users, requests) of one read_step of the plan's two arms at this revision."""
    from analysis.definitions import Slo
    from rollouts.readings import read_step

    plan = rollout_plan()
    spent = timing_queries(store)
    t = time.perf_counter()
    try:
        reading = read_step(store, EXPERIMENT, revision, plan, Slo(200.0), keep=False)
    finally:
        untime(store)
    look_s = time.perf_counter() - t
    print("    its queries: " + "; ".join(f"{q_s:.2f} s {q[:40]}" for q_s, q in spent), flush=True)
    check(reading.error == "", f"rollout reading at revision {revision}: {reading.error}")
    want = store.query(
        "SELECT count(), uniqExact(user_id) FROM samples WHERE config_revision = %(r)s AND variant IN ('fp16', 'awq')",
        {"r": revision},
    )[0]
    n = reading.control.n + reading.candidate.n
    check(
        n > 0 and n == want[0],
        f"rollout reading at revision {revision}: {n} requests, the table has {want[0]}",
    )
    return look_s, int(want[1]), int(n)


def measure(args: argparse.Namespace, target: str) -> None:
    from analysis import report as r
    from analysis.definitions import Filters
    from stats import quantiles

    store = open_store(args, target)
    have = store.query("SELECT count() FROM samples")[0][0]
    check(have == args.rows, f"{target}: the samples table holds {have} rows, not {args.rows}")
    rows, comp, raw, per = disk_bytes(store, target)
    check(rows == have, f"{target}: active parts hold {rows} rows, the table {have}")
    print(
        f"{target}: {comp / rows:.1f} B/sample compressed ({raw / rows:.1f} uncompressed, {raw / comp:.1f}x)"
    )
    for name, b in per[:8]:
        print(f"    {name}: {b / rows:.2f} B/sample")
    exp, f = experiment_info(), Filters(EXPERIMENT)
    reports, times, spent = {}, {}, {}
    for use in (False,) if args.raw_only else (True, False):
        quantiles._quantile_ci_ranks.cache_clear()
        spent[use] = timing_queries(store)
        t = time.perf_counter()
        try:
            rep = r.build_report(store, exp, f, use_rollup=use)
        finally:
            untime(store)
        times[use] = time.perf_counter() - t
        want = "rollup" if use else "samples"
        check(rep["timing"]["source"] == want, f"{target}: report source {rep['timing']} (want {want})")
        reports[use] = rep
        print(f"{target}: report from the {want}: {times[use]:.2f} s; its slowest queries:", flush=True)
        for q_s, q in sorted(spent[use], reverse=True)[:6]:
            print(f"    {q_s:6.2f} s  {q}", flush=True)
    per_variant = dict(store.query("SELECT variant, count() FROM samples GROUP BY variant"))
    got = {v["key"]: v["n"] for v in reports[False]["variants"]}
    check(got == per_variant, f"{target}: report n per variant {got} != samples per variant {per_variant}")
    figures = {}
    if not args.raw_only:
        check_report(reports[True], reports[False], per_variant, f"{target}, {have} samples")
        page = dashboard_page(url_of(args, target), 1, CLUSTER if target == "cluster" else "")
        print(f"{target}: page cold {page['cold_s']:.2f} s, hot {page['hot_s']:.3f} s", flush=True)
        figures = {
            "report_rollup_s": times[True],
            "rollup_queries": sorted(spent[True], reverse=True)[:4],
            "page_cold_s": page["cold_s"],
            "page_hot_s": page["hot_s"],
        }
    look_s, users, n = rollout_look(store, 1)
    print(
        f"{target}: rollout look at revision 1 ({users:,} users, {n:,} requests): {look_s:.2f} s", flush=True
    )
    figures |= {
        "rows": rows,
        "bytes_per_sample": comp / rows,
        "raw_bytes_per_sample": raw / rows,
        "top_columns": [(name, b / rows) for name, b in per[:8]],
        "report_raw_s": times[False],
        "raw_queries": sorted(spent[False], reverse=True)[:8],
        "look_s": look_s,
        "look_users": users,
        "look_requests": n,
    }
    # steps of their own tables, the same model: (samples, users) each
    looks = []
    for spec_text in args.looks.split(","):
        n_rows, n_users = (int(x) for x in spec_text.split(":"))
        small = look_store(args, target, n_rows, n_users)
        small_s, small_users, small_n = rollout_look(small, 1)
        small.close()
        print(
            f"{target}: rollout look at {small_users:,} users ({small_n:,} requests): {small_s:.3f} s",
            flush=True,
        )
        looks.append((small_s, small_users, small_n))
    figures["looks"] = looks
    record(args.database, target, figures)
    store.close()
    table(args.database)


def look_store(args: argparse.Namespace, target: str, n_rows: int, n_users: int):
    """The store of a look table: a step of its own, n_rows samples of n_users users (the run's
    model), loaded on first use."""
    from samples import synthetic

    small = open_store(args, target, f"{args.database}_look_{n_rows}_{n_users}")
    if small.query("SELECT count() FROM samples")[0][0] != n_rows:
        small.execute("TRUNCATE TABLE samples")
        # two chunks at least: the first half of the run under revision 1, as in the large table
        half = min(-(-n_rows // 2), args.chunk)
        for data in synthetic.generate_chunks(spec_for(n_rows, n_users), half):
            synthetic.insert(small, data, chunk_rows=args.chunk)
    return small


def shards(args: argparse.Namespace, target: str) -> None:
    """The raw per-user moments query on one server, through the cluster's Distributed table,
    per shard as the report reads it (analysis.readers.shards: each shard's local table, side by
    side, the per-arm moments added; only when the cluster's samples are sharded by the unit),
    and on each shard's local table alone (one after the other, each with the machine's two
    cores to itself). Checks that the per-shard moments are the Distributed table's."""
    import numpy as np

    from analysis import units
    from analysis.definitions import Filters, Slo
    from analysis.readers import shards as by_shard

    f, slo = Filters(EXPERIMENT), Slo(200.0)
    sql, params = units.moments_select(f, slo, "user")
    server, cluster = open_store(args, "server"), open_store(args, "cluster")
    by_unit = cluster.samples_sharded_by_unit()
    print(f"cluster samples sharded by the unit: {by_unit}", flush=True)
    got, moments = {}, {}
    steps = [
        ("server", lambda: units.rows_to_moments(server.query(sql, params))),
        ("cluster, Distributed table", lambda: units.rows_to_moments(cluster.query(sql, params))),
        ("cluster, per shard side by side", lambda: by_shard.unit_moments(cluster, f, slo, "user")),
    ]
    local_sql, local_params = units.moments_select(f, slo, "user", table="samples_local")
    steps += [
        (f"shard {num} alone", lambda srv=srv: units.rows_to_moments(srv.query(local_sql, local_params)))
        for num, srv in cluster.shards()
    ]
    for name, step in steps:
        t = time.perf_counter()
        moments[name] = step()
        got[name] = time.perf_counter() - t
        n = sum(m.counts[0] for m in moments[name].values())  # clusters of block "all"
        print(f"moments query, {name}: {got[name]:.2f} s ({n:,} users over its arms)", flush=True)
    check(by_unit, "the cluster's samples are not sharded by the unit: the per-shard path was not taken")
    want, per = moments["cluster, Distributed table"], moments["cluster, per shard side by side"]
    check(want.keys() == per.keys(), f"per-shard arms {sorted(per)} != {sorted(want)}")
    for v in want:
        check(want[v].counts == per[v].counts, f"{v}: per-shard counts {per[v].counts} != {want[v].counts}")
        check(
            bool(np.allclose(per[v].sums, want[v].sums, rtol=1e-9, atol=0)),
            f"{v}: per-shard sums differ from the Distributed table's beyond 1e-9",
        )
    record(args.database, "shards", got)
    table(args.database)


# The servers' pid files (scripts/clickhouse.sh, scripts/clickhouse_cluster.sh): the hosts stage
# pins each server's threads to cores of its own.
PID_FILES = {
    "server": VAR / "clickhouse" / "server.pid",
    "shard 1": VAR / "clickhouse-shard1" / "clickhouse" / "server.pid",
    "shard 2": VAR / "clickhouse-shard2" / "clickhouse" / "server.pid",
}


def _pin(name: str, cores: str) -> None:
    """Every thread of one ClickHouse server onto the given cores (taskset -a)."""
    import subprocess

    pid = PID_FILES[name].read_text().strip()
    subprocess.run(["taskset", "-a", "-cp", cores, pid], check=True, capture_output=True)


def hosts(args: argparse.Namespace, target: str) -> None:
    """The raw report, the per-user moments query and the rollout look at revision 1 with each
    server on a core of its own, as if each were a host of one core: the single server on core
    0, then the cluster's shard 1 on core 0 and shard 2 on core 1 (two hosts against one: what a
    Distributed table should divide).
    Every server gets both cores back at the end. The raw report reads the same rows on both
    (measure checks the counts); the moments are checked equal to 1e-9."""
    import os

    import numpy as np

    from analysis import report as r
    from analysis import units
    from analysis.definitions import Filters, Slo
    from analysis.readers import shards as by_shard

    check(os.cpu_count() >= 2, "hosts: needs two cores")
    f, slo, exp = Filters(EXPERIMENT), Slo(200.0), experiment_info()
    server, cluster = open_store(args, "server"), open_store(args, "cluster")
    check(cluster.samples_sharded_by_unit(), "hosts: the cluster's samples are not sharded by the unit")
    sql, params = units.moments_select(f, slo, "user")
    got, moments, ns = {}, {}, {}
    try:
        _pin("server", "0")
        _pin("shard 1", "0")
        _pin("shard 2", "1")
        for target_name, store, moments_of in (
            ("server", server, lambda: units.rows_to_moments(server.query(sql, params))),
            ("cluster", cluster, lambda: by_shard.unit_moments(cluster, f, slo, "user")),
        ):
            t = time.perf_counter()
            moments[target_name] = moments_of()
            got[f"{target_name} moments"] = time.perf_counter() - t
            t = time.perf_counter()
            rep = r.build_report(store, exp, f, use_rollup=False)
            got[f"{target_name} raw report"] = time.perf_counter() - t
            ns[target_name] = {v["key"]: v["n"] for v in rep["variants"]}
            got[f"{target_name} rollout look"], _users, _n = rollout_look(store, 1)
            print(
                f"{target_name}: moments {got[f'{target_name} moments']:.2f} s, "
                f"raw report {got[f'{target_name} raw report']:.2f} s, "
                f"rollout look at revision 1 {got[f'{target_name} rollout look']:.2f} s",
                flush=True,
            )
    finally:
        for name in PID_FILES:
            _pin(name, f"0-{os.cpu_count() - 1}")
    check(ns["server"] == ns["cluster"], f"hosts: report n per variant {ns['cluster']} != {ns['server']}")
    for v, want in moments["server"].items():
        per = moments["cluster"][v]
        check(want.counts == per.counts, f"{v}: per-shard counts {per.counts} != {want.counts}")
        check(bool(np.allclose(per.sums, want.sums, rtol=1e-9, atol=0)), f"{v}: sums differ beyond 1e-9")
    print("\n| one core per host | server s | 2-shard cluster s | cluster / server | target |")
    print("|---|---:|---:|---:|---|")
    for what, target_text in (("raw report", "<= 0.6x"), ("moments", "-"), ("rollout look", "-")):
        a, b = got[f"server {what}"], got[f"cluster {what}"]
        print(f"| {what} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {target_text} |")
    record(args.database, "hosts", got)


def kept(args: argparse.Namespace, target: str) -> None:
    """Rollout looks through the step's kept per-user sums (rollouts.kept) against reading the
    whole step (keep=False), on revision 1 of the 100M run and on the look tables of `measure`
    (those alone with --own-tables), at each --lag and each --rate: the first kept look (it
    builds the sums from every request of the step), then --kept-looks looks a minute apart
    while live traffic of the same users arrives at the rate (a minute and the lag before the
    first: the minute to fold, the lag's to read afresh; the minute since before each of the
    others), then the kept rows compacted and a look from the compacted generation.
    Every kept reading equals the whole one (counts, users and histograms exactly, moments to
    1e-9). The new samples go to a partition of their own (sent in 2030-01), dropped after, with
    the kept sums. Last, the later looks' medians per lag and rate side by side, with the ratio
    of the most users' to the fewest's."""

    plan = rollout_plan()
    steps = [] if args.own_tables else [(None, "the 100M run's revision 1")]
    for spec_text in args.looks.split(","):
        n_rows, n_users = (int(x) for x in spec_text.split(":"))
        steps.append(((n_rows, n_users), f"{n_rows:,} samples of {n_users:,} users"))
    lags = [int(x) for x in str(args.lag).split(",")]
    rates = [float(x) for x in str(args.rate).split(",")]
    out = []
    for size, label in steps:
        store = open_store(args, target) if size is None else look_store(args, target, *size)
        try:
            check(store.query("SELECT count() FROM samples")[0][0] > 0, f"{label}: no samples (load first)")
            for lag_s in lags:
                for rate in rates:
                    out.append(
                        {
                            "label": label,
                            "lag_s": lag_s,
                            "rate": rate,
                            **kept_looks(store, plan, label, lag_s, rate, args.kept_looks),
                        }
                    )
                    st = out[-1]
                    print(
                        f"{label}, lag {lag_s} s, {rate:,.0f} req/s: {st['users']:,} users, {st['requests']:,} "
                        f"requests: whole {st['whole_s']:.2f} s; kept: first {st['first_s']:.2f} s, then "
                        f"{len(st['steady_s'])} looks, median {median(st['steady_s']):.3f} s "
                        f"({', '.join(f'{x:.3f}' for x in st['steady_s'])}; the median "
                        f"{median(st['steady_s']) / st['whole_s']:.3f}x the whole; units in the traffic each "
                        f"look is the first to see: {', '.join(f'{x:,}' for x in st['traffic_units'])}); "
                        f"compacting {st['compact_rows']:,} kept rows {st['compact_s']:.2f} s",
                        flush=True,
                    )
        finally:
            store.close()
    record(args.database, f"kept/{target}", {"lags": lags, "rates": rates, "steps": out})
    print()
    print(kept_sweep(out))


def index_memory(args: argparse.Namespace, target: str) -> None:
    """index (module docstring): resident memory freed by dropping a step's index, per row."""
    from analysis.definitions import Slo
    from rollouts import kept as keptmod
    from rollouts.readings import read_step
    from samples import schema

    pid_file = PID_FILES["server"]
    check(
        pid_file.exists(), f"index: no pid file {pid_file}: the project's own server (scripts/clickhouse.sh)"
    )
    pid = pid_file.read_text().strip()

    def resident() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    n_rows, n_users = (int(x) for x in args.looks.split(",")[-1].split(":"))
    store = look_store(args, target, n_rows, n_users)
    try:
        plan, slo = rollout_plan(), Slo(200.0)
        for table in (schema.ROLLOUT_USER_SUMS_TABLE, schema.ROLLOUT_FOLDS_TABLE):
            store.execute(f"TRUNCATE TABLE {table}")
        top = int(store.query("SELECT max(recorded_ms) FROM samples WHERE config_revision = 1")[0][0])
        reading = read_step(store, EXPERIMENT, 1, plan, slo, keep=True, now_ms=top + keptmod.KEEP_LAG_MS + 1)
        check(reading.error == "", f"index: {reading.error}")
        step = keptmod.KeptStep(store, EXPERIMENT, 1, (plan.control, plan.candidate), slo, plan.latencies())
        state = step.newest()
        check(step._index_folds(state.generation) == {1}, "index: the first look built no index")
        time.sleep(2)  # the look's own allocations returned
        before = resident()
        store.execute(f"DROP TABLE {step.index_name(state.generation)}")
        time.sleep(2)
        freed = before - resident()
    finally:
        keptmod.forget(store, EXPERIMENT)
        store.close()
    print(
        f"index of {state.entries:,} kept rows ({state.units:,} units): dropping it freed "
        f"{freed / 1e6:,.1f} MB of the server's resident memory, {freed / max(state.entries, 1):,.0f} B a row"
    )
    record(args.database, f"index/{target}", {"rows": state.entries, "freed_bytes": freed})


def kept_sweep(out: list[dict]) -> str:
    """The later looks (their median) per lag and rate, a column per step, and the ratio of the
    step with the most users to the one with the fewest."""
    labels = list(dict.fromkeys(st["label"] for st in out))
    users = {lb: max(st["users"] for st in out if st["label"] == lb) for lb in labels}
    most, fewest = max(labels, key=users.get), min(labels, key=users.get)
    lines = [
        "| lag s | req/s | " + " | ".join(f"{lb}, s" for lb in labels) + f" | {most} / {fewest} |",
        "|---:|---:|" + "---:|" * (len(labels) + 1),
    ]
    cells = {(st["lag_s"], st["rate"], st["label"]): median(st["steady_s"]) for st in out}
    for lag_s, rate in dict.fromkeys((st["lag_s"], st["rate"]) for st in out):
        row = [cells.get((lag_s, rate, lb)) for lb in labels]
        a, b = cells.get((lag_s, rate, most)), cells.get((lag_s, rate, fewest))
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        lines.append(
            f"| {lag_s} | {rate:,.0f} | "
            + " | ".join("-" if x is None else f"{x:.3f}" for x in row)
            + f" | {ratio} |"
        )
    return "\n".join(lines)


def kept_looks(store, plan, label: str, lag_s: int, rate: float, looks: int) -> dict:
    """One step's kept looks at one lag and rate (kept's docstring), checked; their figures."""
    from analysis.definitions import Slo
    from rollouts import kept as keptmod
    from rollouts.readings import read_step
    from samples import schema, synthetic

    slo = Slo(200.0)
    users = (
        int(store.query("SELECT max(toUInt64(substring(user_id, 2))) FROM samples WHERE user_id != ''")[0][0])
        + 1
    )

    def forget() -> None:
        for table in (schema.ROLLOUT_USER_SUMS_TABLE, schema.ROLLOUT_FOLDS_TABLE):
            store.execute(f"TRUNCATE TABLE {table}")
        if store.query(
            "SELECT count() FROM system.parts WHERE database = currentDatabase() AND table = 'samples' "
            "AND partition = '203001' AND active"
        )[0][0]:
            store.execute("ALTER TABLE samples DROP PARTITION 203001")

    what = f"{label}, lag {lag_s} s, {rate:,.0f} req/s"

    def look(now_ms: int):
        return read_step(store, EXPERIMENT, 1, plan, slo, keep=True, now_ms=now_ms, keep_lag_ms=lag_ms)

    forget()
    lag_ms = lag_s * 1000
    top = int(store.query("SELECT max(recorded_ms) FROM samples WHERE config_revision = 1")[0][0])
    now = top + lag_ms + 1
    try:
        t = time.perf_counter()
        whole = read_step(store, EXPERIMENT, 1, plan, slo, keep=False)
        whole_s = time.perf_counter() - t
        t = time.perf_counter()
        first = look(now)
        first_s = time.perf_counter() - t
        same_reading(whole, first, f"{what}: first kept look")
        steady, touched = [], []
        lead_s = 60 + lag_s  # the first later look's traffic: the minute to fold and the lag
        for k in range(looks):
            # recorded after the first look's watermark (its now - lag), none of it late
            since = now - lag_ms + 1 + (0 if k == 0 else (lead_s + (k - 1) * 60) * 1000)
            touched.append(
                traffic(store, synthetic, users, rate, since, lead_s if k == 0 else 60, seed=50 + k)
            )
            spent = timing_queries(store)
            t = time.perf_counter()
            try:
                got = look(now + (k + 1) * 60_000)
            finally:
                untime(store)
            steady.append(time.perf_counter() - t)
            print("    its queries: " + "; ".join(f"{q_s:.3f} s {q[:36]}" for q_s, q in spent), flush=True)
            same_reading(read_step(store, EXPERIMENT, 1, plan, slo, keep=False), got, f"{what}: look {k + 2}")
        # the kept rows summed to one per unit (what a fold does once they pass COMPACT_ABOVE per
        # unit), then a look from the compacted generation
        step = keptmod.KeptStep(
            store, EXPERIMENT, 1, (plan.control, plan.candidate), slo, plan.latencies(), lag_ms=lag_ms
        )
        state = step.newest()
        t = time.perf_counter()
        compacted = step.compact(state)
        compact_s = time.perf_counter() - t
        check(compacted.generation != state.generation, f"{what}: compaction made no generation")
        same_reading(
            read_step(store, EXPERIMENT, 1, plan, slo, keep=False),
            look(now + looks * 60_000),
            f"{what}: after compaction",
        )
    finally:
        forget()
    return {
        "users": sum(got.users.values()),
        "requests": got.control.n + got.candidate.n,
        "whole_s": whole_s,
        "first_s": first_s,
        "steady_s": steady,
        "traffic_units": touched,
        "compact_rows": state.entries,
        "compact_s": compact_s,
    }


def traffic(store, synthetic, users: int, rate: float, from_ms: int, seconds: int, seed: int) -> int:
    """``seconds`` of live traffic at ``rate`` requests a second of the step's users (the same
    model as the run), recorded from ``from_ms``, under revision 1, sent in 2030-01; how many
    units (users, and requests without one) it holds."""
    import numpy as np

    n = int(rate * seconds)
    c = synthetic.generate(spec_for(max(n, 1000), users, seed=seed)).columns
    k = len(c["variant"])
    rng = np.random.default_rng(seed)
    c["config_revision"] = np.ones(k, dtype=np.int64)
    c["run_id"] = np.full(k, 2030_01_00 + seed, dtype=np.uint64)
    c["recorded_ms"] = (from_ms + rng.random(k) * seconds * 1000).astype(np.uint64)
    c["sent_at"] = np.full(k, 1893456000 + 3600, dtype=np.uint32)  # 2030-01-01 01:00 UTC
    store.insert_columns(c)
    named = c["user_id"] != ""
    return int(np.unique(c["user_id"][named]).size + (~named).sum())  # a request without a user is a unit


def same_reading(a, b, what: str) -> None:
    """Two StepReadings read the same: counts, users, setup errors and histograms exactly, the
    per-user moments to 1e-9."""
    import numpy as np

    check(a.error == "" and b.error == "", f"{what}: {a.error or b.error}")
    check(a.users == b.users, f"{what}: users {a.users} != {b.users}")
    for x, y in ((a.control, b.control), (a.candidate, b.candidate)):
        check(
            (x.n, x.hits, x.errors, x.setup_errors) == (y.n, y.hits, y.errors, y.setup_errors),
            f"{what}: counts {(x.n, x.hits, x.errors)} != {(y.n, y.hits, y.errors)}",
        )
        for name in x.latencies:
            check(bool(np.array_equal(x.latencies[name].counts, y.latencies[name].counts)), f"{what}: {name}")
        for metric in ("attainment", "error_rate"):
            p, q = getattr(x.per_user, metric), getattr(y.per_user, metric)
            check((p is None) == (q is None), f"{what}: {metric} moments on one side only")
            if p is not None:
                check((p.clusters, p.largest) == (q.clusters, q.largest), f"{what}: {metric} clusters")
                check(bool(np.allclose(p.total, q.total, rtol=1e-9, atol=0)), f"{what}: {metric} totals")
                check(bool(np.allclose(p.cross, q.cross, rtol=1e-9, atol=0)), f"{what}: {metric} products")


def shapes(args: argparse.Namespace, target: str) -> None:
    """The per-user moments query of analysis/units.py at --against (a revision) against this
    tree's, on the server's table, alternating (theirs, ours, theirs, ours): each one's time and
    the check that both give the same moments."""
    import importlib.util
    import subprocess

    import numpy as np

    from analysis import units
    from analysis.definitions import Filters, Slo

    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{args.against}:analysis/units.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("units_against", loader=None)
    theirs = importlib.util.module_from_spec(spec)
    sys.modules["units_against"] = theirs  # dataclasses look their module up
    exec(compile(text, f"{args.against}:analysis/units.py", "exec"), theirs.__dict__)  # noqa: S102
    store = open_store(args, target)
    got: dict[str, list[float]] = {args.against: [], "this tree": []}
    answers = {}
    for _ in range(2):
        for name, mod in ((args.against, theirs), ("this tree", units)):
            sql, params = mod.moments_select(Filters(EXPERIMENT), Slo(200.0), "user")
            t = time.perf_counter()
            answers[name] = units.rows_to_moments(store.query(sql, params))
            got[name].append(time.perf_counter() - t)
            print(f"{target}: moments query of {name}: {got[name][-1]:.2f} s", flush=True)
    a, b = answers[args.against], answers["this tree"]
    check(
        set(a) == set(b) and all(a[v].counts == b[v].counts and np.allclose(a[v].sums, b[v].sums) for v in a),
        "the two moments queries disagree",
    )
    record(args.database, "shapes", {k: min(v) for k, v in got.items()})
    store.close()


LAYOUTS = {
    "ORDER BY (experiment, variant, run_id, seq, request_id) (the table's)": "experiment, variant, run_id, seq, request_id",
    "ORDER BY (experiment, variant, run_id, user_id, seq, request_id)": "experiment, variant, run_id, user_id, seq, request_id",
    "ORDER BY (experiment, run_id, seq, request_id)": "experiment, run_id, seq, request_id",
}


def layout(args: argparse.Namespace, target: str) -> None:
    """The samples table's sorting key and compression chosen by measurement: the first
    --layout-rows samples of the server's run copied into tables of each ORDER BY (LAYOUTS), on
    the server (lz4, 18.16's default and only method without a server config) and, with
    --zstd-url, on a server whose config compresses parts with zstd (18.16 has no per-column
    CODEC clause: its <compression> section is the only choice), each merged to one part per
    partition (OPTIMIZE FINAL); bytes per sample, the largest columns, and the per-user moments
    query's time on each."""
    from analysis import units
    from analysis.definitions import Filters, Slo
    from samples.backends.clickhouse import ClickHouseServerBackend

    source = f"remote('{SERVER_URL.rsplit('@', 1)[1]}', {args.database}, samples)"
    sql, params = units.moments_select(Filters(EXPERIMENT), Slo(200.0), "user")
    main = open_store(args, "server")
    # the table as migrated (later migrations added columns to the first one's text)
    columns = ", ".join(
        f"{name} {kind}"
        for name, kind in main.query(
            f"SELECT name, type FROM system.columns WHERE database = '{args.database}' AND table = 'samples'"
        )
    )
    main.close()
    servers = [("lz4", SERVER_URL)] + ([("zstd", args.zstd_url)] if args.zstd_url else [])
    got = {}
    for method, url in servers:
        store = ClickHouseServerBackend(f"{url}/default", send_receive_timeout=1800)
        store.execute(f"CREATE DATABASE IF NOT EXISTS {args.database}_layout")
        for i, (label, key) in enumerate(LAYOUTS.items()):
            scratch = f"{args.database}_layout.samples_{i}"
            store.execute(f"DROP TABLE IF EXISTS {scratch}")
            create = (
                f"CREATE TABLE {scratch} ({columns}) ENGINE = ReplacingMergeTree(recorded_ms) "
                f"PARTITION BY toYYYYMM(sent_at) ORDER BY ({key})"
            )
            store.execute(create)
            store.execute(f"INSERT INTO {scratch} SELECT * FROM {source} WHERE seq < {args.layout_rows}")
            store.execute(f"OPTIMIZE TABLE {scratch} FINAL")
            rows, comp = store.query(
                "SELECT sum(rows), sum(data_compressed_bytes) FROM system.parts "
                f"WHERE database = '{args.database}_layout' AND table = 'samples_{i}' AND active"
            )[0]
            check(rows == args.layout_rows, f"layout {label}: {rows} rows, not {args.layout_rows}")
            per = store.query(
                "SELECT name, data_compressed_bytes FROM system.columns "
                f"WHERE database = '{args.database}_layout' AND table = 'samples_{i}' "
                "ORDER BY data_compressed_bytes DESC LIMIT 6"
            )
            t = time.perf_counter()
            store.query(sql.replace("FROM samples ", f"FROM {scratch} "), params)
            q_s = time.perf_counter() - t
            got[f"{method}, {label}"] = {
                "bytes_per_sample": comp / rows,
                "top": [(name, b / rows) for name, b in per],
                "moments_s": q_s,
            }
            print(
                f"{method}, {label}: {comp / rows:.1f} B/sample; moments query {q_s:.2f} s; "
                + ", ".join(f"{name} {b / rows:.1f}" for name, b in per),
                flush=True,
            )
        store.close()
    record(args.database, "layout", got)
    table(args.database)


def table(database: str) -> None:
    path = VAR / "bench_scale_results.json"
    got = (json.loads(path.read_text()) if path.exists() else {}).get(database, {})
    log = json.loads(LOAD_LOG.read_text()) if LOAD_LOG.exists() else {}
    print()
    print("| figure | server | 2-shard cluster | cluster / server | target |")
    print("|---|---:|---:|---:|---|")
    srv, clu = got.get("server", {}), got.get("cluster", {})

    def row(label, key, fmt, target=""):
        a, b = srv.get(key), clu.get(key)
        ratio = f"{b / a:.2f}x" if a and b else "-"
        fa = fmt.format(a) if a is not None else "-"
        fb = fmt.format(b) if b is not None else "-"
        print(f"| {label} | {fa} | {fb} | {ratio} | {target} |")

    for t in ("server", "cluster"):
        for k, v in log.items():
            if k.startswith(f"{t}/{database}/") and v["insert_s"]:
                got.setdefault(t, {})["insert_rate"] = v["rows"] / v["insert_s"]
                got[t]["insert_rows"] = v["rows"]
    srv, clu = got.get("server", {}), got.get("cluster", {})
    row("samples", "rows", "{:,}")
    row("insert through insert_columns, rows/s", "insert_rate", "{:,.0f}")
    row("rows loaded through the writer", "insert_rows", "{:,}")
    row("rows copied inside ClickHouse (fill)", "copied_rows", "{:,}")
    row("bytes per sample on disk (compressed)", "bytes_per_sample", "{:.1f}")
    row("bytes per sample uncompressed", "raw_bytes_per_sample", "{:.1f}")
    row("rollup build, s", "rollup_build_s", "{:.1f}")
    row("report COLD from the rollup, s", "report_rollup_s", "{:.2f}", "<= 2 s (server)")
    row("report COLD from raw samples, s", "report_raw_s", "{:.1f}", "cluster <= 0.6x")
    row("dashboard page COLD, s", "page_cold_s", "{:.2f}", "<= 3 s")
    row("dashboard page HOT, s", "page_hot_s", "{:.3f}")
    print()
    print(
        "| rollout look (read_step, per-user moments, 2 guardrails) | users | requests | server s | cluster s |"
    )
    print("|---|---:|---:|---:|---:|")
    if srv.get("look_s") is not None:
        c = f"{clu['look_s']:.3f}" if clu.get("look_s") is not None else "-"
        print(
            f"| the run's revision 1 | {srv['look_users']:,} | {srv['look_requests']:,} | {srv['look_s']:.3f} | {c} |"
        )
    a, b = srv.get("looks", []), clu.get("looks", [])
    for i in range(max(len(a), len(b))):
        users, n = (a if i < len(a) else b)[i][1:]
        a_s = f"{a[i][0]:.3f}" if i < len(a) else "-"
        b_s = f"{b[i][0]:.3f}" if i < len(b) else "-"
        print(f"| a table of its own | {users:,} | {n:,} | {a_s} | {b_s} |")
    for target in ("server", "cluster"):
        k = got.get(f"kept/{target}")
        if not k or "lags" not in k:  # recorded before the stage took several lags and rates
            continue
        print()
        print(
            f"| rollout look through the kept sums, {target} | lag s | req/s arriving | users | requests | "
            "whole s | first kept s | next looks s: median (range) | kept / whole | compaction: rows, s |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for st in k["steps"]:
            nxt = f"{median(st['steady_s']):.3f} ({min(st['steady_s']):.3f}-{max(st['steady_s']):.3f})"
            print(
                f"| {st['label']} | {st['lag_s']} | {st['rate']:,.0f} | {st['users']:,} | {st['requests']:,} | "
                f"{st['whole_s']:.2f} | {st['first_s']:.2f} | {nxt} | {median(st['steady_s']) / st['whole_s']:.3f}x | "
                f"{st['compact_rows']:,}, {st['compact_s']:.2f} |"
            )
        print()
        print(kept_sweep(k["steps"]))
    if got.get("shapes"):
        print()
        print("| per-user moments query, the server's table (best of 2) | s |")
        print("|---|---:|")
        for k, v in got["shapes"].items():
            print(f"| {k} | {v:.2f} |")
    lay = got.get("layout", {})
    if lay:
        print()
        print(
            f"| layout (first {lay and 'N'} samples, one part per partition) | B/sample | moments query s | largest columns, B/sample |"
        )
        print("|---|---:|---:|---|")
        for k, v in lay.items():
            cols = ", ".join(f"{n} {b:.1f}" for n, b in v["top"])
            print(f"| {k} | {v['bytes_per_sample']:.1f} | {v['moments_s']:.2f} | {cols} |")
    sh = got.get("shards", {})
    if sh:
        print()
        print("| per-user moments query (raw report's largest) | s | vs server |")
        print("|---|---:|---:|")
        for k, v in sh.items():
            print(f"| {k} | {v:.1f} | {v / sh['server']:.2f}x |")


if __name__ == "__main__":
    main()
