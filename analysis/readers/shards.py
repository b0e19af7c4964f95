"""Queries that group the samples by unit (a user; a request without one), run where every unit
is whole: on each shard's own samples table of a cluster whose samples are sharded by the unit,
side by side, else as one query (one server, chDB, a cluster sharded the old way).

Why: through a Distributed table, a GROUP BY user runs on every shard and the entry merges every
user's partial sums (~1M users x 22 sums at 100M samples), then sums them per arm. When each
user's requests are on one shard (samples.cluster.SAMPLES_SHARDING_KEY), each shard sums its own
users per arm and only a few rows per arm travel; the shards' per-arm moments add up
(analysis.units.merge). The store decides which parts there are (SampleStore.unit_shards);
this module only runs them (analysis.readers.base.run_queries) and names the part that failed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from analysis import units
from analysis.definitions import Filters, Slo
from analysis.readers.base import parallelism, run_queries
from analysis.units import UnitMoments
from samples.store_errors import StoreError

Select = Callable[[str], tuple[str, Mapping[str, Any]]]


def query_by_unit(
    store: Any, select: Select, *, settings: Mapping[str, int] | None = None
) -> list[list[tuple[Any, ...]]]:
    """The rows of ``select(samples table)`` on every part of the store that holds whole units
    (store.unit_shards()), one list per part, the parts side by side. A part that fails fails
    the read: its error, of the same kind (StoreUnavailable stays transient), names the part;
    no partial sums are ever returned."""
    parts = store.unit_shards()

    def run(part: Any, table: str) -> list[tuple[Any, ...]]:
        sql, params = select(table)
        if settings is None:
            return part.query(sql, params)
        return part.query(sql, params, settings=settings)

    if len(parts) == 1:  # one query: its error as it is
        _name, part, table = parts[0]
        return [run(part, table)]

    def job(name: str, part: Any, table: str) -> list[tuple[Any, ...]]:
        try:
            return run(part, table)
        except StoreError as e:
            raise type(e)(f"{name}: {e}") from e

    jobs = {name: (lambda n=name, p=part, t=table: job(n, p, t)) for name, part, table in parts}
    got = run_queries(parallelism(store), jobs)
    return [got[name] for name, _part, _table in parts]


def unit_moments(
    store: Any,
    f: Filters,
    slo: Slo,
    unit: str,
    *,
    extra: Sequence[str] = (),
    params: Mapping[str, Any] | None = None,
    settings: Mapping[str, int] | None = None,
    blocks: Sequence[str] | None = None,
) -> dict[str, UnitMoments]:
    """{variant: moments} per user or per request (analysis.units.moments_select) over the
    samples in f, each part of the store's (query_by_unit) added up. ``extra``/``params``: more
    conditions on the samples and their parameters (a rollout step's revision); ``blocks``: the
    moments' blocks to read (every one by default)."""

    def select(table: str) -> tuple[str, dict[str, Any]]:
        sql, mp = units.moments_select(f, slo, unit, extra=extra, table=table, blocks=blocks)
        return sql, {**mp, **(params or {})}

    parts = query_by_unit(store, select, settings=settings)
    return units.merge(*(units.rows_to_moments(rows, blocks) for rows in parts))
