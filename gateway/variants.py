"""Where each variant is: endpoints, models and credentials, read from the database.

Only running and paused experiments are loaded, and the configured default experiment whatever
its status (the operator's choice): a draft or a concluded experiment is not served, so a draft
cannot take over a model name and nobody reaches a draft's endpoints or secrets through the
gateway. The request path never touches the database: a background thread re-reads every experiment's
variants each ``ABPLAT_GATEWAY_VARIANTS_REFRESH_S`` and swaps one immutable snapshot (as the
weights router does). A variant's secret is read from ABPLAT_VARIANT_SECRETS_DIR at each
refresh (a rotated file takes effect within one interval) and lives only in its headers, once
the operator's binding allows its endpoint's host and its experiment's team
(streaming.egress.bound_bearer); a refused one is the variant's ``error``, served as such.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from django.conf import settings
from django.db import close_old_connections

from streaming.egress import bound_bearer
from streaming.endpoint import Endpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Target:
    experiment: str
    key: str
    control: bool
    endpoint: Endpoint
    model: str
    headers: Mapping[str, str] = field(repr=False)  # the Authorization, never logged
    error: str = ""  # why this variant cannot be served now (its secret is missing or not bound here)


@dataclass(frozen=True, slots=True)
class ExperimentTargets:
    key: str
    status: str
    control: str
    variants: Mapping[str, Target]
    team: str = ""
    shadow_share: float = 0.0  # the document's fidelity.shadow_share (gateway/shadow.py)


_EMPTY: Mapping[str, ExperimentTargets] = MappingProxyType({})
SERVED_STATUSES = ("running", "paused")


def load_targets(
    secrets_dir: str | None = None, default_experiment: str | None = None
) -> dict[str, ExperimentTargets]:
    """Every served experiment with a control (running, paused, and the default one), from the
    database (call from a thread, not the loop)."""
    from django.db.models import Q

    from experiments.models import Experiment

    directory = settings.VARIANT_SECRETS_DIR if secrets_dir is None else secrets_dir
    default = settings.GATEWAY_DEFAULT_EXPERIMENT if default_experiment is None else default_experiment
    served = Q(status__in=SERVED_STATUSES) | Q(key=default) if default else Q(status__in=SERVED_STATUSES)
    out: dict[str, ExperimentTargets] = {}
    rows = (
        Experiment.objects.filter(served).select_related("team").prefetch_related("variants").order_by("key")
    )
    for exp in rows:
        variants: dict[str, Target] = {}
        control = ""
        for v in exp.variants.all():
            headers: dict[str, str] = {}
            error = ""
            try:
                endpoint = Endpoint.parse(v.endpoint)
            except ValueError as exc:
                log.error("gateway: variant %s/%s: %s", exp.key, v.key, exc)
                continue
            if v.auth_secret:
                try:
                    headers = bound_bearer(directory, v.auth_secret, url=v.endpoint, team=exp.team.name)
                except ValueError as exc:  # SecretError: names the secret, never its value
                    error = str(exc)
            variants[v.key] = Target(exp.key, v.key, v.control, endpoint, v.model, headers, error)
            if v.control:
                control = v.key
        if control:
            out[exp.key] = ExperimentTargets(
                exp.key,
                exp.status,
                control,
                MappingProxyType(variants),
                team=exp.team.name,
                shadow_share=float(exp.fidelity_shadow_share or 0.0),
            )
    return out


class Directory:
    """The snapshot of targets, refreshed in the background (``start``) or by ``refresh``."""

    def __init__(
        self, targets: Mapping[str, ExperimentTargets] | None = None, default_experiment: str | None = None
    ) -> None:
        """``default_experiment``: served whatever its status (None: the setting's)."""
        self.default_experiment = default_experiment
        self._targets: Mapping[str, ExperimentTargets] = (
            MappingProxyType(dict(targets)) if targets else _EMPTY
        )
        self._controls: Mapping[str, str] = {k: e.control for k, e in self._targets.items()}
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self.loaded = targets is not None
        self.last_error = ""

    @property
    def targets(self) -> Mapping[str, ExperimentTargets]:
        return self._targets

    @property
    def controls(self) -> Mapping[str, str]:
        return self._controls

    def target(self, experiment: str, variant: str) -> Target | None:
        exp = self._targets.get(experiment)
        return exp.variants.get(variant) if exp is not None else None

    def replace(self, targets: Mapping[str, ExperimentTargets]) -> None:
        snapshot = MappingProxyType(dict(targets))
        self._controls = {k: e.control for k, e in snapshot.items()}
        self._targets = snapshot  # readers see the old or the new one, each whole
        self.loaded = True

    def refresh(self) -> None:
        self.replace(load_targets(default_experiment=self.default_experiment))

    def kick(self) -> None:
        """Refresh soon (a router assigned a variant this snapshot does not hold yet)."""
        self._kick.set()

    def start(self, interval_s: float) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, args=(interval_s,), name="gateway-variants", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                close_old_connections()
                self.refresh()
                self.last_error = ""
            except Exception as exc:  # keep serving the last snapshot
                if not self.last_error:
                    log.warning("gateway: cannot read the variants (%s); serving the last snapshot", exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._kick.wait(interval_s)
            self._kick.clear()
