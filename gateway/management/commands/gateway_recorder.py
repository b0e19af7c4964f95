"""python manage.py gateway_recorder [--spool-dir D] [--idle-exit S]: the host's live recorder.

It writes the samples the gateway processes of this host append to their queue files
(gateway/recorder_process.py). Run it under a supervisor beside the gateway (docs/deploy.md); a
gateway that finds none running starts one itself. A second one on the same spool directory
exits at once (status 3): the first holds its lock."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import CommandError

from experiments.cli import Command as AbplatCommand


class Command(AbplatCommand):
    help = (
        "Write the live gateway's samples from this host's queue files to the sample store (or its "
        "spool); one per spool directory."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--spool-dir", default="", help="the spool directory (default ABPLAT_SPOOL_DIR, as the gateway's)"
        )
        parser.add_argument(
            "--idle-exit",
            type=float,
            default=None,
            help="end after this many seconds with no queue file and nothing spooled (0: as soon as there is "
            "none; default: never)",
        )

    def handle(self, *args, spool_dir: str, idle_exit: float | None, **opts) -> None:
        from gateway.recorder_process import serve

        if idle_exit is not None and idle_exit < 0:
            raise CommandError(f"--idle-exit {idle_exit}: must be >= 0 seconds")
        status = serve(spool_dir or str(settings.SPOOL_DIR), idle_exit_s=idle_exit)
        if status:
            raise CommandError("another recorder holds this spool directory's lock", returncode=status)
