"""python manage.py apply_experiment FILE|- [--as NAME] [--json]

--json: {"experiment": KEY, "result": "created" | "updated" | "unchanged", "changes": [str]};
a rejected document exits 1 with {"error": {"message", "field", "errors": [{"field",
"message"}]}}, one entry per field error (field paths as the API's 400 names them).
"""

import sys

from experiments import services
from experiments.cli import CliError, JsonCommand, actor_for, add_json_argument
from experiments.document import DocumentError
from experiments.loading import load_document_file, load_document_text


class Command(JsonCommand):
    help = "Create or update an experiment from a YAML or JSON document (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("file", help="path to the document, or - for standard input")
        parser.add_argument(
            "--as",
            dest="username",
            help="the user who acts (recorded in the audit log; bound by their teams and permissions)",
        )
        add_json_argument(parser)

    def handle(self, *args, file, username=None, **options):
        actor = actor_for(username)
        try:
            raw = load_document_text(sys.stdin.read(), "stdin") if file == "-" else load_document_file(file)
            result = services.apply_document(raw, actor=actor)
        except DocumentError as exc:
            # One error is one line; several are listed a line each under it.
            lines = f" {exc.errors[0]}" if len(exc.errors) == 1 else "".join(f"\n  {e}" for e in exc.errors)
            raise CliError(
                f"{file}: rejected, nothing changed:{lines}",
                errors=[(e.path, e.message) for e in exc.errors],
            ) from None
        key = result.experiment.key
        outcome = "created" if result.created else "updated" if result.changes else "unchanged"
        if self.json:
            self.emit({"experiment": key, "result": outcome, "changes": result.changes})
            return
        self.say(f"{outcome} {key}")
        for change in result.changes:
            self.say(f"  {change}")
