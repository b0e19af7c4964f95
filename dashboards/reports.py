"""The report of one experiment model: its settings and weights history from the database, and
the report cache (Django's cache, keyed by everything the report depends on). The report itself
is assembled by analysis.report.build_report, which knows nothing of Django."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import django.dispatch
import redis

from analysis.definitions import Filters, QueryError, slo_of
from analysis.readers.raw import RawReader
from analysis.report import SCHEMA_VERSION, ExperimentInfo, VariantInfo, build_report
from dashboards.filters import filters_from_params

log = logging.getLogger(__name__)


def weights_history(experiment: Any) -> tuple[dict[int, dict[str, float]], str, list[dict]]:
    """Weights in force per config revision, from the audit log when it recorded them.

    Any audit entry whose ``before`` or ``after`` holds {"weights": {...}, "revision": int}
    (experiments.weights.service.publish_weights writes "set_weights" entries like that) maps
    that revision to its weights. Revisions the log does not name are tested against the
    variants' current weights, which is wrong for revisions before a later weight change: the
    report's srm.weights_source says which source was used.
    """
    by_rev: dict[int, dict[str, float]] = {}
    changes: list[dict[str, Any]] = []
    for entry in experiment.audit.order_by("at", "id"):
        found = False
        for state in (entry.before, entry.after):
            state = state if isinstance(state, dict) else {}
            weights, rev = state.get("weights"), state.get("revision")
            if (
                isinstance(weights, dict)
                and isinstance(rev, int)
                and not isinstance(rev, bool)
                and rev > 0
                and all(isinstance(w, int | float) for w in weights.values())
            ):
                by_rev[rev] = {str(k): float(w) for k, w in weights.items()}
                found = True
        if found or "weights" in entry.action:
            changes.append(
                {
                    "at": entry.at.astimezone(dt.UTC).isoformat().replace("+00:00", "Z"),
                    "label": f"{entry.action} by {entry.actor_name}",
                }
            )
    source = (
        "audit log (weights per config revision; other revisions: current weights)"
        if by_rev
        else "current variant weights (no weights history in the audit log)"
    )
    return by_rev, source, changes


def experiment_info(experiment: Any) -> ExperimentInfo:
    by_rev, source, changes = weights_history(experiment)
    return ExperimentInfo(
        key=experiment.key,
        name=experiment.name,
        slo=slo_of(experiment),
        target=experiment.sla_target,
        variants=[
            VariantInfo(v.key, v.control, v.weight, dict(v.factors or {})) for v in experiment.variants.all()
        ],
        weights_by_revision=by_rev,
        weights_source=source,
        weight_changes=changes,
        cluster_by_user=experiment.analysis_cluster_by_user,
        adjust=experiment.analysis_adjust,
        store_answers=experiment.fidelity_store_answers,
        score_share=experiment.fidelity_score_share,
    )


def report_time_limit_s() -> int:
    from django.conf import settings

    return int(settings.REPORT_MAX_EXECUTION_S)


class TimeLimitedStore:
    """A sample store whose reads stop after ``seconds`` on ClickHouse (max_execution_time;
    samples.store.QueryTimeout past it): what the report's readers get, so one expensive
    report cannot hold the server (or chDB's one session) for long. Everything else is the
    wrapped store's."""

    def __init__(self, store: Any, seconds: int) -> None:
        self._store = store
        self.time_limit_s = seconds
        self._settings = {"max_execution_time": seconds}

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self._store.query(sql, params, settings=self._settings)

    def query_columns(self, sql: str, params: Mapping[str, Any] | None = None) -> dict[str, list[Any]]:
        return self._store.query_columns(sql, params, settings=self._settings)

    def unit_shards(self) -> list[tuple[str, Any, str]]:
        """The wrapped store's parts (SampleStore.unit_shards), each under the same limit."""
        return [
            (name, TimeLimitedStore(part, self.time_limit_s), table)
            for name, part, table in self._store.unit_shards()
        ]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def timeout_message(seconds: int) -> str:
    return (
        f"the report took longer than {seconds} s (ABPLAT_REPORT_MAX_EXECUTION_S) on the sample "
        "store and was stopped: narrow it (run, since/until, variant) or ask an operator to "
        "raise the limit"
    )


CACHE_ALIAS = "default"
# What a Redis report cache raises when it is down, unreachable or too slow (its socket
# timeouts: abplat/caches.py); the report is then computed as if the cache missed.
CACHE_ERRORS = (redis.RedisError, OSError)
CACHE_TIMEOUT_S = 600
# bump when the report's computation changes without a SCHEMA_VERSION change
CACHE_FORMAT = 7  # 4: the run catalog selects the runs; failures per variant; 5: anytime-valid intervals;
# 6: per-user (clustered) and covariate-adjusted statistics; 7: the gateway phase of TTFT and the
# clustered and adjusted anytime-valid sequences


def cache_key(
    store: Any,
    exp: ExperimentInfo,
    filters: Filters,
    version: Sequence[Sequence[int]],
    catalog: Sequence[Mapping[str, Any]] = (),
    answers: Sequence[int] = (),
) -> str:
    """Everything the report depends on: the store, the experiment's settings and weights
    history, the filters, the experiment's data version (RawReader.data_version), its run
    catalog (SampleStore.runs: a run going from running to done changes the runs read) and its
    answers' version (RawReader.answers_version: a scoring pass ends after its run)."""
    blob = json.dumps(
        {
            "format": [SCHEMA_VERSION, CACHE_FORMAT],
            "store": store.describe(),
            "experiment": dataclasses.asdict(exp),
            "filters": filters.as_dict(),
            "version": list(version),
            "answers": list(answers),
            "catalog": [
                [c["run_id"], c["status"], c["mode"], c["version"], c.get("label"), c.get("complete")]
                for c in catalog
            ],
        },
        sort_keys=True,
        default=str,
    )
    return "abplat:sla-report:" + hashlib.sha256(blob.encode()).hexdigest()


run_labels = django.dispatch.Signal()
"""Sent by report_for before the report picks its runs, with the keyword ``experiment`` (its key).
Receivers return {run_id: {"label": str, "complete": bool}} for the runs they know to be
something of their own (capacity.labels: the capacity search's steps); analysis.runs names those
runs by their label, and a complete one (stopped on purpose once it had what it was for) is not
partial. Defined here, where the catalog is read, so that the apps above (capacity) connect to it
and this layer imports none of them."""


def labelled_catalog(experiment: str, catalog: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The run catalog with what run_labels' receivers say of its runs (a receiver that raises
    is logged and left out: the runs are then named by their status)."""
    names: dict[int, Mapping[str, Any]] = {}
    for receiver, got in run_labels.send_robust(sender=report_for, experiment=experiment):
        if isinstance(got, Exception):
            log.warning("run labels of %s from %s not read: %s", experiment, receiver, got)
        elif got:
            names.update(got)
    return [{**c, **names[int(c["run_id"])]} if int(c["run_id"]) in names else c for c in catalog]


def report_for(
    experiment: Any, filters: Filters, store: Any | None = None, *, use_cache: bool = True
) -> dict[str, Any]:
    """The report, from Django's cache when the experiment's data have not changed since.

    A hit costs one scan of recorded_ms (data_version) instead of the report's passes; its
    ``generated_at`` is when it was computed and ``timing.cache`` says "hit".
    """
    if store is None:
        from samples.factory import sample_store

        store = sample_store()
    store = TimeLimitedStore(store, report_time_limit_s())
    info = experiment_info(experiment)
    t0 = time.perf_counter()
    version = RawReader(store).data_version(filters.experiment)
    catalog = labelled_catalog(filters.experiment, store.runs(filters.experiment))
    check_run(filters, version, catalog)
    if not use_cache:
        report = build_report(store, info, filters, version=version, catalog=catalog)
        report["timing"]["cache"] = "off"
        return report
    from django.core.cache import caches

    cache = caches[CACHE_ALIAS]
    key = cache_key(
        store, info, filters, version, catalog, RawReader(store).answers_version(filters.experiment)
    )
    try:
        cached = cache.get(key)
    except CACHE_ERRORS as exc:  # a shared cache (ABPLAT_CACHE_URL) that is down: compute
        log.warning("report cache unavailable, computing the report of %s: %s", filters.experiment, exc)
        report = build_report(store, info, filters, version=version, catalog=catalog)
        report["timing"]["cache"] = "unavailable"
        return report
    if cached is not None:
        cached["timing"] = {**cached["timing"], "cache": "hit", "lookup_s": time.perf_counter() - t0}
        return cached
    report = build_report(store, info, filters, version=version, catalog=catalog)
    report["timing"].update(cache="miss", lookup_s=time.perf_counter() - t0 - report["timing"]["query_s"])
    try:
        cache.set(key, report, CACHE_TIMEOUT_S)
    except CACHE_ERRORS as exc:
        log.warning("report cache unavailable, the report of %s is not kept: %s", filters.experiment, exc)
    return report


def check_run(
    filters: Filters, version: Sequence[Sequence[int]], catalog: Sequence[Mapping[str, Any]]
) -> None:
    """QueryError unless the run asked for (filters.run_id) is one of this experiment's: it has
    samples or a run catalog row (an unknown run was an empty report, which looked like data)."""
    if filters.run_id is None:
        return
    runs = sorted({int(v[0]) for v in version} | {int(c["run_id"]) for c in catalog})
    if filters.run_id not in runs:
        shown = ", ".join(map(str, runs[-20:])) or "none yet"
        raise QueryError(
            f"run={filters.run_id}: unknown run of experiment {filters.experiment!r} (its runs: {shown})"
        )


def report_for_params(
    experiment: Any,
    params: Mapping[str, str],
    variants: Sequence[str],
    statuses: Sequence[str] | None = None,
) -> tuple[Filters, dict[str, Any]]:
    """The filters named by request (or command line) parameters, and their report: the one
    path of the page, the CSV export, the API and sla_report. Raises QueryError naming a bad
    parameter (dashboards.filters.filters_from_params) or an unknown run (check_run)."""
    known = [v.key for v in experiment.variants.all()]
    filters = filters_from_params(experiment.key, params, variants, known, statuses)
    return filters, report_for(experiment, filters)
