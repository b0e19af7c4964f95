"""The experiment as the SLA report reads it: its variants, SLO and target, the weights in force
per config revision, how its statistics are asked for (the unit, regression adjustment), and
whether its answers' texts are stored.

Plain values built by the caller (dashboards.reports from the models, tests and benches by hand)
and given to analysis.report.build_report, which needs no Django.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from analysis.definitions import Slo


@dataclasses.dataclass(frozen=True)
class VariantInfo:
    key: str
    control: bool
    weight: float
    factors: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class ExperimentInfo:
    key: str
    name: str
    slo: Slo
    target: float
    variants: Sequence[VariantInfo]
    # config revision -> {variant: weight} in force; revisions missing here use `weights`
    weights_by_revision: Mapping[int, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    weights_source: str = "current variant weights (no weights history recorded)"
    weight_changes: Sequence[Mapping[str, Any]] = ()  # [{"at": iso, "label": str}]
    # the experiment document's analysis block: users as the independent unit, and regression
    # adjustment on pre-request covariates (analysis.units); off: request-level statistics only
    cluster_by_user: bool = True
    adjust: bool = True
    # the document's fidelity.store_answers: mirror replays keep answers' texts, and the report
    # shows a few diverged ones (analysis.answer_fidelity); off: fingerprints only
    store_answers: bool = False
    # the document's fidelity.score_share: the share of a mirror run's requests scored by teacher
    # forcing after it ends (the report's fidelity.kl); 0: none; None: not told (its kl_note then
    # names both reasons a KL can be missing)
    score_share: float | None = None

    @property
    def unit(self) -> str:
        return "user" if self.cluster_by_user else "request"

    @property
    def control(self) -> str:
        keys = [v.key for v in self.variants if v.control]
        if len(keys) != 1:
            raise ValueError(f"experiment {self.key!r} needs exactly one control, has {keys}")
        return keys[0]

    @property
    def weights(self) -> dict[str, float]:
        return {v.key: float(v.weight) for v in self.variants}
