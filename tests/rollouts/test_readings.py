"""A rollout step's reading counts the users the router assigned: a live request retried on the
control after the candidate failed carries the step's revision, and counted as a control user
it would tilt the SRM guardrail just when the candidate fails."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.definitions import Slo
from rollouts.controller import Plan
from rollouts.readings import read_step
from samples import synthetic

pytestmark = pytest.mark.services

EXP, RUN, REV = "roll", 10**12 + 7, 5


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


def live(n: int, *, seed: int) -> dict:
    spec = synthetic.SyntheticSpec(
        experiment=EXP, mode="split", n=n, seed=seed, run_id=RUN, config_revisions=(REV,),
        variants=[synthetic.VariantSpec("base", 50, {}, control=True), synthetic.VariantSpec("cand", 50, {})],
    )  # fmt: skip
    c = synthetic.generate(spec).columns
    c["mode"] = np.full(len(c["mode"]), "live", dtype=object)
    return c


def test_a_step_counts_the_users_the_router_assigned_not_the_retries_on_the_control(store):
    assigned = live(2000, seed=1)
    store.insert_columns(assigned)
    retries = live(600, seed=2)  # the candidate's users, failed over to the control
    k = len(retries["mode"])
    retries["variant"] = np.full(k, "base", dtype=object)
    retries["attempt"] = np.full(k, 2, dtype=np.uint8)
    retries["seq"] = retries["seq"] + 10**6
    retries["request_id"] = np.array([f"gw-retry-{i}" for i in range(k)], dtype=object)
    store.insert_columns(retries)
    plan = Plan(candidate="cand", control="base", steps=(5, 50, 100), min_samples=100, min_duration_s=0.0,
                guardrails=(), on_breach="rollback", notify=(), alpha=0.05)  # fmt: skip
    reading = read_step(store, EXP, REV, plan, Slo(200.0))
    assert reading.error == ""
    users = {v: int(np.sum(assigned["variant"] == v)) for v in ("base", "cand")}
    assert reading.users == users  # one user per assigned request; none of the retries
    assert reading.control.n == users["base"] + k  # the retries are the control's requests all the same
