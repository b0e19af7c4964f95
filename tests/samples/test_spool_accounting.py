"""What a spool holds is told, per run, to whoever keeps the books:
before a batch is spooled and after a flush, and the rows a quarantined file lost, so no host
ends a run or resends a request while its samples wait in, or were lost from, some spool."""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest

from samples.columns import COLUMN_NAMES
from samples.spool import Spool, SpoolHooks, SpoolingWriter
from samples.store import StoreUnavailable


class Books:
    """SpoolHooks that remember every call, and what the spool directory held at the time."""

    def __init__(self, spool_dir: str) -> None:
        self.dir = spool_dir
        self.pending: list[tuple[str, dict[int, int], int]] = []  # (spool, counts, files then)
        self.quarantined: list[tuple[str, str, dict[int, int]]] = []
        self.refuse = False

    def files(self) -> int:
        return sum(1 for name in os.listdir(self.dir) if name.endswith((".jsonl", ".jsonl.tmp")))

    def on_pending(self, spool: str, counts: dict[int, int]) -> None:
        if self.refuse:
            raise RuntimeError("the books are closed")
        self.pending.append((spool, counts, self.files()))

    def on_quarantined(self, spool: str, path: str, lost: dict[int, int]) -> None:
        self.quarantined.append((spool, path, lost))

    def hooks(self) -> SpoolHooks:
        return SpoolHooks(pending=self.on_pending, quarantined=self.on_quarantined)


@pytest.fixture
def down():
    """down(store): every write and lookup of the store raises StoreUnavailable until undone."""
    patch = pytest.MonkeyPatch()

    def make(store):
        def unavailable(*_a, **_k):
            raise StoreUnavailable("the store is down (test)")

        for name in ("insert_columns", "insert_samples", "existing_keys"):
            patch.setattr(store, name, unavailable)
        return patch.undo

    yield make
    patch.undo()


def test_every_run_s_spooled_rows_are_told_before_the_batch_is_written_and_none_after_the_flush(
    store, make_rows, tmp_path, down
):
    spool_dir = str(tmp_path / "spool")
    books = Books(spool_dir)
    writer = SpoolingWriter(store, spool_dir, hooks=books.hooks())
    back_up = down(store)
    assert writer.write(make_rows(10)) == "spooled"
    assert writer.write(make_rows(3, start=10, run_id=8) + make_rows(5, start=10)) == "spooled"
    # told first, with the batch counted, while the directory did not hold its file yet
    assert [(counts, files) for _s, counts, files in books.pending] == [({7: 10}, 0), ({7: 15, 8: 3}, 1)]
    assert {spool for spool, _c, _f in books.pending} == {writer.spool.id}
    assert writer.spool.rows_by_run() == {7: 15, 8: 3}

    back_up()
    report = writer.flush()
    assert report.inserted == 18 and books.pending[-1][1] == {}
    assert store.count(7) == 15 and store.count(8) == 3


def test_rows_the_books_cannot_hear_of_are_not_spooled(store, make_rows, tmp_path, down):
    spool_dir = str(tmp_path / "spool")
    books = Books(spool_dir)
    writer = SpoolingWriter(store, spool_dir, hooks=books.hooks())
    down(store)
    books.refuse = True
    with pytest.raises(RuntimeError, match="the books are closed"):
        writer.write(make_rows(4))
    assert writer.pending() == 0  # the caller keeps the rows (the replay's sink retries, then fails)


def test_a_spool_file_of_another_column_schema_is_quarantined_with_its_rows_counted_per_run(
    store, make_rows, tmp_path
):
    """A schema change made every row of older spool files unreadable; the file went
    to quarantine/ and its rows were gone without a word to the run."""
    spool_dir = str(tmp_path / "spool")
    books = Books(spool_dir)
    writer = SpoolingWriter(store, spool_dir, hooks=books.hooks())
    rows = make_rows(6) + make_rows(2, start=6, run_id=8)
    path = os.path.join(writer.spool.dir, "000000000001.jsonl")
    with open(path, "w", encoding="utf-8") as f:  # written by a writer with one more column
        f.write(
            json.dumps({"spool": 2, "seq": 1, "rows": 8, "runs": [7, 8], "counts": {"7": 6, "8": 2}}) + "\n"
        )
        for r in rows:
            f.write(json.dumps([r[c] for c in COLUMN_NAMES] + ["new column"]) + "\n")
    assert writer.spool.rows_by_run() == {7: 6, 8: 2}

    report = writer.flush()
    (q,) = report.quarantined
    assert q.path == os.path.join(writer.spool.quarantine, "000000000001.jsonl.torn") and os.path.exists(
        q.path
    )
    assert (q.salvaged, q.lost, report.lost) == (0, {7: 6, 8: 2}, 8)
    assert books.quarantined == [(writer.spool.id, q.path, {7: 6, 8: 2})]
    assert books.pending[-1][1] == {} and store.count(7) == 0


def test_a_torn_file_counts_only_the_rows_it_could_not_give_up(store, make_rows, tmp_path):
    spool_dir = str(tmp_path / "spool")
    books = Books(spool_dir)
    writer = SpoolingWriter(store, spool_dir, hooks=books.hooks())
    name = writer.spool.append(make_rows(10))
    path = os.path.join(writer.spool.dir, name)
    lines = open(path, "rb").read().split(b"\n")
    with open(path, "r+b") as f:  # header + 4 rows and half of the 5th
        f.truncate(sum(len(x) + 1 for x in lines[:5]) + len(lines[5]) // 2)
    report = writer.flush()
    assert (report.salvaged, report.lost, report.quarantined[0].lost) == (4, 6, {7: 6})
    assert store.count(7) == 4 and books.quarantined[0][2] == {7: 6}


def test_a_file_whose_rows_all_arrived_is_quarantined_without_a_loss(store, make_rows, tmp_path):
    spool_dir = str(tmp_path / "spool")
    books = Books(spool_dir)
    writer = SpoolingWriter(store, spool_dir, hooks=books.hooks())
    name = writer.spool.append(make_rows(5))
    os.rename(os.path.join(spool_dir, name), os.path.join(spool_dir, name + ".tmp"))  # crash before rename
    report = writer.flush()
    assert (report.salvaged, report.lost, len(report.quarantined)) == (5, 0, 1)
    assert books.quarantined == [] and store.count(7) == 5


def test_an_older_header_without_counts_counts_its_rows_for_each_run_it_names(tmp_path, make_rows):
    spool = Spool(str(tmp_path / "spool"))
    with open(os.path.join(spool.dir, "000000000001.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"spool": 1, "seq": 1, "rows": 3, "runs": [7, 9]}) + "\n")
        for r in make_rows(3):
            f.write(json.dumps(r) + "\n")
    assert spool.rows_by_run() == {7: 3, 9: 3}  # an upper bound for each: never too few


def test_the_spool_id_names_its_host_and_directory_and_stays_with_a_copy(tmp_path, make_rows):
    spool = Spool(str(tmp_path / "spool"))
    assert spool.id == f"{socket.gethostname()}:{tmp_path / 'spool'}"
    spool.append(make_rows(2))
    shutil.copytree(tmp_path / "spool", tmp_path / "elsewhere")
    assert Spool(str(tmp_path / "elsewhere")).id == spool.id
    assert Spool(str(tmp_path / "spool")).id == spool.id
