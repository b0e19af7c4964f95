"""The embedded database (no ABPLAT_DATABASE_URL): its backend (abplat/db/sqlite3/base.py) makes
the directory of the SQLite file on the first connection, since loading the settings makes
nothing on disk."""

from __future__ import annotations

import pytest
from django.db.utils import ConnectionHandler

from abplat.config import settings_from
from abplat.db.sqlite3.base import make_file_directory


def test_the_first_connection_makes_the_database_directory_and_works(tmp_path, django_db_blocker):
    var = tmp_path / "fresh" / "var"
    databases = settings_from({"ABPLAT_VAR": str(var)})["DATABASES"]
    assert not var.exists()  # the settings made nothing
    handler = ConnectionHandler(databases)
    try:
        with django_db_blocker.unblock(), handler["default"].cursor() as cursor:
            cursor.execute("CREATE TABLE t (x INTEGER)")
            cursor.execute("INSERT INTO t VALUES (42)")
            cursor.execute("SELECT x FROM t")
            assert cursor.fetchall() == [(42,)]
    finally:
        handler.close_all()
    assert (var / "abplat.sqlite3").is_file()
    # A second process connecting finds the directory and the file as they are.
    again = ConnectionHandler(databases)
    try:
        with django_db_blocker.unblock(), again["default"].cursor() as cursor:
            cursor.execute("SELECT x FROM t")
            assert cursor.fetchall() == [(42,)]
    finally:
        again.close_all()


def test_a_database_url_keeps_djangos_own_backend(tmp_path):
    databases = settings_from(
        {"ABPLAT_VAR": str(tmp_path), "ABPLAT_DATABASE_URL": "sqlite:////srv/db.sqlite3"}
    )
    assert databases["DATABASES"]["default"]["ENGINE"] == "django.db.backends.sqlite3"


def test_make_file_directory_makes_the_parents_of_a_file(tmp_path):
    make_file_directory(tmp_path / "a" / "b" / "db.sqlite3")
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "db.sqlite3").exists()
    make_file_directory(str(tmp_path / "a" / "b" / "db.sqlite3"))  # already there: nothing to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


@pytest.mark.parametrize(
    "name", [":memory:", "file:memdb1?mode=memory&cache=shared", "file:{d}/x/db.sqlite3"]
)
def test_make_file_directory_leaves_memory_and_uri_databases_alone(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    make_file_directory(name.format(d=tmp_path))
    assert list(tmp_path.iterdir()) == []
