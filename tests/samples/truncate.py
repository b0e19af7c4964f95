"""truncate_for_tests(store): empty every table a test writes, on a test database only."""

from __future__ import annotations

from samples import schema
from samples.store import SampleStore, StoreError

# What tests write: the samples, the rollups and their builds, the run catalog, server metrics.
# The migrations table is kept (the database stays migrated).
TABLES = (
    schema.SAMPLES_TABLE,
    schema.ROLLUP_BUILDS_TABLE,
    *schema.ROLLUP_BUILD_TABLES,
    *schema.ROLLUP_TABLES,
    schema.RUNS_TABLE,
    schema.SERVER_METRICS_TABLE,
)


def truncate_for_tests(store: SampleStore) -> None:
    """TRUNCATE every table of TABLES in the store's database (a cluster's store runs it on
    every server's local table); StoreError, and nothing emptied, unless the database's name
    holds "test"."""
    if "test" not in store.database:
        raise StoreError(f"truncate_for_tests refuses database {store.database!r}: name must contain 'test'")
    for table in TABLES:
        store.execute(f"TRUNCATE TABLE IF EXISTS {table}")
