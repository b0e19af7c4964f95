"""How one StreamResult plus its replay context becomes a samples row.

The replay's side of the samples table: samples/ defines the columns and validates rows, and
knows nothing of streaming or the replay; this module maps a measurement onto those columns.
Pure: no Django, no database driver. A row is a samples.columns.SampleRow (its values in column
order; read by name too, row["seq"]); every value is a str, int, float, None or (itl_gaps_us) a
list of ints, so the spool can write the row as a JSON line.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Mapping
from typing import Any

from replay.plan import MIRROR, request_id
from samples.columns import BY_NAME, COLUMN_NAMES, MODES, SampleError, SampleRow, validate_values
from streaming.result import Outcome, StreamResult

MAX_ERROR_CHARS = 4096  # a runaway error body must not make one row megabytes long

REQUIRED_CONTEXT = ("experiment", "run_id", "seq", "variant", "mode", "sent_unix_ms")
OPTIONAL_CONTEXT: dict[str, Any] = {
    "request_id": "",
    "user_id": "",
    "config_revision": 0,
    "scheduled_offset_ms": 0.0,
    "schedule_lag_ms": 0.0,
    "in_flight": 0,
    "prompt_tokens": 0,  # what the replay sent; the usage event's count wins when reported
    "prompt_tokens_estimated": False,
    "max_tokens": 0,
    "worker": "",
    "attempt": 1,
    "recorded_ms": None,  # default: now
}
_CONTEXT_KEYS = frozenset(REQUIRED_CONTEXT) | frozenset(OPTIONAL_CONTEXT)

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
    "in_flight",
    "max_tokens",
    "worker",
    "attempt",
)
_IN_COLUMN_ORDER = operator.itemgetter(*COLUMN_NAMES)


def row_from(result: StreamResult, context: Mapping[str, Any]) -> SampleRow:
    """One samples row (JSON-safe values in column order) from a measurement and its replay context.

    Required context: experiment, run_id, seq, variant, mode, sent_unix_ms. Optional: see
    OPTIONAL_CONTEXT. Unknown keys are rejected so a typo never silently drops a value.

    Checked here, each error a samples.columns.SampleError naming the field at its source: the
    context's keys and every value this function puts in the row from the context (type, range,
    mode, a non-empty experiment, the request id). The StreamResult's values (the client's) are
    not checked one row at a time: the whole batch is, columnar, where it is stored
    (samples.columns.validate_samples in the store's writer), and replay.sink.BatchSink then
    names the bad row's request and column and fails the shard (per-row validation was
    a fifth of the replay's CPU).
    """
    if not isinstance(result, StreamResult):
        raise SampleError(f"row_from: result must be a StreamResult, got {type(result).__name__}")
    unknown = context.keys() - _CONTEXT_KEYS
    if unknown:
        raise SampleError(f"row_from: unknown context key(s) {sorted(unknown)}")
    missing = [k for k in REQUIRED_CONTEXT if k not in context]
    if missing:
        raise SampleError(f"row_from: missing context key(s) {missing}")
    ctx = {**OPTIONAL_CONTEXT, **context}

    # 1. the context's values, checked here so the error names the field it came from
    row: dict[str, Any] = {name: ctx[name] for name in _CONTEXT_COLUMNS}
    sent = ctx["sent_unix_ms"]
    if not isinstance(sent, int | float) or isinstance(sent, bool):
        raise SampleError(f"row_from: sent_unix_ms must be a number, got {sent!r}")
    row["sent_unix_ms"] = float(sent)
    recorded = ctx["recorded_ms"]
    row["recorded_ms"] = int(time.time() * 1000) if recorded is None else recorded
    given_id = row["request_id"] = ctx["request_id"]
    # 2. prompt tokens: the server's usage count is exact; otherwise the replay's own count,
    # flagged when that count was itself an estimate.
    if result.usage_reported and result.prompt_tokens > 0:
        prompt_tokens, estimated = result.prompt_tokens, 0
    else:
        row["prompt_tokens"] = prompt_tokens = ctx["prompt_tokens"]
        estimated = int(bool(ctx["prompt_tokens_estimated"]))
    validate_values(row, "row_from")
    if row["mode"] not in MODES:
        raise SampleError(f"row_from: mode must be one of {MODES}, got {row['mode']!r}")
    if not row["experiment"]:
        raise SampleError("row_from: experiment must be a non-empty string")
    row["sent_at"] = int(row["sent_unix_ms"] // 1000)
    row["prompt_tokens"], row["prompt_tokens_estimated"] = prompt_tokens, estimated

    # 3. request id: the replay's deterministic id; the client must have sent that same id.
    try:
        derived = request_id(row["run_id"], row["seq"], row["variant"] if row["mode"] == MIRROR else None)
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
