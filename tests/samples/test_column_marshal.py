"""Pure: samples.column_marshal, the validator's fast path, reads whole columns from marshal's
bytes or says None (the validator then checks value by value: tests/samples/test_columns.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from samples import column_marshal


def test_floats_come_back_exactly_as_float64():
    values = [1.5, -0.0, 1e308, 5e-324]
    got = column_marshal.numbers(values, floats=True, nullable=False)
    assert got is not None and got.dtype == np.float64 and got.tolist() == values
    assert math.copysign(1.0, got[1]) == -1.0  # -0.0 stays negative zero


def test_none_in_a_float_column_is_nan_only_when_nullable():
    values = [1.5, None, 2.25, None]
    assert column_marshal.numbers(values, floats=True, nullable=False) is None
    got = column_marshal.numbers(values, floats=True, nullable=True)
    assert got is not None and got.dtype == np.float64
    assert [None if math.isnan(v) else v for v in got.tolist()] == values
    every_null = column_marshal.numbers([None, None], floats=True, nullable=True)
    assert every_null is not None and np.isnan(every_null).all()


def test_ints_of_32_bits_come_back_as_int32_without_a_range_check():
    values = [0, -5, 2**31 - 1, -(2**31)]
    got = column_marshal.numbers(values, floats=False, nullable=False)
    assert got is not None and got.dtype == np.int32 and got.tolist() == values


def test_larger_ints_of_one_width_come_back_as_uint64():
    values = [2**62 + 17, 2**62 + 19_000_017, 2**64 - 1]
    got = column_marshal.numbers(values, floats=False, nullable=False)
    assert got is not None and got.dtype == np.uint64 and got.tolist() == values


def test_an_all_null_integer_column_is_an_object_array_of_none_only_when_nullable():
    got = column_marshal.numbers([None, None, None], floats=False, nullable=True)
    assert got is not None and got.dtype == object and got.tolist() == [None, None, None]
    assert column_marshal.numbers([None, None], floats=False, nullable=False) is None


@pytest.mark.parametrize(
    ("values", "floats"),
    [
        ([], True),  # nothing to read
        ([], False),
        ([1.5, 2], True),  # an int in a float column
        ([1, 2.5], False),  # a float in an integer column
        ([True, False], False),  # bool is not an int (marshal writes it as T/F)
        ([np.float64(1.5)], True),  # a float subclass: marshal cannot write it
        ([np.int64(3)], False),
        ([1, 2**40], False),  # two marshal widths
        ([2**40, 2**63], False),  # one width, other digit counts
        ([2**64], False),  # beyond UInt64
        ([1, None], False),  # None among ints
        (["1"], False),
        ((1.5, 2.5), True),  # a tuple is read like a list
    ],
)
def test_anything_else_is_none_for_the_per_value_path(values, floats):
    got = column_marshal.numbers(values, floats=floats, nullable=True)
    if isinstance(values, tuple):
        assert got is not None and got.tolist() == list(values)
    else:
        assert got is None


def test_a_numpy_array_is_not_read_from_marshal():
    assert column_marshal.numbers(np.array([1.5, 2.5]), floats=True, nullable=False) is None


def test_array_items_reads_rows_of_small_ints_in_row_order():
    rows = [[3900, 4100, 0], [], (7,), [2**31 - 1]]
    got = column_marshal.array_items(rows, np.array([len(r) for r in rows]))
    assert got is not None and got.dtype == np.uint32 and got.tolist() == [3900, 4100, 0, 7, 2**31 - 1]
    assert column_marshal.array_items([[]], np.array([0])).tolist() == []
    for odd in ([True], [2**31], [-1], [1.0], ["1"], [None]):
        assert column_marshal.array_items([[1], odd], np.array([1, len(odd)])) is None
