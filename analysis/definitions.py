"""What the report measures, each defined once: filters, SLOs, metrics, phases, bucket edges.

Definitions shared by every reader and the report:
- a request meets the SLA when outcome = 'ok' and every SLO holds with a strict "<"
  (TTFT under sla_ttft_ms, and TPOT / end-to-end when the experiment sets them); a metric the
  request never produced is a miss;
- a setup error (SETUP_ERROR: a 4xx the variant answered because of how it is configured or
  called: an unknown model, auth, a bad request) is no measure of the serving change: it is counted
  apart per variant (the report's setup_errors) and left out of every other figure (n, errors,
  hits, attainment, percentiles, comparisons, segments, phases, attribution); 408 and 429 are
  load, not setup, and stay misses;
- latency percentiles are over successful requests (outcome = 'ok') that produced the metric:
  failures are counted once, as errors and misses, not as latencies;
- except ITL (``itl_ms``), which is over every inter-token gap of every successful request, as
  vLLM's benchmark_serving pools them (GAP_METRICS): one value per gap, so a long request weighs
  more than a short one; TPOT stays one value per request.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from typing import Any

from samples.columns import MODES
from samples.schema import RUN_STATUSES

__all__ = [
    "GAP_METRICS",
    "GAP_REQUESTS",
    "INFLIGHT_EDGES",
    "ITL_CI_NOTE",
    "MAX_TIME_BUCKETS",
    "METRICS",
    "METRIC_LABELS",
    "MODES",
    "MW_SCALE",
    "PHASES",
    "PHASE_COLUMNS",
    "PHASE_LABELS",
    "PHASE_ROWS",
    "PROMPT_TOKEN_EDGES",
    "TIME_BUCKETS_S",
    "SERIES_LEVELS_S",
    "Filters",
    "QueryError",
    "RUN_STATUSES",
    "SETUP_ERROR",
    "SETUP_LOAD_STATUSES",
    "Slo",
]


class QueryError(ValueError):
    """A bad filter or SLO; the message names the value."""


@dataclasses.dataclass(frozen=True)
class Filters:
    experiment: str
    run_id: int | None = None
    since: dt.datetime | None = None  # inclusive, on sent_at (UTC)
    until: dt.datetime | None = None  # exclusive
    variants: tuple[str, ...] = ()  # empty: all
    # Only these runs (the report's choice of runs from the run catalog, and the raw part beside
    # per-run rollups; not an analyst filter, so not in as_dict). None: no restriction; an
    # empty tuple: no run at all.
    runs: tuple[int, ...] | None = None
    # Analyst filters over the run catalog (analysis.runs): which run statuses to read (empty:
    # the default, completed runs and runs without a catalog row) and which mode (None: the mode
    # of the latest completed run).
    status: tuple[str, ...] = ()
    mode: str | None = None

    def __post_init__(self) -> None:
        if not self.experiment:
            raise QueryError("Filters.experiment must be a non-empty key")
        for run in self.runs or ():
            if isinstance(run, bool) or not isinstance(run, int) or run < 0:
                raise QueryError(f"Filters.runs must hold non-negative integers, got {run!r}")
        if self.run_id is not None and (
            isinstance(self.run_id, bool) or not isinstance(self.run_id, int) or self.run_id < 0
        ):
            raise QueryError(f"Filters.run_id must be a non-negative integer, got {self.run_id!r}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, dt.datetime) or value.tzinfo is None):
                raise QueryError(f"Filters.{name} must be a timezone-aware datetime, got {value!r}")
            try:
                value and value.astimezone(dt.UTC)  # readers compare UTC instants
            except OverflowError:  # 9999-12-31T23:59-23:59 is in year 10000 in UTC
                raise QueryError(f"{name}={value.isoformat()} is outside the calendar in UTC") from None
        bad = [x for x in self.status if x not in RUN_STATUSES]
        if bad or len(set(self.status)) != len(self.status):
            raise QueryError(f"status={list(self.status)}: each one of {', '.join(RUN_STATUSES)}, once")
        if self.mode is not None and self.mode not in MODES:
            raise QueryError(f"mode={self.mode!r} must be one of {', '.join(MODES)}")
        if self.since and self.until and self.since >= self.until:
            raise QueryError(f"Filters: since ({self.since}) must be before until ({self.until})")

    def as_dict(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "run_id": self.run_id,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "variants": list(self.variants),
            "status": list(self.status),
            "mode": self.mode,
        }


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is None and name != "ttft_ms":
                continue
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise QueryError(f"Slo.{name} must be a positive number of ms, got {value!r}")

    def limits(self) -> dict[str, float]:
        return {
            k: float(v)
            for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2e_ms", self.e2e_ms))
            if v is not None
        }


def slo_of(experiment: Any) -> Slo:
    """The SLOs of an experiment (anything with sla_ttft_ms, sla_tpot_ms, sla_e2e_ms)."""
    return Slo(experiment.sla_ttft_ms, experiment.sla_tpot_ms, experiment.sla_e2e_ms)


# ---------------------------------------------------------------------------------------------
# Metrics

# metric key in the report -> samples column
METRICS: dict[str, str] = {
    "ttft_ms": "ttft_ms",
    "ttfb_ms": "ttfb_ms",
    "itl_ms": "itl_gaps_us",  # every inter-token gap (GAP_METRICS); report schema 1 had the per-request mean
    "tpot_ms": "tpot_ms",
    "e2e_ms": "e2e_ms",
}
# Metrics whose values are the elements of an array column of microseconds, pooled over the
# successful requests: one value per inter-token gap. Their counts (metric_n) count gaps; their
# order statistics are located through a histogram of the gaps at the same 0.2% resolution as
# the other metrics' (sql.HIST_KEYS), raw or rolled up, so both give the same exact values.
GAP_METRICS: dict[str, str] = {"itl_ms": "itl_gaps_us"}
METRIC_LABELS = {
    "ttft_ms": "TTFT",
    "ttfb_ms": "TTFB",
    "itl_ms": "ITL (all gaps)",
    "itl_mean_ms": "ITL (per-request mean)",  # the samples column, not a report metric
    "tpot_ms": "TPOT",
    "e2e_ms": "End-to-end",
}
# Successful requests counted beside the pooled gaps (summary "itl_requests", "itl_unrecorded"):
# those with gaps, and those without gaps stored although they had two token chunks or more
# (a per-request ITL exists): rows recorded before samples had itl_gaps_us. A request of one
# token has no gap and is in neither.
GAP_REQUESTS: dict[str, str] = {
    "itl_requests": "outcome = 'ok' AND notEmpty(itl_gaps_us)",
    "itl_unrecorded": "outcome = 'ok' AND empty(itl_gaps_us) AND isNotNull(itl_mean_ms)",
}
# On every itl_ms estimate and the report's "itl" key: what the interval assumes.
ITL_CI_NOTE = (
    "over every inter-token gap of every successful request; the CI treats the gaps as independent "
    "draws, which they are not within one request (a slow request's gaps are slow together), so it is "
    "narrower than the real uncertainty"
)
# TTFT (and mirror differences) rounded to 0.1 ms for the rank tests' counts, half up, as
# floor(x * 10 + 0.5) / 10: the same IEEE arithmetic everywhere, unlike round(), whose ties
# differ between 18.16, chDB and numpy.
MW_SCALE = 10

# ---------------------------------------------------------------------------------------------
# Setup errors: what a request measured about how the variant is configured or called, not how
# it serves

# A 4xx is the variant refusing the request as asked: a model it does not serve (404 "The model
# 'x' does not exist"), auth (401, 403), a malformed or invalid body (400, 422), and so on. Two
# 4xx statuses are load instead, and stay SLA misses: 408 (the server timed the request out) and
# 429 (too many requests). streaming.result.Outcome.HTTP_4XX carries the status beside it.
SETUP_LOAD_STATUSES: tuple[int, ...] = (408, 429)
SETUP_ERROR = (
    f"(outcome = 'http_4xx' AND http_status NOT IN ({', '.join(str(s) for s in SETUP_LOAD_STATUSES)}))"
)
# What to check for a setup error's status, in the report's banner.
SETUP_CHECKS: dict[int, str] = {
    400: "the request body the variant gets (fields, max_tokens against its context length)",
    401: "the credentials the gateway sends to the variant",
    403: "the credentials the gateway sends to the variant and what they may do",
    404: "the model name and path: does the variant serve the model the clients ask for?",
    422: "the request body the variant gets (fields the variant's server refuses)",
}
SETUP_CHECK_DEFAULT = "how the variant is configured and called (model, auth, request body)"

# ---------------------------------------------------------------------------------------------
# Phases of the TTFT of missed requests

# Before the request is written: a replay's lateness against its plan (schedule_lag) or a live
# request's time in the gateway (gateway); each is 0 in the other's samples (samples.rows). Then
# the StreamResult's own timeline.
PHASES: tuple[str, ...] = (
    "schedule_lag",
    "gateway",
    "connect",
    "headers",
    "headers_to_first_event",
    "first_event_to_first_content",
)
PHASE_LABELS: dict[str, str] = {
    "schedule_lag": "schedule lag",
    "gateway": "gateway",
    "connect": "connect",
    "headers": "time to headers",
    "headers_to_first_event": "headers to first event",
    "first_event_to_first_content": "first event to first content",
}
# The timestamps the phases are differences of (SQL over the samples table); the readers sum
# them and analysis.phases.phases_from_sums differences the sums. A live row's schedule_lag_ms
# is 0, except in rows recorded before samples had gateway_ms (store migration 7), which held
# the gateway's time there: it is read as the gateway's, so every live row splits the same.
PHASE_COLUMNS = {
    "schedule_lag": "if(mode = 'live', 0., schedule_lag_ms)",
    "gateway": "gateway_ms + if(mode = 'live', schedule_lag_ms, 0.)",
    "connect": "ifNull(connect_ms, 0)",
    "ttfb": "assumeNotNull(ttfb_ms)",
    "ttft_event": "assumeNotNull(ttft_event_ms)",
    "ttft": "assumeNotNull(ttft_ms)",
}
# Misses with a complete TTFT timeline (a failed request without TTFT has no phases to split).
PHASE_ROWS = "isNotNull(ttft_ms) AND isNotNull(ttfb_ms) AND isNotNull(ttft_event_ms)"

# ---------------------------------------------------------------------------------------------
# Segments

# Interior cut points; bucket i holds edges[i-1] <= x < edges[i] (open at both ends).
PROMPT_TOKEN_EDGES: tuple[float, ...] = (128, 512, 2048, 8192)
INFLIGHT_EDGES: tuple[float, ...] = (2, 4, 8, 16, 32, 64)
# Time buckets of the segments and the p99 chart: the smallest giving <= MAX_TIME_BUCKETS.
TIME_BUCKETS_S = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
MAX_TIME_BUCKETS = 120


# ---------------------------------------------------------------------------------------------
# The rollup tables' format (built by analysis.rollup, read by analysis.readers)

GRAIN_S = 10  # every report time bucket (definitions.TIME_BUCKETS_S) is a multiple of this
# The p99 chart's levels a rollup keeps above its 10 s grain: every report time bucket, each a
# multiple of the one before, so a chart of bucket b reads the largest level dividing b.
SERIES_LEVELS_S = tuple(b for b in TIME_BUCKETS_S if b > 10)
SERIES_KEY = "toInt64(floor(assumeNotNull(ttft_ms)))"  # 1 ms buckets for the p99 chart
GRAIN_SQL = f"toUInt32(intDiv(toUInt32(sent_at), {GRAIN_S}) * {GRAIN_S})"  # the 10 s cell of a sample

# Bump when what a build computes changes (a histogram key, a bucket edge, a column): builds of
# another version are then not used, and the report reads the raw samples until rebuilt.
FORMAT_VERSION = 8  # 2: distinct users on a 64-bit hash (sql.DISTINCT_USERS); 3: itl_ms over every gap;
# 4: distinct users of live traffic's assigned requests too (sql.SRM_SAMPLES); 5: per-unit moments
# (rollup_moments, analysis.units); 6: the gateway phase (rollup_cells.s_gateway, PHASE_COLUMNS);
# 7: setup errors (SETUP_ERROR) left out of every table but the SRM users; 8: the failed requests
# by class (rollup_failures) and the p99 chart's coarser levels (rollup_series_levels)


def build_spec(slo: Slo) -> str:
    """What a build depends on: the rollup format and the SLO (hits and miss phases)."""
    limits = ";".join(f"{name}<{limit!r}" for name, limit in sorted(slo.limits().items()))
    return f"v{FORMAT_VERSION}|{limits}"
