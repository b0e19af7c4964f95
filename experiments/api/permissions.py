"""Who may do what over the API, by Django model permission (the role groups grant them).

product: add/change/delete experiments and run their lifecycle; sre: change traffic weights
(and the rollout plan of a started experiment, which the controller turns into weights) and
start/stop replays; analyst: view everything. Superusers hold every permission.

On which experiments is the caller's teams' (experiments.teams): the views read through
``visible_experiments``, so another team's experiment is a 404 whatever the permission.
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

VIEW = "experiments.view_experiment"
CHANGE = "experiments.change_experiment"
TRAFFIC = "experiments.change_weights"  # experiments.services.TRAFFIC_PERMISSION
BY_METHOD = {
    "POST": "experiments.add_experiment",
    "PUT": CHANGE,
    "PATCH": CHANGE,
    "DELETE": "experiments.delete_experiment",
}


def _has(request, perm: str) -> bool:
    user = request.user
    return bool(user and user.is_authenticated and user.has_perm(perm))


class ExperimentPermission(BasePermission):
    """Read with view permission; write with the permission of the method."""

    def has_permission(self, request, view) -> bool:
        if request.method in SAFE_METHODS:
            return _has(request, VIEW)
        return _has(request, BY_METHOD.get(request.method, "experiments.__never__"))


class ExperimentDocumentPermission(ExperimentPermission):
    """The experiment detail endpoint: as ExperimentPermission, and PUT/PATCH also with the
    traffic permission (the sre role), which may change the rollout plan and nothing else
    (the view checks what changed; experiments.services checks who may change a plan)."""

    def has_permission(self, request, view) -> bool:
        if request.method in ("PUT", "PATCH") and _has(request, TRAFFIC):
            return True
        return super().has_permission(request, view)


def require(perm: str, *, read_perm: str = VIEW) -> type[BasePermission]:
    """A permission class: ``read_perm`` for safe methods, ``perm`` for anything else."""

    class _Perm(BasePermission):
        message = f"You need the permission {perm!r} for this action."

        def has_permission(self, request, view) -> bool:
            if request.method in SAFE_METHODS:
                return _has(request, read_perm)
            return _has(request, perm)

    _Perm.__name__ = f"Require_{perm.replace('.', '_')}"
    return _Perm


CanRunLifecycle = require("experiments.run_lifecycle")
CanChangeWeights = require(TRAFFIC)
CanView = require(VIEW)
