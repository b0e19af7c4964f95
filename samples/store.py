"""SampleStore: the sample store's interface, whatever the backend, and the errors it raises.

samples.factory picks the backend (samples/backends/: a ClickHouse server, a cluster of them, or
chDB in-process); each subclasses SampleStore and implements the four hooks of StoreBase. The
store's methods are grouped by job, one module each, and SampleStore is all of them:

  samples/store_base.py           StoreBase: the backend hooks; query, query_columns, execute;
                                  check_schema (is every migration applied?)
  samples/store_migrations.py     StoreMigrations: migrate, migration_status, and verifying
                                  that what the migrations made is still there
  samples/store_writes.py         SampleWrites: insert_samples, insert_columns (the one
                                  validator, samples.columns), deduplicate
  samples/store_reads.py          SampleReads: what a writer asks about the samples stored
                                  (recorded_request_ids, existing_keys, counts)
  samples/store_catalog.py        RunCatalog: record_run, runs
  samples/store_server_metrics.py ServerMetricsWrites: insert_server_metrics
  samples/store_errors.py         StoreError and its kinds

Errors: StoreUnavailable is transient (the caller spools and retries later); every other
StoreError is permanent and is raised at once. Import the errors, query_settings and
check_ident from here.
"""

from __future__ import annotations

from samples.store_base import MIGRATE_ALL_COMMAND, QuerySettings, check_ident, query_settings
from samples.store_catalog import RunCatalog
from samples.store_errors import (
    InvalidSamples,
    NotMigrated,
    QueryTimeout,
    SchemaMismatch,
    StoreError,
    StoreLocked,
    StoreUnavailable,
)
from samples.store_fidelity import FidelityWrites
from samples.store_migrations import StoreMigrations
from samples.store_reads import SampleReads
from samples.store_server_metrics import ServerMetricsWrites
from samples.store_writes import SampleWrites

__all__ = [
    "MIGRATE_ALL_COMMAND",
    "InvalidSamples",
    "NotMigrated",
    "QuerySettings",
    "QueryTimeout",
    "SampleStore",
    "SchemaMismatch",
    "StoreError",
    "StoreLocked",
    "StoreUnavailable",
    "check_ident",
    "query_settings",
]


class SampleStore(
    StoreMigrations, SampleWrites, SampleReads, RunCatalog, ServerMetricsWrites, FidelityWrites
):
    """Backend-independent API: every part above, on one backend (a subclass implementing the
    hooks of StoreBase)."""
