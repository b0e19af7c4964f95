"""python manage.py capacity KEY --trace FILE [--variants a,b] [--arrival poisson|gamma|recorded]
[--max-rate R] [--start-rate R] [--start-rates a=R,b=R] [--min-rate R] [--tolerance 0.05] [--max-steps 12]
[--step-requests 2000] [--warmup 5] [--seed 0] [--alpha 0.05] [--lag-limit MS] [--json]

Per variant, the highest request rate at which attainment meets the experiment's SLA target
with confidence (capacity/search.py: bracketing then bisection, each step a replay of that
variant alone stopped by a sequential test). Every step is an ordinary replay run, so
``sla_report KEY --run ID --status all`` reads any step. Prints a table ranked by SLA capacity
per unit of price (variants' ``cost``), or with --json one document:

    {"search": ID, "experiment", "target", "ranking": [variant],
     "variants": {variant: {"capacity_rps", "upper_rps", "limited_by", "knee_rps", "message",
                            "search_s", "cost": {...}|null, "steps": [{"rate_rps", "verdict", "n",
                            "hits", "lag_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "run_id", ...}]}}}

``upper_rps`` is the table's "not met at": the lowest rate tried above the capacity that did not
meet the target with confidence. A step's verdict is "meets", "misses" or "undecided" (it reached
its request cap, or could no longer meet the target before it, without deciding).
"""

from __future__ import annotations

import argparse

from analysis.answer_fidelity import identical_share
from capacity.search import NOT_MET_AT, UNDECIDED, rate_text
from capacity.service import Options, mirror_fidelity, ranking, search_experiment
from experiments.cli import (
    CliError,
    JsonCommand,
    actor_for,
    add_json_argument,
    check_acts_on,
    experiment_named,
)
from workers.runs import ReplayError


def _variants(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _start_rates(text: str) -> dict[str, float]:
    """'fp16=32,awq-fa2=128' -> {"fp16": 32.0, "awq-fa2": 128.0}."""
    out = {}
    for part in _variants(text):
        key, eq, rate = part.partition("=")
        try:
            out[key.strip()] = float(rate)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected VARIANT=RATE, got {part!r}") from None
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"expected VARIANT=RATE, got {part!r}")
    return out


class Command(JsonCommand):
    help = "Find each variant's SLA capacity (highest req/s within the SLA) and its cost there."

    def add_arguments(self, parser):
        parser.add_argument("key", help="experiment key (must be running)")
        parser.add_argument(
            "--trace", required=True, help="a trace or log (a local path, or an uploaded trace's name)"
        )
        parser.add_argument(
            "--format", choices=["azure", "jsonl"], help="the trace's format (default: azure)"
        )
        parser.add_argument(
            "--variants", type=_variants, default=[], help="comma-separated variant keys (default: all)"
        )
        parser.add_argument(
            "--arrival",
            choices=["poisson", "gamma", "recorded"],
            default="poisson",
            help="poisson/gamma gaps at each rate, or the trace's own arrivals scaled to it",
        )
        parser.add_argument("--cv", type=float, default=1.0, help="gamma: burstiness (gap CV)")
        parser.add_argument("--max-rate", type=float, default=50.0, help="highest rate to try (req/s)")
        parser.add_argument("--start-rate", type=float, help="first rate to try (default: max-rate / 4)")
        parser.add_argument(
            "--start-rates",
            type=_start_rates,
            default={},
            help="a first rate per variant, VARIANT=RATE,... (others: --start-rate)",
        )
        parser.add_argument("--min-rate", type=float, default=0.05, help="lowest rate to try (req/s)")
        parser.add_argument(
            "--tolerance",
            type=float,
            default=0.05,
            help="stop when the bracket's ends are this close (relative)",
        )
        parser.add_argument("--max-steps", type=int, default=12, help="steps per variant at most")
        parser.add_argument("--step-requests", type=int, default=2000, help="requests per step at most")
        parser.add_argument("--warmup", type=float, default=5.0, help="seconds of each step not judged")
        parser.add_argument("--seed", type=int, default=0, help="user population and arrival seed")
        parser.add_argument("--alpha", type=float, default=0.05, help="error rate of the whole search")
        parser.add_argument(
            "--lag-limit",
            type=float,
            default=None,
            help="ms of the replay's own schedule lag p99 above which a step is void (default: "
            "max(5, 5%% of the tightest SLO threshold), 10 ms for a 200 ms TTFT)",
        )
        parser.add_argument(
            "--as",
            "--user",
            dest="as_user",
            help="the user who acts (the audit log records them; bound by their teams)",
        )
        add_json_argument(parser)

    def handle(self, *args, **o):
        experiment = experiment_named(o["key"])
        if o["arrival"] != "gamma" and o["cv"] != 1.0:
            raise CliError(f"--cv applies to --arrival gamma, not {o['arrival']}", field="--cv")
        opts = Options(
            trace=o["trace"],
            source_format=o["format"],
            variants=o["variants"],
            arrival=o["arrival"],
            cv=o["cv"],
            start_rps=o["start_rate"],
            start_rps_by=o["start_rates"],
            max_rps=o["max_rate"],
            min_rps=o["min_rate"],
            rel_tol=o["tolerance"],
            max_steps=o["max_steps"],
            alpha=o["alpha"],
            step_requests=o["step_requests"],
            warmup_s=o["warmup"],
            seed=o["seed"],
            lag_limit_ms=o["lag_limit"],
        )
        actor = actor_for(o["as_user"])
        check_acts_on(actor, experiment)  # --as: only an experiment of that user's teams
        try:
            record = search_experiment(experiment, opts, actor=actor, say=self.say)
        except (ReplayError, ValueError) as exc:
            raise CliError(str(exc)) from None
        fidelity, note = mirror_fidelity(experiment)
        doc = {
            "search": record.pk,
            "experiment": experiment.key,
            "target": experiment.sla_target,
            "ranking": ranking(record.result),
            "variants": record.result,
            # the answers each variant gives against the control's, from the mirror replay's report
            # (the steps replay each variant alone): {variant: variants[].fidelity}, and whence
            "control": experiment.control_key(),
            "fidelity": fidelity,
            "fidelity_note": note,
        }
        self.say(render_table(doc))
        if self.json:
            self.emit(doc)


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x) -> str:
    return "-" if x is None else rate_text(x)


def render_table(doc: dict) -> str:
    head = (
        f"{'variant':<14}{'capacity req/s':>16}{NOT_MET_AT:>12}{'limited by':>12}{'knee':>8}"
        f"{'steps':>7}{'search s':>10}{'per 1M req':>14}{'per 1M out tok':>16}{'req/s per $/h':>15}"
    )
    fidelity = doc.get("fidelity") or {}
    if fidelity:
        head += f"{'identical':>11}"
    lines = [
        f"SLA capacity of {doc['experiment']} (target {doc['target']:.2%}), best value first:",
        head,
        "-" * len(head),
    ]
    for v in doc["ranking"]:
        r = doc["variants"][v]
        c = r["cost"] or {}
        cur = c.get("currency", "")
        lines.append(
            f"{v:<14}{_rate(r['capacity_rps']):>16}{_rate(r['upper_rps']):>12}{r['limited_by']:>12}"
            f"{_rate(r['knee_rps']):>8}{len(r['steps']):>7}{r['search_s']:>10.0f}"
            f"{(_f(c.get('per_million_requests'), ',.2f') + ' ' + cur).strip():>14}"
            f"{(_f(c.get('per_million_output_tokens'), ',.2f') + ' ' + cur).strip():>16}"
            f"{_f(c.get('capacity_per_currency_hour'), '.3g'):>15}"
            + (
                f"{'ref' if v == doc.get('control') else identical_share(fidelity.get(v)):>11}"
                if fidelity
                else ""
            )
        )
    lines += [f"  {v}: {doc['variants'][v]['message']}" for v in doc["ranking"]]
    lines.append(
        f"  {NOT_MET_AT}: the lowest rate tried above the capacity that did not meet the target with "
        f"confidence (missed, or {UNDECIDED})"
    )
    if doc.get("fidelity_note"):
        lines.append(f"  {doc['fidelity_note']}")
    return "\n".join(lines)
