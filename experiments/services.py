"""Changing experiments: apply a document, export one, move through the lifecycle, delete.

Every change runs in one transaction with its audit entry, so a rejected change leaves
nothing behind and an accepted one is always audited (before and after, in full).

What may change depends on the status:

- a draft changes freely;
- a running experiment keeps its variant set, control, factors and weights (weights move
  through set_weights), and also what each variant measures: its endpoint, model, api, http2
  and engine_args. Changing those mid-run would mix two configurations in one measurement, so
  the change is refused until the experiment is paused;
- a paused experiment may change what its variants measure, audited like every change;
- the rollout plan of a running or paused experiment is a traffic setting (the controller turns
  it into weights): adding, changing or removing it needs the weights' permission
  (TRAFFIC_PERMISSION, the sre role; superusers hold every permission);
- a concluded experiment changes no more.

Webhook URLs (``rollout.notify``) often carry the receiver's token in their path or query: they
are served in full only to users who may change traffic (``document_for``), stored redacted in
the audit log, and a redacted URL sent back in a document stands for the stored one
(``restore_webhooks``), so a document read by any role applies back unchanged.

engine_args are checked against the vLLM flags a product user may set
(``experiments.engine_args``) when a variant is created or its engine_args change, so a bad flag is
refused while the experiment is defined, not when an operator serves it.

Teams (experiments.teams): an experiment belongs to a team, and a user who is not in it (and does
not act on every team) changes, moves through its lifecycle or deletes nothing of it, whichever
path calls in. A document's ``team`` is filled in when it names none: the experiment's own, else
its author's only team, else the default team for the operator and those who act on every team.

A variant's secret (``auth: {secret: NAME}``) is checked against the operator's bindings
(streaming/egress.py, ``_bindings.json``) when the variant is created or its secret, endpoint or
team changes: the binding must let the experiment's team send it to the endpoint's host. Every
connection checks again (``bound_bearer``), so a binding narrowed later takes effect anyway.
"""

from __future__ import annotations

import dataclasses

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import ProtectedError, RestrictedError
from django.utils import timezone

from experiments import audit, lifecycle
from experiments.checks import document_egress
from experiments.document import (
    DocumentError,
    FieldError,
    is_redacted_url,
    redact_rollout,
    redact_url,
    scrub_url,
    validate_document,
)
from experiments.engine_args import RISKY, check_engine_args
from experiments.models import Experiment, Team, Variant
from experiments.signals import experiment_transitioned
from experiments.teams import (
    acts_on_all_teams,
    default_team_name,
    may_act_on,
    teams_of,
    visible_experiments,
)
from streaming.egress import SecretError, binding_refusal, read_bindings, split_url

# What a variant measures: fixed while the experiment runs (pause it to change them).
MEASURED_FIELDS = ("endpoint", "model", "api", "http2", "engine_args")
# Traffic changes: the weights, and the rollout plan of a started experiment. The sre role holds
# it (experiments/migrations/0002_role_groups.py), superusers hold every permission.
TRAFFIC_PERMISSION = "experiments.change_weights"


def may_change_traffic(actor) -> bool:
    """Whether ``actor`` may change traffic settings. A change made with no user (the operator's
    command line without ``--as``, the services' own callers) may: a shell on the host reaches
    the weights store anyway. A named user needs TRAFFIC_PERMISSION."""
    if actor is None or not hasattr(actor, "has_perm"):
        return True
    return bool(actor.has_perm(TRAFFIC_PERMISSION))


def may_read_webhooks(user) -> bool:
    """Whether ``user`` reads webhook URLs in full: only users who may change traffic (the sre
    role, superusers). Everyone else, and a caller that names no user, reads them redacted."""
    return user is not None and hasattr(user, "has_perm") and bool(user.has_perm(TRAFFIC_PERMISSION))


class ConflictError(Exception):
    """The row changed under us (another user acted first); nothing was written."""


class ProtectedExperimentError(lifecycle.TransitionError):
    """The experiment has replay runs (and their samples): deleting it would orphan them."""


class NotInTeamError(PermissionDenied):
    """The actor is not in the team that owns the experiment (nor acts on every team)."""


def check_acts_on(actor, experiment: Experiment, what: str) -> None:
    """NotInTeamError unless ``actor`` may act on ``experiment`` (experiments.teams)."""
    if not may_act_on(actor, experiment):
        name = getattr(actor, "get_username", lambda: str(actor))()
        raise NotInTeamError(
            f"{name!r} cannot {what} experiment {experiment.key!r}: it belongs to team "
            f"{experiment.team.name!r}, which {name!r} is not in"
        )


@dataclasses.dataclass
class ApplyResult:
    experiment: Experiment
    created: bool
    changes: list[str]


def sla_document(experiment: Experiment) -> dict:
    """The document's ``sla`` mapping (optional SLOs only when set)."""
    sla = {"ttft_ms": experiment.sla_ttft_ms}
    if experiment.sla_tpot_ms is not None:
        sla["tpot_ms"] = experiment.sla_tpot_ms
    if experiment.sla_e2e_ms is not None:
        sla["e2e_ms"] = experiment.sla_e2e_ms
    sla["target"] = experiment.sla_target
    return sla


def export_document(experiment: Experiment) -> dict:
    sla = sla_document(experiment)
    doc = {
        "key": experiment.key,
        "name": experiment.name,
        "team": experiment.team.name,
        "hypothesis": experiment.hypothesis,
        "sla": sla,
        "variants": [
            {
                "key": v.key,
                "control": v.control,
                "weight": v.weight,
                "endpoint": v.endpoint,
                "model": v.model,
                "api": v.api,
                "http2": v.http2,
                "factors": dict(v.factors),
                "engine_args": dict(v.engine_args),
                "auth": {"secret": v.auth_secret} if v.auth_secret else None,  # the name only
                "cost": v.cost,
            }
            for v in experiment.variants.all()  # Variant.Meta.ordering: by position; a list's prefetch serves it
        ],
    }
    if experiment.rollout:
        doc["rollout"] = experiment.rollout
    doc["analysis"] = experiment.analysis()
    doc["fidelity"] = experiment.fidelity()
    return doc


def redacted_document(doc: dict | None) -> dict | None:
    """A copy of ``doc`` with its webhook URLs redacted (experiments.document.redact_url)."""
    if doc is None or not doc.get("rollout"):
        return doc
    return {**doc, "rollout": redact_rollout(doc["rollout"])}


def document_for(experiment: Experiment, user) -> dict:
    """The experiment's document as ``user`` may read it: webhook URLs in full only for those
    who may change traffic (may_read_webhooks)."""
    doc = export_document(experiment)
    return doc if may_read_webhooks(user) else redacted_document(doc)


def redact_audit_value(value):
    """An audit entry's ``before``/``after`` with webhook URLs redacted wherever they sit: a
    document's ``rollout.notify`` and a failed webhook's ``url`` (and its error text). Entries
    are stored this way; this also covers entries written before they were."""
    if isinstance(value, list):
        return [redact_audit_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: redact_audit_value(v) for k, v in value.items()}
    if isinstance(value.get("rollout"), dict):
        out["rollout"] = redact_rollout(value["rollout"])
    if isinstance(value.get("webhooks"), list):
        out["webhooks"] = [_redacted_webhook_result(w) for w in value["webhooks"]]
    return out


def _redacted_webhook_result(result):
    if not isinstance(result, dict) or not isinstance(result.get("url"), str):
        return result
    url = result["url"]
    out = {**result, "url": url if is_redacted_url(url) else redact_url(url)}
    if isinstance(result.get("error"), str) and not is_redacted_url(url):
        out["error"] = scrub_url(result["error"], url)
    return out


def restore_webhooks(raw, actor=None):
    """``raw`` (a document as sent) with each redacted webhook URL replaced by the stored URL it
    stands for: the one at the same place in the stored plan, else the only stored URL with that
    redaction. One it cannot place is left for validation to refuse, naming its path. ``raw``
    itself is not changed. Only an experiment ``actor`` may act on lends its URLs (None: the
    operator)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("rollout"), dict):
        return raw
    notify = raw["rollout"].get("notify")
    if not isinstance(notify, list) or not any(is_redacted_url(u) for u in notify):
        return raw
    key = raw.get("key")
    mine = visible_experiments(actor).filter(key=key) if isinstance(key, str) else None
    stored = mine.values_list("rollout", flat=True).first() if mine is not None else None
    old = [u for u in ((stored or {}).get("notify") or []) if isinstance(u, str)]
    restored = []
    for i, url in enumerate(notify):
        if is_redacted_url(url):
            shown = url.strip()
            if i < len(old) and redact_url(old[i]) == shown:
                url = old[i]
            else:
                matches = {o for o in old if redact_url(o) == shown}
                url = matches.pop() if len(matches) == 1 else url
        restored.append(url)
    return {**raw, "rollout": {**raw["rollout"], "notify": restored}}


def _normalized(doc: dict) -> dict:
    """The comparable form: sla without absent optional SLOs (a document without ``team``
    keeps none: check_change fills it in)."""
    doc = dict(doc)
    doc["sla"] = {k: v for k, v in doc["sla"].items() if v is not None}
    if doc.get("rollout") is None:
        doc.pop("rollout", None)
    return doc


def changed_parts(experiment: Experiment, doc: dict) -> set[str]:
    """The top-level fields (name, sla, variants, rollout, ...) in which the validated document
    ``doc`` differs from ``experiment``'s own."""
    before, after = _normalized(export_document(experiment)), _normalized(doc)
    after.setdefault("team", before["team"])  # no team named: it stays where it is
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def diff_documents(before: dict | None, after: dict) -> list[str]:
    if before is None:
        return [f"created with variants {', '.join(v['key'] for v in after['variants'])}"]
    changes = []
    for field in ("name", "team", "hypothesis"):
        if before.get(field) != after.get(field):
            changes.append(f"{field}: {before.get(field)!r} -> {after.get(field)!r}")
    for field in sorted(set(before["sla"]) | set(after["sla"])):
        if before["sla"].get(field) != after["sla"].get(field):
            changes.append(f"sla.{field}: {before['sla'].get(field)} -> {after['sla'].get(field)}")
    for block in ("analysis", "fidelity"):
        was, now = before.get(block) or {}, after.get(block) or {}
        for field in sorted(set(was) | set(now)):
            if was.get(field) != now.get(field):
                changes.append(f"{block}.{field}: {was.get(field)} -> {now.get(field)}")
    if before.get("rollout") != after.get("rollout"):
        # Webhook URLs are shown redacted: this line reaches the API's answer and the admin.
        was, now = redact_rollout(before.get("rollout")), redact_rollout(after.get("rollout"))
        hidden = " (a webhook URL changed; URLs are shown redacted)" if was == now else ""
        changes.append(f"rollout: {was!r} -> {now!r}{hidden}")
    old = {v["key"]: v for v in before["variants"]}
    new = {v["key"]: v for v in after["variants"]}
    for key in new.keys() - old.keys():
        changes.append(f"variants[{key}]: added")
    for key in old.keys() - new.keys():
        changes.append(f"variants[{key}]: removed")
    for key in sorted(new.keys() & old.keys()):
        for field, value in new[key].items():
            if old[key][field] != value:
                changes.append(f"variants[{key}].{field}: {old[key][field]!r} -> {value!r}")
    if [v["key"] for v in before["variants"] if v["key"] in new] != [
        v["key"] for v in after["variants"] if v["key"] in old
    ]:
        changes.append("variants: reordered")
    return changes


def _check_locked_change(experiment: Experiment, before: dict, after: dict, actor=None) -> None:
    """A running or paused experiment keeps its variant set, control, factors and weights; a
    running one also what its variants measure (MEASURED_FIELDS). Its rollout plan changes only
    by a user who may change traffic (``_plan_errors``)."""
    if experiment.status == Experiment.Status.CONCLUDED:
        raise DocumentError(
            [FieldError("key", f"experiment {experiment.key!r} is concluded and cannot be changed")]
        )
    errors = []
    old = {v["key"]: v for v in before["variants"]}
    for i, v in enumerate(after["variants"]):
        path = f"variants[{i}]"
        if v["key"] not in old:
            errors.append(
                FieldError(
                    f"{path}.key", f"cannot add variant {v['key']!r}: experiment is {experiment.status}"
                )
            )
            continue
        was = old[v["key"]]
        if v["control"] != was["control"]:
            errors.append(
                FieldError(f"{path}.control", f"cannot change the control: experiment is {experiment.status}")
            )
        if v["factors"] != was["factors"]:
            errors.append(
                FieldError(f"{path}.factors", f"cannot change factors: experiment is {experiment.status}")
            )
        if v["weight"] != was["weight"]:
            errors.append(
                FieldError(
                    f"{path}.weight",
                    f"weights of a {experiment.status} experiment are traffic settings: change them "
                    "with set_weights or the weights API (sre role)",
                )
            )
        if experiment.status == Experiment.Status.RUNNING:
            for field in MEASURED_FIELDS:
                if v.get(field) != was.get(field):
                    errors.append(
                        FieldError(
                            f"{path}.{field}",
                            f"cannot change variant {v['key']!r}'s {field} while experiment "
                            f"{experiment.key!r} is running: the measurement would mix two "
                            "configurations; pause it first",
                        )
                    )
    for key in old.keys() - {v["key"] for v in after["variants"]}:
        errors.append(
            FieldError("variants", f"cannot remove variant {key!r}: experiment is {experiment.status}")
        )
    errors += _plan_errors(experiment, before.get("rollout"), after.get("rollout"), actor)
    if errors:
        raise DocumentError(errors)


def _plan_errors(experiment: Experiment, old: dict | None, new: dict | None, actor) -> list[FieldError]:
    """Once an experiment has started, the controller turns its rollout plan into traffic
    weights at the next look: adding, changing or removing the plan is a traffic change and
    needs TRAFFIC_PERMISSION, like the weights themselves. One error per changed field."""
    if old == new or may_change_traffic(actor):
        return []
    need = (
        f"needs the permission {TRAFFIC_PERMISSION} (sre role) while experiment {experiment.key!r} is "
        f"{experiment.status}: the rollout controller turns the plan into traffic weights"
    )
    if old is None:
        return [FieldError("rollout", f"adding a rollout plan {need}")]
    if new is None:
        return [FieldError("rollout", f"removing the rollout plan {need}")]
    fields = list(new) + [f for f in old if f not in new]
    return [
        FieldError(f"rollout.{f}", f"changing the rollout plan's {f} {need}")
        for f in fields
        if old.get(f) != new.get(f)
    ]


def _engine_args_errors(before: dict | None, after: dict) -> list[FieldError]:
    """Engine flags a product user may not set, in variants that are new or whose engine_args
    change (rows stored before the allowlist are still checked when served). Risky flags pass
    here: serving them needs an operator's --allow-risky-engine-args."""
    old = {v["key"]: v for v in before["variants"]} if before else {}
    errors = []
    for i, v in enumerate(after["variants"]):
        was = old.get(v["key"])
        if was is not None and was["engine_args"] == v["engine_args"]:
            continue
        for problem in check_engine_args(v["engine_args"], allow_risky=RISKY):
            path = f"variants[{i}].engine_args" + (f".{problem.key}" if problem.key else "")
            errors.append(FieldError(path, f"variant {v['key']!r}: {problem.message}"))
    return errors


def _team_list(actor) -> str:
    names = list(teams_of(actor).values_list("name", flat=True))
    return f"your teams: {', '.join(names)}" if names else "you are in no team"


def with_team(experiment: Experiment | None, doc: dict, actor=None) -> dict:
    """``doc`` with its ``team`` filled in, once ``actor`` may make this change as far as teams
    go; DocumentError naming ``key`` or ``team`` otherwise. Another team's experiment is refused
    without naming its team (the key is taken, no more), and a team the author is not in is
    refused like one that does not exist, listing the author's own teams."""
    if experiment is not None and not may_act_on(actor, experiment):
        raise DocumentError(
            [
                FieldError(
                    "key",
                    f"experiment {experiment.key!r} exists and is not one of your teams': choose another key",
                )
            ]
        )
    name = doc.get("team")
    if name is None and experiment is not None:
        return {**doc, "team": experiment.team.name}
    if name is None:
        return {**doc, "team": _team_for_new(actor)}
    if experiment is not None and name == experiment.team.name:
        return doc
    team = Team.objects.filter(name=name).first()
    if acts_on_all_teams(actor):
        if team is None and name != default_team_name():
            raise DocumentError(
                [
                    FieldError(
                        "team",
                        f"no team is named {name!r}: a superuser creates it in the admin (Teams) first",
                    )
                ]
            )
    elif team is None or not team.members.filter(pk=getattr(actor, "pk", None)).exists():
        raise DocumentError(
            [FieldError("team", f"you are not in a team named {name!r} ({_team_list(actor)})")]
        )
    return doc


def _team_for_new(actor) -> str:
    """The team of a new experiment whose document names none: the author's only team; else,
    for those who act on every team (the operator too), the default team."""
    names = list(teams_of(actor).values_list("name", flat=True)[:20])
    if len(names) == 1:
        return names[0]
    if acts_on_all_teams(actor) and default_team_name():
        return default_team_name()
    if names:
        return _refuse_team(f"is required: you are in several teams ({', '.join(names)}); name one")
    if acts_on_all_teams(actor):
        return _refuse_team(
            "is required: name the team that owns the experiment (ABPLAT_DEFAULT_TEAM is empty)"
        )
    return _refuse_team(
        "you are in no team, so you cannot create experiments: an administrator adds you to one"
    )


def _refuse_team(message: str):
    raise DocumentError([FieldError("team", message)])


def _secret_errors(before: dict | None, after: dict) -> list[FieldError]:
    """Variants naming a secret whose binding does not let the experiment's team send it to the
    endpoint's host: those that are new, or whose secret, endpoint or team changes (every
    connection checks all of them again, streaming.egress.bound_bearer)."""
    old = {v["key"]: v for v in before["variants"]} if before else {}
    moved = before is None or before.get("team") != after["team"]
    errors: list[FieldError] = []
    bindings: dict | None = None
    unreadable = ""  # why the bindings cannot be read (no directory, a bad file): every such variant says it
    for i, v in enumerate(after["variants"]):
        name = (v.get("auth") or {}).get("secret")
        was = old.get(v["key"])
        if not name or (not moved and was and was["auth"] == v["auth"] and was["endpoint"] == v["endpoint"]):
            continue
        path = f"variants[{i}].auth.secret"
        if bindings is None and not unreadable:
            try:
                bindings = read_bindings(settings.VARIANT_SECRETS_DIR)
            except SecretError as exc:
                unreadable = str(exc)
        try:
            host = split_url(v["endpoint"]).host
        except ValueError:  # the endpoint's own error is reported at its own path
            continue
        if unreadable:
            errors.append(
                FieldError(path, f"variant {v['key']!r}: secret {name!r} cannot be checked: {unreadable}")
            )
            continue
        refusal = binding_refusal(bindings, name, host, after["team"], advise=True)
        if refusal is not None:
            errors.append(FieldError(path, f"variant {v['key']!r}: {refusal}"))
    return errors


def check_change(experiment: Experiment | None, after: dict, before: dict | None = None, actor=None) -> dict:
    """The rules beyond the document's own that a change of ``experiment`` (None: a new one) to
    the validated, normalized document ``after`` must pass; DocumentError naming every field.
    ``before``: the experiment's current normalized document, when the caller has it. ``actor``:
    the user making the change (None: the operator, see may_change_traffic). Returns ``after``
    with its team filled in (with_team)."""
    after = with_team(experiment, after, actor)
    if experiment is not None and before is None:
        before = _normalized(export_document(experiment))
    if before == after:
        return after
    errors = _engine_args_errors(before, after) + _secret_errors(before, after)
    if experiment is not None and experiment.is_locked:
        try:
            _check_locked_change(experiment, before, after, actor)
        except DocumentError as exc:
            errors += exc.errors
    if errors:
        raise DocumentError(errors)
    return after


def _write_variants(experiment: Experiment, doc: dict) -> None:
    keep = [v["key"] for v in doc["variants"]]
    experiment.variants.exclude(key__in=keep).delete()
    # Clear the control flag first: the one-control constraint holds at every statement.
    experiment.variants.update(control=False)
    existing = {v.key: v for v in experiment.variants.all()}
    for position, v in enumerate(doc["variants"]):
        row = existing.get(v["key"]) or Variant(experiment=experiment, key=v["key"])
        row.position = position
        for field in ("weight", "endpoint", "model", "api", "http2", "factors", "engine_args", "cost"):
            setattr(row, field, v[field])
        row.auth_secret = (v["auth"] or {}).get("secret", "")
        row.control = False
        row.save()
    control = next(v["key"] for v in doc["variants"] if v["control"])
    experiment.variants.filter(key=control).update(control=True)


def check_document(raw, actor=None) -> dict:
    """apply_document's checks, writing nothing: the normalized document (its team filled in),
    or DocumentError."""
    doc = _normalized(validate_document(restore_webhooks(raw, actor), **document_egress()))
    return check_change(Experiment.objects.filter(key=doc["key"]).first(), doc, actor=actor)


def apply_document(raw, actor=None, reason: str = "") -> ApplyResult:
    """Create or update the experiment ``raw`` describes. Idempotent: applying the same
    document twice changes nothing the second time. ``reason`` goes to the audit entry, which
    holds the documents with their webhook URLs redacted. ``actor`` is the user making the change
    (None: the operator's command line): a started experiment's plan needs TRAFFIC_PERMISSION,
    and an existing experiment must be one of the actor's teams' (experiments.teams)."""
    doc = _normalized(validate_document(restore_webhooks(raw, actor), **document_egress()))
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().filter(key=doc["key"]).first()
        doc = with_team(experiment, doc, actor)  # before comparing: a document may name no team
        before = _normalized(export_document(experiment)) if experiment else None
        if before == doc:
            return ApplyResult(experiment, created=False, changes=[])
        doc = check_change(experiment, doc, before, actor=actor)
        if experiment is None:
            experiment = Experiment(key=doc["key"], owner=actor if getattr(actor, "pk", None) else None)
        if experiment.team_id is None or experiment.team.name != doc["team"]:
            # with_team made sure the team exists, or is the default one, created on first use.
            experiment.team = Team.objects.get_or_create(name=doc["team"])[0]
        experiment.name = doc["name"]
        experiment.hypothesis = doc["hypothesis"]
        experiment.sla_ttft_ms = doc["sla"]["ttft_ms"]
        experiment.sla_tpot_ms = doc["sla"].get("tpot_ms")
        experiment.sla_e2e_ms = doc["sla"].get("e2e_ms")
        experiment.sla_target = doc["sla"]["target"]
        experiment.rollout = doc.get("rollout")
        experiment.analysis_cluster_by_user = doc["analysis"]["cluster_by_user"]
        experiment.analysis_adjust = doc["analysis"]["adjust"]
        experiment.fidelity_store_answers = doc["fidelity"]["store_answers"]
        experiment.fidelity_score_share = doc["fidelity"]["score_share"]
        experiment.fidelity_score_top_k = doc["fidelity"]["score_top_k"]
        experiment.fidelity_shadow_share = doc["fidelity"]["shadow_share"]
        experiment.save()
        _write_variants(experiment, doc)
        audit.record(
            actor,
            experiment,
            "create" if before is None else "update",
            before=redacted_document(before),
            after=redacted_document(doc),
            reason=reason,
        )
        return ApplyResult(experiment, created=before is None, changes=diff_documents(before, doc))


def transition(experiment: Experiment, action: str, actor=None, reason: str = "") -> Experiment:
    """Move the experiment through its lifecycle; raises TransitionError or ConflictError.
    Starting publishes the weights and concluding retires them: when the move then fails (a
    listener, the audit entry, the COMMIT), that store write is undone
    (experiments.weights.publish)."""
    from experiments.weights.publish import undo_store_writes_on_failure

    check_acts_on(actor, experiment, action)
    target = lifecycle.target_of(action, experiment.status)
    now = timezone.now()
    fields = {"status": target, "updated_at": now}
    if action == "start":
        fields["started_at"] = now
    if target == lifecycle.CONCLUDED:
        fields["concluded_at"] = now
    with undo_store_writes_on_failure(), transaction.atomic():
        # Conditional claim: only one of two concurrent actions wins.
        claimed = Experiment.objects.filter(pk=experiment.pk, status=experiment.status).update(**fields)
        if claimed != 1:
            experiment.refresh_from_db()
            raise ConflictError(
                f"experiment {experiment.key!r} changed meanwhile; it is now {experiment.status}"
            )
        before_status = experiment.status
        experiment.refresh_from_db()
        on_transition(experiment, action, actor)
        experiment_transitioned.send(
            sender=Experiment,
            experiment=experiment,
            action=action,
            before=before_status,
            after=target,
            actor=actor,
        )
        audit.record(
            actor,
            experiment,
            action,
            before={"status": before_status},
            after={"status": target},
            reason=reason,
        )
    return experiment


def on_transition(experiment: Experiment, action: str, actor) -> None:
    """Side effects of a lifecycle move, inside its transaction (publishing traffic weights)."""
    from experiments.weights import lifecycle_hooks

    lifecycle_hooks.after_transition(experiment, action, actor)


def delete_experiment(experiment: Experiment, actor=None) -> None:
    """Delete a draft, audited; the one path for the API, the admin's delete page and its bulk
    action. Raises TransitionError (not a draft), ProtectedExperimentError (it has runs) or
    NotInTeamError (the actor is not in its team)."""
    check_acts_on(actor, experiment, "delete")
    if experiment.status != Experiment.Status.DRAFT:
        raise lifecycle.TransitionError(
            f"only draft experiments can be deleted; {experiment.key!r} is {experiment.status} "
            "(conclude it instead)"
        )
    try:
        with transaction.atomic():
            before = redacted_document(export_document(experiment))
            audit.record(actor, experiment, "delete", before=before, after=None)
            experiment.delete()
    except (ProtectedError, RestrictedError) as exc:
        found = exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects
        counts: dict[type, int] = {}
        for obj in found:
            counts[type(obj)] = counts.get(type(obj), 0) + 1
        what = ", ".join(
            f"{n} {m._meta.verbose_name if n == 1 else m._meta.verbose_name_plural}"
            for m, n in counts.items()
        )
        raise ProtectedExperimentError(
            f"experiment {experiment.key!r} cannot be deleted: {what} and the samples they recorded "
            "refer to it, and are kept for the record"
        ) from None
