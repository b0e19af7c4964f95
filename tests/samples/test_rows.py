"""Pure: how a StreamResult and its context become one samples row (samples.rows), the one row
builder of the replay and the live gateway."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from replay import plan
from samples import columns, rows
from samples.columns import SampleError
from samples.rows import SampleContext, request_id, row_from
from streaming.result import Outcome, StreamResult
from tests.samples.conftest import ANSWER_TEXT, GAPS_US, TOKEN_FPS


def full_result(**over: Any) -> StreamResult:
    """A StreamResult with every field set to a non-default value."""
    fields: dict[str, Any] = dict(
        outcome=Outcome.STALL,
        http_status=200,
        error="stall after 12 tokens: «Überlauf» 日本語 'quoted' \\ back\nslash",
        new_connection=True,
        connect_ms=1.25,
        ttfb_ms=3.5,
        first_byte_ms=3.75,
        ttft_event_ms=20.125,
        ttft_ms=21.5,
        itl_mean_ms=4.0,
        itl_p50_ms=3.9,
        itl_p99_ms=12.0,
        itl_max_ms=15.5,
        itl_gaps_us=list(GAPS_US),
        tpot_ms=4.1,
        e2e_ms=120.0,
        output_tokens=25,
        prompt_tokens=512,
        usage_reported=True,
        chunks=27,
        finish_reason="length",
        request_id="",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        trace_id="0af7651916cd43dd8448eb211c80319c",
        server_ttft_ms=19.0,
        start_ns=2**62 + 17,
        server_first_content_ns=2**62 + 19_000_017,
        output_fp=2**64 - 3,
        token_fps=list(TOKEN_FPS),
        answer_text=ANSWER_TEXT,
    )
    fields.update(over)
    return StreamResult(**fields)


def context(seq_: int, **over: Any) -> SampleContext:
    """A replay's context of request ``seq_`` (split mode), every field set; ``over`` replaces
    fields (an unknown one is a TypeError, as for any SampleContext)."""
    ctx: dict[str, Any] = dict(
        experiment="ttft-opt",
        run_id=7,
        seq=seq_,
        variant="awq",
        mode="split",
        sent_unix_ms=1_732_900_000_123.456 + seq_ * 10,
        user_id=f"user-{seq_ % 5}",
        config_revision=42,
        scheduled_offset_ms=seq_ * 10.0,
        schedule_lag_ms=0.75,
        in_flight=3,
        prompt_tokens=500,
        prompt_tokens_estimated=True,
        max_tokens=64,
        worker="host-a:1234",
        attempt=1,
        recorded_ms=1_732_900_001_000 + seq_,
    )
    ctx.update(over)
    return SampleContext(**ctx)


@pytest.fixture
def build():
    """build.result(**fields) and build.context(seq, **keys): the pieces row_from takes."""
    import types

    return types.SimpleNamespace(result=full_result, context=context)


def test_every_stream_result_field_has_a_same_named_column():
    fields = {f.name for f in dataclasses.fields(StreamResult)}
    assert fields <= set(columns.COLUMN_NAMES)


def test_request_id_is_deterministic_and_distinct_per_run_seq_and_variant():
    assert request_id(7, 3) == request_id(7, 3) == "r7-3"  # split: the router picks the variant
    assert request_id(7, 3, "awq") == "r7-3-awq"  # mirror: one per variant
    ids = {request_id(r, s, v) for r in (1, 2) for s in (1, 10, 100) for v in ("a", "b", None)}
    assert len(ids) == 18
    with pytest.raises(ValueError, match="variant must be a non-empty string or None"):
        request_id(7, 3, "")


def test_the_replay_sends_the_ids_row_from_derives(build):
    assert rows.request_id is plan.request_id is request_id
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
    # a SampleRow: every column's value, in column order
    assert isinstance(row, columns.SampleRow) and list(row.as_dict()) == list(columns.COLUMN_NAMES)


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
        ({"seq": -1}, "column seq (UInt32) cannot hold -1"),
        ({"attempt": 300}, "column attempt (UInt8) cannot hold 300"),
        ({"schedule_lag_ms": math.nan}, "column schedule_lag_ms (Float64) cannot hold nan"),
        ({"gateway_ms": math.inf}, "column gateway_ms (Float64) cannot hold inf"),
        ({"user_id": 12}, "column user_id (String) cannot hold 12"),
        ({"experiment": ""}, "experiment must be a non-empty string"),
    ],
)
def test_bad_context_is_rejected_naming_the_field(build, override, message):
    with pytest.raises(SampleError) as err:
        row_from(build.result(), build.context(1, **override))
    assert message in str(err.value)


def test_an_unknown_or_missing_context_field_is_named_where_the_context_is_made(build):
    """Named fields: a typo never silently drops a value, and a required one cannot be left out."""
    with pytest.raises(TypeError, match="colour"):
        build.context(1, colour="red")
    with pytest.raises(TypeError, match="sent_unix_ms"):
        SampleContext(experiment="ttft-opt", run_id=7, seq=1, variant="awq", mode="split")
    with pytest.raises(dataclasses.FrozenInstanceError):
        build.context(1).seq = 2  # type: ignore[misc]


def test_a_context_is_a_sample_context_not_a_mapping(build):
    with pytest.raises(SampleError, match="row_from: context must be a SampleContext, got dict"):
        row_from(build.result(), dataclasses.asdict(build.context(1)))  # type: ignore[arg-type]


def test_the_clients_values_are_left_to_the_batch_check_which_names_the_row(build):
    """row_from checks the context's values; the StreamResult's are checked with the whole batch
    where it is stored (replay.sink.BatchSink then names the request, tests/replay/test_sink.py)."""
    bad = row_from(build.result(ttft_ms=math.inf), build.context(1))
    with pytest.raises(
        SampleError, match=r"rows row 1: column ttft_ms \(Nullable\(Float64\)\) cannot hold inf"
    ):
        columns.validate_samples([row_from(build.result(), build.context(0)), bad])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"run_id": "7"}, "row_from: column run_id (UInt64) cannot hold '7': not an integer"),
        ({"variant": None}, "row_from: column variant (LowCardinality(String)) cannot hold None: not a str"),
        ({"in_flight": 2**32}, "row_from: column in_flight (UInt32) cannot hold 4294967296: out of range"),
        (
            {"config_revision": 1.0},
            "row_from: column config_revision (Int64) cannot hold 1.0: not an integer",
        ),
        ({"scheduled_offset_ms": math.inf}, "row_from: column scheduled_offset_ms (Float64) cannot hold inf"),
        ({"worker": b"host"}, "row_from: column worker (LowCardinality(String)) cannot hold b'host'"),
        ({"recorded_ms": -1}, "row_from: column recorded_ms (UInt64) cannot hold -1"),
        ({"request_id": 5}, "row_from: column request_id (String) cannot hold 5"),
        ({"max_tokens": True}, "row_from: column max_tokens (UInt32) cannot hold True: not an integer"),
        ({"sent_unix_ms": True}, "sent_unix_ms must be a number, got True"),
        ({"mode": "mirror", "variant": ""}, "variant must be a non-empty string or None"),
    ],
)
def test_every_context_value_is_checked_where_row_from_builds_it(build, override, message):
    with pytest.raises(SampleError) as err:
        row_from(build.result(), build.context(1, **override))
    assert message in str(err.value)


def test_the_replays_prompt_count_is_checked_when_it_is_the_one_stored(build):
    with pytest.raises(SampleError, match=r"column prompt_tokens \(UInt32\) cannot hold -5"):
        row_from(build.result(usage_reported=False), build.context(1, prompt_tokens=-5))
    # the server's count wins, so the replay's is not stored (nor checked)
    assert row_from(build.result(), build.context(1, prompt_tokens=-5))["prompt_tokens"] == 512


def test_row_from_values_are_those_validate_row_returns(build):
    """The row is what the validator would return for it: the batch check adds nothing to fix."""
    row = row_from(build.result(), build.context(3))
    assert columns.validate_row(row.as_dict()) == row.as_dict()
    assert row_from(StreamResult(), build.context(2)).as_dict() == columns.validate_row(
        row_from(StreamResult(), build.context(2)).as_dict()
    )


def test_request_id_sent_must_match_the_replay_id(build):
    with pytest.raises(SampleError, match="differs from context request_id"):
        row_from(build.result(request_id="x"), build.context(1, request_id="y"))
    row = row_from(build.result(request_id="r7-00000001-awq"), build.context(1))
    assert row["request_id"] == "r7-00000001-awq"


def test_a_row_from_row_from_is_what_the_sample_tests_store(build):
    """tests/samples builds its rows without the replay (samples knows nothing of it): they must
    stay the rows row_from makes from this module's result and context."""
    from tests.samples.conftest import sample_row

    assert row_from(build.result(), build.context(3)).as_dict() == sample_row(3)
    assert row_from(
        build.result(), build.context(4, run_id=8, variant="fp16", attempt=2)
    ).as_dict() == sample_row(4, run_id=8, variant="fp16", attempt=2)


# ---- the recorder's own time before the send: one column each, 0 in the other's rows ------------


def live_context(seq_: int, **over: Any) -> SampleContext:
    """What the gateway knows of a live request (gateway.recording builds the same)."""
    fields: dict[str, Any] = dict(
        experiment="ttft-opt",
        run_id=10**12 + 1,
        seq=seq_,
        variant="awq",
        mode="live",
        sent_unix_ms=1_764_640_000_000.0 + seq_,
        request_id=f"gw-{seq_}",
        user_id="user-1",
        config_revision=42,
        scheduled_offset_ms=1_000.0 + seq_,
        gateway_ms=0.625,
        prompt_tokens=20,
        prompt_tokens_estimated=True,
        max_tokens=64,
        worker="gw:1",
    )
    fields.update(over)
    return SampleContext(**fields)


@pytest.mark.parametrize("mode", ["split", "mirror"])
def test_a_replay_row_has_its_lateness_in_schedule_lag_and_no_gateway_time(build, mode):
    row = row_from(build.result(), build.context(3, mode=mode))
    assert row["mode"] == mode and row["schedule_lag_ms"] == 0.75 and row["gateway_ms"] == 0.0
    assert row_from(build.result(), build.context(3, mode=mode, schedule_lag_ms=0.0))["gateway_ms"] == 0.0


def test_a_live_row_has_the_gateway_s_time_in_gateway_ms_and_no_schedule_lag(build):
    row = row_from(build.result(), live_context(5))
    assert row["mode"] == "live" and row["gateway_ms"] == 0.625 and row["schedule_lag_ms"] == 0.0
    assert row["request_id"] == "gw-5" and row["scheduled_offset_ms"] == 1_005.0
    assert columns.validate_row(row.as_dict()) == row.as_dict()
    # the client's TTFT: the gateway's time, then the measurement's own clock
    assert row["gateway_ms"] + row["ttft_ms"] == 22.125


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: live_context(1, schedule_lag_ms=0.625),
            "a live sample has no schedule: schedule_lag_ms must be 0, got 0.625 (the gateway's own time is gateway_ms)",
        ),
        (
            lambda: context(1, gateway_ms=0.5),
            "gateway_ms is a live sample's (the gateway's own time); a split replay's must be 0, got 0.5",
        ),
        (
            lambda: context(1, mode="mirror", gateway_ms=0.5),
            "a mirror replay's must be 0, got 0.5 (its lateness is schedule_lag_ms)",
        ),
    ],
)
def test_each_recorder_s_time_goes_to_its_own_column_only(build, make, message):
    with pytest.raises(SampleError) as err:
        row_from(build.result(), make())
    assert message in str(err.value)
