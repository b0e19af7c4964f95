"""How one StreamResult plus its replay context becomes a samples row.

The replay's side of the samples table: samples/ defines the columns and validates rows, and
knows nothing of streaming or the replay; this module maps a measurement onto those columns.
Pure: no Django, no database driver. A row is a samples.columns.SampleRow (its values in column
order; read by name too, row["seq"]); every value is a str, int, float, None or (itl_gaps_us) a
list of ints, so the spool can write the row as a JSON line.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from replay.plan import MIRROR, request_id
from samples.columns import BY_NAME, MODES, SampleError, SampleRow, validate_row
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

# StreamResult fields copied as-is (after validation) into same-named columns.
_RESULT_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(StreamResult)
    if f.name in BY_NAME and f.name not in ("request_id", "prompt_tokens")
)
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
    "sent_unix_ms",
)


def row_from(result: StreamResult, context: Mapping[str, Any]) -> SampleRow:
    """One samples row (JSON-safe values in column order) from a measurement and its replay context.

    Required context: experiment, run_id, seq, variant, mode, sent_unix_ms. Optional: see
    OPTIONAL_CONTEXT. Unknown keys are rejected so a typo never silently drops a value.
    Raises samples.columns.SampleError naming the field.
    """
    if not isinstance(result, StreamResult):
        raise SampleError(f"row_from: result must be a StreamResult, got {type(result).__name__}")
    unknown = sorted(set(context) - set(REQUIRED_CONTEXT) - set(OPTIONAL_CONTEXT))
    if unknown:
        raise SampleError(f"row_from: unknown context key(s) {unknown}")
    missing = [k for k in REQUIRED_CONTEXT if k not in context]
    if missing:
        raise SampleError(f"row_from: missing context key(s) {missing}")
    ctx = {**OPTIONAL_CONTEXT, **context}

    row: dict[str, Any] = {name: getattr(result, name) for name in _RESULT_FIELDS}
    row["outcome"] = Outcome(result.outcome).value
    row["error"] = result.error[:MAX_ERROR_CHARS]

    # 1. request id: the replay's deterministic id; the client must have sent that same id.
    try:
        derived = request_id(ctx["run_id"], ctx["seq"], ctx["variant"] if ctx["mode"] == MIRROR else None)
    except ValueError as e:
        raise SampleError(f"row_from: {e}") from None
    rid = ctx["request_id"] or result.request_id or derived
    if result.request_id and ctx["request_id"] and result.request_id != ctx["request_id"]:
        raise SampleError(
            f"row_from: result.request_id {result.request_id!r} differs from "
            f"context request_id {ctx['request_id']!r}"
        )
    row["request_id"] = rid

    # 2. prompt tokens: the server's usage count is exact; otherwise the replay's own count,
    # flagged when that count was itself an estimate.
    if result.usage_reported and result.prompt_tokens > 0:
        row["prompt_tokens"] = result.prompt_tokens
        row["prompt_tokens_estimated"] = 0
    else:
        row["prompt_tokens"] = ctx["prompt_tokens"]
        row["prompt_tokens_estimated"] = int(bool(ctx["prompt_tokens_estimated"]))

    # 3. the rest of the context
    for name in _CONTEXT_COLUMNS:
        row[name] = ctx[name]
    if row["mode"] not in MODES:
        raise SampleError(f"row_from: mode must be one of {MODES}, got {row['mode']!r}")
    if not row["experiment"]:
        raise SampleError("row_from: experiment must be a non-empty string")
    if not isinstance(row["sent_unix_ms"], int | float) or isinstance(row["sent_unix_ms"], bool):
        raise SampleError(f"row_from: sent_unix_ms must be a number, got {row['sent_unix_ms']!r}")
    row["sent_unix_ms"] = float(row["sent_unix_ms"])
    row["sent_at"] = int(row["sent_unix_ms"] // 1000)
    recorded = ctx["recorded_ms"]
    row["recorded_ms"] = int(time.time() * 1000) if recorded is None else recorded
    for name in ("new_connection", "usage_reported"):
        row[name] = int(bool(row[name]))
    # checked here, one row, so the error names the field at its source; the batch is checked
    # again, columnar, where it is stored
    return SampleRow(validate_row(row, where="row_from").values())
