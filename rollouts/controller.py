"""The rollout decision, pure: plan + state + what the stores say now -> one decision, with why.

No framework, no I/O: the glue (rollouts/service.py) reads the weights store and the sample
store, calls ``decide_step`` and carries the decision out. Every input is a value, so a test can
table-drive every path and an audit entry can be recomputed from its numbers.

Decisions (``Decision.action``):

- ``start``: no step taken yet; set the weights to the first step.
- ``hold``: keep the current step (too few samples, too young, a store down: never promote blind).
- ``promote``: the step passed its guardrails; move to the next step's weights.
- ``complete``: the step before 100 % passed; the candidate gets every user and the rollout ends.
- ``rollback``: a guardrail is breached with confidence and the plan says roll back: the
  candidate goes to 0 % and the rollout ends.
- ``pause``: a breach with ``on_breach: pause``, or a sample ratio mismatch (the split itself is
  broken, so no guardrail can be trusted): the weights stay, the rollout waits for a person.
- ``yield``: the weights in the store are not the ones the controller last wrote (a person
  changed them): the controller pauses itself and never overwrites a human.

Error budget: a plan's ``alpha`` bounds the chance of a false rollback (or false pass) over the
whole rollout; each step gets alpha / (number of steps) (stats/sequential/guardrails.py: the
union bound across steps).

Inference: with the experiment's ``analysis.cluster_by_user`` (the default) the step's reading
carries per-user aggregates and attainment and error rate are read with users as the
independent unit, their differences to the control adjusted on pre-request covariates unless
``analysis.adjust`` is off; each guardrail in the decision's numbers names how it was read
(stats/sequential/guardrails.py). An identical_answers guardrail reads the candidate's live
requests shadowed to the control (the reading's ``candidate.shadows``) and must be shown to hold
before a step is promoted; its check in the numbers carries the shadows' counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from experiments.document import parse_duration, resolve_guardrail
from stats.sequential.arm_snapshot import IDENTICAL_ANSWERS, ArmSnapshot
from stats.sequential.guardrail_spec import Guardrail
from stats.sequential.guardrails import BREACH, HALT, PASS, RolloutDecision, decide
from stats.sequential.srm import SrmSequence

START, HOLD, PROMOTE, COMPLETE = "start", "hold", "promote", "complete"
ROLLBACK, PAUSE, YIELD = "rollback", "pause", "yield"
ACTIONS = (START, HOLD, PROMOTE, COMPLETE, ROLLBACK, PAUSE, YIELD)
# Rollout states (RolloutState.status)
RUNNING, PAUSED, YIELDED, COMPLETED, ROLLED_BACK = "running", "paused", "yielded", "completed", "rolled_back"
STATES = (RUNNING, PAUSED, YIELDED, COMPLETED, ROLLED_BACK)
STATE_AFTER = {
    START: RUNNING,
    HOLD: RUNNING,
    PROMOTE: RUNNING,
    COMPLETE: COMPLETED,
    ROLLBACK: ROLLED_BACK,
    PAUSE: PAUSED,
    YIELD: YIELDED,
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated ``rollout:`` block with its names resolved (experiments/document.py)."""

    candidate: str
    control: str
    steps: tuple[int, ...]
    min_samples: int
    min_duration_s: float
    guardrails: tuple[Guardrail, ...]
    on_breach: str
    notify: tuple[str, ...]
    alpha: float
    # The experiment's analysis block (its document's ``analysis:``): attainment and error rate
    # read with users as the independent unit (the reading carries per-user aggregates), and
    # their differences to the control adjusted on pre-request covariates. Adjustment rides on
    # the per-user aggregates: with cluster_by_user off every guardrail reads requests.
    cluster_by_user: bool = True
    adjust: bool = True

    @classmethod
    def from_document(
        cls,
        rollout: Mapping[str, Any],
        *,
        control: str,
        sla_target: float,
        analysis: Mapping[str, Any] | None = None,
    ) -> Plan:
        switches = analysis or {}
        return cls(
            candidate=rollout["candidate"],
            control=control,
            steps=tuple(rollout["steps"]),
            min_samples=int(rollout["min_samples"]),
            min_duration_s=parse_duration(rollout["min_duration"]),
            guardrails=tuple(resolve_guardrail(g, sla_target) for g in rollout["guardrails"]),
            on_breach=rollout.get("on_breach", "rollback"),
            notify=tuple(rollout.get("notify") or ()),
            alpha=float(rollout.get("alpha", 0.05)),
            cluster_by_user=bool(switches.get("cluster_by_user", True)),
            adjust=bool(switches.get("adjust", True)),
        )

    @property
    def step_alpha(self) -> float:
        return self.alpha / len(self.steps)

    def weights_at(self, step: int) -> dict[str, int]:
        p = self.steps[step]
        return {self.control: 100 - p, self.candidate: p}

    def rolled_back_weights(self) -> dict[str, int]:
        return {self.control: 100, self.candidate: 0}

    def latencies(self) -> list[str]:
        """The latency columns the quantile guardrails read (ttft_ms for p99_ttft_ms)."""
        return sorted({g.quantile[1] for g in self.guardrails if g.quantile is not None})

    def reads_shadows(self) -> bool:
        """An identical_answers guardrail: the step's reading needs the candidate's shadows."""
        return any(g.metric == IDENTICAL_ANSWERS for g in self.guardrails)


@dataclasses.dataclass(frozen=True)
class State:
    """What the controller remembers between looks (RolloutState)."""

    status: str = RUNNING
    step: int | None = None  # None: no step taken yet
    step_started_s: float | None = None
    last_seen_revision: int = 0  # the weights revision the controller last wrote (or adopted)
    srm_max_log_e: float = 0.0  # the SRM sequence's largest log e-value so far in this step


@dataclasses.dataclass(frozen=True)
class StoreView:
    """The weights store now: None fields when it could not be read."""

    weights: Mapping[str, int] | None
    revision: int | None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class StepReading:
    """This step's samples (config revision = the step's): per-arm totals (with per-user
    aggregates when the plan clusters by user: ArmSnapshot.per_user; with the candidate's
    shadowed requests when the plan has an identical_answers guardrail: ArmSnapshot.shadows)
    and distinct users. ``error`` set: the sample store could not be read."""

    control: ArmSnapshot | None = None
    candidate: ArmSnapshot | None = None
    users: Mapping[str, int] = dataclasses.field(default_factory=dict)
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    step: int | None  # the step the decision was taken at (None: before the first)
    to_step: int | None  # the step after it (None: none)
    weights: dict[str, int] | None  # weights to write (None: leave the store alone)
    numbers: dict[str, Any]  # what decided it: guardrail intervals, SRM, counts, elapsed
    srm_log_e: float = 0.0  # the step's SRM evidence after this look (State.srm_max_log_e next)
    # The weights revision a write of ``weights`` compares against (None: no write, or the
    # store could not be read). Before the first step it is the store's revision now: the
    # experiment's start published those weights, the controller has written none yet. After
    # that it is the revision the controller last wrote, so a person's change in between makes
    # the write fail and the rollout yield.
    base_revision: int | None = None

    @property
    def state_after(self) -> str:
        return STATE_AFTER[self.action]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _same(a: Mapping[str, int], b: Mapping[str, int]) -> bool:
    return {k: int(v) for k, v in a.items() if v} == {k: int(v) for k, v in b.items() if v}


def decide_step(
    plan: Plan, state: State, store: StoreView, reading: StepReading | None, now_s: float
) -> Decision:
    """The one decision for this look. ``reading`` may be None before the first step (nothing
    to read yet). ``now_s`` and ``state.step_started_s`` come from one clock (the glue uses the
    database's, so processes with skewed clocks agree)."""
    step = state.step
    base = store.revision if step is None else state.last_seen_revision

    def out(
        action: str,
        reason: str,
        to_step: int | None = step,
        weights=None,
        srm_log_e: float = state.srm_max_log_e,  # a look without a reading keeps the evidence
        **numbers,
    ) -> Decision:
        return Decision(
            action, reason, step, to_step, weights, numbers, srm_log_e, base if weights is not None else None
        )

    if state.status != RUNNING:
        raise ValueError(f"decide_step: the rollout is {state.status}, not running")
    if store.revision is None or store.weights is None:
        return out(HOLD, f"weights store unavailable ({store.error or 'no answer'}): holding the step")
    if step is None:
        if plan.steps[0] == 100:
            return out(
                COMPLETE, f"the plan's only step is 100%: {plan.candidate} to 100%", 0, plan.weights_at(0)
            )
        return out(
            START, f"starting the rollout at {plan.steps[0]}% on {plan.candidate}", 0, plan.weights_at(0)
        )
    if store.revision != state.last_seen_revision or not _same(store.weights, plan.weights_at(step)):
        return out(
            YIELD,
            f"the weights changed outside the rollout (revision {state.last_seen_revision} -> "
            f"{store.revision}, now {dict(store.weights)}): a person is in charge; the rollout "
            "pauses itself and leaves the weights alone",
            store_revision=store.revision,
            store_weights=dict(store.weights),
        )
    if reading is None or reading.error:
        why = reading.error if reading is not None else "no reading"
        return out(HOLD, f"sample store unavailable ({why}): holding the step, never promoting blind")
    assert reading.control is not None and reading.candidate is not None
    elapsed = max(0.0, now_s - (state.step_started_s if state.step_started_s is not None else now_s))
    weights = plan.weights_at(step)
    srm = SrmSequence(weights, alpha=plan.step_alpha, max_log_e=state.srm_max_log_e)
    srm = srm.update({k: int(reading.users.get(k, 0)) for k in weights})
    srm_check = srm.check()
    verdict: RolloutDecision = decide(
        plan.guardrails,
        reading.control,
        reading.candidate,
        alpha=plan.step_alpha,
        min_samples=plan.min_samples,
        min_duration_s=plan.min_duration_s,
        elapsed_s=elapsed,
        srm=srm_check,
        adjust=plan.adjust,
    )
    # Each check names its inference (requests, user-clustered, adjusted, order statistics) and
    # the variance reduction an adjustment achieved; "analysis" is what the experiment asked for.
    numbers = {
        "verdict": verdict.as_dict(),
        "srm_log_e": srm.max_log_e,
        "analysis": {"cluster_by_user": plan.cluster_by_user, "adjust": plan.adjust},
    }
    here = f"step {step + 1}/{len(plan.steps)} ({plan.steps[step]}%)"
    if verdict.decision == HALT:
        return out(PAUSE, f"{here}: halted: {verdict.reason}", **numbers)
    if verdict.decision == BREACH:
        if plan.on_breach == "rollback":
            return out(
                ROLLBACK,
                f"{here}: guardrail breached: {verdict.reason}; {plan.candidate} back to 0%",
                None,
                plan.rolled_back_weights(),
                **numbers,
            )
        return out(PAUSE, f"{here}: guardrail breached: {verdict.reason}; paused per plan", **numbers)
    if verdict.decision != PASS:
        return out(HOLD, f"{here}: {verdict.reason}", **numbers)
    nxt = step + 1
    if nxt >= len(plan.steps) or plan.steps[nxt] == 100:
        return out(
            COMPLETE,
            f"{here}: {verdict.reason}; {plan.candidate} to 100%",
            len(plan.steps) - 1,
            {plan.control: 0, plan.candidate: 100},
            **numbers,
        )
    return out(
        PROMOTE,
        f"{here}: {verdict.reason}; promoting to {plan.steps[nxt]}%",
        nxt,
        plan.weights_at(nxt),
        **numbers,
    )


def weights_match(a: Mapping[str, int], b: Mapping[str, int]) -> bool:
    """Equal weights, ignoring variants at 0 that one side leaves out."""
    return _same(a, b)
