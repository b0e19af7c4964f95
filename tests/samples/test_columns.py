"""Pure: the samples table's columns, the one row validator, SQL quoting.

How a StreamResult becomes a row: samples.rows (tests/samples/test_rows.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from samples import column_marshal, columns, schema
from samples.columns import SampleError, validate_columns, validate_row, validate_rows, validate_samples
from samples.sql import ParamError, bind, quote
from tests.samples.conftest import GAPS_US, TOKEN_FPS, sample_row


def test_frozen_migration_creates_exactly_the_declared_columns():
    ddl = schema.CREATE_SAMPLES_TABLE
    body = ddl[ddl.index("(") + 1 : ddl.index("\n)")]
    declared = [line.strip().rstrip(",").split(" ", 1) for line in body.strip().splitlines()]
    added = [c.name for c in columns.COLUMNS if c.name in columns.ADDED_DEFAULTS]
    assert [(n, t) for n, t in declared] == [
        (c.name, c.ch_type) for c in columns.COLUMNS if c.name not in added
    ]
    # the migrations after it add the rest, each at its place
    assert schema.table_columns(schema.SAMPLES_TABLE) == [(c.name, c.ch_type) for c in columns.COLUMNS]
    # migrations 7, 5, 8 and 9
    assert added == ["gateway_ms", "itl_gaps_us", "output_fp", "token_fps", "answer_text"]


def test_validate_row_names_unknown_and_missing_columns():
    row = sample_row(1)
    row["extra"] = 1
    del row["seq"]
    with pytest.raises(SampleError, match=r"unknown column\(s\) \['extra'\], missing column\(s\) \['seq'\]"):
        validate_row(row)


def test_quote_escapes_strings_and_rejects_ambiguous_values():
    assert quote("it's \\ \n") == "'it\\'s \\\\ \\n'"
    assert quote(True) == "1" and quote(None) == "NULL" and quote(2.5) == "2.5"
    assert quote((1, 2)) == "(1, 2)" and quote([1]) == "[1]" and quote({"b", "a"}) == "('a', 'b')"
    for bad in (math.nan, object(), ()):
        with pytest.raises(ParamError):
            quote(bad, "p")


def test_bind_names_a_missing_parameter():
    with pytest.raises(ParamError, match="'run'"):
        bind("SELECT %(run)s", {"other": 1})
    assert bind("SELECT '100%'", None) == "SELECT '100%'"


def test_validate_rows_returns_the_batch_as_typed_columns():
    rows = [sample_row(i) for i in range(3)]
    rows[1].update(ttft_ms=None, server_first_content_ns=None, run_id=2**64 - 1, config_revision=-5)
    cols = validate_rows(rows)
    assert list(cols) == list(columns.COLUMN_NAMES)
    assert cols["seq"].dtype == np.uint32 and cols["run_id"].dtype == np.uint64
    assert cols["run_id"][1] == 2**64 - 1 and cols["config_revision"][1] == -5
    assert cols["sent_at"].dtype == np.uint32 and cols["attempt"].dtype == np.uint8
    assert np.isnan(cols["ttft_ms"][1]) and cols["ttft_ms"][0] == 21.5  # NaN is NULL in a nullable float
    assert cols["server_first_content_ns"].tolist() == [2**62 + 19_000_017, None, 2**62 + 19_000_017]
    assert cols["error"].dtype == object and cols["error"][0] == rows[0]["error"]


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("seq", "three", "rows row 2: column seq (UInt32) cannot hold 'three': not an integer"),
        ("seq", True, "rows row 2: column seq (UInt32) cannot hold True: not an integer"),
        ("seq", 3.0, "rows row 2: column seq (UInt32) cannot hold 3.0: not an integer"),
        (
            "seq",
            2**32,
            "rows row 2: column seq (UInt32) cannot hold 4294967296: out of range [0, 4294967295]",
        ),
        ("config_revision", -(2**63) - 1, "column config_revision (Int64) cannot hold"),
        ("sent_unix_ms", "1.5", "rows row 2: column sent_unix_ms (Float64) cannot hold '1.5': not a number"),
        ("sent_unix_ms", None, "rows row 2: column sent_unix_ms (Float64) cannot hold None: not a number"),
        ("sent_unix_ms", 10**400, "cannot hold 1000000000000000000000000000000000"),
        (
            "ttft_ms",
            math.nan,
            "rows row 2: column ttft_ms (Nullable(Float64)) cannot hold nan: not a finite number",
        ),
        (
            "ttft_ms",
            -math.inf,
            "rows row 2: column ttft_ms (Nullable(Float64)) cannot hold -inf: not a finite",
        ),
        (
            "ttft_ms",
            False,
            "rows row 2: column ttft_ms (Nullable(Float64)) cannot hold False: not a number or None",
        ),
        ("mode", None, "rows row 2: column mode (LowCardinality(String)) cannot hold None: not a str"),
        ("server_first_content_ns", 1.5, "column server_first_content_ns (Nullable(UInt64)) cannot hold 1.5"),
        ("server_first_content_ns", -1, "column server_first_content_ns (Nullable(UInt64)) cannot hold -1"),
    ],
)
def test_the_validator_names_row_column_type_value_and_reason(column, value, message):
    rows = [sample_row(i) for i in range(4)]
    rows[2][column] = value
    with pytest.raises(SampleError) as err:
        validate_rows(rows)
    assert message in str(err.value)
    assert err.value.row == 2
    one = dict(rows[2])
    with pytest.raises(SampleError, match=f"^row: column {column} "):  # one row: the same check
        validate_row(one)


def test_a_row_with_a_column_too_many_or_too_few_is_named():
    rows = [sample_row(i) for i in range(3)]
    rows[1]["colour"] = "red"
    with pytest.raises(
        SampleError, match=r"^rows row 1: unknown column\(s\) \['colour'\], missing column\(s\) \[\]$"
    ):
        validate_rows(rows)
    del rows[1]["colour"], rows[1]["seq"]
    with pytest.raises(
        SampleError, match=r"rows row 1: unknown column\(s\) \[\], missing column\(s\) \['seq'\]"
    ):
        validate_rows(rows)
    with pytest.raises(SampleError, match="rows row 0: expected a mapping, got tuple"):
        validate_rows([tuple(sample_row(0).values())])
    assert all(len(v) == 0 for v in validate_rows([]).values())


def test_bulk_columns_take_numpy_arrays_and_nan_as_null():
    cols = columns.to_columns([sample_row(i) for i in range(3)])
    cols["ttft_ms"] = np.array([1.0, np.nan, 3.0])
    cols["server_first_content_ns"] = np.array([np.nan, 7.0, np.nan])
    cols["seq"] = np.arange(3, dtype=np.int64)
    cols["experiment"] = np.array(["a", "b", "c"])  # a numpy str array
    out = validate_columns(cols)
    assert out["server_first_content_ns"].tolist() == [None, 7, None]
    assert out["seq"].dtype == np.uint32 and out["experiment"].tolist() == ["a", "b", "c"]
    with pytest.raises(
        SampleError, match=r"^rows row 1: column ttft_ms .* cannot hold nan"
    ):  # rows: NaN is a bug
        validate_columns(cols, "rows", nan_is_null=False)
    cols["seq"] = np.array([0.0, 1.0, 2.0])
    with pytest.raises(
        SampleError, match=r"insert_columns: column seq \(UInt32\) needs integers, got dtype float64"
    ):
        validate_columns(cols)


def test_sample_rows_validate_like_dict_rows_and_read_by_name():
    dicts = [sample_row(i) for i in range(3)]
    dicts[1].update(ttft_ms=None, server_first_content_ns=None)
    rows = [columns.SampleRow.of(r) for r in dicts]
    assert rows[1]["seq"] == 1 and rows[1][3] == 1 and rows[1].as_dict() == dicts[1]
    got, want = validate_samples(rows), validate_rows(dicts)
    assert list(got) == list(want)
    for name in columns.COLUMN_NAMES:
        assert got[name].dtype == want[name].dtype
        if columns.BY_NAME[name].kind == "au32":
            expected = {"itl_gaps_us": GAPS_US, "token_fps": TOKEN_FPS}[name]
            assert [a.tolist() for a in got[name]] == [a.tolist() for a in want[name]] == [expected] * 3
        else:
            np.testing.assert_array_equal(got[name], want[name])
    assert validate_samples([tuple(r) for r in rows]).keys() == want.keys()  # plain tuples too
    assert validate_samples(dicts).keys() == want.keys()  # and mappings


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("seq", True, "rows row 1: column seq (UInt32) cannot hold True: not an integer"),
        ("seq", 2**32, "rows row 1: column seq (UInt32) cannot hold 4294967296: out of range"),
        ("sent_unix_ms", math.inf, "rows row 1: column sent_unix_ms (Float64) cannot hold inf"),
        ("sent_unix_ms", 10**400, "rows row 1: column sent_unix_ms (Float64) cannot hold 1000"),
        ("ttft_ms", math.nan, "rows row 1: column ttft_ms (Nullable(Float64)) cannot hold nan"),
        ("mode", 3, "rows row 1: column mode (LowCardinality(String)) cannot hold 3: not a str"),
    ],
)
def test_a_bad_sample_row_is_named(column, value, message):
    rows = [columns.SampleRow.of(sample_row(i)) for i in range(3)]
    rows[1] = columns.SampleRow.of(dict(rows[1].as_dict(), **{column: value}))
    with pytest.raises(SampleError) as err:
        validate_samples(rows)
    assert message in str(err.value) and err.value.row == 1


def test_a_sample_row_of_the_wrong_length_is_named():
    rows = [tuple(sample_row(i).values()) for i in range(3)]
    rows[2] = rows[2][:-1]
    width = len(columns.COLUMN_NAMES)
    with pytest.raises(
        SampleError, match=rf"^rows row 2: expected {width} values in column order, got {width - 1}$"
    ):
        validate_samples(rows)


class _Float(float):
    pass


@pytest.mark.parametrize(
    ("column", "values"),
    [
        ("sent_unix_ms", [1.5, 2.0, -0.0, 1e308]),  # floats only: marshal's b"g" records
        ("sent_unix_ms", (1.5, 2.5)),  # a tuple
        ("sent_unix_ms", [1.5, 2, 3.0]),  # an int among floats: the per-value path
        ("sent_unix_ms", [1.5, True]),
        ("sent_unix_ms", [1.5, np.float64(2.0)]),
        ("sent_unix_ms", [1.5, _Float(2.0)]),
        ("sent_unix_ms", [1.5, math.inf]),
        ("sent_unix_ms", [1.5, None]),
        ("ttft_ms", [None, 1.5, None, 2.5]),  # b"N" and b"g" records
        ("ttft_ms", [None, None, None]),
        ("ttft_ms", [None, 1.5, math.nan]),
        ("ttft_ms", [None, -math.inf]),
        ("ttft_ms", [None, 1, 2.5]),
        ("ttft_ms", [None, "1.5"]),
        ("seq", [0, 7, 2**31 - 1]),  # b"i" records
        ("seq", [0, 2**31, 2**32 - 1]),  # b"i" and b"l" records
        ("seq", [2**31, 2**32 - 1]),  # b"l" records of 3 digits
        ("seq", [0, 2**32]),
        ("seq", [3, -1]),
        ("seq", [1, 2.0]),
        ("seq", [1, np.int64(2)]),
        ("attempt", [1, 255, 256]),
        ("sent_at", [1_732_900_000, 2**31 + 5]),
        ("run_id", [2**45 + 1, 2**45 + 2**44]),  # b"l" records of 4 digits
        ("run_id", [2**45, 2**44]),  # 4 and 3 digits
        ("run_id", [2**64 - 1, 2**63]),  # 5 digits
        ("run_id", [2**64, 2**63]),
        ("config_revision", [2**63, 2**62]),
        ("run_id", [np.uint64(2**63), 5]),
        ("config_revision", [-(2**40), 2**40]),
        ("config_revision", [-(2**63), 2**63 - 1]),
        ("config_revision", [-(2**63) - 1]),
        ("server_first_content_ns", [None, None]),
        ("server_first_content_ns", [None, 5, 2**50]),
        ("server_first_content_ns", [5, 2**50 + 1]),
        ("server_first_content_ns", [-5, None]),
        ("server_first_content_ns", [2.0, math.nan, 3.5]),
    ],
)
def test_the_fast_path_of_numeric_columns_agrees_with_the_per_value_check(monkeypatch, column, values):
    """Numeric columns go through marshal first (one C-level pass checks exact types); whatever
    it lets through or refuses must come out exactly as the per-value check decides it."""

    def outcome(nan_is_null: bool) -> str:
        cols = columns.to_columns([sample_row(i) for i in range(len(values))])
        cols[column] = values
        try:
            out = validate_columns(cols, "rows", nan_is_null=nan_is_null)[column]
        except SampleError as e:
            return f"{e} (row {e.row})"
        return f"{out.dtype} {out.tolist()!r} {[type(v) for v in out.tolist()]}"

    for nan_is_null in (False, True):
        fast = outcome(nan_is_null)
        with monkeypatch.context() as m:
            m.setattr(columns, "_marshalled_numbers", lambda kind, values: None)
            assert outcome(nan_is_null) == fast


def test_a_float_left_in_a_bulk_nullable_integer_column_is_named():
    cols = columns.to_columns([sample_row(i) for i in range(3)])
    cols["server_first_content_ns"] = [2.0, math.inf, 5]  # NaN would be NULL, 2.0 is 2; inf is not
    with pytest.raises(
        SampleError,
        match=r"^insert_columns row 1: column server_first_content_ns \(Nullable\(UInt64\)\) "
        r"cannot hold inf: not an integer$",
    ):
        validate_columns(cols)


def test_the_numeric_columns_of_ordinary_rows_take_the_fast_path(monkeypatch):
    """Guards the speed of insert_samples (bench/bench_insert.py) against a change of marshal's
    format in a new Python: every numeric column of ordinary rows is read from marshal's bytes."""
    taken = []
    fast = columns._marshalled_numbers

    def spy(kind, values):
        out = fast(kind, values)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(columns, "_marshalled_numbers", spy)
    rows = [
        sample_row(i, ttft_ms=None if i % 2 else 1.5, recorded_ms=1_764_500_000_000 + i) for i in range(4)
    ]
    validate_rows(rows)
    assert len(taken) == sum(c.kind not in ("str", "au32") for c in columns.COLUMNS) and all(taken)


# ---- Array(UInt32): the inter-token gaps ------------------------------------------------------


def test_gap_arrays_come_out_as_one_uint32_array_per_row_from_lists_tuples_and_numpy():
    rows = [sample_row(i) for i in range(4)]
    rows[1]["itl_gaps_us"] = []  # one token: no gaps
    rows[2]["itl_gaps_us"] = (5, 6)
    rows[3]["itl_gaps_us"] = np.array([7, 2**32 - 1], dtype=np.uint64)
    got = validate_rows(rows)["itl_gaps_us"]
    assert got.dtype == object and got.shape == (4,)
    assert all(a.dtype == np.uint32 for a in got)
    assert [a.tolist() for a in got] == [GAPS_US, [], [5, 6], [7, 2**32 - 1]]
    # equal-length rows stay one array per row (np.array would stack them into a matrix)
    same = validate_rows([sample_row(i, itl_gaps_us=[1, 2]) for i in range(3)])["itl_gaps_us"]
    assert same.shape == (3,) and [a.tolist() for a in same] == [[1, 2]] * 3
    # one row: a JSON-safe copy of the list
    one = sample_row(1, itl_gaps_us=(1, 2))
    assert columns.validate_row(one)["itl_gaps_us"] == [1, 2]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            [1, -1],
            r"rows row 2: column itl_gaps_us \(Array\(UInt32\)\) cannot hold \[1, -1\]: holds an integer "
            r"out of range \[0, 4294967295\]",
        ),
        ([2**32], "holds an integer out of range"),
        ([1, 2.5], r"cannot hold \[1, 2.5\]: not a list of integers"),
        ([True], "not a list of integers"),
        ("12", r"cannot hold '12': not a list of integers"),
        (None, r"cannot hold None: not a list of integers"),
        (12, "not a list of integers"),
        (np.array([1.5]), r"not an array of integers \(dtype float64"),
        (
            list(range(10_000, 10_100)) + [-5],
            r"cannot hold \[10000, 10001, .*\.\.\.: holds an integer out of range",
        ),
    ],
)
def test_a_bad_gap_array_is_named_with_its_row(value, message):
    rows = [sample_row(i) for i in range(4)]
    rows[2]["itl_gaps_us"] = value
    with pytest.raises(SampleError, match=message) as e:
        validate_rows(rows)
    assert e.value.row == 2
    with pytest.raises(SampleError, match="itl_gaps_us"):
        columns.validate_row(rows[2])


def test_a_gap_column_must_be_an_object_array_of_rows():
    cols = {name: [v] * 3 for name, v in sample_row(1).items()}
    cols["itl_gaps_us"] = np.array([1, 2, 3], dtype=np.uint32)  # one flat array is not per-row arrays
    with pytest.raises(
        SampleError, match=r"itl_gaps_us \(Array\(UInt32\)\) needs a 1-dimensional object array"
    ):
        validate_columns(cols)


def test_ordinary_gap_rows_take_the_marshal_path_and_anything_else_the_checked_one():
    rows = [[3900, 4100, 0], [], (7,), [2**31 - 1]]
    lengths = np.array([len(r) for r in rows])
    got = column_marshal.array_items(rows, lengths)
    assert got is not None and got.dtype == np.uint32 and got.tolist() == [3900, 4100, 0, 7, 2**31 - 1]
    for odd in ([True], [2**31], [-1], [1.0], ["1"]):  # each goes the per-row way (which names it)
        assert column_marshal.array_items([[1], odd], np.array([1, len(odd)])) is None
    assert [a.tolist() for a in validate_rows([sample_row(1, itl_gaps_us=[2**31])])["itl_gaps_us"]] == [
        [2**31]
    ]


_HOSTILE = [
    "",
    "x",
    0,
    1,
    -1,
    2**8,
    2**16,
    2**31,
    2**32,
    2**63,
    2**64,
    -(2**63) - 1,
    10**400,
    True,
    False,
    None,
    0.0,
    -0.0,
    1.5,
    math.inf,
    -math.inf,
    math.nan,
    1e308,
    b"x",
    [1],
    (),
    [],
    np.int64(3),
    np.uint64(2**64 - 1),
    np.float64(1.5),
    np.int64(-1),
    object(),
]


@pytest.mark.parametrize("name", [c.name for c in columns.COLUMNS])
def test_validate_values_accepts_and_refuses_exactly_what_validate_row_does(name):
    """Its fast path for the common exact types must never take a value the validator refuses
    (samples.rows.row_from checks its context values with it), and refuses with the same message."""
    base = sample_row(1)
    for v in _HOSTILE:
        try:
            columns.validate_row({**base, name: v}, where="w")
        except columns.SampleError as e:
            with pytest.raises(columns.SampleError) as err:
                columns.validate_values({name: v}, where="w")
            assert str(err.value) == str(e), (name, v)
        else:
            columns.validate_values({name: v}, where="w")


def test_validate_values_refuses_a_name_that_is_no_column():
    with pytest.raises(columns.SampleError, match="w: unknown column 'colour'"):
        columns.validate_values({"colour": "red"}, where="w")
