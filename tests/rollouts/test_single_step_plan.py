"""A plan whose only step is 100%: the first look moves every user to the candidate.

The first write of a rollout compares against the revision the experiment's start published
(the controller has written none yet); comparing against "nothing written" (0) made every look
conflict with the start's own weights, so the plan never took effect."""

from __future__ import annotations

import pytest

from experiments import services
from experiments.document import validate_document
from experiments.models import AuditEntry, Experiment
from experiments.weights.process import weights_store
from rollouts import controller as c
from rollouts import service
from rollouts.controller import Plan, State, StoreView, decide_step
from rollouts.models import RolloutState

KEY = "rollout-demo"


def plan_of(doc, **change) -> Plan:
    doc["rollout"].update(change)
    valid = validate_document(doc)
    return Plan.from_document(valid["rollout"], control="fp16", sla_target=valid["sla"]["target"])


def test_the_first_write_compares_against_the_revision_in_the_store_now(rollout_document):
    """Pure: before any step the controller's write is based on the store's revision (the
    start's), not on State.last_seen_revision (0: nothing written by the controller yet)."""
    plan = plan_of(rollout_document, steps=[100])
    d = decide_step(plan, State(), StoreView({"fp16": 100, "awq-fa2": 0}, 5), None, 0)
    assert d.action == c.COMPLETE and d.weights == {"fp16": 0, "awq-fa2": 100}
    assert d.base_revision == 5


def test_the_first_step_of_a_longer_plan_is_based_on_the_store_revision_too(rollout_document):
    plan = plan_of(rollout_document)
    d = decide_step(plan, State(), StoreView({"fp16": 100, "awq-fa2": 0}, 3), None, 0)
    assert d.action == c.START and d.base_revision == 3


def test_later_writes_compare_against_the_revision_the_controller_wrote(rollout_document):
    from tests.rollouts.test_controller import arm, reading

    plan = plan_of(rollout_document)
    state = State(step=0, step_started_s=0, last_seen_revision=7)
    d = decide_step(plan, state, StoreView({"fp16": 90, "awq-fa2": 10}, 7), reading(arm(900), arm(100)), 10)
    assert d.action == c.PROMOTE and d.base_revision == 7
    hold = decide_step(plan, state, StoreView({"fp16": 90, "awq-fa2": 10}, 7), reading(arm(9), arm(1)), 10)
    assert hold.action == c.HOLD and hold.weights is None and hold.base_revision is None


@pytest.mark.django_db
@pytest.mark.engine
def test_a_single_step_plan_takes_effect_on_the_first_look(weights_backend, rollout_document):
    rollout_document["rollout"]["steps"] = [100]
    experiment = services.apply_document(rollout_document).experiment
    services.transition(experiment, "start")
    _, started_revision = weights_store().get(KEY)

    r = service.look(KEY, interval_s=0)

    assert r.decision.action == c.COMPLETE, r.note
    doc, revision = weights_store().get(KEY)
    assert dict(doc.weights) == {"fp16": 0, "awq-fa2": 100} and revision > started_revision
    state = RolloutState.objects.get(experiment__key=KEY)
    assert (state.status, state.step, state.last_seen_revision, state.pending) == (
        c.COMPLETED,
        0,
        revision,
        None,
    )
    assert Experiment.objects.get(key=KEY).weights() == {"fp16": 0, "awq-fa2": 100}
    actions = list(
        AuditEntry.objects.filter(experiment_key=KEY, action__startswith="rollout_").values_list(
            "action", flat=True
        )
    )
    assert actions == ["rollout_complete"]
    assert r.percent == 100 and r.status == c.COMPLETED
