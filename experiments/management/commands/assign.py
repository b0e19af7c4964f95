"""python manage.py assign KEY < user_ids.txt > assignments.tsv

Streams: one line in, one line out, written in bounded chunks, so a million users need no more
memory than a thousand.

--json prints a summary instead of the assignments, as one JSON document: {"experiment",
"revision", "hash_version", "weights", "users", "by_variant": {variant: users},
"skipped_empty_lines", "output"}; with --output FILE the assignments go to FILE as well.
Without --json the same summary is one line on stderr.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter

from experiments.cli import CliError, JsonCommand, add_json_argument, experiment_named
from experiments.weights.errors import StoreUnavailable
from experiments.weights.process import weights_store
from experiments.weights.publish import why_not_assigned
from experiments.weights.router import Router, UnknownExperiment

CHUNK_LINES = 4096


class Command(JsonCommand):
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
        parser.add_argument(
            "--output",
            metavar="FILE",
            help="write the assignments to FILE (default: stdout; none with --json)",
        )
        add_json_argument(parser)

    def handle(self, *args, key, with_revision=False, output=None, **options):
        stdin = options.get("stdin") or sys.stdin
        # A one-shot load, no watch: the answer is for the weights as they are at start.
        router = Router(weights_store())
        try:
            router.refresh()
            first = router.assign(key, "")
            doc, _ = router.document(key)
        except StoreUnavailable as exc:
            raise CliError(f"weights store unavailable: {exc}") from None
        except UnknownExperiment as exc:
            experiment_named(key)  # a key no experiment has: say so, and the closest one
            raise CliError(why_not_assigned(key) or str(exc), field="key") from None
        try:
            sink = open(output, "w", encoding="utf-8") if output else None  # closed in the finally below
        except OSError as exc:
            raise CliError(f"--output: cannot write {output}: {exc.strerror}", field="--output") from None
        if sink is not None:
            write = sink.write
        elif self.json:
            write = None  # the summary only
        else:
            write = functools.partial(self.stdout.write, ending="")
        suffix = f"\t{first.revision}\n" if with_revision else "\n"
        chunk: list[str] = []
        by_variant = Counter({v: 0 for v in doc.weights})
        skipped = 0
        try:
            for line in stdin:
                user_id = line.rstrip("\r\n")
                if not user_id:
                    skipped += 1
                    continue
                variant = router.assign(key, user_id).variant
                by_variant[variant] += 1
                if write is None:
                    continue
                chunk.append(f"{user_id}\t{variant}{suffix}")
                if len(chunk) >= CHUNK_LINES:
                    write("".join(chunk))
                    chunk.clear()
            if chunk:
                write("".join(chunk))
        finally:
            if sink is not None:
                sink.close()
        summary = {
            "experiment": key,
            "revision": first.revision,
            "hash_version": first.hash_version,
            "weights": dict(doc.weights),
            "users": sum(by_variant.values()),
            "by_variant": dict(by_variant),
            "skipped_empty_lines": skipped,
            "output": output,
        }
        if self.json:
            self.emit(summary)
            return
        if skipped:
            self.stderr.write(f"skipped {skipped} empty line(s)")
        shares = ", ".join(f"{v} {n}" for v, n in by_variant.items())
        self.stderr.write(
            f"{summary['users']} user(s) assigned at revision {first.revision}: {shares}", style_func=str
        )
