"""Changing an experiment's traffic weights: the one path for set_weights, the API and the admin.

``publish_weights`` validates everything first (nothing is written on any error), rebalances
the stored bucket table (minimal movement), then in one database transaction updates the
Variant rows, compare-and-sets the weights store and writes the audit entry.

The database and the weights store cannot commit together, so the order is chosen for the
failures that remain:

1. The store write comes after every database write but the audit entry that needs its
   revision, inside the transaction: a store that refuses (conflict, down) raises, and the
   database rolls back. Nothing was written anywhere.
2. Anything that fails after the store write (the audit entry, a later step of an enclosing
   transaction such as the start transition's listeners, or the COMMIT itself) rolls the
   database back while the store already holds the new document. ``undo_store_writes_on_failure``
   then compensates: it compare-and-sets the store back to the exact bytes it held before (or
   deletes a first publication), only if the store is still at the revision we wrote, and
   records what it did as a ``weights_rolled_back`` audit entry in a fresh transaction. Routers
   may have seen the undone revision for that moment, which is why it is audited.
3. If the undo itself fails (the store went away, someone wrote after us) the store keeps a
   document the database never committed: a ``weights_rollback_failed`` audit entry (and an
   error in the log) names the revision for an SRE to put right with set_weights.

``retire_weights`` deletes under the same rules (its undo puts the document back). Callers that
wrap these functions in a transaction of their own must open ``undo_store_writes_on_failure()``
around it, outside ``transaction.atomic()``, so the undo also covers their COMMIT:
``services.transition`` does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
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
from experiments.weights.errors import ConflictError, StoreUnavailable, WeightsError
from experiments.weights.process import weights_store
from experiments.weights.store import StoredValue, WeightsStore

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
    current_raw: StoredValue | None = None  # the bytes a failed publication restores

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
    doc, stored = _current(key)
    return doc, stored.revision if stored else 0


def _current(key: str) -> tuple[WeightsDocument | None, StoredValue | None]:
    stored = weights_store().get_raw(key)
    if stored is None:
        return None, None
    try:
        return parse_document(stored.raw, expected_key=key), stored
    except WeightsError as exc:
        log.warning("stored weights for %r are invalid and will be replaced: %s", key, exc)
        return None, stored


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
    current, stored = _current(experiment.key)
    revision = stored.revision if stored else 0
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
    return WeightsPreview(experiment, current, revision, new, move_between(current, new), stored)


def preview_move(
    experiment: Experiment | str,
    weights: object,
    actor=None,
    reason: object = "preview",
    expected_revision: int | None = None,
) -> WeightsPreview:
    """Validate a change and say how many users it would move, writing nothing."""
    return _prepare(_experiment(experiment), weights, actor, reason, expected_revision)


# The undo actions of the store writes made inside the innermost open scope.
_undo: ContextVar[list[Callable[[BaseException], None]] | None] = ContextVar("weights_undo", default=None)


@contextlib.contextmanager
def undo_store_writes_on_failure() -> Iterator[None]:
    """Undo the weights-store writes made inside this block if it raises (see the module
    docstring). Open it outside ``transaction.atomic()`` so a failed COMMIT is covered too.
    Nested, the inner block undoes its own writes when it fails, and hands them to the outer
    one when it succeeds: the outer transaction may still roll them back."""
    outer = _undo.get()
    mine: list[Callable[[BaseException], None]] = []
    token = _undo.set(mine)
    try:
        yield
    except BaseException as exc:
        _undo.reset(token)
        for undo in reversed(mine):
            undo(exc)
        raise
    _undo.reset(token)
    if outer is not None:
        outer.extend(mine)


def _on_failure(undo: Callable[[BaseException], None]) -> None:
    pending = _undo.get()
    if pending is None:  # a programming error: every writer below opens a scope
        raise RuntimeError("weights store written outside undo_store_writes_on_failure()")
    pending.append(undo)


def _undo_write(
    store: WeightsStore,
    experiment: Experiment,
    actor,
    written: int,
    previous: StoredValue | None,
    what: dict,
    *,
    at: int,
) -> Callable[[BaseException], None]:
    """Put ``previous`` back (delete the key when there was none), only if the key is still at
    ``at``, where our write left it (``written`` for a put, 0 for a delete); audit either
    outcome. Never raises: it runs while the failure that called it propagates."""
    key = experiment.key

    def undo(failure: BaseException) -> None:
        why = f"{type(failure).__name__}: {failure}"[:500]
        try:
            if previous is None:
                now = store.get_raw(key)
                if now is None or now.revision != at:
                    raise ConflictError(key, at, now.revision if now else 0)
                restored = store.delete(key)
            else:
                restored = store.put_raw(key, previous.raw, at)
        except (ConflictError, StoreUnavailable) as exc:
            log.error(
                "weights of %s: the database change failed (%s) but its store write at revision %d "
                "could not be undone (%s); the store holds a document the database never committed: "
                "set the weights again with set_weights",
                key,
                why,
                written,
                exc,
            )
            _audit_undo(
                actor,
                experiment,
                "weights_rollback_failed",
                before={"revision": written, **what},
                after=None,
                reason=f"database change failed ({why}); undoing its store write failed: {exc}",
            )
            return
        except Exception:  # never mask the failure being handled
            log.exception("weights of %s: undoing the store write at revision %d failed", key, written)
            return
        log.warning(
            "weights of %s: the database change failed (%s); its store write at revision %d was "
            "undone at revision %d",
            key,
            why,
            written,
            restored,
        )
        _audit_undo(
            actor,
            experiment,
            "weights_rolled_back",
            before={"revision": written, **what},
            after={"revision": restored, "restored_revision": previous.revision if previous else 0},
            reason=f"database change failed ({why}); its store write was undone",
        )

    return undo


def _audit_undo(actor, experiment: Experiment, action: str, **entry) -> None:
    try:
        with transaction.atomic():
            audit.record(actor, experiment, action, **entry)
    except Exception:  # the database may be what failed; the log line above stays
        log.exception("weights of %s: could not write the %s audit entry", experiment.key, action)


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
    stored ones write nothing and return the stored document and revision. A failure after the
    store write (the audit entry, the COMMIT) undoes it (module docstring)."""
    with undo_store_writes_on_failure(), transaction.atomic():
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
        # 1. The store last but for the audit entry that names its revision.
        store = weights_store()
        revision = store.put(locked.key, new, plan.current_revision)
        # 2. From here a failure (or the COMMIT's) undoes the store write.
        what = {"weights": dict(new.weights)}
        _on_failure(_undo_write(store, locked, actor, revision, plan.current_raw, what, at=revision))
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
    rolls the conclusion back, so an experiment is never concluded while still assigning, and
    a conclusion that fails after the delete puts the weights back (module docstring).
    Returns the store revision of the delete, None when nothing was stored."""
    with undo_store_writes_on_failure(), transaction.atomic():
        store = weights_store()
        current = store.get_raw(experiment.key)
        if current is None:
            return None
        revision = store.delete(experiment.key)
        # The undo puts the bytes back only while the key is still absent (revision 0).
        _on_failure(_undo_write(store, experiment, actor, revision, current, {"weights": None}, at=0))
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
