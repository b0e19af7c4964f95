import json

import yaml
from django.core.management.base import BaseCommand, CommandError

from experiments.models import Experiment
from experiments.services import export_document


class Command(BaseCommand):
    help = "Print an experiment as a document that apply_experiment accepts unchanged."

    def add_arguments(self, parser):
        parser.add_argument("key")
        parser.add_argument("--format", choices=["yaml", "json"], default="yaml")

    def handle(self, *args, key, format, **options):
        experiment = Experiment.objects.filter(key=key).first()
        if experiment is None:
            raise CommandError(f"no experiment with key {key!r}")
        doc = export_document(experiment)
        if format == "json":
            self.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False))
        else:
            self.stdout.write(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).rstrip())
