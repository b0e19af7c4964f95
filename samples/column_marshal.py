"""Whole columns read back from marshal's bytes: the fast path of samples.columns' validator.

One C-level pass (marshal) checks every value's exact type and serialises it, and numpy reads the
values back from the bytes (per 10k-value float column ~0.15 ms, where set(map(type)) and then
array("d") take ~0.45 ms). marshal format 2 writes a list or tuple as a 5-byte head (b"[" or
b"(", int32 length), then each item as a type code chosen by exact type (PyFloat_CheckExact,
PyLong_CheckExact, None; bool, numpy scalars and subclasses get other codes or cannot be
marshalled at all) and that item's bytes:
  b"g" + 8 bytes       a float (little-endian double)
  b"i" + 4 bytes       an int in [-2**31, 2**31) (little-endian int32)
  b"l" + int32 d + d 2-byte digits   any other int: |d| 15-bit digits, least significant
                       first, the sign of d is the number's
  b"N"                 None
Each code fixes the size of its item, so finding the expected code at every offset the items
before it lead to, with the bytes adding up exactly, is a full parse: the column holds only values
of those exact types. Anything else (or another format) gives None here, and the column takes the
validator's per-value path, which also names the bad value.

Pure: stdlib and numpy. What a column may hold (its kind, range and dtype) is samples.columns'.
"""

from __future__ import annotations

import marshal
from collections.abc import Sequence
from typing import Any

import numpy as np

_M_HEAD = 5
_M_LIST = frozenset(b"[(")
_M_LIST_CODES = np.frombuffer(b"[(", dtype=np.uint8)
_G, _I, _L, _N = b"gilN"


def numbers(values: Any, *, floats: bool, nullable: bool) -> np.ndarray | None:
    """A list or tuple of numbers read from its marshal bytes, or None (empty, another type of
    sequence, or a value of another kind than asked).

    floats: every value a float (or None when nullable: NaN there), as a float64 array.
    Otherwise every value an int of one marshal width: an int32 array (ints in [-2**31, 2**31))
    or a uint64 array (larger ints below 2**64, all with the same number of digits), not checked
    against any column's range; or, when nullable and every value is None, an object array of
    None."""
    n = len(values)
    if not n or type(values) not in (list, tuple):
        return None
    try:
        data = marshal.dumps(values, 2)
    except ValueError:  # an object marshal cannot write: not a number anyway
        return None
    if data[0] not in _M_LIST or int.from_bytes(data[1:5], "little") != n:
        return None
    u8 = np.frombuffer(data, dtype=np.uint8)
    if floats:
        if len(data) == _M_HEAD + 9 * n:  # floats only
            if not (u8[_M_HEAD::9] == _G).all():
                return None
            return np.ndarray((n,), "<f8", data, _M_HEAD + 1, (9,)).astype(np.float64)
        if not nullable:
            return None
        return _nullable_floats(values, data, u8)
    first = data[_M_HEAD]
    if first == _I:  # ints of at most 32 bits
        if len(data) != _M_HEAD + 5 * n or not (u8[_M_HEAD::5] == _I).all():
            return None
        return np.ndarray((n,), "<i4", data, _M_HEAD + 1, (5,))
    if first == _L:  # larger ints (below 2**64), all with the same number of digits
        digits = int.from_bytes(data[_M_HEAD + 1 : _M_HEAD + 5], "little", signed=True)
        width = 5 + 2 * digits
        if not 1 <= digits <= 5 or len(data) != _M_HEAD + width * n:
            return None
        recs = u8[_M_HEAD:].reshape(n, width)
        if not (recs[:, :5] == recs[0, :5]).all():  # every code b"l", every digit count ours
            return None
        ints = np.zeros(n, dtype=np.uint64)
        for k in range(digits):
            digit = np.ndarray((n,), "<u2", data, _M_HEAD + 5 + 2 * k, (width,))
            if k == 4 and digit.max() >= 1 << 4:  # 2**64 or more
                return None
            ints |= digit.astype(np.uint64) << np.uint64(15 * k)
        return ints
    if nullable and len(data) == _M_HEAD + n and data.count(_N, _M_HEAD) == n:  # all NULL
        return np.full(n, None, dtype=object)
    return None


def _nullable_floats(values: Any, data: bytes, u8: np.ndarray) -> np.ndarray | None:
    """A Nullable(Float64) column with None in it (NaN there), read from its marshal bytes:
    b"N" where the item is None, b"g" + 8 bytes everywhere else, or None."""
    null = np.frombuffer(bytes([v is None for v in values]), dtype=np.bool_)
    size = np.where(null, 1, 9)
    ends = np.cumsum(size)
    if len(data) != _M_HEAD + int(ends[-1]):
        return None
    starts = _M_HEAD + ends - size
    if not (u8[starts] == np.where(null, _N, _G)).all():
        return None
    arr = np.full(len(values), np.nan)
    present = ~null
    arr[present] = u8[starts[present, None] + np.arange(1, 9)].view("<f8").ravel()
    return arr


# The array column's rows (lists or tuples of ints): marshal format 2 writes a list of rows as its
# 5-byte head, then each row as a 5-byte head (b"[" or b"(", int32 length) and its items, an int
# in [-2**31, 2**31) as b"i" + int32. So when every item is such an int, the bytes after the outer
# head are 5-byte records throughout, a row's head at record (row + items before it), its items
# after it: one strided view reads every code and value at once.
_ARRAY_RECORD = np.dtype([("code", "u1"), ("value", "<i4")])  # packed: 5 bytes


def array_items(values: Sequence[Any], lengths: np.ndarray) -> np.ndarray | None:
    """Every item of rows of Python ints in [0, 2**31) (``lengths``: each row's), as one uint32
    array (rows in order), read from marshal's bytes; None when any item is something else (the
    validator's per-row path says what)."""
    n, m = len(values), int(lengths.sum())
    try:
        data = marshal.dumps(values, 2)
    except ValueError:  # an object marshal cannot write: not an int anyway
        return None
    if len(data) != _M_HEAD + 5 * (n + m) or data[0] not in _M_LIST:
        return None
    records = np.ndarray((n + m,), _ARRAY_RECORD, data, _M_HEAD)
    head = np.zeros(n + m, dtype=bool)
    head[np.arange(n) + np.cumsum(lengths) - lengths] = True
    codes = records["code"]
    if not (np.isin(codes[head], _M_LIST_CODES).all() and (codes[~head] == _I).all()):
        return None
    items = records["value"][~head]
    if m and int(items.min()) < 0:
        return None
    return items.astype(np.uint32)
