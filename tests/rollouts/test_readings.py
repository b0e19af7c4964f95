"""A rollout step's reading counts the users the router assigned: a live request retried on the
control after the candidate failed carries the step's revision, and counted as a control user
it would tilt the SRM guardrail just when the candidate fails. Its per-user aggregates (the
clustered and adjusted guardrails') are those of the raw samples."""

from __future__ import annotations

import dataclasses

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


def raw_user_rows(c: dict, variant: str, slo_ms: float) -> np.ndarray:
    """The per-user aggregates of one arm computed in Python from the raw samples, one row per
    user (a request without a user: its own), columns as UserSums, sorted."""
    mine = c["variant"] == variant
    ok = c["outcome"][mine] == "ok"
    with np.errstate(invalid="ignore"):
        hit = ok & (np.nan_to_num(c["ttft_ms"][mine].astype(float), nan=np.inf) < slo_ms)
    err = ~ok
    x = np.stack([c["prompt_tokens"][mine], c["max_tokens"][mine]], axis=1).astype(float)
    keys = [u or f"request:{r}" for u, r in zip(c["user_id"][mine], c["request_id"][mine], strict=True)]
    codes = np.unique(np.array(keys, dtype=object), return_inverse=True)[1].ravel()

    def per_user(w):
        return np.bincount(codes, weights=w)

    cols = [per_user(np.ones(codes.size)), per_user(hit), per_user(err)]
    cols += [per_user(x[:, 0] * x[:, 0]), per_user(x[:, 0] * x[:, 1]), per_user(x[:, 1] * x[:, 1])]
    cols += [per_user(x[:, k]) for k in range(2)]
    cols += [per_user(x[:, k] * hit) for k in range(2)] + [per_user(x[:, k] * err) for k in range(2)]
    return np.array(sorted(map(tuple, np.stack(cols, axis=1))))


def read_user_rows(u) -> np.ndarray:
    cols = [u.n, u.hits, u.errors, u.sum_xx[:, 0, 0], u.sum_xx[:, 0, 1], u.sum_xx[:, 1, 1]]
    cols += [u.sum_x[:, k] for k in range(2)]
    cols += [u.sum_x_hits[:, k] for k in range(2)] + [u.sum_x_errors[:, k] for k in range(2)]
    return np.array(sorted(map(tuple, np.stack([np.asarray(c, dtype=float) for c in cols], axis=1))))


def test_a_step_reads_per_user_aggregates_equal_to_those_of_the_raw_samples(store):
    # Heavy-tailed users within each arm (the router keeps a user on one variant), 10% of the
    # requests without a user (each its own), prompts and requested tokens that vary, and
    # errors: the per-user rows read_step returns are those computed from the raw samples.
    exp, rev = "roll-users", 9
    spec = synthetic.SyntheticSpec(
        experiment=exp, mode="split", n=3000, seed=4, run_id=RUN + 1, config_revisions=(rev,),
        variants=[synthetic.VariantSpec("base", 50, {}, control=True),
                  synthetic.VariantSpec("cand", 50, {}, ttft_scale=1.5, error_rate=0.05)],
    )  # fmt: skip
    c = synthetic.generate(spec).columns
    rng = np.random.default_rng(4)
    n = len(c["variant"])
    weights = rng.lognormal(0.0, 1.2, 200)
    user = rng.choice(200, size=n, p=weights / weights.sum())
    no_user = rng.random(n) < 0.1
    c["user_id"] = np.array(
        ["" if nu else f"{v}-u{u}" for nu, v, u in zip(no_user, c["variant"], user, strict=True)],
        dtype=object,
    )
    c["max_tokens"] = rng.choice([128, 256, 1024], size=n).astype(np.uint32)
    store.insert_columns(c)
    plan = Plan(candidate="cand", control="base", steps=(5, 50, 100), min_samples=100, min_duration_s=0.0,
                guardrails=(), on_breach="rollback", notify=(), alpha=0.05)  # fmt: skip
    reading = read_step(store, exp, rev, plan, Slo(200.0))
    assert reading.error == ""
    for variant, snap in (("base", reading.control), ("cand", reading.candidate)):
        u = snap.per_user
        assert u is not None and u.covariates == ("prompt_tokens", "max_tokens")
        expected = raw_user_rows(c, variant, 200.0)
        got = read_user_rows(u)
        assert got.shape == expected.shape and got.shape[0] > 100  # a row per user, each ''-request its own
        np.testing.assert_array_equal(got, expected)
        assert (snap.n, snap.hits, snap.errors) == (int(u.n.sum()), int(u.hits.sum()), int(u.errors.sum()))
        assert snap.n == int((c["variant"] == variant).sum())
    assert (
        reading.candidate.errors > 0
        and reading.candidate.hits < reading.candidate.n - reading.candidate.errors
    )
    # Users off (the experiment's analysis.cluster_by_user): totals only, as before.
    plain = read_step(store, exp, rev, dataclasses.replace(plan, cluster_by_user=False), Slo(200.0))
    assert plain.control.per_user is None and plain.candidate.per_user is None
    assert (plain.candidate.n, plain.candidate.hits, plain.candidate.errors) == (
        reading.candidate.n, reading.candidate.hits, reading.candidate.errors,
    )  # fmt: skip
