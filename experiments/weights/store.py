"""The weights store interface: one key per experiment, revisions, compare-and-set, watch.

Two implementations share it: ``local.LocalWeightsStore`` (files, the embedded default) and
``etcd.EtcdWeightsStore``. Revisions are store-wide and increase with every write (etcd's
mod_revision); revision 0 means "absent", so ``put(key, doc, expected_revision=0)`` creates.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from experiments.weights.document import WeightsDocument, parse_document, validate_key
from experiments.weights.errors import WeightsError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredValue:
    key: str
    raw: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Listing:
    values: dict[str, StoredValue]
    # The store revision the listing is consistent at: watch from revision + 1 to miss nothing.
    revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: str
    raw: bytes | None  # None: the key was deleted
    revision: int


class WeightsStore(ABC):
    """Raw operations are abstract; document-level helpers validate on the way in and out."""

    description: str = "weights store"

    @abstractmethod
    def get_raw(self, key: str) -> StoredValue | None: ...

    @abstractmethod
    def list_raw(self) -> Listing: ...

    @abstractmethod
    def put_raw(self, key: str, raw: bytes, expected_revision: int) -> int:
        """Compare-and-set: write only if the key is at ``expected_revision`` (0: absent).
        Returns the new revision; raises ConflictError otherwise, StoreUnavailable when down.
        Writes bytes unchecked: tooling and tests use it to play a hand edit."""

    @abstractmethod
    def delete(self, key: str) -> int: ...

    @abstractmethod
    def watch(self, start_revision: int, stop: threading.Event) -> Iterator[list[WatchEvent]]:
        """Yield batches of changes with revision >= start_revision, in revision order. The
        first batch comes as soon as the watch is registered (possibly empty), then an empty
        batch at least once a second while idle (so the caller can do periodic work).
        Returns when ``stop`` is set; raises StoreUnavailable when the store goes away and
        WatchCompacted when start_revision is no longer available."""

    def close(self) -> None:  # noqa: B027 - optional hook: most stores hold nothing to close
        pass

    # Document-level helpers -------------------------------------------------------------

    def get(self, key: str) -> tuple[WeightsDocument, int] | None:
        """The stored document and its revision, None if absent; WeightsError if invalid."""
        check_key(key)
        stored = self.get_raw(key)
        if stored is None:
            return None
        return parse_document(stored.raw, expected_key=key), stored.revision

    def list_all(self) -> dict[str, tuple[WeightsDocument, int]]:
        """Every valid document; invalid ones are logged and left out (the router counts
        them)."""
        out: dict[str, tuple[WeightsDocument, int]] = {}
        for key, stored in self.list_raw().values.items():
            try:
                out[key] = (
                    parse_document(stored.raw, expected_key=key),
                    stored.revision,
                )
            except WeightsError as exc:
                log.warning("%s: skipping invalid document %r: %s", self.description, key, exc)
        return out

    def put(self, key: str, doc: WeightsDocument, expected_revision: int) -> int:
        check_key(key)
        if doc.experiment != key:
            raise WeightsError(f"experiment: document is for {doc.experiment!r}, not {key!r}")
        if isinstance(expected_revision, bool) or not isinstance(expected_revision, int):
            raise WeightsError(
                f"expected_revision: must be an integer (0 to create), got {expected_revision!r}"
            )
        return self.put_raw(key, doc.dumps(), expected_revision)


def check_key(key: str) -> None:
    errors = validate_key(key)
    if errors:
        raise WeightsError(errors)
