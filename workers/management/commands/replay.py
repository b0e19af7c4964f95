"""python manage.py replay KEY --trace T [options] [--json] [--progress|--no-progress]

--json prints one document when the command ends: {"run": {...}, "plan": {...}}. ``run`` holds
what the audit log records of a run (workers.runs.describe: run, experiment, status, mode,
source, format, arrival, limit, sample_fraction, render_chat, wrap_prompt, total_requests,
expected_samples, samples_recorded, skipped_lines, outcomes, shards, error) and lag_p99_ms
(the worst shard's schedule lag p99, null before any send) and url (the API's); ``plan`` the
planned requests, samples, duration_s (null: closed loop) and rate. A run that ends other than
done exits 1 with {"error": {...}, "run": ..., "plan": ...}; a refused replay with the error
alone, ``field`` naming the option. Without --wait on real workers the document is the queued
run. Progress (samples recorded, rate, ETA) is drawn on stderr (experiments.cli). With --wait, a
run no worker has taken NO_WORKER_AFTER_S after it was queued is said so on stderr, once, with
the command that starts a worker; the command keeps waiting for one.
"""

import signal
import threading
import time

from django.conf import settings

from experiments.cli import (
    CliError,
    JsonCommand,
    add_json_argument,
    add_progress_arguments,
    broker_name,
    experiment_named,
)
from replay.arrivals import Arrival
from telemetry.logs import bind as bind_log_fields
from telemetry.logs import log_context
from workers.models import ReplayRun
from workers.runs import ReplayError, ReplayInputError, ReplayRequest, describe, lag_p99_ms, reap_abandoned
from workers.service import ReplayHandle, submit

# The option behind each field a refusal names (workers.runs words them as the API does).
OPTION_OF = {
    "trace": "--trace",
    "source": "--trace",
    "format": "--format",
    "limit": "--limit",
    "speed": "--speed",
    "concurrency": "--concurrency",
    "arrival.concurrency": "--concurrency",
    "sample_fraction": "--sample",
}

# How long a queued run may wait for a worker before --wait says that none has taken it.
NO_WORKER_AFTER_S = 10.0
WORKER_COMMAND = "celery -A abplat worker"


class Command(JsonCommand):
    help = "Replay recorded traffic through an experiment's variants and record one sample per request."
    # The follow loop's clock and pause between polls (tests move a clock of their own).
    clock = staticmethod(time.monotonic)
    pause = staticmethod(time.sleep)

    def add_arguments(self, parser):
        parser.add_argument("key", help="experiment key (must be running)")
        parser.add_argument(
            "--trace",
            required=True,
            help="trace or log: a local file (this shell's, or the project's data/traces/...), or an uploaded "
            "trace's name or sha256",
        )
        parser.add_argument(
            "--format", choices=["azure", "jsonl"], help="default: an uploaded trace's format, else azure"
        )
        parser.add_argument("--mode", choices=["split", "mirror"], default="split")
        parser.add_argument(
            "--arrival", choices=["recorded", "poisson", "gamma", "closed"], default="recorded"
        )
        parser.add_argument("--speed", type=float, default=1.0, help="recorded arrivals: time compression")
        parser.add_argument("--rate", type=float, default=0.0, help="poisson/gamma: requests per second")
        parser.add_argument("--cv", type=float, help="gamma: burstiness (gap CV, default 1)")
        parser.add_argument(
            "--concurrency", type=int, default=512, help="in flight per shard (closed loop: exactly)"
        )
        parser.add_argument("--limit", type=int, help="only the first N requests")
        parser.add_argument("--sample", type=float, default=1.0, help="keep this share of requests (0, 1]")
        parser.add_argument("--shards", type=int, help="shards to fan out to workers")
        parser.add_argument(
            "--skip-malformed", action="store_true", help="skip bad lines instead of rejecting"
        )
        parser.add_argument("--seed", type=int, default=0, help="user population and arrival seed")
        parser.add_argument("--wait", action="store_true", help="wait for the end (always with eager Celery)")
        parser.add_argument(
            "--render-chat",
            choices=["reject", "plain"],
            default="reject",
            help="chat `messages` for completions variants: reject the run (default), or render them "
            "as 'role: content' blocks ending in 'assistant:' (replay/shapes.py)",
        )
        parser.add_argument(
            "--wrap-prompt",
            action="store_true",
            help="send `prompt` lines to chat variants as one user message (default: reject the run)",
        )
        parser.add_argument(
            "--max-duration",
            type=float,
            metavar="SECONDS",
            help="refuse a planned schedule longer than this (default: setting REPLAY_MAX_DURATION_S, 2 h)",
        )
        parser.add_argument("--yes", action="store_true", help="run even if the plan exceeds --max-duration")
        parser.add_argument(
            "--no-preflight",
            action="store_true",
            help="skip probing each variant's GET /v1/models before the run starts",
        )
        add_json_argument(parser)
        add_progress_arguments(parser)

    def execute(self, *args, **options):
        # Its log lines carry the experiment, and the run once created (telemetry/logs.py).
        with log_context(experiment=options.get("key")):
            return super().execute(*args, **options)

    def handle(self, *args, **o):
        experiment = experiment_named(o["key"])
        try:
            cv = 1.0 if o["cv"] is None else o["cv"]
            if o["cv"] is not None and o["arrival"] != "gamma":
                raise ReplayError(
                    f"--cv applies to --arrival gamma, not {o['arrival']} (poisson gaps have cv 1)"
                )
            arrival = Arrival(
                mode=o["arrival"],
                speed=o["speed"],
                rate=o["rate"],
                cv=cv,
                concurrency=o["concurrency"],
                seed=o["seed"],
            )
            eager = settings.CELERY_TASK_ALWAYS_EAGER
            if eager:
                # The periodic check of eager mode: end runs whose owner process died.
                for ended in reap_abandoned():
                    self.stderr.write(f"run {ended}: its owner had died; ended")
            handle = submit(
                ReplayRequest(
                    experiment,
                    source=o["trace"],
                    local_paths=True,
                    source_format=o["format"],
                    mode=o["mode"],
                    arrival=arrival,
                    limit=o["limit"],
                    concurrency=o["concurrency"],
                    shards=o["shards"],
                    on_malformed="skip" if o["skip_malformed"] else "reject",
                    seed=o["seed"],
                    sample_fraction=o["sample"],
                    render_chat=o["render_chat"],
                    wrap_prompt=o["wrap_prompt"],
                    max_duration_s=o["max_duration"],
                    confirm=o["yes"],
                    check_variants=not o["no_preflight"],
                )
            )
        except ReplayInputError as exc:
            raise CliError(str(exc), field=OPTION_OF.get(exc.field, exc.field)) from None
        except (ReplayError, ValueError) as exc:
            raise CliError(str(exc)) from None
        run = handle.run
        bind_log_fields(run=run.pk)  # until execute() ends
        plan = run.plan
        self.say(str(plan))
        self.say(
            f"run {run.pk}: {run.total_requests} requests, {run.expected_samples} samples expected "
            f"({run.mode}, {run.shard_count} shard(s)); {run.skipped_lines} malformed line(s) skipped"
        )
        progress = self.progress(o, unit="samples")
        if eager:
            # Eager Celery: the run goes on in a thread of this process (it owns the embedded
            # sample store, workers.service) while this thread draws the progress bar.
            with self._stop_on_signals():
                self._follow(handle, progress)
                handle.wait()
            if handle.failure:
                run.refresh_from_db()
                raise CliError(f"run {run.pk} failed: {handle.failure}", context=result_document(run, plan))
        elif o["wait"]:
            with self._stop_on_signals():
                self._follow(handle, progress)
        else:
            self.say(
                f"queued on {broker_name(settings.CELERY_BROKER_URL)} for a worker (`{WORKER_COMMAND}`); "
                f"follow it with the API /api/replays/{run.pk}/ or the admin, or pass --wait"
            )
            if self.json:
                run.refresh_from_db()
                self.emit(result_document(run, plan))
            return
        run.refresh_from_db()
        document = result_document(run, plan)
        summary = document["run"]
        self.say(
            f"\nrun {run.pk} {run.status}: {summary['samples_recorded']}/{summary['expected_samples']} samples, "
            f"outcomes {summary['outcomes']}"
        )
        if summary["lag_p99_ms"] is not None:
            self.say(f"schedule lag p99 (worst shard): {summary['lag_p99_ms']:.2f} ms")
        if run.error:
            self.say(f"error: {run.error}")
        if run.status == ReplayRun.Status.FLUSHING:
            raise CliError(
                f"run {run.pk}: every request was sent and recorded, but the sample store is down: "
                f"samples wait in the spool ({settings.SPOOL_DIR}); run `manage.py flush_samples` "
                "when the store is back",
                context=document,
            )
        if run.status != ReplayRun.Status.DONE:
            by = f" ({self._signal})" if self._signal else ""
            raise CliError(f"run {run.pk} ended {run.status}{by}", context=document)
        if self.json:
            self.emit(document)

    _signal = ""

    class _StopOnSignals:
        """SIGINT (Ctrl-C) and SIGTERM cancel the run instead of killing the progress bar: the
        handler only notes the signal; the follow loop cancels the run (shards stop sending,
        requests in flight finish or are recorded as cancelled) and keeps following until the
        run has ended, so its counters and the store agree. Main thread only (where Python
        delivers signals)."""

        def __init__(self, command):
            self.command, self.previous = command, {}

        def __enter__(self):
            if threading.current_thread() is threading.main_thread():
                for signum in (signal.SIGINT, signal.SIGTERM):
                    self.previous[signum] = signal.signal(signum, self.handle)
            return self

        def handle(self, signum, frame):
            name = signal.Signals(signum).name
            if self.command._signal:
                self.command.stderr.write(f"\n{name}: already cancelling; waiting for requests in flight")
            self.command._signal = name

        def __exit__(self, *exc):
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)
            return False

    def _stop_on_signals(self):
        return self._StopOnSignals(self)

    def _follow(self, handle: ReplayHandle, progress) -> None:
        """Poll the run until it ends (or its eager thread does), drawing progress on stderr,
        cancel it once when a signal came, and say once when no worker has taken it."""
        run = handle.run
        queued_at, told = self.clock(), False
        while True:
            ended = handle.ended()
            p = run.progress()
            progress.update(p["recorded"], p["expected"], run.status, detail=f"{p['sent']} sent")
            if ended:
                break
            waited = self.clock() - queued_at
            queued = run.status == ReplayRun.Status.QUEUED and not settings.CELERY_TASK_ALWAYS_EAGER
            if queued and not told and waited >= NO_WORKER_AFTER_S:
                told = True
                self.stderr.write(
                    f"\nrun {run.pk}: queued on {broker_name(settings.CELERY_BROKER_URL)}, no worker has "
                    f"taken it after {waited:.0f} s: start one with `{WORKER_COMMAND}` (still waiting)"
                )
            if self._signal and not run.cancel_requested:
                self.stderr.write(
                    f"\n{self._signal}: cancelling run {run.pk}; waiting for requests in flight"
                )
                handle.cancel()
                continue
            self.pause(0.5)
        run.refresh_from_db()
        p = run.progress()
        progress.finish(p["recorded"], p["expected"], run.status, detail=f"{p['sent']} sent")


def result_document(run: ReplayRun, plan) -> dict:
    """replay --json (module docstring)."""
    rate = plan.rate
    return {
        "run": {**describe(run), "lag_p99_ms": lag_p99_ms(run), "url": f"/api/replays/{run.pk}/"},
        # rate: None for a closed loop, and for a schedule of no duration (all at once)
        "plan": {
            "requests": plan.requests,
            "samples": plan.samples,
            "duration_s": plan.duration_s,
            "rate": rate if rate is not None and rate != float("inf") else None,
        },
    }
