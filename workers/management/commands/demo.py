"""make demo: the main job on the embedded defaults, then the admin and dashboards.

1. Migrate the database and the embedded sample store (chDB).
2. Start three vLLM-compatible simulators (FP16, AWQ, AWQ + FlashAttention-2 profiles, each a
   deployment of 4 engines: the trace is a whole production service's traffic) and load the
   demo experiment pointing at them; start it (this publishes its weights).
3. Replay a slice of the real Azure code trace through the live router (split mode).
4. Print the per-variant SLA table, then serve the admin and dashboards until Ctrl-C.

--json (with --no-serve) prints one document at the end: {"experiment", "simulators":
[{"variant", "url", "profile", "replicas"}], "replay": replay --json's document, "report":
sla_report --json's, "seconds"}.
"""

import io
import json
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command

from experiments import services
from experiments.cli import CliError, JsonCommand, add_json_argument, add_progress_arguments
from experiments.loading import load_document_file
from experiments.models import Experiment
from simulator.serve import start_subprocess
from traces.storage import TraceError, store_file
from workers.models import ReplayRun

DEMO_DOCUMENT = Path(settings.BASE_DIR) / "demo" / "ttft-optimizations.yaml"
TRACE = "data/traces/azure_llm_2023_code.csv"


class Command(JsonCommand):
    help = "Replay the demo experiment on the embedded defaults, print its SLA table, serve the admin."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000, help="admin and dashboards port")
        parser.add_argument("--limit", type=int, default=1000, help="requests of the trace to replay")
        parser.add_argument("--speed", type=float, default=4.0, help="time compression of the trace")
        parser.add_argument("--replicas", type=int, default=4, help="engines per simulated deployment")
        parser.add_argument("--no-serve", action="store_true", help="stop after the SLA table")
        parser.add_argument(
            "--create-demo-user", action="store_true",
            help="create the demo/demo superuser even on a configured database (ABPLAT_DATABASE_URL)",
        )  # fmt: skip
        add_json_argument(parser)
        add_progress_arguments(parser)

    def handle(self, *args, port: int, limit: int, speed: float, replicas: int, no_serve: bool, **options):
        started = time.monotonic()
        if self.json and not no_serve:
            raise CliError("--json prints the demo's result and ends: add --no-serve", field="--json")
        call_command("migrate", verbosity=0)
        call_command("clickhouse_migrate", verbosity=0)
        demo_user = self.demo_user(options["create_demo_user"])
        # The shipped trace in the trace directory too: the admin's "Start a replay" and the API
        # read traces from there only (this command reads it from data/traces/, an operator's path).
        try:
            store_file(Path(settings.BASE_DIR) / TRACE, user=demo_user)
        except TraceError as exc:
            self.stderr.write(f"{TRACE} not added to the trace directory: {exc}")

        # 2. Simulators on the document's ports (or free ones, written back to the variants).
        doc = load_document_file(DEMO_DOCUMENT)
        sims = []
        for variant in doc["variants"]:
            wanted = int(variant["endpoint"].rsplit(":", 1)[1].split("/")[0])
            try:
                handle = start_subprocess(
                    variant["key"], port=wanted, model=variant["model"], replicas=replicas
                )
            except (OSError, RuntimeError):
                handle = start_subprocess(variant["key"], port=0, model=variant["model"], replicas=replicas)
            variant["endpoint"] = handle.url + "/v1"
            sims.append(handle)
            self.say(
                f"simulator {variant['key']:8s} {handle.url} (profile {handle.profile}, {replicas} replicas)"
            )
        experiment = Experiment.objects.filter(key=doc["key"]).first()
        if experiment is not None and experiment.status == Experiment.Status.CONCLUDED:
            for handle in sims:
                handle.stop()
            if self.json:
                raise CliError(f"{doc['key']} is concluded; run `make clean` for a fresh demo", field="key")
            self.stderr.write(f"{doc['key']} is concluded; run `make clean` for a fresh demo")
            return
        result = services.apply_document(doc, actor=demo_user)
        experiment = result.experiment
        if experiment.status == Experiment.Status.DRAFT:
            services.transition(experiment, "start", demo_user, reason="demo")
        elif experiment.status == Experiment.Status.PAUSED:
            services.transition(experiment, "resume", demo_user, reason="demo")

        # 3. The main job.
        self.say(f"\nreplaying {limit} requests of {TRACE} at {speed:g}x through {experiment.key}")
        progress = {None: [], True: ["--progress"], False: ["--no-progress"]}[options.get("progress")]
        replay_args = [
            "replay",
            experiment.key,
            "--trace",
            TRACE,
            "--limit",
            str(limit),
            "--speed",
            str(speed),
        ]
        if self.json:
            out = io.StringIO()
            call_command(*replay_args, *progress, "--json", stdout=out)
            replayed = json.loads(out.getvalue())
        else:
            call_command(*replay_args, *progress)
        run = ReplayRun.objects.filter(experiment=experiment).first()

        # 4. The SLA table of this run.
        if self.json:
            out = io.StringIO()
            call_command("sla_report", experiment.key, "--run", str(run.pk), "--json", stdout=out)
            for handle in sims:
                handle.stop()
            self.emit({
                "experiment": experiment.key,
                "simulators": [
                    {"variant": v["key"], "url": h.url, "profile": h.profile, "replicas": replicas}
                    for v, h in zip(doc["variants"], sims)
                ],
                "replay": replayed, "report": json.loads(out.getvalue()),
                "seconds": round(time.monotonic() - started, 1),
            })  # fmt: skip
            return
        self.stdout.write("")
        call_command("sla_report", experiment.key, "--run", str(run.pk))
        self.stdout.write(f"\ndemo job took {time.monotonic() - started:.0f} s")
        if no_serve:
            for handle in sims:
                handle.stop()
            return
        login = "login demo / demo" if demo_user is not None else "log in as a superuser (createsuperuser)"
        self.stdout.write(
            f"\nAdmin:     http://127.0.0.1:{port}/admin/  ({login})\n"
            f"Dashboard: http://127.0.0.1:{port}/dashboards/{experiment.key}/\n"
            f"API docs:  http://127.0.0.1:{port}/api/docs/\n"
            "Ctrl-C stops the server and the simulators.\n"
        )
        call_command("runserver", f"127.0.0.1:{port}", use_reloader=False)

    def demo_user(self, create: bool):
        """The demo/demo superuser: made on the embedded SQLite database only (a throwaway on
        this machine) or with --create-demo-user; a configured database is someone's, where a
        superuser with a published password is a way in. None when not made."""
        user_model = get_user_model()
        user = user_model.objects.filter(username="demo").first()
        if user is not None:
            return user
        if settings.DATABASE_URL and not create:
            self.say(
                "not creating the demo/demo superuser: the database is the one ABPLAT_DATABASE_URL "
                "names, not the embedded SQLite file; pass --create-demo-user to create it there "
                "anyway, or use manage.py createsuperuser"
            )
            return None
        return user_model.objects.create_superuser("demo", "demo@localhost", "demo")
