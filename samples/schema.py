"""Versioned ClickHouse schema migrations, applied in order by `SampleStore.migrate()`.

Pure: SQL text only. A migration, once applied anywhere, is never edited: a change is a new
version (migrate() refuses to run when an applied migration's checksum no longer matches).
Every statement is idempotent (IF NOT EXISTS) so a migration interrupted between its statements
and its schema_migrations record can simply be run again.
"""

from __future__ import annotations

import dataclasses
import hashlib

SAMPLES_TABLE = "samples"
MIGRATIONS_TABLE = "schema_migrations"
# What reads should select from: FINAL collapses duplicate recordings of one request.
SAMPLES_FROM = f"{SAMPLES_TABLE} FINAL"


@dataclasses.dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]

    @property
    def checksum(self) -> str:
        text = "\n;\n".join(self.statements)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


CREATE_MIGRATIONS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (
    version UInt32,
    name String,
    checksum String,
    applied_at DateTime('UTC')
)
-- a handful of rows; MergeTree rather than TinyLog so concurrent readers never see a torn file
ENGINE = MergeTree
ORDER BY version
""".strip()

# Choices, each for a reason:
# - ReplacingMergeTree(recorded_ms): "retries never duplicate rows". A batch re-inserted after an
#   ambiguous failure (the insert landed but the reply was lost, or a spool flush that raced the
#   first attempt) leaves physical duplicates; reads FROM samples FINAL (SAMPLES_FROM) collapse
#   them to the latest recording, and background merges eventually remove them on disk. Plain
#   MergeTree has no block deduplication on 18.16 (only Replicated tables do), and dedup-before-
#   insert alone is racy between workers, so we use both: the spool flush filters ids already
#   stored (SpoolingWriter.flush), and the engine makes whatever slips through invisible.
# - ORDER BY (experiment, variant, run_id, seq, request_id): the sorting key is the dedup key, so
#   it must hold only what is identical across retries of one request (sent_at is not: a re-sent
#   request is sent later). request_id already determines seq; seq sits before it so that within a
#   run a variant's rows are in schedule (= time) order, and the experiment/variant prefix serves
#   the dashboards' per-experiment, per-variant queries.
# - PARTITION BY toYYYYMM(sent_at): monthly parts prune time-range queries and make dropping old
#   months cheap. Caveat: FINAL only collapses duplicates inside one partition; two recordings of
#   one request on either side of a month boundary would both show. count() and
#   recorded_request_ids() therefore count distinct keys, and the flush-time filter stops the
#   only path that produces such pairs (a spooled copy of a request re-sent elsewhere).
# Frozen text: adding a column to columns.COLUMNS needs a new migration (ALTER TABLE ... ADD
# COLUMN), never an edit here; tests compare the migrated table with COLUMNS.
CREATE_SAMPLES_TABLE = f"""
CREATE TABLE IF NOT EXISTS {SAMPLES_TABLE} (
    experiment LowCardinality(String),
    variant LowCardinality(String),
    run_id UInt64,
    seq UInt32,
    request_id String,
    mode LowCardinality(String),
    user_id String,
    config_revision Int64,
    sent_at DateTime('UTC'),
    sent_unix_ms Float64,
    scheduled_offset_ms Float64,
    schedule_lag_ms Float64,
    in_flight UInt32,
    prompt_tokens UInt32,
    prompt_tokens_estimated UInt8,
    max_tokens UInt32,
    worker LowCardinality(String),
    attempt UInt8,
    outcome LowCardinality(String),
    http_status UInt16,
    error String,
    new_connection UInt8,
    connect_ms Nullable(Float64),
    ttfb_ms Nullable(Float64),
    first_byte_ms Nullable(Float64),
    ttft_event_ms Nullable(Float64),
    ttft_ms Nullable(Float64),
    itl_mean_ms Nullable(Float64),
    itl_p50_ms Nullable(Float64),
    itl_p99_ms Nullable(Float64),
    itl_max_ms Nullable(Float64),
    tpot_ms Nullable(Float64),
    e2e_ms Nullable(Float64),
    output_tokens UInt32,
    usage_reported UInt8,
    chunks UInt32,
    finish_reason LowCardinality(String),
    traceparent String,
    trace_id String,
    server_ttft_ms Nullable(Float64),
    start_ns UInt64,
    server_first_content_ns Nullable(UInt64),
    recorded_ms UInt64
)
ENGINE = ReplacingMergeTree(recorded_ms)
PARTITION BY toYYYYMM(sent_at)
ORDER BY (experiment, variant, run_id, seq, request_id)
""".strip()

MIGRATIONS: tuple[Migration, ...] = (Migration(1, "create samples", (CREATE_SAMPLES_TABLE,)),)


def check_sequence(migrations: tuple[Migration, ...] = MIGRATIONS) -> None:
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"schema migrations must be numbered 1..n without gaps, got {versions}")


check_sequence()
