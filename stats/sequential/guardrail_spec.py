"""A guardrail as the experiment document states it (``rollout.guardrails``): a metric of the
candidate arm, or its difference to the control, against a limit.

    {metric: attainment, at_least: 0.992}              candidate attainment >= 0.992
    {metric: error_rate, at_most_over_control: 0.005}  candidate - control error rate <= 0.005
    {metric: p99_ttft_ms, at_most_over_control: 20}    candidate p99 - control p99 <= 20 ms
    {metric: identical_answers, at_least: 0.95}        candidate's shadowed answers identical
                                                       to the control's: share >= 0.95

``identical_answers`` takes at_least and at_most only: its share already compares the candidate
with the control (the control's answers are the reference, identical to themselves), so a
difference to the control's own share would compare it with 1.

``Guardrail`` checks the form; stats.sequential.guardrails reads it against the arms.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

from stats._common import AsDict
from stats.sequential.arm_snapshot import ATTAINMENT, ERROR_RATE, IDENTICAL_ANSWERS

AT_LEAST, AT_MOST = "at_least", "at_most"
AT_LEAST_OVER, AT_MOST_OVER = "at_least_over_control", "at_most_over_control"
RULES = (AT_LEAST, AT_MOST, AT_LEAST_OVER, AT_MOST_OVER)
_QUANTILE_METRIC = re.compile(r"^p(\d{1,2}(?:\.\d+)?)_([a-z][a-z0-9_]*)$")


@dataclasses.dataclass(frozen=True, slots=True)
class Guardrail(AsDict):
    metric: str
    rule: str
    threshold: float

    def __post_init__(self) -> None:
        where = f"guardrail {self.metric!r}"
        if self.rule not in RULES:
            raise ValueError(f"{where}: rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t):
            raise ValueError(f"{where}: {self.rule} must be a finite number, got {t!r}")
        object.__setattr__(self, "threshold", float(t))
        if self.metric == IDENTICAL_ANSWERS and self.over_control:
            raise ValueError(
                f"{where}: {self.rule} does not apply: the share already compares the candidate's "
                f"answers with the control's (the reference, identical to itself); use {AT_LEAST} "
                f"(or {AT_MOST})"
            )
        if self.metric in (ATTAINMENT, ERROR_RATE, IDENTICAL_ANSWERS):
            low = -1.0 if self.over_control else 0.0
            if not low <= t <= 1.0:
                raise ValueError(f"{where}: {self.rule} must be a share in [{low:g}, 1], got {t!r}")
        elif self.quantile is None:
            raise ValueError(
                f"guardrail metric must be {ATTAINMENT}, {ERROR_RATE}, {IDENTICAL_ANSWERS} or a "
                f"quantile like p99_ttft_ms, got {self.metric!r}"
            )

    @property
    def over_control(self) -> bool:
        return self.rule in (AT_LEAST_OVER, AT_MOST_OVER)

    @property
    def quantile(self) -> tuple[float, str] | None:
        """(q, latency name) for a quantile metric: p99_ttft_ms -> (0.99, "ttft_ms")."""
        m = _QUANTILE_METRIC.match(self.metric)
        if not m:
            return None
        q = float(m.group(1)) / 100.0
        return (q, m.group(2)) if 0.0 < q < 1.0 else None

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any], where: str = "guardrail") -> Guardrail:
        """From the document's form: {"metric": "attainment", "at_least": 0.992}."""
        if not isinstance(spec, Mapping) or "metric" not in spec:
            raise ValueError(f"{where}: must be a mapping with a metric and one rule, got {spec!r}")
        rules = [k for k in spec if k != "metric"]
        if len(rules) != 1:
            raise ValueError(f"{where}: needs exactly one of {', '.join(RULES)}, got {sorted(rules)}")
        try:
            return cls(str(spec["metric"]), rules[0], spec[rules[0]])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
