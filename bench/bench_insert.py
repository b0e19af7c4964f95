"""Sample store insert rate (rows/s): the validated store insert vs unvalidated baselines, same run.

    scripts/clickhouse.sh start
    .venv/bin/python bench/bench_insert.py [--rows 200000] [--batch 10000] [--single 2000]
        [--rounds 3] [--url clickhouse://default:@127.0.0.1:19000/abplat_bench]
    .venv/bin/python bench/bench_insert.py --quick    # 20k rows, 1 round, the same tables (~15 s)

Rows are built as the replay builds them (samples.rows.row_from: samples.columns.SampleRow, the
values in column order); building them is not timed, nor is copying them, once, into the plain
tuples (the same values) the baselines hand to the driver and into fresh SampleRows for the
store, so that both sides read rows laid out alike in memory (the driver reads plain tuples by
index; a SampleRow's by-name lookup would only slow it down). Each method starts from what a
writer holds and writes
into a freshly migrated samples table (ClickHouse server database from --url; chDB in a
temporary directory). Methods:
  row-by-row     one INSERT statement per row (what a naive writer does)
  row tuples     UNVALIDATED: the row tuples handed to clickhouse-driver's insert, one list per
                 INSERT (server); one VALUES literal per INSERT (chDB, which has no driver)
  lists          UNVALIDATED: clickhouse-driver columnar=True with Python lists (server)
  store          SampleStore.insert_samples on the SampleRows: transposed (one flat list, a
                 slice per column), validated (samples.columns, whole columns at a time), then
                 sent as one native block encoded from the numpy columns, rows in the table's
                 sorting-key order (server) / as Arrow (chDB)
The batched methods run in --rounds interleaved rounds (every method once per round, in turn),
so a load change on the machine hits them alike; each figure is the median round.
The second table puts the validated store insert beside the unvalidated row tuples of its
backend (target: ratio >= 1.0).

Checks (any failure prints `bench FAILED: <what and where>` to stderr and exits 1): the ClickHouse
server answers and chDB opens its directory; after every method the table holds exactly the rows
that method inserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402

DEFAULT_URL = os.environ.get(
    "ABPLAT_BENCH_CLICKHOUSE_URL", "clickhouse://default:@127.0.0.1:19000/abplat_bench"
)
ROW_BY_ROW, TUPLES, LISTS, STORE = "row-by-row", "row tuples", "lists", "store"


def make_rows(n: int) -> list[Any]:
    from samples.rows import SampleContext, row_from
    from streaming.result import Outcome, StreamResult

    base = StreamResult(
        outcome=Outcome.OK,
        http_status=200,
        connect_ms=1.2,
        ttfb_ms=3.4,
        first_byte_ms=3.5,
        ttft_event_ms=20.0,
        ttft_ms=21.0,
        itl_mean_ms=4.0,
        itl_p50_ms=3.9,
        itl_p99_ms=9.0,
        itl_max_ms=12.0,
        itl_gaps_us=[3_900 + 37 * (k % 7) for k in range(29)],  # chunks - 1, as a stream gives them
        tpot_ms=4.1,
        e2e_ms=130.0,
        output_tokens=28,
        prompt_tokens=700,
        usage_reported=True,
        chunks=30,
        finish_reason="length",
        trace_id="0af7651916cd43dd8448eb211c80319c",
        start_ns=123,
    )
    rows = []
    for i in range(n):
        base.ttft_ms = 15.0 + (i % 97)
        base.server_ttft_ms = None if i % 3 else 14.0
        rows.append(
            row_from(
                base,
                SampleContext(
                    experiment="bench",
                    run_id=1,
                    seq=i,
                    variant=("fp16", "awq", "awq-fa2")[i % 3],
                    mode="split",
                    sent_unix_ms=1_732_900_000_000.0 + i * 3.7,
                    user_id=f"user-{i % 1000}",
                    config_revision=12,
                    scheduled_offset_ms=i * 3.7,
                    schedule_lag_ms=0.4,
                    in_flight=i % 16,
                    max_tokens=28,
                    worker="bench:1",
                ),
            )
        )
    return rows


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def reset(store: Any) -> None:
    from samples import schema

    store.execute(f"DROP TABLE IF EXISTS {schema.SAMPLES_TABLE}")
    store.execute(f"DROP TABLE IF EXISTS {schema.MIGRATIONS_TABLE}")
    store.migrate()


def timed_into(store: Any, label: str, n: int, fn: Callable[[], None]) -> float:
    """Seconds `fn` takes to insert n rows into a fresh table; checks the table then holds n."""
    reset(store)
    t0 = time.perf_counter()
    fn()
    secs = time.perf_counter() - t0
    got = store.query("SELECT count() FROM samples")[0][0]
    if got != n:
        raise BenchFailed(f"{store.backend_name} {label}: inserted {n} rows, the table holds {got}")
    return secs


def server_methods(
    store: Any, rows: list, batch: int, single: int
) -> dict[str, tuple[int, Callable[[], None]]]:
    from samples.columns import COLUMN_NAMES, to_columns

    client = store._client()  # the raw driver, for the baselines
    tuples = [tuple(r) for r in rows]  # SampleRow -> plain tuple: the same values, in column order
    sql = f"INSERT INTO samples ({', '.join(COLUMN_NAMES)}) VALUES"
    tuple_batches, row_batches = batches(tuples, batch), batches(rows, batch)
    list_batches = [list(to_columns(b).values()) for b in row_batches]
    return {
        ROW_BY_ROW: (single, lambda: [client.execute(sql, [t]) for t in tuples[:single]]),
        TUPLES: (len(rows), lambda: [client.execute(sql, b) for b in tuple_batches]),
        LISTS: (len(rows), lambda: [client.execute(sql, b, columnar=True) for b in list_batches]),
        STORE: (len(rows), lambda: [store.insert_samples(b) for b in row_batches]),
    }


def chdb_methods(
    store: Any, rows: list, batch: int, single: int
) -> dict[str, tuple[int, Callable[[], None]]]:
    from samples.columns import COLUMN_NAMES
    from samples.sql import quote

    head = f"INSERT INTO samples ({', '.join(COLUMN_NAMES)}) VALUES "
    tuples = [tuple(r) for r in rows]

    def value(v: Any) -> str:
        # an array column's value (a tuple or list, maybe empty: token_fps of an answer not
        # fingerprinted) is an Array literal; quote() keeps tuples for IN and refuses empty ones
        if isinstance(v, list | tuple):
            return "[" + ", ".join(quote(x) for x in v) + "]"
        return quote(v)

    def literal(ts: list[tuple]) -> str:
        return ", ".join("(" + ", ".join(value(v) for v in t) + ")" for t in ts)

    tuple_batches, row_batches = batches(tuples, batch), batches(rows, batch)
    return {
        ROW_BY_ROW: (single, lambda: [store.execute(head + literal([t])) for t in tuples[:single]]),
        TUPLES: (len(rows), lambda: [store.execute(head + literal(b)) for b in tuple_batches]),
        STORE: (len(rows), lambda: [store.insert_samples(b) for b in row_batches]),
    }


def measure(
    backend: str, store: Any, methods: dict[str, tuple[int, Callable[[], None]]], rounds: int
) -> list[tuple[str, str, int, float]]:
    """(backend, method, rows, median seconds); row-by-row once, the batched ones interleaved."""
    out = []
    n, fn = methods[ROW_BY_ROW]
    out.append((backend, ROW_BY_ROW, n, timed_into(store, ROW_BY_ROW, n, fn)))
    times: dict[str, list[float]] = {label: [] for label in methods if label != ROW_BY_ROW}
    for _ in range(rounds):
        for label in times:
            n, fn = methods[label]
            times[label].append(timed_into(store, label, n, fn))
    for label, secs in times.items():
        out.append((backend, label, methods[label][0], statistics.median(secs)))
    return out


def warm(store: Any, rows: list) -> None:
    """One small validated insert before timing, untimed: first-use imports (pandas for the
    driver's numpy path, pyarrow) and connection setup must not be charged to any method."""
    reset(store)
    store.insert_samples(rows[:100])


def run(args: argparse.Namespace) -> None:
    from samples.backends.chdb import ChdbBackend
    from samples.backends.clickhouse import ClickHouseServerBackend
    from samples.columns import COLUMN_NAMES, SampleRow
    from samples.store import StoreError

    server = ClickHouseServerBackend(args.url, tries=1)
    try:
        server.ensure_database()  # through the `default` database: this one may not exist yet
        server.ping()
    except StoreError as e:
        raise BenchFailed(f"precondition: ClickHouse server {server.url_safe} unreachable: {e}") from None

    rows = [SampleRow(r) for r in make_rows(args.rows)]  # a fresh copy, as the tuples are
    warm(server, rows)
    results = measure("server", server, server_methods(server, rows, args.batch, args.single), args.rounds)
    server.execute("DROP TABLE IF EXISTS samples")
    with tempfile.TemporaryDirectory() as d:
        try:
            chdb = ChdbBackend(d, "abplat_bench")
        except StoreError as e:
            raise BenchFailed(f"precondition: chDB cannot open {d}: {e}") from None
        warm(chdb, rows)
        results += measure("chdb", chdb, chdb_methods(chdb, rows, args.batch, args.single), args.rounds)

    label = {
        ROW_BY_ROW: "row-by-row (1 INSERT/row)",
        TUPLES: f"row tuples, {args.batch}/INSERT (unvalidated)",
        LISTS: f"columnar lists, {args.batch}/INSERT (unvalidated)",
        STORE: f"store.insert_samples, {args.batch} (validated)",
    }
    print(
        f"\nInsert rate, {len(COLUMN_NAMES)} columns, {args.rows} rows, batch {args.batch}, "
        f"median of {args.rounds} interleaved round(s)"
    )
    print(f"{'backend':<8} {'method':<46} {'rows':>8} {'s':>8} {'rows/s':>10} {'vs row-by-row':>14}")
    rate: dict[tuple[str, str], float] = {}
    for backend, method, n, secs in results:
        rate[backend, method] = n / secs
        base = rate[backend, ROW_BY_ROW]
        print(
            f"{backend:<8} {label[method]:<46} {n:>8} {secs:>8.2f} {n / secs:>10,.0f} "
            f"{n / secs / base:>13.1f}x"
        )
    print("\nValidated store insert vs unvalidated row tuples (same run; target: ratio >= 1.0)")
    print(f"{'backend':<8} {'row tuples rows/s':>18} {'validated rows/s':>17} {'ratio':>7}")
    for backend in ("server", "chdb"):
        t, s = rate[backend, TUPLES], rate[backend, STORE]
        print(f"{backend:<8} {t:>18,.0f} {s:>17,.0f} {s / t:>6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--single", type=int, default=2_000, help="rows for the row-by-row baseline")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the batched methods")
    ap.add_argument("--url", default=DEFAULT_URL)
    ap.add_argument("--quick", action="store_true", help="smoke run: 20k rows, 1 round (~15 s)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.batch, args.single, args.rounds = 20_000, 5_000, 50, 1

    def checked() -> None:
        if urllib.parse.urlsplit(args.url).scheme != "clickhouse":
            raise BenchFailed(f"--url must be clickhouse://..., got {args.url!r}")
        if min(args.rows, args.batch, args.single, args.rounds) < 1 or args.single > args.rows:
            raise BenchFailed("--rows, --batch, --single, --rounds must be >= 1 and --single <= --rows")
        run(args)

    sys.exit(run_checked(checked))


if __name__ == "__main__":
    main()
