"""Sample store insert rate (rows/s): our columnar batch path vs plain inserts, same run.

    .venv/bin/python bench/bench_insert.py [--rows 200000] [--batch 10000] [--single 2000]
        [--url clickhouse://default:@127.0.0.1:19000/abplat_bench]

Needs the ClickHouse server (scripts/clickhouse.sh start). Each method writes into a fresh
samples table; row generation is not timed. Baselines, per backend:
  row-by-row   one INSERT statement per row (what a naive writer does)
  row tuples   clickhouse-driver executemany-style list of tuples / one VALUES literal for chDB
  lists        clickhouse-driver columnar=True with Python lists (no numpy)
  store        SampleStore.insert_samples: validation + numpy columnar (server) /
               pyarrow + INSERT ... SELECT FROM Python(tbl) (chDB)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.columns import COLUMN_NAMES, row_from, to_columns  # noqa: E402
from samples.sql import quote  # noqa: E402
from samples.store import ChdbBackend, ClickHouseServerBackend, SampleStore  # noqa: E402
from streaming.result import Outcome, StreamResult  # noqa: E402


def make_rows(n: int) -> list[dict[str, Any]]:
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
                {
                    "experiment": "bench",
                    "run_id": 1,
                    "seq": i,
                    "variant": ("fp16", "awq", "awq-fa2")[i % 3],
                    "mode": "split",
                    "sent_unix_ms": 1_732_900_000_000.0 + i * 3.7,
                    "user_id": f"user-{i % 1000}",
                    "config_revision": 12,
                    "scheduled_offset_ms": i * 3.7,
                    "schedule_lag_ms": 0.4,
                    "in_flight": i % 16,
                    "max_tokens": 28,
                    "worker": "bench:1",
                },
            )
        )
    return rows


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def batches(rows: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


INSERT_COLS = f"INSERT INTO samples ({', '.join(COLUMN_NAMES)})"


def values_literal(rows: list[dict[str, Any]]) -> str:
    return ", ".join("(" + ", ".join(quote(r[c]) for c in COLUMN_NAMES) + ")" for r in rows)


def reset(store: SampleStore) -> None:
    store.execute("DROP TABLE IF EXISTS samples")
    store.execute("DROP TABLE IF EXISTS schema_migrations")
    store.migrate()


def check(store: SampleStore, n: int, label: str) -> None:
    got = store.query("SELECT count() FROM samples")[0][0]
    if got != n:
        raise SystemExit(f"{label}: expected {n} rows, table has {got}")


def bench_server(url: str, rows: list, batch: int, single: int) -> list[tuple]:
    store = ClickHouseServerBackend(url)
    store.ensure_database()
    client = store._client()  # the raw driver, for the baselines
    out = []
    tuples = [tuple(r[c] for c in COLUMN_NAMES) for r in rows]
    plain_sql = INSERT_COLS + " VALUES"

    reset(store)
    secs = timed(lambda: [client.execute(plain_sql, [t]) for t in tuples[:single]])
    check(store, single, "server row-by-row")
    out.append(("server", "row-by-row (1 INSERT/row)", single, secs))

    reset(store)
    secs = timed(lambda: [client.execute(plain_sql, b) for b in batches(tuples, batch)])
    check(store, len(rows), "server row tuples")
    out.append(("server", f"row tuples, {batch}/INSERT", len(rows), secs))

    reset(store)

    def lists() -> None:
        for b in batches(rows, batch):
            cols = list(to_columns(b).values())
            client.execute(plain_sql, cols, columnar=True)

    secs = timed(lists)
    check(store, len(rows), "server lists")
    out.append(("server", f"columnar lists, {batch}/INSERT", len(rows), secs))

    reset(store)
    secs = timed(lambda: [store.insert_samples(b) for b in batches(rows, batch)])
    check(store, len(rows), "server store")
    out.append(("server", f"store.insert_samples (numpy), {batch}", len(rows), secs))
    store.execute("DROP TABLE IF EXISTS samples")
    return out


def bench_chdb(path: str, rows: list, batch: int, single: int) -> list[tuple]:
    store = ChdbBackend(path, "abplat_bench")
    out = []

    reset(store)
    secs = timed(
        lambda: [store.execute(INSERT_COLS + " VALUES " + values_literal([r])) for r in rows[:single]]
    )
    check(store, single, "chdb row-by-row")
    out.append(("chdb", "row-by-row (1 INSERT/row)", single, secs))

    reset(store)
    secs = timed(
        lambda: [store.execute(INSERT_COLS + " VALUES " + values_literal(b)) for b in batches(rows, batch)]
    )
    check(store, len(rows), "chdb row tuples")
    out.append(("chdb", f"VALUES literal, {batch}/INSERT", len(rows), secs))

    reset(store)
    secs = timed(lambda: [store.insert_samples(b) for b in batches(rows, batch)])
    check(store, len(rows), "chdb store")
    out.append(("chdb", f"store.insert_samples (arrow), {batch}", len(rows), secs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--single", type=int, default=2_000, help="rows for the row-by-row baseline")
    ap.add_argument("--url", default="clickhouse://default:@127.0.0.1:19000/abplat_bench")
    args = ap.parse_args()
    if urllib.parse.urlsplit(args.url).scheme != "clickhouse":
        raise SystemExit(f"--url must be clickhouse://..., got {args.url!r}")

    rows = make_rows(args.rows)
    results = bench_server(args.url, rows, args.batch, args.single)
    with tempfile.TemporaryDirectory() as d:
        results += bench_chdb(d, rows, args.batch, args.single)

    print(f"\nInsert rate, {len(COLUMN_NAMES)} columns, {args.rows} rows, batch {args.batch}")
    print(f"{'backend':<8} {'method':<40} {'rows':>8} {'s':>8} {'rows/s':>10} {'vs row-by-row':>14}")
    base: dict[str, float] = {}
    for backend, method, n, secs in results:
        rate = n / secs
        base.setdefault(backend, rate)  # the first method of each backend is row-by-row
        print(f"{backend:<8} {method:<40} {n:>8} {secs:>8.2f} {rate:>10,.0f} {rate / base[backend]:>13.1f}x")


if __name__ == "__main__":
    main()
