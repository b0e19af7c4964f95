"""The variants' own metrics: vLLM's ``vllm:*`` series, scraped from each variant's /metrics during
a replay (workers/server_metrics.py), stored in samples.schema.SERVER_METRICS_TABLE, read here.

Pure (no driver, no network): parsing one exposition into rows to store, and reading the stored
rows back as what the report shows (docs/report-json.md, "Server metrics"):

1. ``parse_exposition``: the text of one scrape (prometheus_client's parser) -> the samples of
   the families abplat reads (KEPT), each (metric, sample, labels as sorted JSON, le, value).
2. ``read``: the stored scrapes of the report's runs -> per variant, the increase of every
   counter and histogram bucket between consecutive scrapes (in time order per run and series;
   a value that drops is a server restart, counted from 0 as Prometheus' increase() does),
   added up over the runs and the engines, plus the gauges' scraped values.
3. ``histogram_summary``: from a histogram's increases, the mean (exact: sum / count) and
   quantiles by linear interpolation inside the bucket that holds the rank (as Prometheus'
   histogram_quantile), with that bucket's bounds: vLLM's request-phase buckets start at 0.3 s,
   so a p50 of "0.1 s" only says "in [0, 0.3 s)", and the report says so.
4. ``server_split``: the miss phase breakdown's "headers to first event" split into the server's
   queue and prefill time. The server reports aggregates per scrape interval, not per request:
   each missed request is given the mean queue and prefill time of the requests the server
   finished in its time bucket (weighted by the misses there). An interval estimate, labelled
   so (basis "interval_aggregates").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from analysis.definitions import Filters
from analysis.sql import run_conditions
from samples import schema

# Scrape bookkeeping rows (schema's comment): whether a scrape answered, and how long it took.
SCRAPE_METRIC = "abplat:scrape"
SCRAPE_UP = "abplat:scrape_up"
SCRAPE_DURATION = "abplat:scrape_duration_seconds"

# family -> report key. vLLM 0.32's names (vllm/v1/metrics/loggers.py); the simulator serves them.
HISTOGRAMS: dict[str, str] = {
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:request_decode_time_seconds": "decode",
    "vllm:request_inference_time_seconds": "inference",
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:e2e_request_latency_seconds": "e2e",
}
# The KV-cache gauge is vllm:kv_cache_usage_perc in the vLLM we install; older servers (before
# 0.10) call it vllm:gpu_cache_usage_perc: either is read as kv_cache_usage.
GAUGES: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
}
COUNTERS: dict[str, str] = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:request_success": "requests_finished",
}
KEPT = frozenset(HISTOGRAMS) | frozenset(GAUGES) | frozenset(COUNTERS)
# Gauges summed over a deployment's engines at each scrape (requests); the others averaged (a share).
SUMMED_GAUGES = ("running", "waiting")
QUANTILES = (0.5, 0.99)
SPLIT_BASIS = "interval_aggregates"
SPLIT_NOTE = (
    "Server queue and prefill come from the variant's own histograms, per scrape interval, not per "
    "request: each missed request is given the mean queue and prefill time of the requests the "
    "server finished in its time bucket and the next one (weighted by the misses there): the "
    "server observes a request when it finishes, and a scrape after that."
)


class ExpositionError(ValueError):
    """A /metrics answer that is not Prometheus text exposition (the parser said why)."""


def labels_json(labels: Mapping[str, str]) -> str:
    """A series' labels, ``le`` excepted, as sorted compact JSON: one string per series."""
    return json.dumps({k: labels[k] for k in sorted(labels) if k != "le"}, separators=(",", ":"))


def parse_exposition(text: str) -> list[tuple[str, str, str, str, float]]:
    """(metric, sample, labels, le, value) of every sample of the KEPT families, in the order
    served. ``_created`` samples (when a series was made) and non-finite values (a gauge's NaN)
    are left out. ExpositionError when the text does not parse."""
    out: list[tuple[str, str, str, str, float]] = []
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in KEPT:
                continue
            for s in family.samples:
                if s.name.endswith("_created") or not math.isfinite(s.value):
                    continue
                le = s.labels.get("le", "") if s.name.endswith("_bucket") else ""
                out.append((family.name, s.name, labels_json(s.labels), le, float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's errors on a bad line
        raise ExpositionError(f"not Prometheus text exposition: {exc}") from None
    return out


def scrape_rows(
    experiment: str,
    variant: str,
    run_id: int,
    scraped_ms: int,
    samples: Iterable[tuple[str, str, str, str, float]],
    *,
    duration_s: float,
    error: str = "",
) -> list[dict[str, Any]]:
    """The rows one scrape stores (SampleStore.insert_server_metrics): its samples (none when it
    failed), then its bookkeeping: up (1, or 0 with the error in labels) and its duration."""
    base = {"experiment": experiment, "variant": variant, "run_id": run_id, "scraped_ms": scraped_ms}
    rows = [
        {**base, "metric": m, "sample": s, "labels": lab, "le": le, "value": v}
        for m, s, lab, le, v in samples
    ]
    up_labels = labels_json({"error": error[:500]}) if error else "{}"
    rows.append(
        {
            **base,
            "metric": SCRAPE_METRIC,
            "sample": SCRAPE_UP,
            "labels": up_labels,
            "le": "",
            "value": 0.0 if error else 1.0,
        }
    )
    rows.append(
        {
            **base,
            "metric": SCRAPE_METRIC,
            "sample": SCRAPE_DURATION,
            "labels": "{}",
            "le": "",
            "value": max(0.0, float(duration_s)),
        }
    )
    return rows


# ---------------------------------------------------------------------------------------------
# Reading


def _where(f: Filters, variants: Sequence[str]) -> tuple[str, dict[str, Any]]:
    conds = ["experiment = %(experiment)s"]
    params: dict[str, Any] = {"experiment": f.experiment}
    conds.extend(run_conditions(f, params))
    if f.since is not None:
        conds.append("scraped_ms >= %(since_ms)s")
        params["since_ms"] = int(f.since.timestamp() * 1000)
    if f.until is not None:
        conds.append("scraped_ms < %(until_ms)s")
        params["until_ms"] = int(f.until.timestamp() * 1000)
    if variants:
        conds.append("variant IN %(variants)s")
        params["variants"] = tuple(variants)
    return " AND ".join(conds), params


# The increase of a cumulative series between consecutive scrapes, in time order (ClickHouse
# 18.16 and chDB alike: no window functions, arrays instead): the values sorted by scrape time,
# differenced; a drop is a restart, whose increase is the new value itself (Prometheus'
# increase()). The first scrape is the baseline (difference 0).
_SORTED = "arraySort((x, t) -> t, groupArray(value), groupArray(scraped_ms))"
_STEPS = "arrayMap((d, x) -> if(d < 0, x, d), arrayDifference(xs), xs)"


def read(store: Any, f: Filters, variants: Sequence[str], bucket_s: int) -> dict[str, dict[str, Any]]:
    """{variant: aggregates} of the stored scrapes of the filters' runs (and window, on the
    scrape time). Aggregates: "scrapes" {ok, failed, last_error, first_ms, last_ms}; "hist"
    {key: {"buckets": {le: increase}, "sum", "count"}}; "counters" {key: increase};
    "gauges" {key: [value per scrape]}; "by_bucket" {tb: {key: [sum, count]}} for queue and
    prefill (tb: the bucket_s-wide time bucket of the scrape that saw the increase).

    Four aggregate queries; the increases are taken in ClickHouse, per (run, series), so only a
    few hundred rows per variant come back, whatever the run's length. Duplicate recordings of a
    scrape (a retried insert: the same key, the same value) need no dedup pass: in a series they
    sit next to each other in time order and add an increase of 0; scrapes are counted distinct
    by time, and gauges are read once per key."""
    if not isinstance(bucket_s, int) or bucket_s < 1:
        raise ValueError(f"bucket_s must be a positive integer, got {bucket_s!r}")
    where, params = _where(f, variants)
    table = schema.SERVER_METRICS_TABLE
    cumulative = tuple(sorted(set(HISTOGRAMS) | set(COUNTERS)))
    out: dict[str, dict[str, Any]] = {}

    def entry(variant: str) -> dict[str, Any]:
        return out.setdefault(
            str(variant),
            {
                "scrapes": {"ok": 0, "failed": 0, "last_error": None, "first_ms": None, "last_ms": None},
                "hist": {},
                "counters": {},
                "gauges": {},
                "by_bucket": {},
            },
        )

    # 1. Whether each scrape answered; the last failure's reason.
    rows = store.query(
        f"""SELECT variant, uniqExactIf(scraped_ms, value >= 1), uniqExactIf(scraped_ms, value < 1),
                   argMaxIf(labels, scraped_ms, value < 1), min(scraped_ms), max(scraped_ms)
            FROM {table} WHERE {where} AND sample = %(up)s GROUP BY variant""",
        {**params, "up": SCRAPE_UP},
    )
    for variant, ok, failed, labels, first, last in rows:
        error = json.loads(labels).get("error") if failed and str(labels).startswith("{") else None
        entry(variant)["scrapes"] = {
            "ok": int(ok),
            "failed": int(failed),
            "last_error": error,
            "first_ms": int(first),
            "last_ms": int(last),
        }
    # 2. Counters and histograms: each series' increase over the run, summed over runs and engines.
    rows = store.query(
        f"""SELECT variant, metric, sample, le, sum(inc) FROM (
                SELECT variant, metric, sample, le, {_SORTED} AS xs, arrayReduce('sum', {_STEPS}) AS inc
                FROM {table} WHERE {where} AND metric IN %(cumulative)s
                GROUP BY variant, run_id, metric, sample, labels, le)
            GROUP BY variant, metric, sample, le""",
        {**params, "cumulative": cumulative},
    )
    for variant, metric, sample, le, inc in rows:
        v, inc = entry(variant), float(inc)
        if metric in COUNTERS:
            key = COUNTERS[metric]
            v["counters"][key] = v["counters"].get(key, 0.0) + inc
            continue
        h = v["hist"].setdefault(HISTOGRAMS[metric], {"buckets": {}, "sum": 0.0, "count": 0.0})
        if sample.endswith("_bucket"):
            h["buckets"][le] = h["buckets"].get(le, 0.0) + inc
        elif sample.endswith("_sum"):
            h["sum"] += inc
        elif sample.endswith("_count"):
            h["count"] += inc
    # 3. Queue and prefill sums and counts per time bucket (of the scrape that saw each increase).
    phase_families = tuple(name for name, key in HISTOGRAMS.items() if key in ("queue", "prefill"))
    rows = store.query(
        f"""SELECT variant, metric, sample, intDiv(intDiv(t, 1000), {bucket_s}) * {bucket_s} AS tb, sum(d)
            FROM (
                SELECT variant, metric, sample, arraySort(groupArray(scraped_ms)) AS ts, {_SORTED} AS xs,
                       {_STEPS} AS ds
                FROM {table} WHERE {where} AND metric IN %(phases)s AND le = ''
                GROUP BY variant, run_id, metric, sample, labels, le)
            ARRAY JOIN ts AS t, ds AS d
            GROUP BY variant, metric, sample, tb""",
        {**params, "phases": phase_families},
    )
    for variant, metric, sample, tb, d in rows:
        part = 0 if sample.endswith("_sum") else 1 if sample.endswith("_count") else None
        if part is None:
            continue
        cell = entry(variant)["by_bucket"].setdefault(int(tb), {}).setdefault(HISTOGRAMS[metric], [0.0, 0.0])
        cell[part] += float(d)
    # 4. Gauges, one value per scrape over a deployment's engines: summed (requests) or averaged.
    rows = store.query(
        f"""SELECT variant, metric, scraped_ms, sum(v), count() FROM (
                SELECT variant, run_id, metric, labels, scraped_ms, any(value) AS v
                FROM {table} WHERE {where} AND metric IN %(gauges)s
                GROUP BY variant, run_id, metric, labels, scraped_ms)
            GROUP BY variant, metric, scraped_ms ORDER BY variant, metric, scraped_ms""",
        {**params, "gauges": tuple(sorted(GAUGES))},
    )
    for variant, metric, _t, total, n in rows:
        key = GAUGES[metric]
        value = float(total) if key in SUMMED_GAUGES else float(total) / int(n)
        entry(variant)["gauges"].setdefault(key, []).append(value)
    return out


# ---------------------------------------------------------------------------------------------
# Summaries


def _le(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


def histogram_summary(h: Mapping[str, Any], quantiles: Sequence[float] = QUANTILES) -> dict[str, Any]:
    """{n, mean_ms, quantiles: [{q, label, value_ms, bucket_ms: [lo, hi|null]}]} from a
    histogram's increases (seconds in, ms out). A quantile in the +Inf bucket is that bucket's
    lower edge (value_ms), with hi null: more than that, by how much the server does not say."""
    n = int(round(h.get("count", 0.0)))
    out: dict[str, Any] = {"n": n, "mean_ms": None, "quantiles": []}
    if n <= 0:
        return out
    out["mean_ms"] = h["sum"] / h["count"] * 1000.0
    edges = sorted((_le(le), c) for le, c in h["buckets"].items())
    for q in quantiles:
        rank = q * h["count"]
        lo, prev = 0.0, 0.0
        entry = {"q": q, "label": f"p{q * 100:g}", "value_ms": None, "bucket_ms": [None, None]}
        for upper, cum in edges:
            if cum >= rank and cum > prev:
                if math.isinf(upper):
                    entry.update(value_ms=lo * 1000.0, bucket_ms=[lo * 1000.0, None])
                else:
                    value = lo + (upper - lo) * (rank - prev) / (cum - prev)
                    entry.update(value_ms=value * 1000.0, bucket_ms=[lo * 1000.0, upper * 1000.0])
                break
            lo, prev = upper, cum
        out["quantiles"].append(entry)
    return out


def _gauge_summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "max": None}
    return {"n": len(values), "mean": sum(values) / len(values), "max": max(values)}


def variant_summary(agg: Mapping[str, Any] | None, client: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report's "server" entry of one variant (docs/report-json.md) from read()'s aggregates;
    ``client``: the variant's client-side TTFT percentiles, shown beside the server's."""
    agg = agg or {
        "scrapes": {"ok": 0, "failed": 0, "last_error": None, "first_ms": None, "last_ms": None},
        "hist": {},
        "counters": {},
        "gauges": {},
    }
    hist = agg["hist"]
    out: dict[str, Any] = {
        "scrapes": dict(agg["scrapes"]),
        "requests_finished": int(round(hist.get("queue", {}).get("count", 0.0))),
        "client_ttft_ms": dict(client or {}),
    }
    for key in ("queue", "prefill", "decode", "ttft", "e2e"):
        out[f"{key}_ms"] = histogram_summary(hist.get(key, {}))
    for key in ("running", "waiting", "kv_cache_usage"):
        out[key] = _gauge_summary(agg["gauges"].get(key, []))
    out["tokens"] = {k: agg["counters"].get(k) for k in ("prompt_tokens", "generation_tokens")}
    return out


def _pooled(*cells: Sequence[float] | None) -> tuple[float, float] | None:
    """[sum, count] increases of adjacent buckets added up (None when none has one)."""
    got = [c for c in cells if c]
    return (sum(c[0] for c in got), sum(c[1] for c in got)) if got else None


def server_split(
    phases: Mapping[str, Any],
    misses_by_bucket: Mapping[int, int],
    server_by_bucket: Mapping[int, Mapping[str, Any]],
    bucket_s: int,
) -> dict[str, Any]:
    """The miss phase breakdown of one variant (analysis.phases.phase_breakdown_from_sums, with
    mean_ms per phase) split into network, server queue and server prefill (module docstring, 4).

    ``misses_by_bucket``: {time bucket: missed requests sent in it}; ``server_by_bucket``: read()'s
    by_bucket. Phases: schedule lag (a replay's); gateway (a live request's time in the gateway
    before it was sent); network (connect + time to headers); server queue and server prefill
    (interval means); other (headers to first content minus queue and prefill: the first event's
    way back, detokenization, and the interval estimate's error; negative when the interval
    means exceed these requests' own time)."""
    base = {"basis": SPLIT_BASIS, "note": SPLIT_NOTE, "bucket_s": bucket_s}
    covered, queue, prefill = 0, 0.0, 0.0
    for tb, misses in misses_by_bucket.items():
        # The server counts a request when it finishes, at the scrape after that: the requests
        # sent in bucket tb show up in its increases over tb and the bucket after (pooled).
        here, after = server_by_bucket.get(tb, {}), server_by_bucket.get(tb + bucket_s, {})
        q, p = (
            _pooled(here.get("queue"), after.get("queue")),
            _pooled(here.get("prefill"), after.get("prefill")),
        )
        if misses <= 0 or not q or not p or q[1] <= 0 or p[1] <= 0:
            continue
        covered += misses
        queue += misses * q[0] / q[1]
        prefill += misses * p[0] / p[1]
    total = sum(m for m in misses_by_bucket.values() if m > 0)
    ph = phases.get("phases", {})
    mean = {k: (ph.get(k) or {}).get("mean_ms") for k in ph}
    if not covered or not ph or any(x is None for x in mean.values()):
        return {
            **base,
            "available": False,
            "misses": total,
            "covered_misses": covered,
            "phases": {},
            "why": "no server metrics in the time buckets of the missed requests"
            if ph
            else "no missed request with a complete TTFT timeline",
        }
    queue_ms, prefill_ms = queue / covered * 1000.0, prefill / covered * 1000.0
    to_content = mean["headers_to_first_event"] + mean["first_event_to_first_content"]
    parts = {
        "schedule_lag": ("schedule lag", mean["schedule_lag"]),
        "gateway": ("gateway", mean["gateway"]),
        "network": ("network (connect + time to headers)", mean["connect"] + mean["headers"]),
        "server_queue": ("server queue (interval mean)", queue_ms),
        "server_prefill": ("server prefill (interval mean)", prefill_ms),
        "other": (
            "other (first event's way back, detokenization, estimate error)",
            to_content - queue_ms - prefill_ms,
        ),
    }
    return {
        **base,
        "available": True,
        "misses": total,
        "covered_misses": covered,
        "phases": {k: {"label": label, "mean_ms": value} for k, (label, value) in parts.items()},
    }


def misses_by_bucket(cells: Iterable[Mapping[str, Any]], variant: str) -> dict[int, int]:
    """{time bucket: requests that missed the SLA} of one variant from the report's segment cells
    (n - hits: failed requests count as misses, as everywhere in the report)."""
    out: dict[int, int] = {}
    for c in cells:
        if c["variant"] == variant:
            out[int(c["tb"])] = out.get(int(c["tb"]), 0) + int(c["n"]) - int(c["hits"])
    return out
