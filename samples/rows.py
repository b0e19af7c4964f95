"""How one StreamResult and its context become a samples row: the one row builder of the replay
(replay.runner) and the live gateway (gateway.recording).

samples.columns defines the columns and validates rows; this module maps a measurement and what
its recorder knows of the request (a SampleContext) onto those columns. Pure: no Django, no
database driver, nothing of the replay or the gateway (both import it; neither imports the
other). A row is a samples.columns.SampleRow (its values in column order; read by name too,
row["seq"]); every value is a str, int, float, None or (itl_gaps_us) a list of ints, so the spool
can write the row as a JSON line.

Time before the StreamResult's clock (which starts when the request is written) has one column
per recorder, so each column means one thing whatever the mode:
- schedule_lag_ms: a replay's, how late its send was against the plan (scheduled_offset_ms, ms
  after the run's start); 0 in a live sample, which has no plan.
- gateway_ms: a live sample's, the gateway's own time from the client's request received
  (scheduled_offset_ms: when, after the run's start) to the upstream request written; 0 in a
  replay's sample, which goes through no gateway.
The client's TTFT is either one plus ttft_ms, and the report splits it into those phases
(analysis.definitions.PHASES).
"""

from __future__ import annotations

import dataclasses
import operator
import time

from samples.columns import BY_NAME, COLUMN_NAMES, MODES, SampleError, SampleRow, validate_values
from streaming.result import Outcome, StreamResult

MAX_ERROR_CHARS = 4096  # a runaway error body must not make one row megabytes long
LIVE, MIRROR = "live", "mirror"  # of samples.columns.MODES: the gateway's, and a replay's mode


def request_id(run_id: int, seq: int, variant: str | None = None) -> str:
    """The one definition of a replayed request's id: deterministic, the same on every retry and
    redelivery. One per (run, request) in split mode (the router picks the variant), one per
    (run, request, variant) in mirror mode (every variant gets the request). The replay sends
    these (replay.plan re-exports it), and row_from derives the same when a writer gives none."""
    if variant is not None and not variant:
        raise ValueError("request_id: variant must be a non-empty string or None")
    base = f"r{int(run_id)}-{int(seq)}"
    return f"{base}-{variant}" if variant is not None else base


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SampleContext:
    """What the recorder knows of a request beyond its measurement: the row's other columns.

    Named fields, so a misspelt one is a TypeError where the context is made, never a value
    silently dropped. row_from checks every value (type, range, mode) and names the field.
    """

    experiment: str
    run_id: int
    seq: int
    variant: str
    mode: str  # one of samples.columns.MODES
    sent_unix_ms: float  # wall clock when the request was written: the StreamResult clock's zero
    request_id: str = ""  # "": the result's, else derived (request_id above)
    user_id: str = ""
    config_revision: int = 0
    scheduled_offset_ms: float = 0.0
    schedule_lag_ms: float = 0.0  # a replay's only (module docstring)
    gateway_ms: float = 0.0  # a live sample's only (module docstring)
    in_flight: int = 0
    prompt_tokens: int = 0  # the recorder's count; the usage event's wins when reported
    prompt_tokens_estimated: bool = False  # the recorder's count is itself an estimate
    max_tokens: int = 0
    worker: str = ""
    attempt: int = 1
    recorded_ms: int | None = None  # None: now


# StreamResult fields copied as-is into same-named columns (checked with the batch, see row_from).
_RESULT_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(StreamResult)
    if f.name in BY_NAME and f.name not in ("request_id", "prompt_tokens")
)
_RESULT_VALUES = operator.attrgetter(*_RESULT_FIELDS)
# Context values copied as-is into same-named columns (checked here, see row_from).
_CONTEXT_COLUMNS = (
    "experiment",
    "variant",
    "run_id",
    "seq",
    "mode",
    "user_id",
    "config_revision",
    "scheduled_offset_ms",
    "schedule_lag_ms",
    "gateway_ms",
    "in_flight",
    "max_tokens",
    "worker",
    "attempt",
    "request_id",
)
_CONTEXT_VALUES = operator.attrgetter(*_CONTEXT_COLUMNS)
_IN_COLUMN_ORDER = operator.itemgetter(*COLUMN_NAMES)


def row_from(result: StreamResult, context: SampleContext) -> SampleRow:
    """One samples row (JSON-safe values in column order) from a measurement and its context.

    Checked here, each error a samples.columns.SampleError naming the field at its source: every
    value this function puts in the row from the context (type, range, mode, a non-empty
    experiment, the request id, the recorder's own time column: schedule_lag_ms 0 in a live
    sample, gateway_ms 0 in a replay's). The StreamResult's values (the client's) are not checked
    one row at a time: the whole batch is, columnar, where it is stored
    (samples.columns.validate_samples in the store's writer), and the writer's caller then names
    the bad row's request and column (per-row validation was a fifth of the replay's CPU).
    """
    if not isinstance(result, StreamResult):
        raise SampleError(f"row_from: result must be a StreamResult, got {type(result).__name__}")
    if not isinstance(context, SampleContext):
        raise SampleError(f"row_from: context must be a SampleContext, got {type(context).__name__}")

    # 1. the context's values, checked here so the error names the field it came from
    row = dict(zip(_CONTEXT_COLUMNS, _CONTEXT_VALUES(context), strict=True))
    sent = context.sent_unix_ms
    if not isinstance(sent, int | float) or isinstance(sent, bool):
        raise SampleError(f"row_from: sent_unix_ms must be a number, got {sent!r}")
    row["sent_unix_ms"] = float(sent)
    recorded = context.recorded_ms
    row["recorded_ms"] = int(time.time() * 1000) if recorded is None else recorded
    given_id = row["request_id"]
    # 2. prompt tokens: the server's usage count is exact; otherwise the recorder's own count,
    # flagged when that count was itself an estimate.
    if result.usage_reported and result.prompt_tokens > 0:
        prompt_tokens, estimated = result.prompt_tokens, 0
    else:
        row["prompt_tokens"] = prompt_tokens = context.prompt_tokens
        estimated = int(bool(context.prompt_tokens_estimated))
    validate_values(row, "row_from")
    mode = row["mode"]
    if mode not in MODES:
        raise SampleError(f"row_from: mode must be one of {MODES}, got {mode!r}")
    if not row["experiment"]:
        raise SampleError("row_from: experiment must be a non-empty string")
    if mode == LIVE and row["schedule_lag_ms"]:
        raise SampleError(
            f"row_from: a live sample has no schedule: schedule_lag_ms must be 0, got "
            f"{row['schedule_lag_ms']!r} (the gateway's own time is gateway_ms)"
        )
    if mode != LIVE and row["gateway_ms"]:
        raise SampleError(
            f"row_from: gateway_ms is a live sample's (the gateway's own time); a {mode} replay's must be 0, "
            f"got {row['gateway_ms']!r} (its lateness is schedule_lag_ms)"
        )
    row["sent_at"] = int(row["sent_unix_ms"] // 1000)
    row["prompt_tokens"], row["prompt_tokens_estimated"] = prompt_tokens, estimated

    # 3. request id: the writer's (the replay's deterministic id, the gateway's X-Request-Id);
    # the client must have sent that same id.
    try:
        derived = request_id(row["run_id"], row["seq"], row["variant"] if mode == MIRROR else None)
    except ValueError as e:
        raise SampleError(f"row_from: {e}") from None
    if result.request_id and given_id and result.request_id != given_id:
        raise SampleError(
            f"row_from: result.request_id {result.request_id!r} differs from context request_id {given_id!r}"
        )
    row["request_id"] = given_id or result.request_id or derived

    # 4. the measurement, as the client recorded it
    row.update(zip(_RESULT_FIELDS, _RESULT_VALUES(result), strict=True))
    row["outcome"] = Outcome(result.outcome).value
    row["error"] = result.error[:MAX_ERROR_CHARS]
    row["new_connection"] = int(bool(row["new_connection"]))
    row["usage_reported"] = int(bool(row["usage_reported"]))
    return SampleRow(_IN_COLUMN_ORDER(row))
