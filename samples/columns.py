"""The samples table's columns and the one validator of what goes into them.

Pure: stdlib and numpy (no Django, no database driver), and nothing of the replay or the
gateway: samples.rows builds rows (row_from, for both), this module says what a valid row is.
A row holds a str, int, float or None for every column (a list of ints for the array column): a
SampleRow (the values in COLUMNS order, what the replay's and the gateway's writers hold and the
spool writes as a JSON array) or a mapping of column name to value. A batch is validated a whole
column at a time (validate_columns) and comes out as the numpy arrays both store backends insert.

Types are the subset that works on ClickHouse 18.16 (CI) and chDB 4.4 alike: no DateTime64, Bool,
Map or JSON. Booleans are UInt8 0/1; exact send time is kept as Float64 unix milliseconds next to a
second-resolution DateTime('UTC') used for partitioning and time buckets. Two array columns,
itl_gaps_us and token_fps (Array(UInt32)): a row holds a list of ints there, the validator returns
an object array of uint32 arrays (one per row).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from samples import column_marshal

# split / mirror: a replay (replay.plan); live: real users' traffic measured by the gateway
# (gateway.recording), one run per gateway process start (gateway.models.LiveRun).
MODES = ("split", "mirror", "live")


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    name: str
    ch_type: str
    # kind drives conversion to Arrow/numpy and validation:
    # str, u8, u16, u32, u64, i64, f64, nf64 / nu64 (nullable float64 / uint64),
    # datetime (unix seconds), au32 (Array(UInt32): a list of ints per row)
    kind: str


def _c(name: str, ch_type: str, kind: str) -> Column:
    return Column(name, ch_type, kind)


# Order is the physical column order in the table and in every batch.
COLUMNS: tuple[Column, ...] = (
    # --- the sample's context (samples.rows.SampleContext): identity (the ReplacingMergeTree key, see schema.py)
    _c("experiment", "LowCardinality(String)", "str"),
    _c("variant", "LowCardinality(String)", "str"),
    _c("run_id", "UInt64", "u64"),
    _c("seq", "UInt32", "u32"),
    _c("request_id", "String", "str"),
    # --- the sample's context: how and when it was sent
    _c("mode", "LowCardinality(String)", "str"),  # one of MODES (split, mirror, live), checked by row_from
    _c("user_id", "String", "str"),
    _c("config_revision", "Int64", "i64"),  # etcd revision of the weights the router used
    _c("sent_at", "DateTime('UTC')", "datetime"),  # explicit UTC: same partitions on any host
    _c("sent_unix_ms", "Float64", "f64"),  # exact send time
    # A replay's planned send time, ms after the run start; live: the client's request received.
    _c("scheduled_offset_ms", "Float64", "f64"),
    _c("schedule_lag_ms", "Float64", "f64"),  # a replay's: how late the send was against that plan; live 0
    # Live: the gateway's own time from the client's request received to the upstream request
    # written (auth, limits, routing, the body rewrite); 0 in a replay (schema migration 7).
    _c("gateway_ms", "Float64", "f64"),
    _c("in_flight", "UInt32", "u32"),  # requests in flight in this shard at send time
    _c("prompt_tokens", "UInt32", "u32"),
    _c("prompt_tokens_estimated", "UInt8", "u8"),  # 1: no usage event and no known tokenizer
    _c("max_tokens", "UInt32", "u32"),
    _c("worker", "LowCardinality(String)", "str"),  # hostname:pid of the recording worker
    _c("attempt", "UInt8", "u8"),  # delivery attempt of the shard task that sent it (1-based)
    # --- StreamResult: every measured field, same names
    _c("outcome", "LowCardinality(String)", "str"),
    _c("http_status", "UInt16", "u16"),
    _c("error", "String", "str"),
    _c("new_connection", "UInt8", "u8"),
    _c("connect_ms", "Nullable(Float64)", "nf64"),
    _c("ttfb_ms", "Nullable(Float64)", "nf64"),
    _c("first_byte_ms", "Nullable(Float64)", "nf64"),
    _c("ttft_event_ms", "Nullable(Float64)", "nf64"),
    _c("ttft_ms", "Nullable(Float64)", "nf64"),
    _c("itl_mean_ms", "Nullable(Float64)", "nf64"),
    _c("itl_p50_ms", "Nullable(Float64)", "nf64"),
    _c("itl_p99_ms", "Nullable(Float64)", "nf64"),
    _c("itl_max_ms", "Nullable(Float64)", "nf64"),
    # Every inter-token gap of the request, in arrival order, microseconds rounded half up from
    # the nanosecond clock (streaming.timing): chunks - 1 of them; [] with fewer than two token
    # chunks, and in rows recorded before the column existed (schema migration 5). The report
    # pools them into the ITL distribution (analysis.definitions.GAP_METRICS).
    _c("itl_gaps_us", "Array(UInt32)", "au32"),
    _c("tpot_ms", "Nullable(Float64)", "nf64"),
    _c("e2e_ms", "Nullable(Float64)", "nf64"),
    _c("output_tokens", "UInt32", "u32"),
    _c("usage_reported", "UInt8", "u8"),
    _c("chunks", "UInt32", "u32"),
    _c("finish_reason", "LowCardinality(String)", "str"),
    _c("traceparent", "String", "str"),
    _c("trace_id", "String", "str"),
    _c("server_ttft_ms", "Nullable(Float64)", "nf64"),
    # host CLOCK_MONOTONIC ns: comparable only between rows recorded on the same host
    _c("start_ns", "UInt64", "u64"),
    _c("server_first_content_ns", "Nullable(UInt64)", "nu64"),
    # What the answer said, as fingerprints (fidelity/fingerprints.py; schema migration 8): a
    # mirror replay's successful requests; 0 and [] elsewhere.
    _c("output_fp", "UInt64", "u64"),
    _c("token_fps", "Array(UInt32)", "au32"),
    # What the answer said, as text (schema migration 9): only a mirror replay's successful
    # answers, and only where the experiment's document allows it (fidelity.store_answers), at
    # most streaming.result.ANSWER_TEXT_MAX_BYTES of UTF-8, cut at a character; "" elsewhere.
    _c("answer_text", "String", "str"),
    # --- bookkeeping: ReplacingMergeTree version; the latest recording of a request wins
    _c("recorded_ms", "UInt64", "u64"),
)

COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
# Columns added after the table was first made (samples.schema: migration 5 on), with what a
# row written before them holds there: an older spool file's rows are read with these. (A live
# row written before gateway_ms held the gateway's time in schedule_lag_ms: the report reads it
# as the gateway's, analysis.definitions.PHASE_COLUMNS.)
ADDED_DEFAULTS: dict[str, Any] = {
    "itl_gaps_us": (),
    "gateway_ms": 0.0,
    "output_fp": 0,
    "token_fps": (),
    "answer_text": "",
}

_INT_RANGES = {
    "u8": (0, 2**8 - 1),
    "u16": (0, 2**16 - 1),
    "u32": (0, 2**32 - 1),
    "u64": (0, 2**64 - 1),
    "nu64": (0, 2**64 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "datetime": (0, 2**32 - 1),
}

# numpy dtype of each validated column; nu64 stays an object array of int | None, because a
# uint64 array cannot hold NULL and float64 would round the nanosecond clock.
_DTYPES: dict[str, Any] = {
    "str": object,
    "u8": np.uint8,
    "u16": np.uint16,
    "u32": np.uint32,
    "u64": np.uint64,
    "i64": np.int64,
    "datetime": np.uint32,  # unix seconds; each backend turns it into DateTime('UTC')
    "f64": np.float64,
    "nf64": np.float64,  # NaN is NULL
    "nu64": object,
    "au32": object,  # an object array of uint32 arrays, one per row
}
_NONE = type(None)
# Python types a value may have in a list, tuple or object array, per kind: exact types (bool is
# not an int, a str is not a number). numpy integer scalars are integers (object arrays of them);
# a typed numpy array is checked by its dtype instead (_typed_array).
_ALLOWED_TYPES: dict[str, frozenset[type]] = {
    "str": frozenset({str}),
    "f64": frozenset({float, int}),
    "nf64": frozenset({float, int, _NONE}),
    "nu64": frozenset({int, np.int64, np.uint64, _NONE}),
    **{k: frozenset({int, np.int64, np.uint64}) for k in ("u8", "u16", "u32", "u64", "i64", "datetime")},
    "au32": frozenset({list, tuple, np.ndarray}),
}
_PY_INT = frozenset({int})
# array.array type code of each integer kind: the same width and signedness as its dtype
_ARRAY_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i64": "q", "datetime": "I"}
if array("I").itemsize != 4 or array("Q").itemsize != 8:  # pragma: no cover - C ints of this platform
    raise ImportError("samples.columns needs 4-byte array('I') and 8-byte array('Q')")
_WHAT = {"str": "not a str", "f64": "not a number", "nf64": "not a number or None", "au32": "not a list"}
_GETTERS = tuple((name, operator.itemgetter(name)) for name in COLUMN_NAMES)


class SampleError(ValueError):
    """A row or column value that cannot be stored. The message names the column and, for a
    batch, the row; ``row`` is that row's index in the batch (None: not one row's fault)."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message)
        self.row = row


class ValidColumns(dict):
    """{column: numpy array} that passed validate_columns, in COLUMNS order: what the store's
    insert takes without checking again (SpoolingWriter validates once, the store sends).
    Treat it as read-only; a changed array is no longer validated."""


class _Bad(Exception):
    """Inside the validator: the value at `index` of the column is wrong because `why`."""

    def __init__(self, index: int | None, why: str) -> None:
        self.index = index
        self.why = why


def validate_columns(
    cols: Mapping[str, Any],
    where: str = "insert_columns",
    *,
    nan_is_null: bool = True,
) -> ValidColumns:
    """The one validator of samples data: every column of the table, all of one length, each a
    list, tuple or numpy array; checked a whole column at a time.

    Returns {column: numpy array} in COLUMNS order, in the dtypes both backends insert: strings
    as object arrays, integers and DateTime (unix seconds) in their unsigned/signed width,
    floats as float64 with NaN for NULL in nullable columns, Nullable(UInt64) as an object array
    of int | None. Values must have the column's exact Python type (bool is not an integer, a
    str is not a number) or come in a numpy array of a fitting dtype; integers must fit the
    column's range and floats must be finite. ``nan_is_null``: a NaN in a nullable column is
    NULL (bulk arrays); otherwise only None is (rows: NaN from a client is a bug, not "absent").

    Raises SampleError naming `where`, the row (index into the batch), the column, its type and
    the bad value, e.g. "insert_samples row 2: column seq (UInt32) cannot hold 'three': not an
    integer".
    """
    if not isinstance(cols, Mapping):
        raise SampleError(f"{where}: expected a mapping of column -> values, got {type(cols).__name__}")
    if cols.keys() != _NAME_SET:
        extra = sorted(set(cols) - _NAME_SET)
        missing = [n for n in COLUMN_NAMES if n not in cols]
        raise SampleError(f"{where}: unknown column(s) {extra}, missing column(s) {missing}")
    lengths = {n: len(cols[n]) for n in COLUMN_NAMES}
    if len(set(lengths.values())) > 1:
        raise SampleError(f"{where}: columns differ in length: {lengths}")
    return _checked(((col, cols[col.name]) for col in COLUMNS), where, nan_is_null)


def _checked(columns: Iterable[tuple[Column, Any]], where: str, nan_is_null: bool) -> ValidColumns:
    """Each (column, values) in turn through _column; the first bad value raises SampleError."""
    out = ValidColumns()
    for col, values in columns:
        try:
            out[col.name] = _column(col, values, nan_is_null)
        except _Bad as bad:
            raise _error(where, col, values, bad, one_row=False) from None
    return out


def _error(where: str, col: Column, values: Any, bad: _Bad, one_row: bool) -> SampleError:
    if bad.index is None:
        return SampleError(f"{where}: column {col.name} ({col.ch_type}) {bad.why}")
    at = "" if one_row else f" row {bad.index}"
    value = values[bad.index]
    value = value.item() if isinstance(value, np.generic) else value  # 1.5, not np.float64(1.5)
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    text = text if len(text) <= 120 else text[:117] + "..."  # an array of gaps can be long
    return SampleError(
        f"{where}{at}: column {col.name} ({col.ch_type}) cannot hold {text}: {bad.why}", row=bad.index
    )


def _first_true(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _first_not(values: Sequence[Any], allowed: frozenset[type]) -> int:
    return next(i for i, v in enumerate(values) if type(v) not in allowed)


def _column(col: Column, values: Any, nan_is_null: bool, convert: bool = True) -> Any:
    """One column, validated and converted (see validate_columns); raises _Bad. Without
    `convert` (one row: numpy would cost more than the checks) it only checks."""
    kind = col.kind
    if kind == "au32":
        return _arrays(values, convert)
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise _Bad(None, f"needs a 1-dimensional array, got shape {values.shape}")
        if values.dtype != object:
            return _typed_array(col, values, nan_is_null)
        values = values.tolist()  # an object array: check its items like a list's
    if convert and kind in _MARSHAL_KINDS:
        fast = _marshalled_numbers(kind, values)
        if fast is not None:  # every value of the common exact type, ints in range
            return _check_floats(kind, fast, values, nan_is_null) if kind in _FLOAT_KINDS else fast
    allowed = _ALLOWED_TYPES[kind]
    types = set(map(type, values))  # one C-level pass: the common all-valid case stops here
    if not types <= allowed:
        if kind == "nu64" and nan_is_null and float in types:
            # NaN is NULL here too, and a whole float (an integer that went through a float
            # array) is that integer; anything else falls to the type error below.
            values = [
                None if type(v) is float and v != v else int(v) if type(v) is float and v.is_integer() else v
                for v in values
            ]
            return _column(col, values, False, convert)  # no second pass: a float left is bad
        raise _Bad(_first_not(values, allowed), _WHAT.get(kind, "not an integer"))
    if kind == "str":
        return np.fromiter(values, dtype=object, count=len(values)) if convert else None
    if kind in ("f64", "nf64"):
        if not convert:
            for i, v in enumerate(values):
                try:
                    finite = v is None or math.isfinite(v) or (nan_is_null and kind == "nf64" and v != v)
                except OverflowError:  # an int beyond float64
                    raise _Bad(i, "out of range of Float64") from None
                if not finite:
                    raise _Bad(i, "not a finite number")
            return None
        try:
            if _NONE in types:
                arr = np.array(values, dtype=np.float64)  # None -> NaN
            else:  # array.array converts about twice as fast as numpy from a list
                arr = np.frombuffer(array("d", values), dtype=np.float64)
        except OverflowError:  # an int beyond float64
            i = next(i for i, v in enumerate(values) if type(v) is int and _beyond_float(v))
            raise _Bad(i, "out of range of Float64") from None
        return _check_floats(kind, arr, values, nan_is_null)
    lo, hi = _INT_RANGES[kind]
    if convert and types <= _PY_INT and kind != "nu64":  # nu64: an object array checks nothing
        # Each kind's range is exactly its dtype's, and numpy refuses (OverflowError) a Python
        # int outside the dtype: the conversion is the range check.
        # array.array refuses the same ints (and converts faster); numpy views its buffer.
        try:
            return np.frombuffer(array(_ARRAY_CODES[kind], values), dtype=_DTYPES[kind])
        except OverflowError:
            pass
    else:  # None or numpy integers (which numpy would wrap around silently), or one row
        present = [v for v in values if v is not None] if _NONE in types else values
        if not present or lo <= min(present) and max(present) <= hi:
            return np.array(values, dtype=_DTYPES[kind]) if convert else None
    i = next(i for i, v in enumerate(values) if v is not None and not lo <= v <= hi)
    raise _Bad(i, f"out of range [{lo}, {hi}]")


# The numeric kinds whose columns are first read from marshal's bytes (samples.column_marshal,
# the fast path: one C-level pass checks every value's exact type); a column it cannot read takes
# the per-value path of _column, which also names the bad value.
_MARSHAL_KINDS = frozenset({"f64", "nf64", "nu64", "u8", "u16", "u32", "u64", "i64", "datetime"})


def _marshalled_numbers(kind: str, values: Any) -> np.ndarray | None:
    """A float or integer column converted by way of marshal (samples.column_marshal), or None:
    not every value is a float (None too in a nullable float column) or, in an integer column,
    an int of one marshal width and within the column's range."""
    got = column_marshal.numbers(values, floats=kind in _FLOAT_KINDS, nullable=kind in _NULLABLE_KINDS)
    if got is None or kind in _FLOAT_KINDS or got.dtype == object:  # floats, or all NULL
        return got
    lo, hi = _INT_RANGES[kind]
    if int(got.min()) < lo or int(got.max()) > hi:
        return None  # the per-value path names the first value out of range
    return got.astype(_DTYPES[kind])


def _beyond_float(v: int) -> bool:
    try:
        float(v)
    except OverflowError:
        return True
    return False


def _check_floats(kind: str, arr: np.ndarray, values: Any, nan_is_null: bool) -> np.ndarray:
    """Finite floats; NaN only as NULL of a nullable column (from None, or any NaN when
    nan_is_null). `values` is the input sequence, or None for a typed numpy array."""
    bad = ~np.isfinite(arr)
    if not bad.any():
        return arr
    if kind == "nf64":
        nan = np.isnan(arr)
        if nan_is_null:
            bad &= ~nan
        elif values is not None:
            if int(nan.sum()) == values.count(None) and not np.isinf(arr).any():
                return arr  # every NaN came from a None (each None is a NaN): all NULLs
            bad &= ~np.fromiter((v is None for v in values), dtype=bool, count=arr.size)
    if bad.any():
        raise _Bad(_first_true(bad), "not a finite number")
    return arr


def _typed_array(col: Column, arr: np.ndarray, nan_is_null: bool) -> np.ndarray:
    """A numpy array of a non-object dtype: checked by dtype and vectorized range tests."""
    kind, dk = col.kind, arr.dtype.kind
    if kind == "str":
        if dk != "U":
            raise _Bad(None, f"needs strings, got dtype {arr.dtype}")
        return arr.astype(object)
    if kind in ("f64", "nf64"):
        if dk not in "fiu":
            raise _Bad(None, f"needs numbers, got dtype {arr.dtype}")
        return _check_floats(kind, arr.astype(np.float64, copy=False), None, nan_is_null)
    if kind == "nu64" and dk == "f":
        # a float array of a nullable integer column (NaN = NULL): through the list path
        return _column(col, arr.tolist(), nan_is_null)
    if dk not in "iu":
        raise _Bad(None, f"needs integers, got dtype {arr.dtype}")
    lo, hi = _INT_RANGES[kind]
    if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
        raise _Bad(_first_true((arr < lo) | (arr > hi)), f"out of range [{lo}, {hi}]")
    if kind == "nu64":
        return arr.astype(object)
    return arr.astype(_DTYPES[kind], copy=False)


_U32_MAX = 2**32 - 1
_ROW_TYPES = frozenset({list, tuple})
# integers an array row may hold (numpy integer scalars too; never bool)
_INT_ITEMS = frozenset(
    {int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64}
)


def _arrays(values: Any, convert: bool) -> np.ndarray | None:
    """An Array(UInt32) column: per row a list or tuple of integers (or a 1-dimensional numpy
    integer array), each in [0, 2**32 - 1]; bool is not an integer. Converted: an object array
    holding one uint32 array per row. Rows of Python ints (what the replay and the spool hold)
    are read from marshal's bytes in one pass (samples.column_marshal); other rows one by one."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype != object:
            raise _Bad(
                None,
                f"needs a 1-dimensional object array of per-row arrays, got {values.dtype} "
                f"of shape {values.shape}",
            )
        values = values.tolist()  # its items (lists or arrays) as they are
    types = set(map(type, values))
    if not types <= _ALLOWED_TYPES["au32"]:
        raise _Bad(_first_not(values, _ALLOWED_TYPES["au32"]), "not a list of integers")
    if types <= _ROW_TYPES and values:
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        data = column_marshal.array_items(values, lengths)
        if data is not None:
            return _per_row(np.split(data, np.cumsum(lengths)[:-1])) if convert else None
    parts = [_one_array(i, v) for i, v in enumerate(values)]  # names the first bad row
    return _per_row(parts) if convert else None


def _one_array(i: int, v: Any) -> np.ndarray:
    """Row i of an Array(UInt32) column as a uint32 array, or _Bad saying why it cannot be."""
    if type(v) is np.ndarray:
        if v.ndim != 1 or (v.size and v.dtype.kind not in "iu"):
            raise _Bad(i, f"not an array of integers (dtype {v.dtype}, shape {v.shape})")
        items = v
    else:
        if not set(map(type, v)) <= _INT_ITEMS:
            raise _Bad(i, "not a list of integers")
        items = [int(x) for x in v]
    if len(items) and (int(min(items)) < 0 or int(max(items)) > _U32_MAX):
        raise _Bad(i, f"holds an integer out of range [0, {_U32_MAX}]")
    return np.asarray(items, dtype=np.uint32) if len(items) else np.zeros(0, dtype=np.uint32)


def _per_row(parts: Sequence[np.ndarray]) -> np.ndarray:
    """An object array with one array per item (np.array would stack equal-length ones)."""
    out = np.empty(len(parts), dtype=object)
    for i, p in enumerate(parts):
        out[i] = p
    return out


_NAME_SET = frozenset(COLUMN_NAMES)


_INDEX: dict[str, int] = {name: i for i, name in enumerate(COLUMN_NAMES)}


class SampleRow(tuple):
    """One samples row: its values in COLUMNS order. A batch of them becomes columns in
    C-level passes (validate_samples), where dict rows need a lookup per value, so this is what the
    replay and the gateway build (samples.rows.row_from) and the spool stores (a JSON array per row).

    Read a value by column name or position: row["seq"], row[3]; as_dict() gives the mapping.
    Immutable like any tuple; SampleRow(values) does not validate (validate_samples does).
    """

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        if type(key) is str:
            return tuple.__getitem__(self, _INDEX[key])
        return tuple.__getitem__(self, key)

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(COLUMN_NAMES, self, strict=True))

    @classmethod
    def of(cls, row: Mapping[str, Any] | Sequence[Any]) -> SampleRow:
        """`row` as a SampleRow: a mapping is read in column order (KeyError if one is missing),
        a sequence is taken as the values in COLUMNS order."""
        if isinstance(row, cls):
            return row
        if isinstance(row, Mapping):
            return cls(row[name] for name in COLUMN_NAMES)
        return cls(row)


_TUPLE_ROWS = frozenset({SampleRow, tuple})


def validate_samples(rows: Sequence[Any], where: str = "rows") -> ValidColumns:
    """A batch of rows, validated columnar (validate_columns, NaN is never NULL); returns the
    batch as columns ready to insert, and the error names the row.

    Rows are SampleRows (or plain tuples of the values in COLUMNS order), transposed at C speed,
    or mappings of every column (validate_rows). One batch holds one kind.
    """
    types = set(map(type, rows))
    if not types or not types <= _TUPLE_ROWS:
        return validate_rows(rows, where)
    if set(map(len, rows)) != {len(COLUMN_NAMES)}:
        i = next(i for i, r in enumerate(rows) if len(r) != len(COLUMN_NAMES))
        raise SampleError(
            f"{where} row {i}: expected {len(COLUMN_NAMES)} values in column order, got {len(rows[i])}", row=i
        )
    # Transposed in C-level steps: the values in one flat list (flat += row, row by row, as they
    # lie in memory), then a strided slice per column, each checked (validate_columns' checks;
    # the slices are of one length) and dropped in turn. Cheaper than zip(*rows), which reads
    # across every row once per column: ~6 against ~7.5 ms per 10k bench rows.
    flat = functools.reduce(operator.iconcat, rows, [])
    width = len(COLUMN_NAMES)
    return _checked(((col, flat[i::width]) for i, col in enumerate(COLUMNS)), where, nan_is_null=False)


def rows_to_columns(rows: Sequence[Mapping[str, Any]], where: str = "rows") -> dict[str, list[Any]]:
    """Transpose rows (mappings of exactly the table's columns) into {column: list of values}.

    C-level passes only (map of an itemgetter per column), no Python loop per value: the
    cheapest transposition of dicts measured (bench/bench_insert.py). A row with a missing or
    unknown column raises SampleError naming the row.
    """
    try:
        if set(map(len, rows)) - {len(COLUMN_NAMES)}:
            raise KeyError  # some row has a column too many or too few
        # a column at a time: one C-level pass over the rows each, no row tuples in between
        return {name: list(map(get, rows)) for name, get in _GETTERS}
    except (KeyError, TypeError):
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping):
                raise SampleError(
                    f"{where} row {i}: expected a mapping, got {type(r).__name__}", row=i
                ) from None
            if r.keys() != _NAME_SET:
                extra = sorted(set(r) - _NAME_SET)
                missing = [n for n in COLUMN_NAMES if n not in r]
                raise SampleError(
                    f"{where} row {i}: unknown column(s) {extra}, missing column(s) {missing}", row=i
                ) from None
        raise  # pragma: no cover - every row is a full mapping, so the passes above cannot fail


def validate_rows(rows: Sequence[Mapping[str, Any]], where: str = "rows") -> ValidColumns:
    """A batch of dict rows, validated columnar (validate_columns, NaN is never NULL): returns
    the batch as columns ready to insert; the error names the row."""
    return validate_columns(rows_to_columns(rows, where), where, nan_is_null=False)


_KINDS: dict[str, str] = {c.name: c.kind for c in COLUMNS}


def validate_values(values: Mapping[str, Any], where: str = "row") -> None:
    """Some columns of one row ({column: value}), checked as validate_row checks them, with its
    messages ("row_from: column seq (UInt32) cannot hold -1: out of range [0, 4294967295]").

    For a writer that checks the values it makes itself where they are made, so the error
    names the field at its source, and leaves the rest of the row to the batch's columnar check
    (validate_samples) where it is stored: samples.rows.row_from checks its context values here.
    The common exact types (str, an int in range, a finite float, None where nullable) pass in
    a few bytecodes; anything else takes validate_row's own one-value check, which says why.
    """
    for name, v in values.items():
        kind = _KINDS.get(name)
        if kind is None:
            raise SampleError(f"{where}: unknown column {name!r}")
        t = type(v)
        if t is str:
            if kind == "str":
                continue
        elif t is int:
            bounds = _INT_RANGES.get(kind)
            if bounds is not None and bounds[0] <= v <= bounds[1]:
                continue
        elif t is float:
            if kind in _FLOAT_KINDS and math.isfinite(v):
                continue
        elif v is None and kind in _NULLABLE_KINDS:
            continue
        _one_value(BY_NAME[name], v, where)  # raises, naming the column, unless it is valid


_NULLABLE_KINDS = frozenset({"nf64", "nu64"})


def _one_value(col: Column, v: Any, where: str) -> None:
    """One value of one row through the validator (numpy skipped); SampleError if it is bad."""
    try:
        _column(col, (v,), nan_is_null=False, convert=False)
    except _Bad as bad:
        raise _error(where, col, (v,), bad, one_row=True) from None


def validate_row(row: Mapping[str, Any], where: str = "row") -> dict[str, Any]:
    """One row through the same validator; returns a copy in column order, floats as float."""
    if not isinstance(row, Mapping):
        raise SampleError(f"{where}: expected a mapping, got {type(row).__name__}")
    if row.keys() != _NAME_SET:
        extra = sorted(set(row) - _NAME_SET)
        missing = [n for n in COLUMN_NAMES if n not in row]
        raise SampleError(f"{where}: unknown column(s) {extra}, missing column(s) {missing}")
    out = {}
    for col in COLUMNS:
        v = row[col.name]
        _one_value(col, v, where)  # the same checks, numpy skipped
        if col.kind == "au32":
            out[col.name] = [int(x) for x in v]  # a copy, JSON-safe (the spool writes rows)
        else:
            out[col.name] = float(v) if col.kind in _FLOAT_KINDS and v is not None else v
    return out


_FLOAT_KINDS = frozenset({"f64", "nf64"})


def to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Rows -> {column: list of values} in COLUMNS order, unvalidated (tests, baselines)."""
    return {name: [r[name] for r in rows] for name in COLUMN_NAMES}


def row_key(row: Mapping[str, Any]) -> tuple[str, str, int, str]:
    """The identity of a sample: one row per key in what reads return."""
    return (row["experiment"], row["variant"], row["run_id"], row["request_id"])
