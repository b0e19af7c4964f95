"""SampleWrites: putting samples into the store, and deduplicating what a run recorded twice.

Every insert goes through the one validator (samples.columns): a bad value raises InvalidSamples
naming the row and column, and nothing is sent. deduplicate() is what makes a finished run hold
one row per request, the contract the analytics reads rely on (they read without FINAL).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from samples import cluster as clustermod
from samples import columns as colmod
from samples import schema
from samples.store_base import StoreBase
from samples.store_errors import InvalidSamples, StoreError, StoreUnavailable
from telemetry import metrics


class SampleWrites(StoreBase):
    """insert_samples, insert_columns and deduplicate, on any backend."""

    def insert_samples(self, rows: Sequence[colmod.SampleRow] | Sequence[Mapping[str, Any]]) -> int:
        """Insert rows as one columnar batch; returns rows inserted. Rows are SampleRows (what
        samples.rows.row_from builds; plain tuples of the values in column order too) or
        mappings of every column. Validated columnar (samples.columns.validate_samples); a bad
        value raises InvalidSamples naming the row and column, and nothing is sent."""
        if not rows:
            return 0
        try:
            cols = colmod.validate_samples(rows, "insert_samples")
        except colmod.SampleError as e:
            raise InvalidSamples(str(e), row=e.row) from None
        return self._insert_batch(cols)

    def insert_columns(self, cols: Mapping[str, Any]) -> int:
        """Insert one columnar batch {column: list or numpy array}; returns rows inserted.

        For bulk loads (synthetic data, imports): the same validator as insert_samples, on the
        given columns (skipped for a samples.columns.ValidColumns, which passed it already).
        Every column of the table must be given, all of one length. Nullable
        columns take None, or NaN (NaN cannot be a measurement: non-nullable floats must be
        finite). A bad value raises InvalidSamples naming the column and the first bad row.
        """
        if isinstance(cols, colmod.ValidColumns):  # validated already (SpoolingWriter.write)
            return self._insert_batch(cols)
        try:
            checked = colmod.validate_columns(cols, "insert_columns")
        except colmod.SampleError as e:
            raise InvalidSamples(str(e), row=e.row) from None
        return self._insert_batch(checked)

    def _insert_batch(self, cols: dict[str, np.ndarray]) -> int:
        n = len(next(iter(cols.values()))) if cols else 0
        if n:
            # abplat_store_* (telemetry/metrics.py): rows, seconds per batch, errors by kind.
            started = time.perf_counter()
            try:
                self._explained(self._insert_columns, schema.SAMPLES_TABLE, cols)
            except StoreUnavailable:
                metrics.STORE_INSERT_ERRORS.labels(self.backend_name, "unavailable").inc()
                raise
            except Exception:
                metrics.STORE_INSERT_ERRORS.labels(self.backend_name, "permanent").inc()
                raise
            metrics.STORE_INSERT_SECONDS.labels(self.backend_name).observe(time.perf_counter() - started)
            metrics.STORE_INSERTED_ROWS.labels(self.backend_name).inc(n)
        return n

    def deduplicate(self, run_id: int | None = None) -> int:
        """Physically remove duplicate recordings (of one run, or of the whole table).

        Analytics reads do not use FINAL (it cost ~7 s per pass at 10M rows); they rely on
        completed runs holding one row per (experiment, variant, run_id, seq, request_id). This
        is the step that makes that true: it finds the monthly partitions holding duplicates and
        runs OPTIMIZE TABLE samples PARTITION p FINAL on those only (a partition without
        duplicates is not rewritten). Returns the number of duplicate rows removed. Raises
        StoreError if duplicates remain: a pair split across two months cannot be merged.
        """
        if run_id is not None and (isinstance(run_id, bool) or not isinstance(run_id, int) or run_id < 0):
            raise StoreError(f"deduplicate: run_id must be a non-negative integer or None, got {run_id!r}")
        where = "run_id = %(run_id)s" if run_id is not None else "1"
        params = {"run_id": run_id} if run_id is not None else {}
        key = "experiment, variant, run_id, seq, request_id"
        # OPTIMIZE merges the parts of one table on one server: on a cluster's server, its local
        # table (the rows of one request all land on one shard, samples.cluster).
        table = clustermod.local_name(schema.SAMPLES_TABLE) if self.cluster else schema.SAMPLES_TABLE

        def dup_partitions() -> dict[int, int]:
            rows = self.query(
                f"SELECT toYYYYMM(sent_at) AS p, count() - uniqExact({key}) AS d "
                f"FROM {table} WHERE {where} GROUP BY p HAVING d > 0",
                params,
            )
            return {int(p): int(d) for p, d in rows}

        before = dup_partitions()
        pending = dict(before)
        # A merge already running on those parts can make OPTIMIZE a silent no-op: retry, bounded.
        for attempt in range(3):
            if not pending:
                break
            if attempt:
                time.sleep(0.5 * attempt)
            for p in sorted(pending):
                self.execute(f"OPTIMIZE TABLE {table} PARTITION {p} FINAL")
            pending = dup_partitions()
        if pending:
            raise StoreError(
                f"{self.describe()}: deduplicate({run_id}) left duplicates in partitions {pending} "
                "after OPTIMIZE FINAL (merges busy?); run it again"
            )
        rows = self.query(f"SELECT count() - uniqExact({key}) FROM {table} WHERE {where}", params)
        if int(rows[0][0]):
            raise StoreError(
                f"{self.describe()}: deduplicate({run_id}): {rows[0][0]} duplicate recordings sit "
                "in different monthly partitions, which OPTIMIZE cannot merge; delete the older "
                "copies with ALTER TABLE samples DELETE"
            )
        return sum(before.values())
