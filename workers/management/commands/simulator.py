"""python manage.py simulator --port P [--profile NAME] [--serve NAME=PORT ...]"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from simulator.__main__ import pairs_from_args
from simulator.profiles import DEFAULT, PROFILES
from simulator.serve import DEFAULT_MODEL, run_forever


class Command(BaseCommand):
    help = (
        "Serve the vLLM-compatible simulator on 127.0.0.1: one profile on --port, and/or "
        "several profiles with repeated --serve NAME=PORT, all from this one process."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--port", type=int)
        parser.add_argument("--profile", help=f"one of {', '.join(sorted(PROFILES))} (default {DEFAULT})")
        parser.add_argument("--serve", action="append", default=[], metavar="NAME=PORT")
        parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
        parser.add_argument("--replicas", type=int, default=1, help="engines behind each endpoint")

    def handle(self, *args, **opts) -> None:
        try:
            pairs = pairs_from_args(opts["port"], opts["profile"], opts["serve"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        try:
            if opts["replicas"] < 1:
                raise CommandError(f"--replicas must be at least 1, got {opts['replicas']}")
            run_forever(pairs, opts["model"], opts["replicas"])
        except KeyboardInterrupt:
            pass
