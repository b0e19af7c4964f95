"""Which sample store this process uses: a ClickHouse server when a URL is set, else chDB.

store_from_config is pure of Django (scripts, benches, tests); sample_store/sample_writer read the
lead's settings CLICKHOUSE_URL, CHDB_PATH and SPOOL_DIR and cache one instance per process.
sample_writer's spool tells the hooks set by set_spool_hooks (workers records, per run and spool,
what each host's spool holds: samples imports nothing of the apps above it).
"""

from __future__ import annotations

import threading

from samples.backends.chdb import ChdbBackend
from samples.backends.clickhouse import ClickHouseServerBackend
from samples.spool import SpoolHooks, SpoolingWriter
from samples.store import SampleStore

_cache: dict[tuple[str, str, str], SampleStore] = {}
_cache_lock = threading.Lock()
_spool_hooks: SpoolHooks | None = None


def store_from_config(clickhouse_url: str, chdb_path: str, database: str = "abplat") -> SampleStore:
    """ClickHouse server if clickhouse_url is non-empty (its database comes from the URL path),
    otherwise chDB in-process under chdb_path (database `database`)."""
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

    key = (settings.CLICKHOUSE_URL, str(settings.CHDB_PATH), settings.CHDB_DATABASE)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = store_from_config(str(key[0] or ""), key[1], database=key[2])
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
