"""Which sample store this process uses: a ClickHouse server or cluster when a URL is set, else chDB.

store_from_config is pure of Django (scripts, benches, tests); sample_store/sample_writer read the
lead's settings CLICKHOUSE_URL, CLICKHOUSE_CLUSTER, CHDB_PATH and SPOOL_DIR and cache one
instance per process. A store that lacks migrations raises SampleStoreNotMigrated naming the
command to run: when a replay starts (SampleStore.check_schema, asked once per process), and
wherever a query meets a missing table.
sample_writer's spool tells the hooks set by set_spool_hooks (workers records, per run and spool,
what each host's spool holds: samples imports nothing of the apps above it).
"""

from __future__ import annotations

import threading

from django.core.management.base import CommandError

from samples.backends.chdb import ChdbBackend
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.backends.cluster import ClickHouseClusterBackend
from samples.spool import SpoolHooks, SpoolingWriter
from samples.store import NotMigrated, SampleStore


class SampleStoreNotMigrated(NotMigrated, CommandError):
    """NotMigrated from the process's store: a StoreError, and a CommandError so that every
    management command that meets it (replay, sla_report, flush_samples, ...) ends with its
    one-line message and the command to run, not a traceback."""


_cache: dict[tuple[str, str, str, str], SampleStore] = {}
_cache_lock = threading.Lock()
_spool_hooks: SpoolHooks | None = None


def store_from_config(
    clickhouse_url: str, chdb_path: str, database: str = "abplat", cluster: str = ""
) -> SampleStore:
    """ClickHouse server if clickhouse_url is non-empty (its database comes from the URL path),
    through the Distributed tables of `cluster` when that is set (clickhouse_url then names one
    of its servers), otherwise chDB in-process under chdb_path (database `database`)."""
    if cluster and not clickhouse_url:
        raise ValueError(
            f"ABPLAT_CLICKHOUSE_CLUSTER={cluster} needs ABPLAT_CLICKHOUSE_URL: the URL of one server "
            "of the cluster (the embedded chDB is a single process)"
        )
    if clickhouse_url and cluster:
        return ClickHouseClusterBackend(clickhouse_url, cluster)
    if clickhouse_url:
        return ClickHouseServerBackend(clickhouse_url)
    if not chdb_path:
        raise ValueError(
            "sample store not configured: set ABPLAT_CLICKHOUSE_URL (ClickHouse server) "
            "or ABPLAT_CHDB_PATH (embedded chDB directory)"
        )
    return ChdbBackend(chdb_path, database)


def sample_store() -> SampleStore:
    from django.conf import settings

    cluster = getattr(settings, "CLICKHOUSE_CLUSTER", "")
    key = (settings.CLICKHOUSE_URL, str(settings.CHDB_PATH), settings.CHDB_DATABASE, cluster)
    with _cache_lock:
        if key not in _cache:
            store = store_from_config(str(key[0] or ""), key[1], database=key[2], cluster=cluster)
            store.not_migrated_error = SampleStoreNotMigrated
            _cache[key] = store
        return _cache[key]


def set_spool_hooks(hooks: SpoolHooks | None) -> None:
    """Who hears what this process's spools hold (workers.apps wires its database record)."""
    global _spool_hooks
    _spool_hooks = hooks


def sample_writer(spool_dir: str | None = None) -> SpoolingWriter:
    """The writer of this process: its store, and the spool in settings.SPOOL_DIR (or
    ``spool_dir``: another host's spool, to flush it from here)."""
    from django.conf import settings

    return SpoolingWriter(sample_store(), str(spool_dir or settings.SPOOL_DIR), hooks=_spool_hooks)
