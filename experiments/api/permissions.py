"""Who may do what over the API, by Django model permission (the role groups grant them).

product: add/change/delete experiments and run their lifecycle; sre: change traffic weights
and start/stop replays; analyst: view everything. Superusers hold every permission.
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

VIEW = "experiments.view_experiment"
BY_METHOD = {
    "POST": "experiments.add_experiment",
    "PUT": "experiments.change_experiment",
    "PATCH": "experiments.change_experiment",
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
CanChangeWeights = require("experiments.change_weights")
CanView = require(VIEW)
