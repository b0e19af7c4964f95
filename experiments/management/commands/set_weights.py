"""python manage.py set_weights KEY fp16=50 awq=30 awq-fa2=20 --reason "..." """

from __future__ import annotations

from experiments.api.weights import field_errors
from experiments.cli import (
    CliError,
    JsonCommand,
    actor_for,
    add_json_argument,
    check_acts_on,
    experiment_named,
)
from experiments.weights.errors import ConflictError, StoreUnavailable, WeightsError
from experiments.weights.publish import (
    UnknownExperimentError,
    WeightsPreview,
    preview_move,
    publish_weights,
)


def parse_pairs(pairs: list[str]) -> dict[str, int]:
    weights: dict[str, int] = {}
    errors = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            errors.append(f"{pair!r}: expected VARIANT=PERCENT, e.g. fp16=50")
        elif key in weights:
            errors.append(f"{pair!r}: variant {key!r} given twice")
        elif not value.strip().lstrip("-").isdigit():
            errors.append(f"{pair!r}: weight must be an integer percent, got {value!r}")
        else:
            weights[key] = int(value)
    if errors:
        raise CliError(
            "bad weights, nothing changed:\n" + "\n".join(f"  {e}" for e in errors),
            field="weights",
            errors=[("weights", e) for e in errors],
        )
    return weights


def describe(plan: WeightsPreview) -> list[str]:
    before = plan.move.before
    after = plan.new.weights
    width = max(len(k) for k in after)
    lines = [f"{plan.experiment.key}: weights at revision {plan.current_revision or '(none)'} -> new"]
    for key, weight in after.items():
        old = before.get(key, "-")
        mark = "" if old == weight else "  *"
        lines.append(f"  {key:<{width}}  {old!s:>3} -> {weight:>3}{mark}")
    lines.append(plan.move.describe())
    return lines


class Command(JsonCommand):
    help = (
        "Change an experiment's traffic weights (integer percents summing to 100): validates, "
        "shows how many users will move, writes the weights store and the audit log."
    )

    def add_arguments(self, parser):
        parser.add_argument("key", help="experiment key")
        parser.add_argument("weights", nargs="+", metavar="VARIANT=PERCENT")
        parser.add_argument("--reason", required=True, help="why (kept in the audit log)")
        parser.add_argument(
            "--as",
            dest="username",
            help="the user who acts (recorded in the audit log; bound by their teams)",
        )
        parser.add_argument(
            "--expected-revision",
            type=int,
            help="fail with a conflict unless the stored weights are at this revision",
        )
        parser.add_argument("--dry-run", action="store_true", help="validate and preview only; write nothing")
        add_json_argument(parser)

    def handle(self, *args, key, weights, reason, username=None, **options):
        actor = actor_for(username)
        experiment = experiment_named(key)
        check_acts_on(actor, experiment)
        wanted = parse_pairs(weights)
        expected = options.get("expected_revision")
        dry_run = bool(options.get("dry_run"))
        try:
            plan = preview_move(key, wanted, actor, reason, expected_revision=expected)
            for line in describe(plan):
                self.say(line)
            revision = plan.current_revision
            if dry_run:
                self.say("dry run: nothing written")
            elif plan.unchanged:
                self.say(
                    f"unchanged: already at these weights (revision {plan.current_revision}), nothing written"
                )
            else:
                # Write exactly what was previewed: compare-and-set against the revision we showed.
                _, revision = publish_weights(
                    key, wanted, actor, reason, expected_revision=plan.current_revision
                )
                self.say(f"written at revision {revision}")
        except UnknownExperimentError as exc:
            raise CliError(f"{exc}; nothing changed", field="key") from None
        except WeightsError as exc:
            lines = "\n".join(f"  {e}" for e in exc.errors)
            raise CliError(
                f"{key}: rejected, nothing changed:\n{lines}",
                errors=[(f, m) for f, ms in field_errors(exc).items() for m in ms],
            ) from None
        except ConflictError as exc:
            raise CliError(
                f"conflict, nothing changed: {exc}",
                field="--expected-revision",
                context={"current_revision": exc.actual_revision},
            ) from None
        except StoreUnavailable as exc:
            raise CliError(f"weights store unavailable, nothing changed: {exc}") from None
        if self.json:
            self.emit(result_document(plan, revision, dry_run, reason))


def result_document(plan: WeightsPreview, revision: int, dry_run: bool, reason: str) -> dict:
    """set_weights --json: the keys of PUT /api/experiments/KEY/weights where they mean the same."""
    written = not dry_run and not plan.unchanged
    return {
        "experiment": plan.experiment.key,
        "dry_run": dry_run,
        "changed": written,
        "unchanged": plan.unchanged,  # the stored weights already say this
        "previous_revision": plan.current_revision,
        "revision": revision,  # the stored revision now (the previous one unless written)
        "previous_weights": dict(plan.move.before),
        "weights": dict(plan.new.weights),
        "reason": reason,
        "moved_share": plan.move.moved_share,
        "minimum_share": plan.move.minimum_share,
        "moved_buckets": plan.move.moved_buckets,
        "n_buckets": plan.move.n_buckets,
        "moved": plan.move.describe(),
    }
