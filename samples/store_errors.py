"""What the sample store raises.

StoreUnavailable is transient (the caller spools and retries later); every other StoreError is
permanent and is raised at once. samples.store re-exports them all: callers import them from
there.
"""

from __future__ import annotations

from samples import columns as colmod


class StoreError(Exception):
    """Permanent failure: bad SQL, bad data, schema trouble. Retrying will not help."""


class StoreUnavailable(StoreError):
    """Transient failure (server down, network, timeout): spool the samples and retry later."""


class QueryTimeout(StoreError):
    """A read ran past the max_execution_time it was given (query(settings=...)): permanent for
    that query; ask for less (narrower filters) or allow more time."""


class StoreLocked(StoreError):
    """chDB's data directory is owned by another process."""


class SchemaMismatch(StoreError):
    """The database's schema is not what the code's migrations make: an applied migration
    differs from the code's, or a table it created is missing columns or has other types."""


class NotMigrated(StoreError):
    """The store lacks migrations this code needs (never migrated, or migrated by older code):
    the message names what is missing and the command that applies it."""


class InvalidSamples(StoreError, colmod.SampleError):
    """Samples the table cannot hold (samples.columns' validator said why); nothing was sent.
    Both a StoreError (permanent) and a ValueError (bad input)."""
