"""python manage.py experiment list|show|start|pause|resume|conclude ...

The experiment lifecycle from the command line, as the API (POST
/api/experiments/KEY/{start|pause|resume|conclude}/) and the admin allow it: the same moves
(experiments.lifecycle), through the same code (experiments.services.transition: the
conditional claim, the weights store, the cancellation of open replays, the audit entry).

    experiment list [--status S] [--json]
    experiment show KEY [--json]
    experiment start|pause|resume KEY [--reason TEXT] [--as NAME] [--json]
    experiment conclude KEY --reason TEXT [--as NAME] [--json]

A conclusion is final (the weights leave the store, the experiment becomes read-only), so the
command line asks why. ``--as`` (or ``--user``) names the user who acts, who must exist and be in
the experiment's team (or act on every team: sre, superusers); the audit log records them.
Without it the operator acts and the entry says "system", as for set_weights and apply_experiment.

--json prints what the API prints: ``show`` the experiment as GET /api/experiments/KEY/ does
(ExperimentSerializer: document, status, allowed_actions, owner, salt, hash_version, times,
links), ``list`` {"experiments": [...]} of those, and a move {"transition": {"action", "from",
"to", "reason", "actor", "audit_id", "at"}, "experiment": {...}}. A refused move exits 1 with
{"error": {...}, "experiment": KEY, "status": ..., "allowed_actions": [...]}.
"""

from __future__ import annotations

from experiments import lifecycle, services
from experiments.api.serializers import ActionSerializer, ExperimentSerializer
from experiments.cli import (
    CliError,
    JsonCommand,
    actor_for,
    add_json_argument,
    check_acts_on,
    experiment_named,
)
from experiments.models import AuditEntry, Experiment
from experiments.weights.errors import ConflictError as WeightsConflict
from experiments.weights.errors import StoreUnavailable, WeightsError

WHY = {
    "start": "publishes the weights: routers start assigning users",
    "pause": "keeps the weights; open replays are cancelled",
    "resume": "replays may run again",
    "conclude": "final: the weights leave the store, open replays are cancelled",
}


class Command(JsonCommand):
    help = "List, show, start, pause, resume or conclude experiments (audited, as in the admin and API)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = sub.add_parser("list", help="every experiment, newest first")
        listing.add_argument("--status", choices=lifecycle.STATUSES, help="only experiments in this status")
        add_json_argument(listing)
        show = sub.add_parser("show", help="one experiment: document, status, allowed actions")
        show.add_argument("key")
        add_json_argument(show)
        for action in lifecycle.ACTIONS:
            sources, target = lifecycle.ACTIONS[action]
            move = sub.add_parser(
                action, help=f"{' or '.join(sorted(sources))} -> {target}: {WHY.get(action, '')}"
            )
            move.add_argument("key")
            move.add_argument(
                "--reason",
                required=action == "conclude",
                default="",
                help="why (kept in the audit log)"
                + ("; required: a conclusion is final" if action == "conclude" else ""),
            )
            move.add_argument(
                "--as", "--user", dest="username", help="user recorded in the audit log (must exist)"
            )
            add_json_argument(move)

    def handle(self, *args, action: str, **options):
        if action == "list":
            return self.list(options.get("status"))
        experiment = experiment_named(options["key"], Experiment.objects.prefetch_related("variants"))
        if action == "show":
            return self.show(experiment)
        return self.move(experiment, action, options["reason"], options.get("username"))

    def list(self, status: str | None) -> None:
        qs = (
            Experiment.objects.select_related("owner", "team")
            .prefetch_related("variants")
            .order_by("-created_at")
        )
        if status:
            qs = qs.filter(status=status)
        rows = list(qs)
        if self.json:
            self.emit({"experiments": ExperimentSerializer(rows, many=True).data})
            return
        if not rows:
            self.say("no experiments" + (f" {status}" if status else ""))
            return
        width = max(len(e.key) for e in rows)
        self.say(f"{'key':<{width}}  {'status':<9}  {'variants':>8}  {'started':<16}  name")
        for e in rows:
            started = f"{e.started_at:%Y-%m-%d %H:%M}" if e.started_at else "-"
            self.say(f"{e.key:<{width}}  {e.status:<9}  {len(e.variants.all()):>8}  {started:<16}  {e.name}")

    def show(self, experiment: Experiment) -> None:
        data = ExperimentSerializer(experiment).data
        if self.json:
            self.emit(data)
            return
        doc = data["document"]
        allowed = ", ".join(data["allowed_actions"]) or "none (concluded is final)"
        sla = ", ".join(f"{k} {v:g}" for k, v in doc["sla"].items())
        self.say(f"{doc['key']}: {doc['name']}")
        self.say(f"  status     {data['status']} (allowed: {allowed})")
        self.say(f"  owner      {data['owner'] or '-'}")
        self.say(f"  started    {data['started_at'] or '-'}")
        self.say(f"  concluded  {data['concluded_at'] or '-'}")
        self.say(f"  sla        {sla}")
        self.say(f"  hypothesis {doc['hypothesis'] or '-'}")
        for v in doc["variants"]:
            control = " (control)" if v["control"] else ""
            self.say(
                f"  variant    {v['key']}{control}: weight {v['weight']}, {v['api']} {v['endpoint']} {v['model']}"
            )

    def move(self, experiment: Experiment, action: str, reason: str, username: str | None) -> None:
        actor = actor_for(username)
        check_acts_on(actor, experiment)
        body = ActionSerializer(data={"reason": reason})  # the API's rules for a reason
        if not body.is_valid():
            raise CliError(f"--reason: {' '.join(body.errors['reason'])}", field="--reason")
        reason = body.validated_data["reason"]
        if action == "conclude" and not reason.strip():
            raise CliError("--reason: say why the experiment is concluded (it is final)", field="--reason")
        before = experiment.status
        try:
            services.transition(experiment, action, actor, reason)
        except lifecycle.TransitionError as exc:
            raise self.refused(experiment, f"{exc}", field="action") from None
        except (services.ConflictError, WeightsConflict) as exc:
            raise self.refused(experiment, f"{exc}; nothing changed") from None
        except StoreUnavailable as exc:
            raise self.refused(experiment, f"weights store unavailable, nothing changed: {exc}") from None
        except WeightsError as exc:
            raise self.refused(
                experiment, "weights rejected, nothing changed: " + "; ".join(exc.errors)
            ) from None
        entry = AuditEntry.objects.filter(experiment_key=experiment.key, action=action).first()
        if self.json:
            self.emit(
                {
                    "transition": {
                        "action": action,
                        "from": before,
                        "to": experiment.status,
                        "reason": reason,
                        "actor": entry.actor_name if entry else None,
                        "audit_id": entry.pk if entry else None,
                        "at": entry.at if entry else None,
                    },
                    "experiment": ExperimentSerializer(experiment).data,
                }
            )
            return
        allowed = ", ".join(lifecycle.allowed_actions(experiment.status)) or "none (concluded is final)"
        who = entry.actor_name if entry else "system"
        self.say(
            f"{experiment.key}: {before} -> {experiment.status} (audited as {who}); allowed now: {allowed}"
        )

    def refused(self, experiment: Experiment, message: str, field: str | None = None) -> CliError:
        experiment.refresh_from_db()
        allowed = lifecycle.allowed_actions(experiment.status)
        now = ", ".join(allowed) if allowed else "none (concluded is final)"
        return CliError(
            f"{experiment.key}: {message}. Allowed from {experiment.status}: {now}",
            field=field,
            context={"experiment": experiment.key, "status": experiment.status, "allowed_actions": allowed},
        )
