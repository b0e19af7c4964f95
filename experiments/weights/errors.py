"""Errors of the weights layer (pure: no Django, no network imports)."""

from __future__ import annotations


class WeightsError(ValueError):
    """Invalid weights or weights document; ``errors`` lists every problem, each naming its field
    path (``weights.awq: must be >= 0, got -5``)."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("; ".join(self.errors))


class ConflictError(Exception):
    """A compare-and-set write lost: someone else changed the key since it was read."""

    def __init__(self, key: str, expected_revision: int, actual_revision: int):
        self.key = key
        self.expected_revision = expected_revision
        self.actual_revision = actual_revision
        if actual_revision == 0:
            state = "it does not exist (deleted or never written)"
        elif expected_revision == 0:
            state = f"it already exists at revision {actual_revision}"
        else:
            state = f"it is now at revision {actual_revision}"
        super().__init__(
            f"weights for experiment {key!r} changed concurrently: expected revision "
            f"{expected_revision}, but {state}; reload the current weights and retry"
        )


class StoreUnavailable(Exception):
    """The weights store cannot be reached (etcd down, timeout); nothing was written."""


class StoreAuthError(StoreUnavailable):
    """etcd refused us: a wrong user or password, a role without access to the prefix, or a TLS
    client certificate it does not accept. Retrying cannot help until the configuration
    changes, so it is raised at once; callers that treat StoreUnavailable as "not now" still
    do the right thing."""


class WatchCompacted(Exception):
    """A watch asked for history the store has compacted away: reload everything."""

    def __init__(self, compacted_revision: int):
        self.compacted_revision = compacted_revision
        super().__init__(f"watch start revision compacted (store compacted at {compacted_revision})")
