"""ServerMetricsWrites: the variants' own /metrics series, scraped during a replay, stored in
schema.SERVER_METRICS_TABLE (the rows: analysis.server_metrics.scrape_rows; the scraper:
workers.server_metrics).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from samples import schema
from samples.store_base import StoreBase

# server_metrics' columns in table order; recorded_ms (last) is set by insert_server_metrics.
SERVER_METRIC_COLUMNS = (
    "experiment",
    "variant",
    "run_id",
    "metric",
    "sample",
    "labels",
    "le",
    "scraped_ms",
    "value",
    "recorded_ms",
)
SERVER_METRICS_CHUNK = 500


def _server_metric_tuple(i: int, row: Mapping[str, Any]) -> tuple[Any, ...]:
    """One server_metrics row as the tuple insert_server_metrics binds, or ValueError naming the
    row and column."""
    if not isinstance(row, Mapping):
        raise ValueError(f"insert_server_metrics: row {i} is not a mapping of column -> value")
    out: list[Any] = []
    for name in SERVER_METRIC_COLUMNS[:-1]:
        if name not in row:
            raise ValueError(f"insert_server_metrics: row {i} has no {name!r}")
        v = row[name]
        if name in ("run_id", "scraped_ms"):
            ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64
            rule = "a non-negative integer"
        elif name == "value":
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            v = float(v) if ok else v
            rule = "a finite number"
        else:
            ok = isinstance(v, str) and (bool(v) or name in ("labels", "le"))
            rule = "a string" if name in ("labels", "le") else "a non-empty string"
        if not ok:
            raise ValueError(f"insert_server_metrics: row {i} column {name!r} must be {rule}, got {v!r}")
        out.append(v)
    return tuple(out)


class ServerMetricsWrites(StoreBase):
    """insert_server_metrics, on any backend."""

    def insert_server_metrics(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert scraped series (schema.SERVER_METRICS_TABLE); returns rows inserted.

        Each row maps every column but recorded_ms (set here): experiment, variant, run_id,
        metric, sample, labels, le, scraped_ms, value. A bad value raises ValueError naming the
        row and column, and nothing is sent. Retrying a batch after an ambiguous failure is
        safe: the same rows have the same key, and readers collapse it (schema's comment)."""
        if not rows:
            return 0
        self.check_schema()
        checked = [_server_metric_tuple(i, row) for i, row in enumerate(rows)]
        recorded = int(time.time() * 1000)
        names = ", ".join(SERVER_METRIC_COLUMNS)
        picks = ", ".join(f"tupleElement(r, {i + 1})" for i in range(len(SERVER_METRIC_COLUMNS) - 1))
        # INSERT ... SELECT over an array literal: both backends run it as one statement, and
        # clickhouse-driver would wait for a data block after INSERT ... VALUES. Chunked to stay
        # well inside max_query_size (256 KiB by default).
        for start in range(0, len(checked), SERVER_METRICS_CHUNK):
            self.execute(
                f"INSERT INTO {schema.SERVER_METRICS_TABLE} ({names}) "
                f"SELECT {picks}, %(recorded)s FROM (SELECT arrayJoin(%(rows)s) AS r)",
                {"rows": checked[start : start + SERVER_METRICS_CHUNK], "recorded": recorded},
            )
        return len(checked)
