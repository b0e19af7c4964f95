"""Django's `migrate`, then the sample store's ClickHouse migrations: one command to forget none.

The sample store (samples.factory: a ClickHouse server or cluster, or chDB) is migrated once per
call, after the Django database, whichever database alias was given (it is not a Django
database; its migrations are idempotent, and a current store costs a few queries). Django's test
runner creates its test databases through this command too, so a test settings' store is
migrated with them. `--skip-sample-store` leaves it out (a store migrated by another step);
`--plan` and `--prune` never touch it; `--check` also fails while the store has migrations to
apply. `clickhouse_migrate` applies the store's migrations alone.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.management import call_command
from django.core.management.base import CommandError, CommandParser
from django.core.management.commands.migrate import Command as DjangoMigrate

from experiments.cli import Command as AbplatCommand
from samples.factory import sample_store
from samples.store import StoreError


class Command(AbplatCommand, DjangoMigrate):
    """Django's migrate with abplat's errors: a refusal is one line (experiments.cli)."""

    help = (
        "Update the database schema (Django's migrate), then apply the sample store's ClickHouse "
        "migrations (as clickhouse_migrate does)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--skip-sample-store",
            action="store_true",
            help="migrate the Django database only, not the sample store (ClickHouse or chDB)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        skip = options.pop("skip_sample_store", False)
        super().handle(*args, **options)  # --check with pending Django migrations exits here
        if skip or options["plan"] or options["prune"]:
            return
        if options["check_unapplied"]:
            self._check_sample_store(options["verbosity"])
            return
        if options["verbosity"] >= 1:
            self.stdout.write(self.style.MIGRATE_HEADING("Sample store migrations:"))
        try:
            call_command("clickhouse_migrate", verbosity=options["verbosity"], stdout=self.stdout)
        except CommandError as e:
            raise CommandError(
                f"the database is migrated, the sample store is not: {str(e).rstrip('.')}. Fix that and run "
                "`.venv/bin/python manage.py clickhouse_migrate` (or migrate again)."
            ) from e

    def _check_sample_store(self, verbosity: int) -> None:
        try:
            pending = [m for m in sample_store().migration_status() if not m["applied"]]
        except StoreError as e:
            raise CommandError(f"the sample store cannot be checked: {e}") from e
        if pending:
            if verbosity >= 1:
                names = ", ".join(f"{m['version']:04d} {m['name']!r}" for m in pending)
                self.stdout.write(f"sample store: migrations to apply: {names}")
            sys.exit(1)
