"""SampleReads: what a writer asks the store about the samples already stored.

A resumed shard skips the request ids already recorded (recorded_request_ids), the spool's flush
skips keys already stored (existing_keys), and a finished replay counts what it recorded
(count). The SLA report's reads are analysis.readers'; every read goes through StoreBase.query.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from samples import schema
from samples.store_base import StoreBase


class SampleReads(StoreBase):
    """recorded_request_ids, count, counts_by_variant, active_parts and existing_keys, on any
    backend."""

    def recorded_request_ids(
        self,
        run_id: int,
        *,
        experiment: str | None = None,
        variant: str | None = None,
        seq_from: int | None = None,
        seq_to: int | None = None,
    ) -> set[str]:
        """request_ids already stored for a run (optionally one variant, seq in [from, to)).

        A resumed shard calls this and skips what it returns, so nothing is sent twice.
        """
        where, params = self._run_filter(run_id, experiment, variant, seq_from, seq_to)
        rows = self.query(
            f"SELECT DISTINCT request_id FROM {schema.SAMPLES_TABLE} WHERE {where}",
            params,
        )
        return {r[0] for r in rows}

    def count(self, run_id: int, *, experiment: str | None = None, variant: str | None = None) -> int:
        """Samples of a run: one per (variant, request_id), however many copies are on disk."""
        where, params = self._run_filter(run_id, experiment, variant, None, None)
        rows = self.query(
            f"SELECT uniqExact(variant, request_id) FROM {schema.SAMPLES_TABLE} WHERE {where}",
            params,
        )
        return int(rows[0][0])

    def counts_by_variant(self, run_id: int) -> dict[str, int]:
        rows = self.query(
            f"SELECT variant, uniqExact(request_id) FROM {schema.SAMPLES_TABLE} "
            "WHERE run_id = %(run_id)s GROUP BY variant ORDER BY variant",
            {"run_id": run_id},
        )
        return {v: int(n) for v, n in rows}

    def active_parts(self) -> list[str] | None:
        """The names of the samples table's active parts, or None on a cluster (each shard's
        table has parts of its own; the Distributed table has none). A part never changes once
        written (merges and inserts make new ones), so what a reader counted of a part it can
        keep as long as the name is active (rollouts.kept); the virtual column _part names a
        row's part, and a condition on it in WHERE skips the other parts without reading them."""
        if self.cluster:
            return None
        rows = self.query(
            "SELECT name FROM system.parts WHERE database = %(db)s AND table = %(t)s AND active",
            {"db": self.database, "t": schema.SAMPLES_TABLE},
        )
        return sorted(str(r[0]) for r in rows)

    def existing_keys(self, keys: Iterable[tuple[str, str, int, str]]) -> set[tuple]:
        """Which of these (experiment, variant, run_id, request_id) keys are already stored."""
        keys = set(keys)
        if not keys:
            return set()
        found: set[tuple] = set()
        by_run: dict[int, set[str]] = {}
        for _e, _v, run, rid in keys:
            by_run.setdefault(run, set()).add(rid)
        for run, rids in by_run.items():
            rows = self.query(
                f"SELECT DISTINCT experiment, variant, run_id, request_id "
                f"FROM {schema.SAMPLES_TABLE} WHERE run_id = %(run)s AND request_id IN %(ids)s",
                {"run": run, "ids": rids},
            )
            found.update((e, v, int(r), i) for e, v, r, i in rows)
        return found & keys

    @staticmethod
    def _run_filter(
        run_id: int,
        experiment: str | None,
        variant: str | None,
        seq_from: int | None,
        seq_to: int | None,
    ) -> tuple[str, dict[str, Any]]:
        where = ["run_id = %(run_id)s"]
        params: dict[str, Any] = {"run_id": run_id}
        for name, value, cond in (
            ("experiment", experiment, "experiment = %(experiment)s"),
            ("variant", variant, "variant = %(variant)s"),
            ("seq_from", seq_from, "seq >= %(seq_from)s"),
            ("seq_to", seq_to, "seq < %(seq_to)s"),
        ):
            if value is not None:
                where.append(cond)
                params[name] = value
        return " AND ".join(where), params
