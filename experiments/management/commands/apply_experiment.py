import sys

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from experiments import services
from experiments.document import DocumentError
from experiments.loading import load_document_file, load_document_text


class Command(BaseCommand):
    help = "Create or update an experiment from a YAML or JSON document (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("file", help="path to the document, or - for standard input")
        parser.add_argument("--as", dest="username", help="user recorded in the audit log")

    def handle(self, *args, file, username=None, **options):
        actor = None
        if username:
            actor = get_user_model().objects.filter(username=username).first()
            if actor is None:
                raise CommandError(f"--as: no user named {username!r}")
        try:
            raw = load_document_text(sys.stdin.read(), "stdin") if file == "-" else load_document_file(file)
            result = services.apply_document(raw, actor=actor)
        except DocumentError as exc:
            lines = "\n".join(f"  {e}" for e in exc.errors)
            raise CommandError(f"{file}: rejected, nothing changed:\n{lines}") from None
        key = result.experiment.key
        if result.created:
            self.stdout.write(f"created {key}")
        elif not result.changes:
            self.stdout.write(f"unchanged {key}")
        else:
            self.stdout.write(f"updated {key}")
        for change in result.changes:
            self.stdout.write(f"  {change}")
