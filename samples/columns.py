"""The samples table's columns and how one StreamResult plus its replay context becomes a row.

Pure: stdlib only (no Django, no database driver). The store turns the dict rows built here into
columnar batches; the spool writes them as JSON lines, so every value is a str, int, float or None.

Types are the subset that works on ClickHouse 18.16 (CI) and chDB 4.4 alike: no DateTime64, Bool,
Map or JSON. Booleans are UInt8 0/1; exact send time is kept as Float64 unix milliseconds next to a
second-resolution DateTime('UTC') used for partitioning and time buckets.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from streaming.result import Outcome, StreamResult

MODES = ("split", "mirror")
MAX_ERROR_CHARS = 4096  # a runaway error body must not make one row megabytes long


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    name: str
    ch_type: str
    # kind drives conversion to Arrow/numpy and validation:
    # str, u8, u16, u32, u64, i64, f64, nf64 / nu64 (nullable float64 / uint64),
    # datetime (unix seconds)
    kind: str


def _c(name: str, ch_type: str, kind: str) -> Column:
    return Column(name, ch_type, kind)


# Order is the physical column order in the table and in every batch.
COLUMNS: tuple[Column, ...] = (
    # --- replay context: identity (the ReplacingMergeTree key, see schema.py)
    _c("experiment", "LowCardinality(String)", "str"),
    _c("variant", "LowCardinality(String)", "str"),
    _c("run_id", "UInt64", "u64"),
    _c("seq", "UInt32", "u32"),
    _c("request_id", "String", "str"),
    # --- replay context: how and when it was sent
    _c("mode", "LowCardinality(String)", "str"),  # 'split' | 'mirror', validated in row_from
    _c("user_id", "String", "str"),
    _c("config_revision", "Int64", "i64"),  # etcd revision of the weights the router used
    _c("sent_at", "DateTime('UTC')", "datetime"),  # explicit UTC: same partitions on any host
    _c("sent_unix_ms", "Float64", "f64"),  # exact send time
    _c("scheduled_offset_ms", "Float64", "f64"),  # planned send time, ms after the run start
    _c("schedule_lag_ms", "Float64", "f64"),  # how late the send was against that plan
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
    # --- bookkeeping: ReplacingMergeTree version; the latest recording of a request wins
    _c("recorded_ms", "UInt64", "u64"),
)

COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}

_INT_RANGES = {
    "u8": (0, 2**8 - 1),
    "u16": (0, 2**16 - 1),
    "u32": (0, 2**32 - 1),
    "u64": (0, 2**64 - 1),
    "nu64": (0, 2**64 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "datetime": (0, 2**32 - 1),
}

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
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(StreamResult))


class SampleError(ValueError):
    """A row or context value that cannot be stored; the message names the field."""


def request_id(run_id: int, seq: int, variant: str | None = None) -> str:
    """The one definition of a request's id: deterministic, the same on every retry and
    redelivery. One per (run, request) in split mode (the router picks the variant), one per
    (run, request, variant) in mirror mode (every variant gets the request). The replay
    (replay.plan) sends these, and row_from derives the same when a writer gives none."""
    if variant is not None and not variant:
        raise SampleError("request_id: variant must be a non-empty string or None")
    base = f"r{int(run_id)}-{int(seq)}"
    return f"{base}-{variant}" if variant is not None else base


def row_from(result: StreamResult, context: Mapping[str, Any]) -> dict[str, Any]:
    """One samples row (column name -> JSON-safe value) from a measurement and its replay context.

    Required context: experiment, run_id, seq, variant, mode, sent_unix_ms. Optional: see
    OPTIONAL_CONTEXT. Unknown keys are rejected so a typo never silently drops a value.
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

    row: dict[str, Any] = {}
    for name in _RESULT_FIELDS:
        if name in BY_NAME and name not in ("request_id", "prompt_tokens"):
            row[name] = getattr(result, name)
    row["outcome"] = Outcome(result.outcome).value
    row["error"] = result.error[:MAX_ERROR_CHARS]

    # 1. request id: the replay's deterministic id; the client must have sent that same id.
    derived = request_id(ctx["run_id"], ctx["seq"], ctx["variant"] if ctx["mode"] == "mirror" else None)
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
    for name in (
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
    ):
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
    return validate_row(row, where="row_from")


def validate_row(row: Mapping[str, Any], where: str = "row") -> dict[str, Any]:
    """Check names and value types of one row; returns a normalized copy (floats as float)."""
    extra = sorted(set(row) - set(COLUMN_NAMES))
    missing = [n for n in COLUMN_NAMES if n not in row]
    if extra or missing:
        raise SampleError(f"{where}: unknown column(s) {extra}, missing column(s) {missing}")
    out: dict[str, Any] = {}
    for col in COLUMNS:
        v = row[col.name]
        bad = f"{where}: column {col.name} ({col.ch_type}) cannot hold {v!r}"
        if col.kind == "str":
            if not isinstance(v, str):
                raise SampleError(bad)
        elif col.kind == "nu64" and v is None:
            pass
        elif col.kind in _INT_RANGES:
            if isinstance(v, bool) or not isinstance(v, int):
                raise SampleError(bad)
            lo, hi = _INT_RANGES[col.kind]
            if not lo <= v <= hi:
                raise SampleError(bad + f": out of range [{lo}, {hi}]")
        elif col.kind in ("f64", "nf64"):
            if v is None and col.kind == "nf64":
                pass
            elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise SampleError(bad)
            else:
                v = float(v)
        else:  # pragma: no cover - a new kind without validation is a programming error
            raise AssertionError(f"no validation for kind {col.kind}")
        out[col.name] = v
    return out


_NAME_SET = frozenset(COLUMN_NAMES)
_NONE = type(None)
_ALLOWED_TYPES: dict[str, frozenset[type]] = {
    "str": frozenset({str}),
    "f64": frozenset({float, int}),
    "nf64": frozenset({float, int, _NONE}),
    "nu64": frozenset({int, _NONE}),
    **{k: frozenset({int}) for k in ("u8", "u16", "u32", "u64", "i64", "datetime")},
}


def validate_rows(rows: Sequence[Mapping[str, Any]], where: str = "rows") -> dict[str, list[Any]]:
    """validate_row for a whole batch, column at a time (~20x faster), returning the columns.

    On any problem it falls back to validate_row row by row, so the error names the row.
    """

    def locate() -> None:
        for i, r in enumerate(rows):
            validate_row(r, where=f"{where} row {i}")
        raise AssertionError("columnar validation failed but no row did")  # pragma: no cover

    if not all(r.keys() == _NAME_SET for r in rows):
        locate()
    cols: dict[str, list[Any]] = {}
    for col in COLUMNS:
        values = [r[col.name] for r in rows]
        if not set(map(type, values)) <= _ALLOWED_TYPES[col.kind]:
            locate()
        if col.kind in _INT_RANGES:
            present = values if col.kind != "nu64" else [v for v in values if v is not None]
            lo, hi = _INT_RANGES[col.kind]
            if present and (min(present) < lo or max(present) > hi):
                locate()
        elif col.kind in ("f64", "nf64"):
            present = values if col.kind == "f64" else [v for v in values if v is not None]
            if not all(map(math.isfinite, present)):
                locate()
            values = [v if v is None else float(v) for v in values]
        cols[col.name] = values
    return cols


def to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Rows -> {column: values} in COLUMNS order (the shape every batch insert starts from)."""
    return {name: [r[name] for r in rows] for name in COLUMN_NAMES}


def row_key(row: Mapping[str, Any]) -> tuple[str, str, int, str]:
    """The identity of a sample: one row per key in what reads return."""
    return (row["experiment"], row["variant"], row["run_id"], row["request_id"])
