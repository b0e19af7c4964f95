"""What abplat's management commands share: ``--json`` output and errors, progress on stderr,
and the acting user (docs/command-line.md).

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

Errors (``Command``, every abplat command's base): a refusal, or a failure the command knows
(the embedded store locked by another process, a store down, a bad setting), prints one line on
stderr, ``abplat: <what>: <what to do>``, and exits 1; no class name, no traceback (``--traceback``
shows it). ``experiment_named`` is the one "no such experiment" with its "did you mean".
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import sys
from collections.abc import Iterable
from urllib.parse import urlsplit

from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, SystemCheckError
from django.core.serializers.json import DjangoJSONEncoder

from experiments.models import Experiment
from experiments.teams import may_act_on
from experiments.weights.errors import StoreUnavailable as WeightsStoreUnavailable
from samples.store import NotMigrated, SchemaMismatch, StoreLocked
from samples.store import StoreUnavailable as SampleStoreUnavailable
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


# Failures a command knows and whose message says what to do: one line, never a traceback.
# chDB held by another process (which one, and what to stop); a store down; the sample store
# without the migrations this code needs (the command that applies them).
KNOWN_FAILURES: dict[type[BaseException], str] = {
    StoreLocked: "",
    NotMigrated: "",
    SchemaMismatch: "",
    SampleStoreUnavailable: "sample store unavailable: ",
    WeightsStoreUnavailable: "weights store unavailable: ",
    ImproperlyConfigured: "configuration error: ",
}


def known_failure(exc: BaseException) -> CliError | None:
    """``exc`` as the CliError a person reads, when it is one of KNOWN_FAILURES or the Django
    database unmigrated or down; else None."""
    for kind, prefix in KNOWN_FAILURES.items():
        if isinstance(exc, kind):
            return CliError(f"{prefix}{exc}")
    return database_failure(exc)


# "no such table: x" (SQLite), 'relation "x" does not exist' (PostgreSQL): the tables are missing.
_NO_TABLE = re.compile(r"no such table: (\S+)|relation \"([^\"]+)\" does not exist")


def database_failure(exc: BaseException) -> CliError | None:
    """The Django database without its tables (a command run before ``migrate``) or unreachable,
    as one line naming the database (its name and host, never its password); else None."""
    from django.db import connection
    from django.db.utils import OperationalError, ProgrammingError

    if not isinstance(exc, OperationalError | ProgrammingError):
        return None
    db = connection.settings_dict
    where = f"{db.get('NAME')}" + (f" on {db['HOST']}" if db.get("HOST") else "")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    missing = _NO_TABLE.search(text)
    if missing:
        return CliError(
            f"the database {where} has no table {missing.group(1) or missing.group(2)}: it is not set up; "
            "run `.venv/bin/python manage.py migrate` (make demo does) and try again"
        )
    if isinstance(exc, OperationalError):
        return CliError(f"database unavailable ({where}): {text}")
    return None


def experiment_named(key: str, queryset=None, option: str = "key") -> Experiment:
    """The experiment whose key is ``key`` (from ``queryset``, default every experiment), or a
    CliError naming ``option`` that says what to type instead: the closest key ("did you
    mean"), else where the keys are listed."""
    queryset = Experiment.objects.all() if queryset is None else queryset
    found = queryset.filter(key=key).first()
    if found is not None:
        return found
    keys = list(queryset.values_list("key", flat=True))  # only what the caller may see
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {close[0]!r}?"
    elif keys:
        hint = "`manage.py experiment list` lists them"
    else:
        hint = "there are none yet: `manage.py apply_experiment FILE` makes one"
    raise CliError(f"no experiment {key!r}; {hint}", field=option)


def require_secret_key(option: str, instead: str = "") -> None:
    """A CliError naming ``option`` unless Django's settings hold a secret key: what serves the
    web app signs sessions and forms with it, and Django refuses an empty one (debug off and no
    ABPLAT_SECRET_KEY). Said before the command does anything, not at the first login.
    ``instead``: another way out the command offers."""
    from django.conf import settings

    try:
        settings.SECRET_KEY  # noqa: B018 - Django raises on an empty key
    except ImproperlyConfigured:
        raise CliError(
            f"{option}: ABPLAT_SECRET_KEY is not set: the web app signs sessions and forms with it "
            "(at least 50 random characters) when ABPLAT_DEBUG is off; for development set "
            f"ABPLAT_DEBUG=true (`make dev-env` writes it to .env){instead}",
            field=option,
        ) from None


def broker_name(url: str) -> str:
    """A broker URL as a person may read it in a message: scheme, host, port and path, without
    the user and password."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


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
        "--progress",
        dest="progress",
        action="store_const",
        const=True,
        default=None,
        help="draw progress (rate, elapsed, ETA) on stderr even when it is not a terminal "
        "(plain lines, one every 10 s); default: only on a terminal",
    )
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


class Command(BaseCommand):
    """An abplat command: a refusal (CommandError) or a known failure (KNOWN_FAILURES) is one
    line on stderr, ``abplat: <message>``, and the exit status (module docstring); called in
    a process (call_command) it raises a CliError with that message instead."""

    def execute(self, *args, **options):
        try:
            try:
                return super().execute(*args, **options)
            except Exception as exc:
                known = known_failure(exc)
                if known is None:
                    raise
                raise known from exc
        except SystemCheckError:
            raise  # Django formats the checks' report itself
        except CommandError as exc:
            self.failed(exc)
            if getattr(self, "_called_from_command_line", False) and not options.get("traceback"):
                self.stderr.write(f"abplat: {exc}")
                sys.exit(exc.returncode)
            raise
        except Exception as exc:
            self.crashed(exc)
            raise

    def failed(self, exc: CommandError) -> None:
        """A refusal, before it is printed (JsonCommand prints its document)."""

    def crashed(self, exc: Exception) -> None:
        """A failure the command does not know (a bug): Django prints its traceback."""


class JsonCommand(Command):
    """A command with ``--json`` (add it with ``add_json_argument``): ``emit`` the one result
    document, ``say`` lines for a person (stdout, or stderr under --json); a CommandError
    becomes the error document."""

    json = False
    _json_argv = False
    _emitted = False

    def execute(self, *args, **options):
        self.json = bool(options.get("json"))
        self._emitted = False
        return super().execute(*args, **options)

    def failed(self, exc: CommandError) -> None:
        if self.json and not self._emitted:
            self.emit(error_document(exc))

    def crashed(self, exc: Exception) -> None:  # still one document
        if self.json and not self._emitted:
            self.emit(error_document(CommandError(f"{type(exc).__name__}: {exc}")))

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
