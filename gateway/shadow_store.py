"""The recorder's writer of shadow rows (gateway/shadow.py): to the sample store's
fidelity_shadows table, or to a spool beside the samples' while the store is down.

The host's recorder (gateway/recorder_process.py) reads a gateway's SHADOW records from its
queue file with its samples, and marks them durable, so that its read offset moves past them,
once this writer has stored or spooled them: a shadow row is lost in no case a sample is not.

Layout of ``<spool dir>/fidelity_shadows/``: one file per spooled batch, ``<seq>.jsonl``
numbered in write order, written durably as the samples' (samples.spool.write_durably); line 1
a header ``{"table": "fidelity_shadows", "rows": N}``, then one JSON object per row. Files are
flushed in order once the store answers (``retry``); a file that cannot be read whole gives up
its whole rows and moves to ``quarantine/`` beside them, logged; a row the store's checked
writer refuses (samples/store_fidelity.py) is logged and counted, never retried. Inserting a
file again after an ambiguous failure is harmless: the table is a ReplacingMergeTree on
(experiment, variant, request_id) (samples/schema.py). A spool left by a host's recorder is
flushed by the next one that starts on it (`manage.py gateway_recorder --spool-dir DIR`).

One writer per spool directory: the recorder that holds the host's lock, on its flush loop's
thread (as every store call of the recorder).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from samples.schema import FIDELITY_SHADOWS_TABLE
from samples.spool import write_durably
from samples.store import SampleStore, StoreUnavailable

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(\d{12})\.jsonl$")


class ShadowWriter:
    """write(rows) -> "stored" | "spooled"; retry() flushes the spool once the store answers.
    ``pause_s``: after the store failed, rows are spooled without trying it for this long;
    ``store_paused``: the samples' writer has seen it fail just now (the same store: spooled
    without a try either, which would cost its connect timeout on the recorder's thread)."""

    def __init__(
        self,
        store: SampleStore,
        spool_dir: str,
        *,
        pause_s: float,
        store_paused: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.dir = os.path.join(os.path.abspath(spool_dir), FIDELITY_SHADOWS_TABLE)
        self.quarantine = os.path.join(self.dir, "quarantine")
        os.makedirs(self.quarantine, exist_ok=True)
        self.pause_s, self._clock, self._store_paused = pause_s, clock, store_paused
        self._down_until = 0.0
        self.stored = self.spooled = self.flushed = self.rejected = 0

    def paused(self) -> bool:
        return self._clock() < self._down_until or self._store_paused()

    def pending_files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.dir) if _NAME.match(n))

    def retry_due(self) -> bool:
        return not self.paused() and bool(self.pending_files())

    def write(self, rows: Sequence[Mapping[str, Any]]) -> str:
        """Store the rows, or spool them (the store paused or failing, or older rows spooled and
        not flushed yet: the store gets them in order). A row the store refuses as invalid is
        logged and counted in ``rejected``, never retried."""
        if not rows:
            return "stored"
        if self.paused() or (self.pending_files() and not self.retry()):
            self._spool(rows)
            return "spooled"
        try:
            self._insert(rows)
        except StoreUnavailable as exc:
            self._down_until = self._clock() + self.pause_s
            self._spool(rows)
            log.warning("sample store unavailable, spooled %d shadow rows: %s", len(rows), exc)
            return "spooled"
        self.stored += len(rows)
        return "stored"

    def _insert(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """All the rows; the checked writer refuses a whole batch for one bad row, so then each
        one alone, the bad ones logged and counted."""
        try:
            self.store.insert_fidelity_shadows(rows)
        except ValueError:
            for row in rows:
                try:
                    self.store.insert_fidelity_shadows([row])
                except ValueError as exc:
                    self.rejected += 1
                    log.error("shadow row of request %r rejected: %s", row.get("request_id"), exc)

    def retry(self) -> bool:
        """Flush the spooled files in order; True once none is left. The store still away:
        paused again, False."""
        for name in self.pending_files():
            path = os.path.join(self.dir, name)
            rows, whole = _read(path)
            try:
                if rows:
                    self._insert(rows)
            except StoreUnavailable as exc:
                self._down_until = self._clock() + self.pause_s
                log.info(
                    "sample store still unavailable for %d spooled shadow files: %s",
                    len(self.pending_files()),
                    exc,
                )
                return False
            if whole:
                os.unlink(path)
            else:
                os.replace(path, os.path.join(self.quarantine, name + ".torn"))
                log.error(
                    "spooled shadow file %s was torn: stored %d readable rows, kept it in quarantine/",
                    name,
                    len(rows),
                )
            self.flushed += len(rows)
        self._down_until = 0.0
        return True

    def _spool(self, rows: Sequence[Mapping[str, Any]]) -> None:
        names = self.pending_files() + os.listdir(self.quarantine)
        seq = max((int(n[:12]) for n in names if n[:12].isdigit()), default=0) + 1
        path = os.path.join(self.dir, f"{seq:012d}.jsonl")
        header = {"table": FIDELITY_SHADOWS_TABLE, "rows": len(rows)}
        lines = [json.dumps(header)] + [json.dumps(dict(r), ensure_ascii=False) for r in rows]
        write_durably(path + ".tmp", path, lines)
        self.spooled += len(rows)


def _read(path: str) -> tuple[list[dict[str, Any]], bool]:
    """(the rows a spooled file holds, whether it was read whole as its header says)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows: list[dict[str, Any]] = []
    header: Any = None
    for i, line in enumerate(lines[:-1]):  # a last line without its newline was cut mid-write
        try:
            obj = json.loads(line)
        except ValueError:
            break
        if i == 0:
            header = obj
        elif isinstance(obj, dict):
            rows.append(obj)
        else:
            break
    whole = isinstance(header, dict) and header.get("rows") == len(rows) == len(lines) - 2
    return rows, whole
