"""Versioned ClickHouse schema migrations, applied in order by `SampleStore.migrate()`.

Pure: SQL text only. A migration, once applied anywhere, is never edited: a change is a new
version (migrate() refuses to run when an applied migration's checksum no longer matches).
Every statement is idempotent so a migration interrupted between its statements and its
schema_migrations record can simply be run again: CREATE TABLE IF NOT EXISTS, and ALTER TABLE t
ADD COLUMN c T [AFTER x], one column per statement, which the migrator runs only when t lacks c
(18.16 has no ADD COLUMN IF NOT EXISTS; SampleStore.migrate, added_columns).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

SAMPLES_TABLE = "samples"
# The samples table's sorting key (its ORDER BY below): inserts send rows in this order, so the
# server finds each block already sorted and skips sorting it (bench/bench_insert.py).
SAMPLES_SORT_KEY = ("experiment", "variant", "run_id", "seq", "request_id")
MIGRATIONS_TABLE = "schema_migrations"
# FINAL collapses duplicate recordings of one request at read time: for exact reads of a few
# rows (checks, tests). Analytics do not use it (it cost ~7 s per pass at 10M rows); they rely on
# the dedup contract instead (SampleStore.deduplicate, analysis/readers/raw.py).
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
#   first attempt) leaves physical duplicates; FINAL collapses them to the latest recording,
#   SampleStore.deduplicate (OPTIMIZE ... FINAL) and background merges remove them on disk. Plain
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

# Per-run rollups for the SLA report (analysis.rollup builds and reads them). A finished run's
# samples no longer change, so its additive aggregates are computed once, when the run ends,
# and the report sums a few thousand rollup rows instead of scanning millions of samples.
# - Every rollup row carries the build_id of the build that wrote it; rollup_builds, written
#   last, names each run's current build, with its spec (rollup format version and the SLO it
#   was built for) and the run's row count
#   and sum(recorded_ms) at that moment. A reader uses a run's rollup only when the samples still
#   show that count and sum (a late or replaced row makes it fall back to the raw samples) and
#   its spec is the current one (same format version, the experiment's SLO). So a rebuild never needs an atomic swap, and a
#   half-written build is invisible (its catalog row is missing).
# - rollup_builds is ReplacingMergeTree(build_id) keyed by run: read with FINAL (a few rows per
#   experiment), the newest build wins.
# - Grain: 10 s of sent_at (every time bucket the report uses is a multiple of 10 s).
ROLLUP_BUILDS_TABLE = "rollup_builds"
ROLLUP_CELLS_TABLE = "rollup_cells"
ROLLUP_HIST_TABLE = "rollup_hist"
ROLLUP_SERIES_TABLE = "rollup_series"
ROLLUP_USERS_TABLE = "rollup_users"
ROLLUP_VALUES_TABLE = "rollup_values"
ROLLUP_FAILURES_TABLE = "rollup_failures"  # migration 11, below
ROLLUP_SERIES_LEVELS_TABLE = "rollup_series_levels"  # migration 11, below
# rollup tables whose rows carry (experiment, run_id, build_id); rollup_values carries build_id only
ROLLUP_TABLES = (
    ROLLUP_CELLS_TABLE,
    ROLLUP_HIST_TABLE,
    ROLLUP_SERIES_TABLE,
    ROLLUP_USERS_TABLE,
    ROLLUP_FAILURES_TABLE,
    ROLLUP_SERIES_LEVELS_TABLE,
)

CREATE_ROLLUP_BUILDS = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_BUILDS_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    spec String,
    rows UInt64,
    recorded_sum UInt64,
    built_at DateTime('UTC')
)
ENGINE = ReplacingMergeTree(build_id)
ORDER BY (experiment, run_id)
""".strip()

# One row per (variant, mode, config revision, prompt bucket, in-flight bucket, 10 s): counts,
# SLO hits, per-metric counts, send-time range, and the phase sums of misses. From migration 5
# (rollup format 3) n_itl_ms counts inter-token gaps, not requests, and n_itl_requests /
# n_itl_unrecorded count the successful requests with gaps / without gaps stored although they
# had two token chunks or more (recorded before the samples' itl_gaps_us existed).
CREATE_ROLLUP_CELLS = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_CELLS_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    variant String,
    mode String,
    rev Int64,
    pb UInt8,
    ib UInt8,
    tb UInt32,
    n UInt64,
    errors UInt64,
    hits UInt64,
    n_ttft_ms UInt64,
    n_ttfb_ms UInt64,
    n_itl_ms UInt64,
    n_tpot_ms UInt64,
    n_e2e_ms UInt64,
    first_ms Float64,
    last_ms Float64,
    phase_n UInt64,
    s_schedule_lag Float64,
    s_connect Float64,
    s_ttfb Float64,
    s_ttft_event Float64,
    s_ttft Float64
)
ENGINE = MergeTree
ORDER BY (experiment, run_id, build_id, variant)
""".strip()

# Per (variant, metric, key): how many successful requests fall in the key's bucket and the
# largest value there (for itl_ms, from migration 5 on: how many inter-token gaps, of every
# successful request; their exact values are in rollup_gaps, not rollup_values). The key is monotone in the value (0.1 ms for TTFT, as the rank test
# rounds it; relative 0.2% steps for the other metrics), so it locates any rank; the exact
# value then comes from the few samples of that one bucket.
CREATE_ROLLUP_HIST = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_HIST_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    variant String,
    metric String,
    k Int64,
    n UInt64,
    top Float64
)
ENGINE = MergeTree
ORDER BY (experiment, run_id, build_id, variant, metric, k)
""".strip()

# TTFT per (variant, 10 s, 1 ms key): the p99-over-time chart.
CREATE_ROLLUP_SERIES = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_SERIES_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    variant String,
    tb UInt32,
    k Int64,
    n UInt64,
    top Float64
)
ENGINE = MergeTree
ORDER BY (experiment, run_id, build_id, variant, tb, k)
""".strip()

# Distinct users per (config revision, variant) of one run, split mode (the SRM unit).
CREATE_ROLLUP_USERS = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_USERS_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    rev Int64,
    variant String,
    users UInt64
)
ENGINE = MergeTree
ORDER BY (experiment, run_id, build_id)
""".strip()

# Every successful value of every metric, sorted by (build, variant, metric, histogram key): the
# exact order statistics read only the few index granules of the buckets that hold the ranks,
# instead of scanning the run's samples. Five rows per sample, kept lean because the build
# writes them all: the build_id alone names the run (rollup_builds maps it), LowCardinality
# names, and the two columns that change (k, v).
CREATE_ROLLUP_VALUES = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_VALUES_TABLE} (
    build_id UInt64,
    variant LowCardinality(String),
    metric LowCardinality(String),
    k Int64,
    v Float64
)
ENGINE = MergeTree
ORDER BY (build_id, variant, metric, k)
""".strip()

# The run catalog: one row per status change of a replay run (who writes it: the replay, through
# SampleStore.record_run; who reads it: the SLA report, which by default reads only runs whose
# latest status is 'done', plus runs without any catalog row, e.g. data loaded by tools).
# - ReplacingMergeTree(version) ORDER BY (experiment, run_id): the row with the largest version is
#   a run's current status; SampleStore.runs reads it with argMax (no FINAL needed, and exact even
#   before a merge). record_run ranks terminal statuses above 'running', so a delayed retry of the
#   'running' row never reopens a finished run.
# - LowCardinality(String) names and UInt64 times work on 18.16 and chDB alike.
RUNS_TABLE = "runs"
RUN_STATUSES = ("running", "done", "cancelled", "failed")

CREATE_RUNS = f"""
CREATE TABLE IF NOT EXISTS {RUNS_TABLE} (
    run_id UInt64,
    experiment LowCardinality(String),
    mode LowCardinality(String),
    source LowCardinality(String),
    status LowCardinality(String),
    started_ms UInt64,
    finished_ms UInt64,
    version UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (experiment, run_id)
""".strip()

# ---- server metrics: the variants' own vllm:* series, scraped during a replay ---------------
# Who writes it: the replay's scraper (workers/server_metrics.py, through
# SampleStore.insert_server_metrics), one scrape of one variant's /metrics every
# ABPLAT_SERVER_METRICS_INTERVAL_S; who reads it: the SLA report (analysis/server_metrics.py).
# - One row per sample of a scrape, as the server reported it: cumulative counters and histogram
#   buckets, gauges' current values. Increments are taken at read time, between consecutive
#   scrapes of a (run, variant, series) in time order (a value that drops is a server restart,
#   counted from 0 as Prometheus does), so scrapes of one variant taken by successive shard
#   tasks join without a gap and none is counted twice.
# - metric: the family (vllm:request_queue_time_seconds); sample: the sample's own name
#   (..._bucket, ..._sum, ..._count, ..._total, or the family's name for a gauge); labels: the
#   sample's labels except le, as sorted JSON; le: the bucket's upper bound as the server wrote
#   it ("+Inf"), "" for other samples. Strings, not Float64: +Inf does not survive chDB's JSON.
# - Scrape bookkeeping under metric 'abplat:scrape': sample 'abplat:scrape_up' (1 answered and
#   parsed, 0 failed; a failure's reason in labels as {"error": ...}) and
#   'abplat:scrape_duration_seconds'.
# - ReplacingMergeTree(recorded_ms), ORDER BY the whole identity of a value (a retried insert of
#   a scrape writes the same key): readers GROUP BY that key (analysis/server_metrics.py), so
#   duplicates never count twice, before or after a merge, without FINAL.
SERVER_METRICS_TABLE = "server_metrics"
CREATE_SERVER_METRICS = f"""
CREATE TABLE IF NOT EXISTS {SERVER_METRICS_TABLE} (
    experiment LowCardinality(String),
    variant LowCardinality(String),
    run_id UInt64,
    metric LowCardinality(String),
    sample LowCardinality(String),
    labels String,
    le String,
    scraped_ms UInt64,
    value Float64,
    recorded_ms UInt64
)
ENGINE = ReplacingMergeTree(recorded_ms)
PARTITION BY toYYYYMM(toDateTime(intDiv(scraped_ms, 1000)))
ORDER BY (experiment, variant, run_id, metric, sample, labels, le, scraped_ms)
""".strip()

# ---- inter-token gaps: the ITL distribution over every gap ------------------------------
# Who writes: the replay and the gateway (samples.rows.row_from, every StreamResult.itl_gaps_us)
# and the rollup build (analysis.rollup); who reads: the SLA report's itl_ms (analysis.readers).
# - samples.itl_gaps_us Array(UInt32): every gap of a request in microseconds; rows recorded
#   before read as [] (no gaps), which the report counts.
# - rollup_gaps: per (build, variant, histogram key) every distinct gap value with its count,
#   so the exact order statistics of the pooled gaps come from the rollup as they do from the
#   samples (a run's gaps take a few distinct microsecond values per 0.2% bucket, so this is far
#   smaller than a row per gap would be). Carries build_id only, like rollup_values.
ADD_ITL_GAPS = f"ALTER TABLE {SAMPLES_TABLE} ADD COLUMN itl_gaps_us Array(UInt32) AFTER itl_max_ms"
ADD_ROLLUP_ITL_REQUESTS = f"ALTER TABLE {ROLLUP_CELLS_TABLE} ADD COLUMN n_itl_requests UInt64 AFTER n_e2e_ms"
ADD_ROLLUP_ITL_UNRECORDED = (
    f"ALTER TABLE {ROLLUP_CELLS_TABLE} ADD COLUMN n_itl_unrecorded UInt64 AFTER n_itl_requests"
)
ROLLUP_GAPS_TABLE = "rollup_gaps"
CREATE_ROLLUP_GAPS = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_GAPS_TABLE} (
    build_id UInt64,
    variant LowCardinality(String),
    k Int64,
    v UInt32,
    n UInt64
)
ENGINE = MergeTree
ORDER BY (build_id, variant, k, v)
""".strip()

# ---- per-unit moments: statistics at the unit of randomization ----------------------------
# Who writes: the rollup build (analysis.rollup); who reads: the SLA report's clustered and
# adjusted numbers (analysis.units, analysis.readers).
# - rollup_moments: per (build, variant, unit) the moments analysis.units.moments_select returns:
#   unit 'user' (a request without a user is its own unit) or 'request'; counts and sums are
#   flat arrays in analysis.units.layout() order (its component names are the rollup format:
#   a change is a new definitions.FORMAT_VERSION). A few rows per run, whatever the number of
#   users. Carries build_id only, like rollup_values.
ROLLUP_MOMENTS_TABLE = "rollup_moments"
CREATE_ROLLUP_MOMENTS = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_MOMENTS_TABLE} (
    build_id UInt64,
    unit String,
    variant String,
    counts Array(UInt64),
    sums Array(Float64)
)
ENGINE = MergeTree
ORDER BY (build_id, unit, variant)
""".strip()
# rollup tables whose rows carry build_id only (the build names the run: rollup_builds)
ROLLUP_BUILD_TABLES = (ROLLUP_VALUES_TABLE, ROLLUP_GAPS_TABLE, ROLLUP_MOMENTS_TABLE)

# ---- the gateway's own time: a column of its own ------------------------------------------
# Who writes: the live gateway (gateway.recording, through samples.rows.row_from); who reads: the
# SLA report's TTFT phases of missed requests ("gateway", analysis.definitions.PHASE_COLUMNS),
# raw and rolled up.
# - samples.gateway_ms Float64: a live sample's time in the gateway, from the client's request
#   received to the upstream request written; 0 in a replay's samples (whose schedule_lag_ms is
#   theirs alone), and in every row recorded before the column. Live rows recorded before it
#   held the gateway's time in schedule_lag_ms: the report reads a live row's schedule_lag_ms
#   as the gateway's too, so those rows stay as they are (moving the value would take a
#   mutation rewriting every part, on every server of a cluster; a spool file of that time
#   would still bring such rows in after it).
# - rollup_cells.s_gateway: that phase's sum over the missed requests of a cell (rollup format
#   6; builds of format 5 lack it and are not used).
ADD_GATEWAY_MS = f"ALTER TABLE {SAMPLES_TABLE} ADD COLUMN gateway_ms Float64 AFTER schedule_lag_ms"
ADD_ROLLUP_GATEWAY = f"ALTER TABLE {ROLLUP_CELLS_TABLE} ADD COLUMN s_gateway Float64 AFTER s_schedule_lag"

# ---- answer fingerprints: fidelity beside latency -----------------------------------------
# Who writes: a mirror replay (streaming.timing with fingerprint on, through samples.rows.row_from);
# who reads: the SLA report's fidelity (analysis.readers.raw fidelity_pairs), which pairs each
# variant's answer with the control's for the same request (fidelity/fingerprints.py).
# - samples.output_fp UInt64: the whole answer's fingerprint; 0 where none was taken (split and
#   live samples, failed requests, rows recorded before the column).
# - samples.token_fps Array(UInt32): one fingerprint per token chunk, for the position of the
#   first divergence; [] where output_fp is 0. About 4 bytes a token: random bits do not compress.
ADD_OUTPUT_FP = f"ALTER TABLE {SAMPLES_TABLE} ADD COLUMN output_fp UInt64 AFTER server_first_content_ns"
ADD_TOKEN_FPS = f"ALTER TABLE {SAMPLES_TABLE} ADD COLUMN token_fps Array(UInt32) AFTER output_fp"

# ---- answer texts: where the experiment's document allows them ---------------------------
# Who writes: a mirror replay of an experiment with fidelity.store_answers on (streaming.timing's
# keep_text, through samples.rows.row_from); who reads: the SLA report's fidelity examples
# (analysis.answer_fidelity examples_select), a few diverged pairs' texts around where they part.
# - samples.answer_text String: the successful answer's text, at most 16 KiB of UTF-8 cut at a
#   character (streaming.result.capped_answer); "" where none is kept (the switch off, split and
#   live samples, failed requests, rows recorded before the column).
ADD_ANSWER_TEXT = f"ALTER TABLE {SAMPLES_TABLE} ADD COLUMN answer_text String AFTER token_fps"

# ---- teacher-forced scores: the KL beside identical and where answers part ----------------
# Who writes: the scoring pass after a mirror run (a share of its requests, the document's
# fidelity.score_share): the control's greedy answer is scored under the control and under each
# variant with vLLM's prompt_logprobs (top_k per position), fidelity.scoring.score compares them.
# Who reads: the report's variants[].fidelity.kl (mean KL with a user-clustered interval).
# - One row per (run, request, variant); the control's own row is the scoring's noise floor (its
#   answer scored under itself: 0 on a deterministic server). kl_sum over `positions` scored
#   positions (mean = kl_sum / positions), kl_max the largest, top1_agree the positions whose
#   most likely token is the same under both. outcome "ok" or why no score (error names it).
# - ReplacingMergeTree(scored_ms) on the request's key: a pass run again replaces its rows.
FIDELITY_SCORES_TABLE = "fidelity_scores"
CREATE_FIDELITY_SCORES = f"""
CREATE TABLE IF NOT EXISTS {FIDELITY_SCORES_TABLE} (
    experiment LowCardinality(String),
    variant LowCardinality(String),
    run_id UInt64,
    seq UInt32,
    user_id String,
    control LowCardinality(String),
    top_k UInt8,
    outcome LowCardinality(String),
    error String,
    positions UInt32,
    kl_sum Float64,
    kl_max Float64,
    top1_agree UInt32,
    scored_ms UInt64
)
ENGINE = ReplacingMergeTree(scored_ms)
ORDER BY (experiment, variant, run_id, seq)
""".strip()

# ---- live shadows: a share of live answers compared with the control's -------------------
# Who writes: the gateway, for a share of the live requests a non-control variant serves (the
# document's fidelity.shadow_share), after the user's answer is complete and off the user's path:
# the request is sent again greedily (temperature 0) to the control and, when the live request
# was not greedy itself, to the variant too; the two answers' fingerprints are compared there.
# Who reads: the rollout guardrail identical_answers (per user, under the step's config_revision)
# and the report's live fidelity.
# - One row per shadowed live request (request_id is the live sample's). compared: "live" (the
#   live answer was greedy and is compared as served) or "greedy_pair" (both re-sent greedily).
#   outcome "ok" or what failed (control_error, variant_error, ...); identical and
#   first_divergence (-1: none) only mean something where outcome is "ok".
FIDELITY_SHADOWS_TABLE = "fidelity_shadows"
CREATE_FIDELITY_SHADOWS = f"""
CREATE TABLE IF NOT EXISTS {FIDELITY_SHADOWS_TABLE} (
    experiment LowCardinality(String),
    variant LowCardinality(String),
    control LowCardinality(String),
    request_id String,
    user_id String,
    config_revision Int64,
    sent_at DateTime('UTC'),
    compared LowCardinality(String),
    outcome LowCardinality(String),
    error String,
    identical UInt8,
    first_divergence Int32,
    unit LowCardinality(String),
    variant_tokens UInt32,
    control_tokens UInt32,
    variant_fp UInt64,
    control_fp UInt64,
    recorded_ms UInt64
)
ENGINE = ReplacingMergeTree(recorded_ms)
PARTITION BY toYYYYMM(sent_at)
ORDER BY (experiment, variant, request_id)
""".strip()

# ---- what a report still read from the samples: failures and a long run's chart ----------
# Who writes: the rollup build (analysis.rollup); who reads: analysis.readers.rollup.
# - rollup_failures: per (variant, kind) the requests that failed, counted by class: kind
#   'failure' by outcome (the requests other than 'ok' that are judged), kind 'setup' by HTTP
#   status (definitions.SETUP_ERROR); one HTTP status and one error message per class as
#   RawReader.failures / setup_errors give them. A handful of rows per run; without it every
#   report scanned the run's outcome column for the few failed rows.
# - rollup_series_levels: rollup_series (TTFT per 10 s and 1 ms key) summed again per coarser
#   time bucket g, every definitions.TIME_BUCKETS_S level above 10 s, each from the one below:
#   the p99 chart of a run of days reads its own level (a few hundred thousand rows) instead of
#   re-grouping the 10 s rows (a row per 10 s and ms key: 20M for three days).
CREATE_ROLLUP_FAILURES = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_FAILURES_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    variant String,
    kind String,
    outcome String,
    http_status UInt16,
    n UInt64,
    example String
)
ENGINE = MergeTree
ORDER BY (experiment, run_id, build_id, variant, kind)
""".strip()
CREATE_ROLLUP_SERIES_LEVELS = f"""
CREATE TABLE IF NOT EXISTS {ROLLUP_SERIES_LEVELS_TABLE} (
    experiment String,
    run_id UInt64,
    build_id UInt64,
    g UInt32,
    variant String,
    tb UInt32,
    k Int64,
    n UInt64,
    top Float64
)
ENGINE = MergeTree
ORDER BY (experiment, run_id, build_id, g, variant, tb, k)
""".strip()

# ---- a rollout step's kept per-user sums ------------------------------------------------------
# Who writes and reads: rollouts.kept (its docstring says how a look uses them).
# - rollout_user_sums: per unit of a step (experiment, config revision, spec) one row per fold
#   that saw it: the sums of its requests' vector (analysis.units.vector_sums of the blocks its
#   guardrails read, rollouts.kept.BLOCKS, in that order), its setup errors, rows and their sum
#   of recorded_ms, whether the router assigned it. Plain MergeTree, appended to: a unit's sums
#   are the sum of its rows up to the state's fold; rows of a later fold (one that stopped before
#   writing its state) are never merged away, and its mark in rollout_folds tells of them.
#   ORDER BY puts one step's generation together, by unit.
# - rollout_folds: per fold a mark of its start (state '') then the step's state at its
#   watermark as JSON (rollouts.kept.State): a handful of rows per step, the newest read.
# - rollout_sums_index_<experiment hash>_<generation hash>: not a migration's table. A step's
#   generation of user sums (their unit, fold, vector and assigned flag) again, in a Join-engine
#   table the server holds in memory (and on disk, to load at a restart), so that a look finds the
#   kept sums of the units its new samples touch by key instead of scanning every kept row.
#   rollouts.kept creates, fills, checks and drops them; rollout_user_sums stays the record they
#   are built from.
ROLLOUT_USER_SUMS_TABLE = "rollout_user_sums"
ROLLOUT_FOLDS_TABLE = "rollout_folds"
ROLLOUT_SUMS_INDEX_PREFIX = "rollout_sums_index_"
CREATE_ROLLOUT_USER_SUMS = f"""
CREATE TABLE IF NOT EXISTS {ROLLOUT_USER_SUMS_TABLE} (
    experiment String,
    config_revision Int64,
    spec String,
    generation UInt64,
    fold UInt32,
    variant String,
    cluster UInt64,
    assigned UInt8,
    anon UInt8,
    setup UInt64,
    rows UInt64,
    recorded_sum UInt64,
    v Array(Float64)
)
ENGINE = MergeTree
ORDER BY (experiment, config_revision, spec, generation, cluster)
""".strip()
CREATE_ROLLOUT_FOLDS = f"""
CREATE TABLE IF NOT EXISTS {ROLLOUT_FOLDS_TABLE} (
    experiment String,
    config_revision Int64,
    spec String,
    generation UInt64,
    fold UInt32,
    upto_ms UInt64,
    state String
)
ENGINE = MergeTree
ORDER BY (experiment, config_revision, spec, generation, fold)
""".strip()

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "create samples", (CREATE_SAMPLES_TABLE,)),
    Migration(
        2,
        "per-run report rollups",
        (
            CREATE_ROLLUP_BUILDS,
            CREATE_ROLLUP_CELLS,
            CREATE_ROLLUP_HIST,
            CREATE_ROLLUP_SERIES,
            CREATE_ROLLUP_USERS,
            CREATE_ROLLUP_VALUES,
        ),
    ),
    Migration(3, "run catalog", (CREATE_RUNS,)),
    Migration(4, "variants' server metrics", (CREATE_SERVER_METRICS,)),
    Migration(
        5,
        "inter-token gaps",
        (ADD_ITL_GAPS, ADD_ROLLUP_ITL_REQUESTS, ADD_ROLLUP_ITL_UNRECORDED, CREATE_ROLLUP_GAPS),
    ),
    Migration(6, "per-unit moments", (CREATE_ROLLUP_MOMENTS,)),
    Migration(7, "gateway time", (ADD_GATEWAY_MS, ADD_ROLLUP_GATEWAY)),
    Migration(8, "answer fingerprints", (ADD_OUTPUT_FP, ADD_TOKEN_FPS)),
    Migration(9, "answer texts", (ADD_ANSWER_TEXT,)),
    Migration(10, "answer scores and live shadows", (CREATE_FIDELITY_SCORES, CREATE_FIDELITY_SHADOWS)),
    Migration(11, "rollup failures and chart levels", (CREATE_ROLLUP_FAILURES, CREATE_ROLLUP_SERIES_LEVELS)),
    Migration(12, "rollout kept sums", (CREATE_ROLLOUT_USER_SUMS, CREATE_ROLLOUT_FOLDS)),
)


_CREATE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+) \((.*?)\n\)", re.S)
_ADD_COLUMN = re.compile(r"^ALTER TABLE (\w+) ADD COLUMN (\w+) (.+?)(?: AFTER (\w+))?$", re.S)


@dataclasses.dataclass(frozen=True, slots=True)
class AddedColumn:
    table: str
    name: str
    ch_type: str
    after: str | None


def added_column(statement: str) -> AddedColumn | None:
    """What an ``ALTER TABLE t ADD COLUMN c T [AFTER x]`` statement adds (None for any other
    statement): the migrator runs it only when t lacks c, and verifies c once it is recorded."""
    m = _ADD_COLUMN.match(statement.strip())
    return None if m is None else AddedColumn(m.group(1), m.group(2), m.group(3).strip(), m.group(4))


def added_columns(migration: Migration) -> dict[str, list[tuple[str, str]]]:
    """{table: [(column, ClickHouse type), ...]} the migration's ADD COLUMN statements add."""
    out: dict[str, list[tuple[str, str]]] = {}
    for stmt in migration.statements:
        add = added_column(stmt)
        if add is not None:
            out.setdefault(add.table, []).append((add.name, add.ch_type))
    return out


def table_columns(table: str, migrations: tuple[Migration, ...] | None = None) -> list[tuple[str, str]]:
    """A table's (column, type) list, in order, after every migration (CREATE, then each ADD
    COLUMN at its AFTER position or the end): what samples.columns.COLUMNS must equal."""
    cols: list[tuple[str, str]] = []
    for m in MIGRATIONS if migrations is None else migrations:
        cols = declared_tables(m).get(table, cols)
        for stmt in m.statements:
            add = added_column(stmt)
            if add is None or add.table != table:
                continue
            at = len(cols) if add.after is None else [n for n, _t in cols].index(add.after) + 1
            cols.insert(at, (add.name, add.ch_type))
    return cols


def declared_tables(migration: Migration) -> dict[str, list[tuple[str, str]]]:
    """{table: [(column, ClickHouse type), ...]} of the tables a migration's CREATE TABLE
    statements declare, in order: what SampleStore.migrate() verifies exists once the migration
    is recorded. A statement of another shape (a future ALTER) declares nothing here."""
    out: dict[str, list[tuple[str, str]]] = {}
    for stmt in migration.statements:
        m = _CREATE.match(stmt)
        if m is None:
            continue
        cols = []
        for line in m.group(2).strip().splitlines():
            name, ch_type = line.strip().rstrip(",").split(" ", 1)
            cols.append((name, ch_type))
        out[m.group(1)] = cols
    return out


def check_sequence(migrations: tuple[Migration, ...] = MIGRATIONS) -> None:
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"schema migrations must be numbered 1..n without gaps, got {versions}")


check_sequence()
