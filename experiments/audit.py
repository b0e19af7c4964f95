"""Writing the append-only audit log. Call inside the transaction of the change itself.

Actions: ``create``, ``update`` and ``delete`` of experiments (before and after in full),
the lifecycle moves, ``set_weights`` and ``retire_weights``. Two more say that the weights
store and the database disagreed for a moment: ``weights_rolled_back`` (a store write was
undone after its database change failed) and ``weights_rollback_failed`` (it could not be: the
store holds the revision named until an SRE sets the weights again); see
experiments/weights/publish.py.
"""

from __future__ import annotations

from experiments.models import AuditEntry, Experiment


def actor_name(actor) -> str:
    if actor is None:
        return "system"
    return getattr(actor, "get_username", lambda: str(actor))() or str(actor)


def record(
    actor, experiment: Experiment | None, action: str, *, before=None, after=None, reason="", key=""
) -> AuditEntry:
    user = actor if getattr(actor, "pk", None) is not None else None
    return AuditEntry.objects.create(
        experiment=experiment,
        experiment_key=experiment.key if experiment is not None else key,
        # Who reads the entry once the experiment is gone (experiments.teams.visible_audit).
        team_id=experiment.team_id if experiment is not None else None,
        actor=user,
        actor_name=actor_name(actor),
        action=action,
        reason=reason,
        before=before,
        after=after,
    )
