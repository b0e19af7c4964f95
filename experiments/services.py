"""Changing experiments: apply a document, export one, move through the lifecycle, delete.

Every change runs in one transaction with its audit entry, so a rejected change leaves
nothing behind and an accepted one is always audited.
"""

from __future__ import annotations

import dataclasses

from django.db import transaction
from django.utils import timezone

from experiments import audit, lifecycle
from experiments.document import DocumentError, FieldError, validate_document
from experiments.models import Experiment, Variant
from experiments.signals import experiment_transitioned


class ConflictError(Exception):
    """The row changed under us (another user acted first); nothing was written."""


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
    return {
        "key": experiment.key,
        "name": experiment.name,
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
            }
            for v in experiment.variants.order_by("position")
        ],
    }


def _normalized(doc: dict) -> dict:
    """The comparable form: sla without absent optional SLOs."""
    doc = dict(doc)
    doc["sla"] = {k: v for k, v in doc["sla"].items() if v is not None}
    return doc


def diff_documents(before: dict | None, after: dict) -> list[str]:
    if before is None:
        return [f"created with variants {', '.join(v['key'] for v in after['variants'])}"]
    changes = []
    for field in ("name", "hypothesis"):
        if before[field] != after[field]:
            changes.append(f"{field}: {before[field]!r} -> {after[field]!r}")
    for field in sorted(set(before["sla"]) | set(after["sla"])):
        if before["sla"].get(field) != after["sla"].get(field):
            changes.append(f"sla.{field}: {before['sla'].get(field)} -> {after['sla'].get(field)}")
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


def _check_locked_change(experiment: Experiment, before: dict, after: dict) -> None:
    """A running or paused experiment keeps its variant set, control, factors and weights."""
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
    for key in old.keys() - {v["key"] for v in after["variants"]}:
        errors.append(
            FieldError("variants", f"cannot remove variant {key!r}: experiment is {experiment.status}")
        )
    if errors:
        raise DocumentError(errors)


def _write_variants(experiment: Experiment, doc: dict) -> None:
    keep = [v["key"] for v in doc["variants"]]
    experiment.variants.exclude(key__in=keep).delete()
    # Clear the control flag first: the one-control constraint holds at every statement.
    experiment.variants.update(control=False)
    existing = {v.key: v for v in experiment.variants.all()}
    for position, v in enumerate(doc["variants"]):
        row = existing.get(v["key"]) or Variant(experiment=experiment, key=v["key"])
        row.position = position
        for field in ("weight", "endpoint", "model", "api", "http2", "factors", "engine_args"):
            setattr(row, field, v[field])
        row.control = False
        row.save()
    control = next(v["key"] for v in doc["variants"] if v["control"])
    experiment.variants.filter(key=control).update(control=True)


def apply_document(raw, actor=None) -> ApplyResult:
    """Create or update the experiment ``raw`` describes. Idempotent: applying the same
    document twice changes nothing the second time."""
    doc = _normalized(validate_document(raw))
    with transaction.atomic():
        experiment = Experiment.objects.select_for_update().filter(key=doc["key"]).first()
        before = _normalized(export_document(experiment)) if experiment else None
        if before == doc:
            return ApplyResult(experiment, created=False, changes=[])
        if experiment is None:
            experiment = Experiment(key=doc["key"], owner=actor if getattr(actor, "pk", None) else None)
        elif experiment.is_locked:
            _check_locked_change(experiment, before, doc)
        experiment.name = doc["name"]
        experiment.hypothesis = doc["hypothesis"]
        experiment.sla_ttft_ms = doc["sla"]["ttft_ms"]
        experiment.sla_tpot_ms = doc["sla"].get("tpot_ms")
        experiment.sla_e2e_ms = doc["sla"].get("e2e_ms")
        experiment.sla_target = doc["sla"]["target"]
        experiment.save()
        _write_variants(experiment, doc)
        audit.record(actor, experiment, "create" if before is None else "update", before=before, after=doc)
        return ApplyResult(experiment, created=before is None, changes=diff_documents(before, doc))


def transition(experiment: Experiment, action: str, actor=None, reason: str = "") -> Experiment:
    """Move the experiment through its lifecycle; raises TransitionError or ConflictError."""
    target = lifecycle.target_of(action, experiment.status)
    now = timezone.now()
    fields = {"status": target, "updated_at": now}
    if action == "start":
        fields["started_at"] = now
    if target == lifecycle.CONCLUDED:
        fields["concluded_at"] = now
    with transaction.atomic():
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
            sender=Experiment, experiment=experiment, action=action, before=before_status,
            after=target, actor=actor,
        )  # fmt: skip
        audit.record(
            actor, experiment, action, before={"status": before_status},
            after={"status": target}, reason=reason,
        )  # fmt: skip
    return experiment


def on_transition(experiment: Experiment, action: str, actor) -> None:
    """Side effects of a lifecycle move, inside its transaction (publishing traffic weights)."""
    from experiments.weights import lifecycle_hooks

    lifecycle_hooks.after_transition(experiment, action, actor)


def delete_experiment(experiment: Experiment, actor=None) -> None:
    if experiment.status != Experiment.Status.DRAFT:
        raise lifecycle.TransitionError(
            f"only draft experiments can be deleted; {experiment.key!r} is {experiment.status} "
            "(conclude it instead)"
        )
    with transaction.atomic():
        before = export_document(experiment)
        audit.record(actor, experiment, "delete", before=before, after=None)
        experiment.delete()
