"""The embedded database's backend: Django's SQLite backend that makes its file's directory
(base.py; ENGINE ``abplat.db.sqlite3``)."""
