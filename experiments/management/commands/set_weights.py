"""python manage.py set_weights KEY fp16=50 awq=30 awq-fa2=20 --reason "..." """

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

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
        raise CommandError("bad weights, nothing changed:\n" + "\n".join(f"  {e}" for e in errors))
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


class Command(BaseCommand):
    help = (
        "Change an experiment's traffic weights (integer percents summing to 100): validates, "
        "shows how many users will move, writes the weights store and the audit log."
    )

    def add_arguments(self, parser):
        parser.add_argument("key", help="experiment key")
        parser.add_argument("weights", nargs="+", metavar="VARIANT=PERCENT")
        parser.add_argument("--reason", required=True, help="why (kept in the audit log)")
        parser.add_argument("--as", dest="username", help="user recorded in the audit log")
        parser.add_argument(
            "--expected-revision",
            type=int,
            help="fail with a conflict unless the stored weights are at this revision",
        )
        parser.add_argument("--dry-run", action="store_true", help="validate and preview only; write nothing")

    def handle(self, *args, key, weights, reason, username=None, **options):
        actor = None
        if username:
            actor = get_user_model().objects.filter(username=username).first()
            if actor is None:
                raise CommandError(f"--as: no user named {username!r}")
        wanted = parse_pairs(weights)
        expected = options.get("expected_revision")
        try:
            plan = preview_move(key, wanted, actor, reason, expected_revision=expected)
            for line in describe(plan):
                self.stdout.write(line)
            if options.get("dry_run"):
                self.stdout.write("dry run: nothing written")
                return
            if plan.unchanged:
                self.stdout.write(
                    f"unchanged: already at these weights (revision {plan.current_revision}), nothing written"
                )
                return
            # Write exactly what was previewed: compare-and-set against the revision we showed.
            _, revision = publish_weights(key, wanted, actor, reason, expected_revision=plan.current_revision)
        except UnknownExperimentError as exc:
            raise CommandError(f"{exc}; nothing changed") from None
        except WeightsError as exc:
            lines = "\n".join(f"  {e}" for e in exc.errors)
            raise CommandError(f"{key}: rejected, nothing changed:\n{lines}") from None
        except ConflictError as exc:
            raise CommandError(f"conflict, nothing changed: {exc}") from None
        except StoreUnavailable as exc:
            raise CommandError(f"weights store unavailable, nothing changed: {exc}") from None
        self.stdout.write(f"written at revision {revision}")
