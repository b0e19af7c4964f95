"""What abplat's management commands share: ``--json`` output and errors, progress on stderr,
and the acting user (README, "Command line").

``--json``: stdout holds exactly one JSON document, the command's result, printed when it
ends; messages meant for a person (plans, warnings, progress) go to stderr. A failure prints
instead ``{"error": {"message", "field", "errors": [{"field", "message"}]}}`` (plus whatever
the command knew by then, e.g. a replay's ``run``) and exits non-zero: 1 for a refused or
failed command, 2 for a command line argparse rejects. ``field`` names the option or document
field at fault (``--as``, ``variants[0].weight``), or is null.

Progress (``--progress`` / ``--no-progress``): drawn on stderr, by default only when stderr is
a terminal (telemetry.progress draws it; plain lines when forced on without a terminal).

``--as NAME``: the change is that user's, recorded under their name and bound by their teams
(experiments.teams): an experiment of a team they are not in is refused, naming ``--as``. Without
``--as`` the operator acts, on every team's experiments.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Iterable

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder

from experiments.teams import may_act_on
from telemetry.progress import Progress

JSON_HELP = (
    "print the result as one JSON document on stdout (messages go to stderr); a failure prints "
    '{"error": {"message", "field", "errors"}} and exits non-zero'
)


class CliError(CommandError):
    """A refusal that says which option or field is at fault (``field``), every field error
    when there are several (``errors``: (field, message) pairs), and what was known by then
    (``context``: more keys of the --json error document)."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        errors: Iterable[tuple[str | None, str]] = (),
        context: dict | None = None,
        returncode: int = 1,
    ) -> None:
        super().__init__(message, returncode=returncode)
        self.field = field
        self.errors = [(f, m) for f, m in errors]
        self.context = dict(context or {})


def error_document(exc: BaseException) -> dict:
    """The --json document of a failure (module docstring)."""
    errors = [{"field": f, "message": m} for f, m in getattr(exc, "errors", None) or []]
    field = getattr(exc, "field", None)
    if field is None and errors:
        field = errors[0]["field"]
    context = getattr(exc, "context", None) or {}
    return {"error": {"message": str(exc), "field": field, "errors": errors}, **context}


def dumps(payload) -> str:
    # allow_nan=False: a NaN would make the document invalid JSON for most parsers.
    return json.dumps(payload, indent=2, ensure_ascii=False, allow_nan=False, cls=DjangoJSONEncoder)


def add_json_argument(parser) -> None:
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def add_progress_arguments(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--progress", dest="progress", action="store_const", const=True, default=None,
        help="draw progress (rate, elapsed, ETA) on stderr even when it is not a terminal "
        "(plain lines, one every 10 s); default: only on a terminal",
    )  # fmt: skip
    group.add_argument(
        "--no-progress", dest="progress", action="store_const", const=False, help="draw no progress"
    )


def actor_for(username: str | None, option: str = "--as"):
    """The user an audited change is recorded under: ``username``'s, which must exist; None
    (recorded as "system" in the audit log) when no name is given."""
    if not username:
        return None
    actor = get_user_model().objects.filter(username=username).first()
    if actor is None:
        raise CliError(f"{option}: no user named {username!r}", field=option)
    return actor


def check_acts_on(actor, experiment, option: str = "--as") -> None:
    """CliError naming ``option`` unless ``actor`` (None: the operator) may act on
    ``experiment``: a member of its team, or someone who acts on every team."""
    if actor is None or may_act_on(actor, experiment):
        return
    name = actor.get_username()
    raise CliError(
        f"{option} {name}: experiment {experiment.key!r} belongs to team {experiment.team.name!r}, which "
        f"{name!r} is not in; nothing changed (an administrator adds users to teams)",
        field=option,
    )


# argparse's words for the option at fault: "argument --status: invalid choice ..." and
# "the following arguments are required: --reason, key".
_ARGUMENT = re.compile(r"argument ([^:]+?):|arguments are required: ([^,\s]+)")


class JsonCommand(BaseCommand):
    """A command with ``--json`` (add it with ``add_json_argument``): ``emit`` the one result
    document, ``say`` lines for a person (stdout, or stderr under --json); a CommandError
    becomes the error document."""

    json = False
    _json_argv = False
    _emitted = False

    def execute(self, *args, **options):
        self.json = bool(options.get("json"))
        self._emitted = False
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            if self.json and not self._emitted:
                self.emit(error_document(exc))
            raise
        except Exception as exc:  # a bug or an unexpected service error: still one document
            if self.json and not self._emitted:
                self.emit(error_document(CommandError(f"{type(exc).__name__}: {exc}")))
            raise

    def emit(self, payload) -> None:
        if self._emitted:
            raise RuntimeError("a --json command prints one document")
        self._emitted = True
        self.stdout.write(dumps(payload))

    def say(self, text: str = "") -> None:
        (self.stderr if self.json else self.stdout).write(text, style_func=str)

    def progress(self, options, unit: str) -> Progress:
        tty = self.stderr.isatty()
        wanted = options.get("progress")
        return Progress(
            lambda text: self.stderr.write(text, ending="", style_func=str),
            self.stderr.flush,
            tty=tty,
            enabled=tty if wanted is None else wanted,
            unit=unit,
        )

    # Usage errors on the real command line (argparse's exit 2) get the JSON document too.
    def run_from_argv(self, argv):
        self._json_argv = "--json" in argv[2:]
        return super().run_from_argv(argv)

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        if self._json_argv:
            for p in _parsers(parser):
                p.error = functools.partial(self._usage_error, p)
        return parser

    def _usage_error(self, parser, message: str):
        found = _ARGUMENT.search(message)
        field = (found.group(1) or found.group(2)).split("/")[0] if found else None
        self.stdout.write(dumps(error_document(CliError(message, field=field, returncode=2))))
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"{parser.prog}: error: {message}\n")
        sys.exit(2)


def _parsers(parser):
    """The parser and its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)
