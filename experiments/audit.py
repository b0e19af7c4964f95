"""Writing the append-only audit log. Call inside the transaction of the change itself."""

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
        actor=user,
        actor_name=actor_name(actor),
        action=action,
        reason=reason,
        before=before,
        after=after,
    )
