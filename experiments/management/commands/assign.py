"""python manage.py assign KEY < user_ids.txt > assignments.tsv

Streams: one line in, one line out, written in bounded chunks, so a million users need no more
memory than a thousand.
"""

from __future__ import annotations

import sys

from django.core.management.base import BaseCommand, CommandError

from experiments.weights.errors import StoreUnavailable
from experiments.weights.process import weights_store
from experiments.weights.publish import why_not_assigned
from experiments.weights.router import Router, UnknownExperiment

CHUNK_LINES = 4096


class Command(BaseCommand):
    help = (
        "Read user ids on stdin, one per line; print 'user_id<TAB>variant' for each, using the "
        "weights stored for the experiment now."
    )
    stealth_options = ("stdin",)

    def add_arguments(self, parser):
        parser.add_argument("key", help="experiment key")
        parser.add_argument(
            "--with-revision",
            action="store_true",
            help="add a third column: the weights revision used",
        )

    def handle(self, *args, key, with_revision=False, **options):
        stdin = options.get("stdin") or sys.stdin
        # A one-shot load, no watch: the answer is for the weights as they are at start.
        router = Router(weights_store())
        try:
            router.refresh()
            first = router.assign(key, "")
        except StoreUnavailable as exc:
            raise CommandError(f"weights store unavailable: {exc}") from None
        except UnknownExperiment as exc:
            raise CommandError(why_not_assigned(key) or str(exc)) from None
        suffix = f"\t{first.revision}\n" if with_revision else "\n"
        chunk: list[str] = []
        skipped = 0
        for line in stdin:
            user_id = line.rstrip("\r\n")
            if not user_id:
                skipped += 1
                continue
            chunk.append(f"{user_id}\t{router.assign(key, user_id).variant}{suffix}")
            if len(chunk) >= CHUNK_LINES:
                self.stdout.write("".join(chunk), ending="")
                chunk.clear()
        if chunk:
            self.stdout.write("".join(chunk), ending="")
        if skipped:
            self.stderr.write(f"skipped {skipped} empty line(s)")
