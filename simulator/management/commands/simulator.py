"""python manage.py simulator --port P [--profile NAME] [--serve NAME=PORT ...]: simulator/cli.py.

python manage.py simulator --experiment KEY [--replicas N]: every variant of the experiment on
its endpoint's port, with its model and the profile named like it (simulator/experiment.py)."""

from __future__ import annotations

from django.core.management.base import CommandError

from experiments.cli import Command as AbplatCommand
from experiments.cli import experiment_named
from experiments.services import export_document
from simulator import cli
from simulator.app import MAX_LOGPROBS
from simulator.experiment import served_variants
from simulator.serve import run_forever
from simulator.tokens import DEFAULT_TOKENIZER


class Command(AbplatCommand):
    help = (
        cli.DESCRIPTION + " --experiment KEY serves every variant of an experiment where its endpoint says."
    )

    def add_arguments(self, parser) -> None:
        cli.add_arguments(parser)
        parser.add_argument(
            "--experiment",
            metavar="KEY",
            help="serve each variant of this experiment on its endpoint's port, with its model and "
            "the profile named like the variant (default for other names)",
        )

    def handle(self, *args, **opts) -> None:
        try:
            if opts["experiment"]:
                self.serve_experiment(opts)
            else:
                cli.serve(opts)
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    def serve_experiment(self, opts: dict) -> None:
        key = opts["experiment"]
        for option in ("port", "profile", "model"):
            if opts[option]:
                raise ValueError(
                    f"--{option} with --experiment {key}: the experiment's variants say where and what"
                )
        if opts["serve"]:
            raise ValueError(f"--serve with --experiment {key}: the experiment's variants say where and what")
        if opts["replicas"] < 1:
            raise ValueError(f"--replicas must be at least 1, got {opts['replicas']}")
        max_logprobs = cli.check_max_logprobs(opts.get("max_logprobs", MAX_LOGPROBS))
        experiment = experiment_named(key, option="--experiment")
        served = served_variants(export_document(experiment)["variants"])
        for s in served:
            self.stdout.write(
                f"{key}: variant {s.variant} -> profile {s.profile}, model {s.model}, port {s.port}"
            )
        self.stdout.flush()
        try:
            run_forever(
                [(s.profile, s.port, s.model) for s in served],
                replicas=opts["replicas"],
                tokenizer=opts.get("tokenizer") or DEFAULT_TOKENIZER,
                max_logprobs=max_logprobs,
            )
        except KeyboardInterrupt:
            pass
