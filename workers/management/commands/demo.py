"""make demo: the main job on the embedded defaults, then the admin and dashboards.

workers/demo.py says how the demo is calibrated and why.

1. Migrate the database and the embedded sample store (chDB).
2. Cut the chat-sized slice of the shipped Azure code trace and add both files to the trace
   directory.
3. Start three vLLM-compatible simulators (FP16, AWQ, AWQ + FlashAttention-2 profiles, each a
   deployment of 4 engines) and load the demo experiment pointing at them, with each
   deployment's price per hour; start it (this publishes its weights).
4. Replay the first requests of the slice at their recorded arrivals, sped up, to every variant
   at once (mirror: a paired comparison on identical traffic).
5. Print the per-variant SLA table of that run.
6. Search the SLA capacity of the control and of each variant that met the target
   (manage.py capacity: each deployment alone, Poisson arrivals of the same requests, two
   steps, each starting where the replay's verdict points: demo.start_rate) and print it with the price per million requests; then serve the admin and
   dashboards until Ctrl-C.

--json (with --no-serve) prints one document at the end: {"experiment", "trace": {"source",
"path", "rows", "of", "prompt_budget", "answer_budget"}, "simulators": [{"variant", "url",
"profile", "replicas"}], "replay": replay --json's document, "report": sla_report --json's,
"capacity": capacity --json's plus "seconds" and "summary" (null with --capacity-steps 0),
"warnings": [sentence] (the replay lagged as on a busy machine), "seconds"}.
"""

import io
import json
import re
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command

from analysis.answer_fidelity import identical_line, identical_share
from experiments import services
from experiments.cli import (
    CliError,
    JsonCommand,
    add_json_argument,
    add_progress_arguments,
    require_secret_key,
)
from experiments.models import Experiment
from traces.storage import TraceError, store_file
from workers import demo
from workers.models import ReplayRun

TRACE = demo.TRACE
# The capacity command's lines about each step ("fp16: step at 128 req/s ...", "fp16: 128 req/s
# misses (...)", "fp16: meets 99.20% at 32 req/s, ..."); its own table is left out (the demo
# prints one table for all variants).
STEP_LINE = re.compile(r"^[\w.-]+: ")


class Command(JsonCommand):
    help = "Replay the demo experiment on the embedded defaults, print its SLA table, serve the admin."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000, help="admin and dashboards port")
        parser.add_argument(
            "--limit", type=int, default=demo.LIMIT, help="requests of the slice to replay (0: all)"
        )
        parser.add_argument("--speed", type=float, default=demo.SPEED, help="time compression of the trace")
        parser.add_argument(
            "--replicas", type=int, default=demo.REPLICAS, help="engines per simulated deployment"
        )
        parser.add_argument(
            "--prompt-budget",
            type=int,
            default=demo.PROMPT_BUDGET,
            help="replay the requests with prompts up to this many tokens (0: any)",
        )
        parser.add_argument(
            "--answer-budget",
            type=int,
            default=demo.ANSWER_BUDGET,
            help="... and answers up to this many tokens (0: any)",
        )
        parser.add_argument(
            "--capacity-steps",
            type=int,
            default=demo.CAPACITY_MAX_STEPS,
            help="steps per variant of the capacity search (0: no search)",
        )
        parser.add_argument(
            "--capacity-requests",
            type=int,
            help=f"requests per capacity step at most (default {demo.CAPACITY_STEP_REQUESTS})",
        )
        parser.add_argument("--no-serve", action="store_true", help="stop after the SLA and capacity tables")
        parser.add_argument(
            "--create-demo-user",
            action="store_true",
            help="create the demo/demo superuser even on a configured database (ABPLAT_DATABASE_URL)",
        )
        add_json_argument(parser)
        add_progress_arguments(parser)

    def handle(
        self, *args, port: int, limit: int | None, speed: float, replicas: int, no_serve: bool, **options
    ):
        started = time.monotonic()
        if self.json and not no_serve:
            raise CliError("--json prints the demo's result and ends: add --no-serve", field="--json")
        steps, step_requests = options["capacity_steps"], options["capacity_requests"]
        if steps and not 2 <= steps <= 100:
            raise CliError(f"--capacity-steps must be 0 or 2 to 100, got {steps}", field="--capacity-steps")
        if replicas < 1:
            raise CliError(f"--replicas must be at least 1, got {replicas}", field="--replicas")
        if not no_serve:  # the admin it serves at the end signs sessions: said now, not then
            require_secret_key("manage.py demo", instead=", or pass --no-serve")
        call_command("migrate", verbosity=0)
        call_command("clickhouse_migrate", verbosity=0)
        demo_user = self.demo_user(options["create_demo_user"])

        # 2. The slice. Both files go to the trace directory too: the admin's "Start a replay"
        # and the API read traces from there only (this command reads local paths).
        source = Path(settings.BASE_DIR) / TRACE
        prompts, answers = options["prompt_budget"], options["answer_budget"]
        try:
            cut = demo.write_slice(source, settings.VAR_DIR / "demo", prompts or None, answers or None)
        except ValueError as exc:
            raise CliError(str(exc), field="--prompt-budget") from None
        for path in (source, cut.path):
            try:
                store_file(path, user=demo_user)
            except TraceError as exc:
                self.stderr.write(f"{path.name} not added to the trace directory: {exc}")

        # 3. Simulators on the document's ports (or free ones, written back to the variants).
        doc = demo.load_document(replicas)
        sims = []
        try:
            experiment = self.deploy(doc, sims, replicas, demo_user)
            if experiment is None:
                stop(sims)
                return
            simulators = [
                {"variant": v["key"], "url": h.url, "profile": h.profile, "replicas": replicas}
                for v, h in zip(doc["variants"], sims)
            ]
            # 4. The main job.
            shown = min(limit, cut.rows) if limit else cut.rows
            which = f"the first {shown:,} of the" if shown < cut.rows else "the"
            self.say(
                f"\nreplaying {which} {cut.describe()} of {TRACE}, at {speed:g}x, to every variant at once "
                f"(mirror: each sees the same requests) through {experiment.key}"
            )
            progress = {None: [], True: ["--progress"], False: ["--no-progress"]}[options.get("progress")]
            replay_args = [
                "replay",
                experiment.key,
                "--trace",
                str(cut.path),
                "--mode",
                "mirror",
                "--speed",
                str(speed),
            ]
            if limit:
                replay_args += ["--limit", str(limit)]
            replayed = None
            if self.json:
                out = io.StringIO()
                call_command(*replay_args, *progress, "--json", stdout=out)
                replayed = json.loads(out.getvalue())
            else:
                call_command(*replay_args, *progress)
            run = ReplayRun.objects.filter(experiment=experiment).first()
            warnings = busy_warning(run)
            for line in warnings:
                self.stderr.write(f"warning: {line}")

            # 5. The SLA table of this run (the JSON report says which variants met the target;
            # the table is then read from the report cache).
            out = io.StringIO()
            call_command("sla_report", experiment.key, "--run", str(run.pk), "--json", stdout=out)
            report = json.loads(out.getvalue())
            if not self.json:
                self.stdout.write("")
                call_command("sla_report", experiment.key, "--run", str(run.pk))
            fidelity = {v["key"]: v.get("fidelity") for v in report["variants"]}
            lines = [identical_line(k, f) for k, f in fidelity.items()]
            if any(lines):
                self.say("")
                for line in filter(None, lines):
                    self.say(line)

            # 6. Capacity: of the control and of every variant that met the target.
            capacity = None
            starts = demo.capacity_candidates(report["variants"], report["experiment"]["sla"]["target"])
            searched = list(starts)
            if steps and searched:
                verdicts = {v["key"]: v["verdict"]["verdict"] for v in report["variants"]}
                firsts = ", ".join(f"{k} from {r:g} req/s ({verdicts[k]} above)" for k, r in starts.items())
                met = any(verdicts[k] == "meets" for k in searched)
                which = "the variants that met the target" if met else "the variant closest to the target"
                self.say(
                    f"\nsearching the SLA capacity of {' and '.join(searched)} (the control and {which}): "
                    f"each deployment alone, steady (Poisson) arrivals of the same requests, "
                    f"{firsts}, then halving or doubling up to {demo.CAPACITY_MAX_RPS:g} req/s, {steps} steps at most"
                )
                capacity = self.capacity(experiment, cut, starts, steps, step_requests, fidelity)
                self.say("")
                self.say(render_capacity(capacity, replicas, fidelity, report["experiment"]["control"]))
                self.say(capacity["summary"])
        except BaseException:
            stop(sims)
            raise
        seconds = round(time.monotonic() - started, 1)
        if self.json or no_serve:
            stop(sims)
        if self.json:
            self.emit(
                {
                    "experiment": experiment.key,
                    "trace": {
                        "source": TRACE,
                        "path": str(cut.path),
                        "rows": cut.rows,
                        "of": cut.of,
                        "prompt_budget": prompts or None,
                        "answer_budget": answers or None,
                    },
                    "simulators": simulators,
                    "replay": replayed,
                    "report": report,
                    "capacity": capacity,
                    "warnings": warnings,
                    "seconds": seconds,
                }
            )
            return
        self.stdout.write(f"\ndemo job took {seconds:.0f} s")
        if no_serve:
            return
        login = "login demo / demo" if demo_user is not None else "log in as a superuser (createsuperuser)"
        self.stdout.write(
            f"\nAdmin:     http://127.0.0.1:{port}/admin/  ({login})\n"
            f"Dashboard: http://127.0.0.1:{port}/dashboards/{experiment.key}/?run={run.pk}  (the replay; "
            "each capacity step is a run of its own)\n"
            f"Capacity:  http://127.0.0.1:{port}/capacity/{experiment.key}/\n"
            f"API docs:  http://127.0.0.1:{port}/api/docs/\n"
            "Ctrl-C stops the server and the simulators.\n"
        )
        try:
            call_command("runserver", f"127.0.0.1:{port}", use_reloader=False)
        finally:
            stop(sims)

    def deploy(self, doc: dict, sims: list, replicas: int, demo_user) -> Experiment | None:
        """Start a simulator per variant (``sims`` gets their handles), apply the document and
        start the experiment; None when it is concluded."""
        sims.extend(demo.start_simulators(doc, replicas, say=self.say))
        experiment = Experiment.objects.filter(key=doc["key"]).first()
        if experiment is not None and experiment.status == Experiment.Status.CONCLUDED:
            if self.json:
                raise CliError(f"{doc['key']} is concluded; run `make clean` for a fresh demo", field="key")
            self.stderr.write(f"{doc['key']} is concluded; run `make clean` for a fresh demo")
            return None
        experiment = services.apply_document(doc, actor=demo_user).experiment
        if experiment.status == Experiment.Status.DRAFT:
            services.transition(experiment, "start", demo_user, reason="demo")
        elif experiment.status == Experiment.Status.PAUSED:
            services.transition(experiment, "resume", demo_user, reason="demo")
        return experiment

    def capacity(
        self,
        experiment: Experiment,
        cut: demo.Slice,
        starts: dict[str, float],
        steps: int,
        step_requests: int | None,
        fidelity: dict[str, dict | None],
    ) -> dict:
        """manage.py capacity of ``variants`` on the slice (twice over); its document, the
        search's wall time and the sentence the demo ends with (``fidelity``: the mirror replay's
        answers against the control's, by variant)."""
        t0 = time.monotonic()
        trace = demo.repeat_slice(cut, demo.CAPACITY_PASSES)
        step_requests = min(step_requests or demo.CAPACITY_STEP_REQUESTS, cut.rows * demo.CAPACITY_PASSES)
        out = io.StringIO()
        call_command(
            "capacity",
            experiment.key,
            *demo.capacity_arguments(trace, max(step_requests, 50), steps, starts),
            "--variants",
            ",".join(starts),
            "--json",
            stdout=out,
            stderr=_Lines(lambda line: self.stderr.write(line), STEP_LINE),
        )
        doc = json.loads(out.getvalue())
        doc["seconds"] = round(time.monotonic() - t0, 1)
        doc["summary"] = summary(doc, experiment, fidelity)
        return doc

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


def busy_warning(run: ReplayRun) -> list[str]:
    """A sentence when the replay lagged its schedule the way a busy machine makes it lag."""
    lags = [x for x in run.shards.values_list("lag_p99_ms", flat=True) if x is not None]
    if not lags or max(lags) <= demo.BUSY_LAG_MS:
        return []
    return [
        f"the replay's schedule lag p99 was {max(lags):.0f} ms (over {demo.BUSY_LAG_MS:g}): this machine was "
        "busy with other work, its client read the trace's bursts late and measured their first tokens late, "
        "so every variant looks worse than it is; run the demo again on a quiet machine"
    ]


def stop(sims: list) -> None:
    for handle in sims:
        handle.stop()
    sims.clear()


class _Lines(io.TextIOBase):
    """A text stream that passes on the whole lines matching ``pattern`` to ``write``."""

    def __init__(self, write, pattern: re.Pattern) -> None:
        self._write, self._pattern, self._tail = write, pattern, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._tail = (self._tail + text).split("\n")
        for line in lines:
            if self._pattern.match(line):
                self._write(line)
        return len(text)


def _rate(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def render_capacity(doc: dict, replicas: int, fidelity: dict[str, dict | None], control: str) -> str:
    """The demo's capacity table, best value first (capacity per unit of price), with each
    variant's answers identical to the control's in the mirror replay ("ref": the control)."""
    head = (
        f"{'variant':<10}{'engines':>8}{'capacity req/s':>16}{'not met at':>12}{'limited by':>12}"
        f"{'price/h':>10}{'per 1M requests':>17}{'per 1M out tok':>16}{'identical':>11}{'steps':>7}{'search s':>10}"
    )
    lines = [
        f"SLA capacity (search {doc['search']}, {doc['seconds']:.0f} s): the highest rate each deployment "
        f"carries alone, under steady arrivals, with {doc['target']:.2%} of requests within the SLA with "
        "confidence; the trace's own bursts, above, are harsher",
        head,
        "-" * len(head),
    ]
    for v in doc["ranking"]:
        r = doc["variants"][v]
        c = r.get("cost") or {}
        cur = c.get("currency", "")

        def money(x, cur=cur):
            return "-" if x is None else f"{x:,.2f} {cur}".strip()

        lines.append(
            f"{v:<10}{replicas:>8}{_rate(r['capacity_rps']):>16}{_rate(r['upper_rps']):>12}{r['limited_by']:>12}"
            f"{money(c.get('per_hour')):>10}{money(c.get('per_million_requests')):>17}"
            f"{money(c.get('per_million_output_tokens')):>16}"
            f"{'ref' if v == control else identical_share(fidelity.get(v)):>11}"
            f"{len(r['steps']):>7}{r['search_s']:>10.0f}"
        )
    return "\n".join(lines)


def summary(doc: dict, experiment: Experiment, fidelity: dict[str, dict | None]) -> str:
    """The demo's last line (workers.demo.capacity_summary) for this experiment's control."""
    control = experiment.control_key()
    return demo.capacity_summary(doc, control, fidelity)
