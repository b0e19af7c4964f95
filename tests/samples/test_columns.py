"""Pure: how a StreamResult and its replay context become one samples row."""

from __future__ import annotations

import dataclasses
import math

import pytest

from replay import plan
from samples import columns, schema
from samples.columns import SampleError, request_id, row_from, validate_row
from samples.sql import ParamError, bind, quote
from streaming.result import StreamResult


def test_every_stream_result_field_has_a_same_named_column():
    fields = {f.name for f in dataclasses.fields(StreamResult)}
    assert fields <= set(columns.COLUMN_NAMES)


def test_frozen_migration_creates_exactly_the_declared_columns():
    ddl = schema.CREATE_SAMPLES_TABLE
    body = ddl[ddl.index("(") + 1 : ddl.index("\n)")]
    declared = [line.strip().rstrip(",").split(" ", 1) for line in body.strip().splitlines()]
    assert [(n, t) for n, t in declared] == [(c.name, c.ch_type) for c in columns.COLUMNS]


def test_request_id_is_deterministic_and_distinct_per_run_seq_and_variant():
    assert request_id(7, 3) == request_id(7, 3) == "r7-3"  # split: the router picks the variant
    assert request_id(7, 3, "awq") == "r7-3-awq"  # mirror: one per variant
    ids = {request_id(r, s, v) for r in (1, 2) for s in (1, 10, 100) for v in ("a", "b", None)}
    assert len(ids) == 18
    with pytest.raises(SampleError, match="variant must be a non-empty string or None"):
        request_id(7, 3, "")


def test_the_replay_sends_the_ids_row_from_derives(build):
    assert plan.request_id is request_id
    assert row_from(build.result(), build.context(3, mode="mirror"))["request_id"] == "r7-3-awq"


def test_row_from_maps_result_and_context(build):
    row = row_from(build.result(), build.context(3))
    assert row["request_id"] == "r7-3"
    assert row["sent_at"] == 1_732_900_000  # whole seconds of sent_unix_ms
    assert row["sent_unix_ms"] == 1_732_900_000_153.456
    assert row["outcome"] == "stall"
    assert row["new_connection"] == 1 and row["usage_reported"] == 1
    # the usage event's prompt count wins over the replay's estimate
    assert (row["prompt_tokens"], row["prompt_tokens_estimated"]) == (512, 0)
    assert set(row) == set(columns.COLUMN_NAMES)


def test_without_usage_the_replay_prompt_count_is_kept_and_flagged_estimated(build):
    row = row_from(build.result(usage_reported=False, prompt_tokens=0), build.context(1))
    assert (row["prompt_tokens"], row["prompt_tokens_estimated"]) == (500, 1)


def test_absent_timings_stay_none(build):
    row = row_from(StreamResult(), build.context(1))
    assert row["ttft_ms"] is None and row["connect_ms"] is None and row["e2e_ms"] is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"mode": "shadow"}, "mode must be one of"),
        ({"colour": "red"}, "unknown context key(s) ['colour']"),
        ({"seq": -1}, "column seq (UInt32) cannot hold -1"),
        ({"attempt": 300}, "column attempt (UInt8) cannot hold 300"),
        ({"schedule_lag_ms": math.nan}, "column schedule_lag_ms (Float64) cannot hold nan"),
        ({"user_id": 12}, "column user_id (String) cannot hold 12"),
        ({"experiment": ""}, "experiment must be a non-empty string"),
    ],
)
def test_bad_context_is_rejected_naming_the_field(build, override, message):
    with pytest.raises(SampleError) as err:
        row_from(build.result(), build.context(1, **override))
    assert message in str(err.value)


def test_missing_context_is_named(build):
    ctx = build.context(1)
    del ctx["sent_unix_ms"]
    with pytest.raises(SampleError, match=r"missing context key\(s\) \['sent_unix_ms'\]"):
        row_from(build.result(), ctx)


def test_non_finite_timing_from_the_client_is_rejected(build):
    with pytest.raises(SampleError, match="column ttft_ms"):
        row_from(build.result(ttft_ms=math.inf), build.context(1))


def test_request_id_sent_must_match_the_replay_id(build):
    with pytest.raises(SampleError, match="differs from context request_id"):
        row_from(build.result(request_id="x"), build.context(1, request_id="y"))
    row = row_from(build.result(request_id="r7-00000001-awq"), build.context(1))
    assert row["request_id"] == "r7-00000001-awq"


def test_validate_row_names_unknown_and_missing_columns(build):
    row = row_from(build.result(), build.context(1))
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
