"""python manage.py rollout KEY [--once] [--json] [--interval S]: look at a rollout and decide."""

from __future__ import annotations

import time

from django.conf import settings

from experiments.cli import CliError, JsonCommand, add_json_argument, experiment_named
from rollouts import controller
from rollouts.service import LookResult, RolloutError, look


def describe(r: LookResult) -> list[str]:
    where = f"step {r.step + 1} ({r.percent}%)" if r.step is not None else "no step yet"
    lines = [f"{r.experiment}: rollout {r.status}, {where}, weights revision {r.revision}"]
    if r.decision is None:
        lines.append(f"  no decision: {r.note}")
        return lines
    lines.append(f"  decision: {r.decision.action}")
    lines.append(f"  why: {r.note}")
    verdict = r.decision.numbers.get("verdict")
    if verdict:
        lines.append(
            f"  samples this step: control {verdict['n_control']}, candidate {verdict['n_candidate']}, "
            f"{verdict['elapsed_s']:.0f} s of {verdict['min_duration_s']:.0f} s"
        )
        for check in verdict["checks"]:
            lines.append(f"  guardrail {check['status']}: {check['message']}")
    for sent in r.notified:
        lines.append(f"  webhook {sent['url']}: {sent.get('error') or sent.get('status')}")
    return lines


class Command(JsonCommand):
    help = (
        "Look at an experiment's progressive rollout (its document's rollout: block): print the "
        "state, take a decision (hold, promote, complete, rollback, pause, yield) and say why. "
        "Without --once, keeps looking every interval until the rollout stops."
    )

    def add_arguments(self, parser):
        parser.add_argument("key", help="experiment key")
        parser.add_argument("--once", action="store_true", help="one look, then exit")
        parser.add_argument(
            "--interval",
            type=float,
            default=None,
            help="seconds between decisions (default ABPLAT_ROLLOUT_INTERVAL_S)",
        )
        add_json_argument(parser)

    def handle(self, *args, **options):
        interval = options["interval"]
        if interval is None:
            interval = float(settings.ROLLOUT_INTERVAL_S)
        if interval < 0:
            raise CliError(f"--interval: must be >= 0 seconds, got {interval}", field="interval")
        experiment_named(options["key"])
        while True:
            try:
                result = look(options["key"], interval_s=interval)
            except RolloutError as exc:
                raise CliError(str(exc), field="key") from None
            if options["once"] or result.status != controller.RUNNING:
                break
            for line in describe(result):
                self.say(line)
            time.sleep(max(1.0, interval))
        if self.json:
            self.emit(result.as_dict())
        else:
            for line in describe(result):
                self.say(line)
