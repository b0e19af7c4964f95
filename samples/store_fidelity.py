"""FidelityWrites: the per-request fidelity records beside the samples, on any backend.

- schema.FIDELITY_SCORES_TABLE: the teacher-forced scores a mirror run's scoring pass writes
  (a KL per request and variant).
- schema.FIDELITY_SHADOWS_TABLE: the live answers the gateway compared with the control's.

Rows are mappings of every column but the last (recorded_ms / scored_ms, set here). Each value is
checked against its column's type (the table as the migrations declare it, schema.table_columns),
and a bad one raises ValueError naming the table, row and column before anything is sent.
Retrying a batch after an ambiguous failure is safe: both tables are ReplacingMergeTree on the
request's key (schema's comments).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from samples import schema
from samples.store_base import StoreBase

FIDELITY_CHUNK = 500
_INT_BITS = {
    "UInt8": (0, 8),
    "UInt16": (0, 16),
    "UInt32": (0, 32),
    "UInt64": (0, 64),
    "Int32": (1, 32),
    "Int64": (1, 64),
}


def _check(table: str, i: int, name: str, ch_type: str, v: Any) -> Any:
    """The value as bound for a column of ClickHouse type ch_type, or ValueError."""
    where = f"{table}: row {i} column {name!r}"
    if ch_type in _INT_BITS:
        signed, bits = _INT_BITS[ch_type]
        low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < high:
            raise ValueError(f"{where} must be a whole number in [{low}, {high}) ({ch_type}), got {v!r}")
        return v
    if ch_type == "Float64":
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{where} must be a finite number, got {v!r}")
        return float(v)
    if ch_type == "DateTime('UTC')":
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 32:
            raise ValueError(f"{where} must be whole seconds since 1970 (UTC), got {v!r}")
        return v
    if ch_type in ("String", "LowCardinality(String)"):
        if not isinstance(v, str):
            raise ValueError(f"{where} must be a string, got {v!r}")
        return v
    raise ValueError(f"{where}: column type {ch_type} has no check")  # a new column's type: add it


class FidelityWrites(StoreBase):
    """insert_fidelity_scores and insert_fidelity_shadows."""

    def insert_fidelity_scores(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert scoring-pass rows (schema.FIDELITY_SCORES_TABLE, every column but scored_ms);
        returns rows inserted."""
        return self._insert_fidelity(schema.FIDELITY_SCORES_TABLE, rows)

    def insert_fidelity_shadows(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert the gateway's shadow comparisons (schema.FIDELITY_SHADOWS_TABLE, every column
        but recorded_ms; sent_at in whole seconds since 1970); returns rows inserted."""
        return self._insert_fidelity(schema.FIDELITY_SHADOWS_TABLE, rows)

    def _insert_fidelity(self, table: str, rows: Sequence[Mapping[str, Any]]) -> int:
        if not rows:
            return 0
        self.check_schema()
        columns = schema.table_columns(table)
        given = columns[:-1]  # the last, recorded_ms, is stamped at insert
        checked = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(f"{table}: row {i} is not a mapping of column -> value")
            unknown = sorted(set(row) - {n for n, _t in given}, key=str)
            if unknown:
                raise ValueError(f"{table}: row {i} has unknown columns {unknown}")
            missing = [n for n, _t in given if n not in row]
            if missing:
                raise ValueError(f"{table}: row {i} has no {missing[0]!r}")
            checked.append(tuple(_check(table, i, n, t, row[n]) for n, t in given))
        names = ", ".join(n for n, _t in columns)
        picks = ", ".join(
            f"toDateTime(tupleElement(r, {k + 1}), 'UTC')"
            if t == "DateTime('UTC')"
            else f"tupleElement(r, {k + 1})"
            for k, (_n, t) in enumerate(given)
        )
        now = int(time.time() * 1000)
        # INSERT ... SELECT over an array literal, as ServerMetricsWrites: one statement on both
        # backends, chunked inside max_query_size.
        for start in range(0, len(checked), FIDELITY_CHUNK):
            self.execute(
                f"INSERT INTO {table} ({names}) SELECT {picks}, %(stamp)s FROM (SELECT arrayJoin(%(rows)s) AS r)",
                {"rows": checked[start : start + FIDELITY_CHUNK], "stamp": now},
            )
        return len(checked)
