"""Pure: the readers' row shapers (analysis.readers.base), which turn the rows a query returns
into what the report reads; every reader (raw, rollup) uses the same one."""

from __future__ import annotations

import numpy as np

from analysis.readers.base import histogram_rows, p99_rows


def test_p99_rows_are_each_variants_series_in_bucket_order():
    rows = [
        ("a", np.uint32(1_700_000_000), np.uint64(12), np.float64(31.5)),
        ("a", 1_700_000_010, 3, 40),
        ("b", 1_700_000_000, 1, 7.25),
    ]
    got = p99_rows(rows)
    assert got == {
        "a": [(1_700_000_000, 12, 31.5), (1_700_000_010, 3, 40.0)],
        "b": [(1_700_000_000, 1, 7.25)],
    }
    assert all(type(x) is t for series in got.values() for p in series for x, t in zip(p, (int, int, float)))
    assert p99_rows([]) == {}


def test_histogram_rows_are_each_variants_keys_counts_and_tops():
    rows = [("a", 3, 10, 0.35), ("a", 4, 2, 0.41), ("b", 3, np.uint64(1), np.float64(0.3))]
    assert histogram_rows(rows) == {"a": ([3, 4], [10, 2], [0.35, 0.41]), "b": ([3], [1], [0.3])}
