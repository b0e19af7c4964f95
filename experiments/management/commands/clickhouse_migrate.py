from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from experiments.cli import Command as AbplatCommand
from samples.factory import sample_store
from samples.store import StoreError


class Command(AbplatCommand):
    help = (
        "Apply the sample store's ClickHouse schema migrations (ClickHouse server or cluster, or "
        "chDB). `migrate` runs this too, after the Django database."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--show", action="store_true", help="list migrations and whether each is applied")

    def handle(self, *args: Any, show: bool = False, **options: Any) -> None:
        verbosity = options.get("verbosity", 1)
        try:
            store = sample_store()  # chDB: StoreLocked here when another process owns it
            if show:
                for m in store.migration_status():
                    mark = "[X]" if m["applied"] else "[ ]"
                    bad = "" if m["checksum_ok"] else "  CHECKSUM MISMATCH"
                    self.stdout.write(f"{mark} {m['version']:04d} {m['name']}{bad}")
                return
            applied = store.migrate()
        except StoreError as e:
            raise CommandError(str(e)) from e
        if verbosity < 1:
            return
        if applied:
            for v in applied:
                self.stdout.write(f"applied {v:04d} on {store.describe()}")
        else:
            self.stdout.write(f"no migrations to apply on {store.describe()}")
