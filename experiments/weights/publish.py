"""Changing an experiment's traffic weights: the one path for set_weights, the API and the admin.

``publish_weights`` validates everything first (nothing is written on any error), rebalances
the stored bucket table (minimal movement), then in one database transaction updates the
Variant rows, writes the audit entry and compare-and-sets the weights store; a failed store
write rolls the database back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from django.db import transaction

from experiments import audit
from experiments.models import Experiment
from experiments.weights.document import (
    MovePreview,
    WeightsDocument,
    build_document,
    parse_document,
)
from experiments.weights.document import preview_move as move_between
from experiments.weights.errors import ConflictError, WeightsError
from experiments.weights.process import weights_store

log = logging.getLogger(__name__)

MAX_REASON = 2000


class UnknownExperimentError(LookupError):
    pass


def why_not_assigned(key: str) -> str | None:
    """Why users of ``key`` cannot be assigned, when the experiment's status says it (a draft
    has no weights yet, a concluded one had them retired); None when the status does not
    explain it (no such experiment, or the store simply holds no weights for it)."""
    status = Experiment.objects.filter(key=key).values_list("status", flat=True).first()
    if status == Experiment.Status.DRAFT:
        return f"experiment {key!r} is a draft: its weights are published when it starts"
    if status == Experiment.Status.CONCLUDED:
        return f"experiment {key!r} is concluded: its weights were retired and routers serve the control"
    return None


@dataclass(frozen=True)
class WeightsPreview:
    experiment: Experiment
    current: WeightsDocument | None  # None: never published (or the stored one is invalid)
    current_revision: int  # 0: absent
    new: WeightsDocument
    move: MovePreview

    @property
    def unchanged(self) -> bool:
        """The stored document already says this: same weights, salt, hash version, control.
        Publishing it would only bump the revision and the audit log, so nothing is written."""
        cur = self.current
        return cur is not None and (
            dict(cur.weights) == dict(self.new.weights)
            and cur.salt == self.new.salt
            and cur.hash_version == self.new.hash_version
            and cur.control == self.new.control
        )


def _experiment(experiment: Experiment | str, lock: bool = False) -> Experiment:
    key = experiment if isinstance(experiment, str) else experiment.key
    qs = Experiment.objects.select_for_update() if lock else Experiment.objects.all()
    found = qs.filter(key=key).first()
    if found is None:
        raise UnknownExperimentError(f"unknown experiment {key!r}")
    return found


def current_weights(key: str) -> tuple[WeightsDocument | None, int]:
    """The stored document and revision. A stored document that is invalid (edited by hand)
    counts as absent for rebalancing, but its revision still guards the compare-and-set."""
    stored = weights_store().get_raw(key)
    if stored is None:
        return None, 0
    try:
        return parse_document(stored.raw, expected_key=key), stored.revision
    except WeightsError as exc:
        log.warning("stored weights for %r are invalid and will be replaced: %s", key, exc)
        return None, stored.revision


def _validate(experiment: Experiment, weights: object, reason: object) -> dict[str, int]:
    errors: list[str] = []
    status = experiment.status
    if status == Experiment.Status.CONCLUDED:
        errors.append(f"experiment: {experiment.key!r} is concluded; its weights cannot change")
    elif status == Experiment.Status.DRAFT:
        errors.append(
            f"experiment: {experiment.key!r} is a draft; set its weights in the experiment "
            f"document, they are published when it starts"
        )
    if not isinstance(reason, str) or not reason.strip():
        errors.append("reason: required; say why the weights change")
    elif len(reason) > MAX_REASON:
        errors.append(f"reason: at most {MAX_REASON} characters, got {len(reason)}")
    if not isinstance(weights, Mapping) or not weights:
        errors.append("weights: must map every variant key to an integer percent")
        raise WeightsError(errors)
    variants = [v.key for v in experiment.variants.all()]
    unknown = [k for k in weights if k not in variants]
    for key in unknown:
        errors.append(f"weights.{key}: unknown variant; {experiment.key!r} has {variants}")
    missing = [k for k in variants if k not in weights]
    if missing:
        errors.append(f"weights: missing {missing}; give every variant a weight (0 stops its traffic)")
    total = 0
    for key, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"weights.{key}: must be an integer percent, got {value!r}")
        elif value < 0:
            errors.append(f"weights.{key}: must be >= 0, got {value}")
        else:
            total += value
    if not any("weights." in e and "must be" in e for e in errors) and total != 100:
        errors.append(f"weights: must sum to 100, got {total}")
    if errors:
        raise WeightsError(errors)
    return {k: weights[k] for k in variants}  # variant order, as the experiment lists them


def _control_key(experiment: Experiment) -> str:
    control = experiment.variants.filter(control=True).first()
    if control is None:
        raise WeightsError(f"experiment: {experiment.key!r} has no control variant")
    return control.key


def _prepare(
    experiment: Experiment, weights: object, actor, reason: object, expected_revision: int | None
) -> WeightsPreview:
    clean = _validate(experiment, weights, reason)
    current, revision = current_weights(experiment.key)
    if expected_revision is not None and expected_revision != revision:
        raise ConflictError(experiment.key, expected_revision, revision)
    if current is not None and current.salt != experiment.salt:
        # The experiment row was recreated under the same key: its table starts afresh.
        current = None
    new = build_document(
        experiment.key,
        clean,
        salt=experiment.salt,
        control=_control_key(experiment),
        actor=audit.actor_name(actor),
        reason=str(reason).strip(),
        previous=current,
        hash_version=experiment.hash_version,
    )
    return WeightsPreview(experiment, current, revision, new, move_between(current, new))


def preview_move(
    experiment: Experiment | str,
    weights: object,
    actor=None,
    reason: object = "preview",
    expected_revision: int | None = None,
) -> WeightsPreview:
    """Validate a change and say how many users it would move, writing nothing."""
    return _prepare(_experiment(experiment), weights, actor, reason, expected_revision)


def publish_weights(
    experiment: Experiment | str,
    weights: object,
    actor,
    reason: object,
    expected_revision: int | None = None,
) -> tuple[WeightsDocument, int]:
    """Validate, rebalance and write new weights; returns (document, store revision).

    ``expected_revision`` is the revision the caller looked at (409 material when stale);
    None means "whatever is current", still compare-and-set between our read and our write.
    Raises UnknownExperimentError, WeightsError (nothing written), ConflictError,
    StoreUnavailable (nothing written: the database change rolls back). Weights equal to the
    stored ones write nothing and return the stored document and revision."""
    with transaction.atomic():
        locked = _experiment(experiment, lock=True)
        plan = _prepare(locked, weights, actor, reason, expected_revision)
        if plan.unchanged:
            log.info(
                "weights of %s unchanged at revision %d: nothing written", locked.key, plan.current_revision
            )
            return plan.current, plan.current_revision
        new = plan.new
        for variant in locked.variants.all():
            if variant.weight != new.weights[variant.key]:
                variant.weight = new.weights[variant.key]
                variant.save(update_fields=["weight"])
        revision = weights_store().put(locked.key, new, plan.current_revision)
        audit.record(
            actor,
            locked,
            "set_weights",
            before={
                "weights": dict(plan.current.weights) if plan.current else None,
                "revision": plan.current_revision,
            },
            after={
                "weights": dict(new.weights),
                "revision": revision,
                "moved_share": round(plan.move.moved_share, 6),
                "minimum_share": round(plan.move.minimum_share, 6),
            },
            reason=new.reason,
        )
    log.info(
        "weights of %s set to %s at revision %d by %s: %s",
        locked.key,
        dict(new.weights),
        revision,
        new.actor,
        plan.move.describe(),
    )
    return new, revision


def retire_weights(experiment: Experiment, actor, reason: str) -> int | None:
    """Remove a concluding experiment's weights from the store, so routers stop assigning its
    users (Router.assign then raises UnknownExperiment and callers serve their default).
    Called inside the conclude transition's transaction: a failed delete (StoreUnavailable)
    rolls the conclusion back, so an experiment is never concluded while still assigning.
    Returns the store revision of the delete, None when nothing was stored."""
    store = weights_store()
    current = store.get_raw(experiment.key)
    if current is None:
        return None
    revision = store.delete(experiment.key)
    audit.record(
        actor,
        experiment,
        "retire_weights",
        before={"revision": current.revision},
        after={"weights": None, "revision": revision},
        reason=reason,
    )
    log.info(
        "weights of %s removed from %s at revision %d: %s",
        experiment.key,
        store.description,
        revision,
        reason,
    )
    return revision
