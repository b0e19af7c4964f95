"""python manage.py simulator --port P [--profile NAME] [--serve NAME=PORT ...]: simulator/cli.py."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from simulator import cli


class Command(BaseCommand):
    help = cli.DESCRIPTION

    def add_arguments(self, parser) -> None:
        cli.add_arguments(parser)

    def handle(self, *args, **opts) -> None:
        try:
            cli.serve(opts)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
