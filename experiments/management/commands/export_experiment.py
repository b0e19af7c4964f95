"""python manage.py export_experiment KEY [--format yaml|json] [--json]

Prints the experiment's document (the shape apply_experiment and the API take). ``--json`` is
``--format json`` (the document itself, nothing around it), and an unknown key prints the
--json error document.
"""

import yaml

from experiments.cli import CliError, JsonCommand, add_json_argument, dumps, experiment_named
from experiments.services import export_document


class Command(JsonCommand):
    help = "Print an experiment as a document that apply_experiment accepts unchanged."

    def add_arguments(self, parser):
        parser.add_argument("key")
        parser.add_argument("--format", choices=["yaml", "json"], help="default: yaml (json with --json)")
        add_json_argument(parser)

    def handle(self, *args, key, format, **options):
        if self.json and format == "yaml":
            raise CliError("--json prints JSON: leave out --format yaml", field="--format")
        experiment = experiment_named(key)
        doc = export_document(experiment)
        if self.json:
            self.emit(doc)
        elif format == "json":
            self.stdout.write(dumps(doc))
        else:
            self.stdout.write(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).rstrip())
