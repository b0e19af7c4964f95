"""chDB: one owner process per data directory, and a clear error for everyone else."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from samples.backends.chdb import ChdbBackend
from samples.store import StoreError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.process
def test_a_second_process_gets_a_lock_error_naming_the_directory_and_the_fix(chdb_dir):
    ChdbBackend(chdb_dir, "abplat_test_lock").ping()  # this process owns the directory
    code = (
        "import sys\n"
        "from samples.backends.chdb import ChdbBackend\nfrom samples.store import StoreLocked\n"
        "try:\n"
        f"    ChdbBackend({chdb_dir!r}, 'abplat_test_lock')\n"
        "except StoreLocked as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 3, proc.stderr
    assert f"chDB data directory {os.path.realpath(chdb_dir)} is locked by another process" in (proc.stdout)
    assert f"pid {os.getpid()}" in proc.stdout
    assert "ABPLAT_CLICKHOUSE_URL" in proc.stdout


def test_a_second_directory_in_the_same_process_is_refused(chdb_dir, tmp_path):
    ChdbBackend(chdb_dir, "abplat_test_lock").ping()
    with pytest.raises(StoreError, match="allows one data directory per process"):
        ChdbBackend(str(tmp_path / "other"), "abplat_test_lock")


def test_two_databases_share_the_process_session_without_mixing_rows(make_store, make_rows):
    a, b = make_store("chdb"), make_store("chdb")
    a.migrate()
    b.migrate()
    a.insert_samples(make_rows(3))
    assert (a.count(7), b.count(7)) == (3, 0)


def test_a_forked_child_gets_an_error_instead_of_hanging(chdb_dir):
    store = ChdbBackend(chdb_dir, "abplat_test_lock")
    store.ping()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not touch chDB internals; report and leave without atexit
        os.close(read)
        try:
            store.ping()
            msg = b"no error"
        except StoreError as e:
            msg = str(e).encode()
        os.write(write, msg)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    os.waitpid(pid, 0)
    assert "forked child" in message and "chDB hangs after fork" in message
