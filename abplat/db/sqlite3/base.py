"""The embedded database's backend: Django's SQLite backend, which first makes the directory the
database file is in.

abplat/config.py names it in DATABASES when no ABPLAT_DATABASE_URL is set: the SQLite file in
ABPLAT_VAR. SQLite creates a missing file but not a missing directory, and loading the settings
makes nothing on disk; so the first connection of whichever process connects first (``manage.py
migrate`` on a fresh clone, the test database) makes the directory.
"""

from __future__ import annotations

from pathlib import Path

from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper
from django.utils.asyncio import async_unsafe


def make_file_directory(database: str | Path) -> None:
    """Make the directory of the SQLite database file ``database`` (and its parents) if missing.
    A database in memory (":memory:", a URI with mode=memory) or named by a ``file:`` URI (SQLite
    reads the path from it) is left alone."""
    name = str(database)
    if name == ":memory:" or "mode=memory" in name or name.startswith("file:"):
        return
    Path(name).parent.mkdir(parents=True, exist_ok=True)


class DatabaseWrapper(SQLiteDatabaseWrapper):
    @async_unsafe
    def get_new_connection(self, conn_params):
        make_file_directory(conn_params["database"])
        return super().get_new_connection(conn_params)
