"""The rollout timeline page: every decision of an experiment's rollout with its numbers, and
the weight changes people made meanwhile. Analyst, product, sre and superusers (as the
dashboards)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required, permission_required
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from experiments.models import AuditEntry, Experiment
from experiments.teams import visible_experiments
from rollouts.models import RolloutState

VIEW_PERM = "experiments.view_experiment"
MAX_ENTRIES = 500


def timeline_rows(experiment: Experiment) -> list[dict[str, Any]]:
    """Newest first: rollout decisions, and the weight changes people made."""
    entries = AuditEntry.objects.filter(
        Q(action__startswith="rollout_") | Q(action="set_weights"), experiment_key=experiment.key
    ).order_by("-at", "-id")[:MAX_ENTRIES]
    steps = (experiment.rollout or {}).get("steps") or []
    rows = []
    for e in entries:
        after = e.after or {}
        decision = after.get("decision") or {}
        verdict = (decision.get("numbers") or {}).get("verdict") or {}
        step = after.get("step")
        rows.append(
            {
                "at": e.at,
                "actor": e.actor_name,
                "action": e.action.removeprefix("rollout_"),
                "by_person": e.action == "set_weights" and e.actor_name != "rollout-controller",
                "status": after.get("status", ""),
                "percent": 0
                if after.get("status") == "rolled_back"
                else (steps[step] if isinstance(step, int) and 0 <= step < len(steps) else None),
                "weights": after.get("weights"),
                "revision": after.get("revision"),
                "n_control": verdict.get("n_control"),
                "n_candidate": verdict.get("n_candidate"),
                "checks": verdict.get("checks") or [],
                "reason": e.reason,
            }
        )
    return rows


@login_required
@permission_required(VIEW_PERM, raise_exception=True)
@require_GET
def timeline(request: HttpRequest, key: str) -> HttpResponse:
    experiment = get_object_or_404(visible_experiments(request.user), key=key)  # the user's teams
    state = RolloutState.objects.filter(experiment=experiment).first()
    return render(
        request,
        "rollouts/timeline.html",
        {
            "experiment": experiment,
            "plan": experiment.rollout,
            "state": state,
            "rows": timeline_rows(experiment),
        },
    )
