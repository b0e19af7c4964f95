"""A rollout step's reading counts the users the router assigned: a live request retried on the
control after the candidate failed carries the step's revision, and counted as a control user
it would tilt the SRM guardrail just when the candidate fails. Its per-user aggregates (the
clustered and adjusted guardrails'), reduced in the store to a row per arm, are those of the
per-user rows it read before (and those the raw samples'), and decide the same."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from analysis.definitions import Slo
from analysis.sql import SAMPLES, hit_expr
from rollouts.controller import Plan
from rollouts.readings import read_step
from samples import synthetic
from stats.sequential.arm_snapshot import ArmSnapshot, UserMoments, UserSums
from stats.sequential.guardrail_spec import Guardrail
from stats.sequential.guardrails import check_guardrail

pytestmark = pytest.mark.services

EXP, RUN, REV = "roll", 10**12 + 7, 5


@pytest.fixture(params=["chdb", "server"])
def store(request, shared_store):
    return shared_store(request.param)  # the session's migrated database, empty (tests/sample_dbs.py)


def live(n: int, *, seed: int) -> dict:
    spec = synthetic.SyntheticSpec(
        experiment=EXP,
        mode="split",
        n=n,
        seed=seed,
        run_id=RUN,
        config_revisions=(REV,),
        variants=[synthetic.VariantSpec("base", 50, {}, control=True), synthetic.VariantSpec("cand", 50, {})],
    )
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
    plan = Plan(
        candidate="cand",
        control="base",
        steps=(5, 50, 100),
        min_samples=100,
        min_duration_s=0.0,
        guardrails=(),
        on_breach="rollback",
        notify=(),
        alpha=0.05,
    )
    reading = read_step(store, EXP, REV, plan, Slo(200.0))
    assert reading.error == ""
    users = {v: int(np.sum(assigned["variant"] == v)) for v in ("base", "cand")}
    assert reading.users == users  # one user per assigned request; none of the retries
    assert reading.control.n == users["base"] + k  # the retries are the control's requests all the same


# The per-user reading as it was before the store reduced it per arm (a row per arm and user,
# ``GROUP BY variant, user``): the reference the per-arm moments are checked against.
LEGACY_USER_KEY = "cityHash64(user_id, if(user_id = '', request_id, ''))"
COVARIATE_SQL = ("toFloat64(prompt_tokens)", "toFloat64(max_tokens)")


def legacy_user_sums(store, experiment: str, revision: int, slo: Slo) -> dict[str, UserSums]:
    hit, hp = hit_expr(slo)
    err, x = "outcome != 'ok'", COVARIATE_SQL
    cols = ["variant", "count() AS n", f"countIf({hit}) AS hits", f"countIf({err}) AS errors"]
    cols += [f"sum({e}) AS x{k}" for k, e in enumerate(x)]
    cols += [f"sum({x[k]} * {x[m]}) AS xx{k}{m}" for k in range(2) for m in range(k, 2)]
    cols += [f"sumIf({e}, {hit}) AS xh{k}" for k, e in enumerate(x)]
    cols += [f"sumIf({e}, {err}) AS xe{k}" for k, e in enumerate(x)]
    rows = store.query_columns(
        f"SELECT {', '.join(cols)} FROM {SAMPLES} PREWHERE experiment = %(e)s WHERE config_revision = %(r)s "
        f"GROUP BY variant, {LEGACY_USER_KEY}",
        {"e": experiment, "r": revision, **hp},
    )
    variant = np.asarray(rows["variant"], dtype=object)
    out = {}
    for arm in sorted(set(variant)):
        mine = variant == arm

        def col(name, mine=mine):
            return np.asarray(rows[name], dtype=float)[mine]

        g = int(mine.sum())
        sxx = np.zeros((g, 2, 2))
        for k in range(2):
            for m in range(k, 2):
                sxx[:, k, m] = sxx[:, m, k] = col(f"xx{k}{m}")
        out[arm] = UserSums(
            col("n").astype(np.int64),
            col("hits").astype(np.int64),
            col("errors").astype(np.int64),
            ("prompt_tokens", "max_tokens"),
            np.stack([col("x0"), col("x1")], 1),
            sxx,
            np.stack([col("xh0"), col("xh1")], 1),
            np.stack([col("xe0"), col("xe1")], 1),
        )
    return out


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


class RowCounting:
    """A store that records how many rows each query returned."""

    def __init__(self, store):
        self.store, self.rows = store, []

    def query(self, sql, params=None, *, settings=None):
        got = self.store.query(sql, params, settings=settings)
        self.rows.append(len(got))
        return got

    def query_columns(self, sql, params=None, *, settings=None):
        got = self.store.query_columns(sql, params, settings=settings)
        self.rows.append(len(next(iter(got.values()), [])))
        return got

    def execute(self, sql, params=None):
        return self.store.execute(sql, params)

    def unit_shards(self):
        return [("counted", self, SAMPLES)]

    def active_parts(self):  # a listing of the table's parts (rollouts.kept), not a read of the step
        return self.store.active_parts()


def step_samples(exp: str, rev: int, seed: int, run_id: int, constant_max_tokens: bool = False) -> dict:
    """A step's random samples: heavy-tailed users within each arm (the router keeps a user on
    one variant), 10% of the requests without a user (each its own), prompts and requested
    tokens that vary (or max_tokens the same for all), and errors."""
    spec = synthetic.SyntheticSpec(
        experiment=exp,
        mode="split",
        n=4000,
        seed=seed,
        run_id=run_id,
        config_revisions=(rev,),
        variants=[
            synthetic.VariantSpec("base", 50, {}, control=True),
            synthetic.VariantSpec("cand", 50, {}, ttft_scale=1.5, error_rate=0.05),
        ],
    )
    c = synthetic.generate(spec).columns
    rng = np.random.default_rng(seed)
    n = len(c["variant"])
    weights = rng.lognormal(0.0, 1.2, 200)
    user = rng.choice(200, size=n, p=weights / weights.sum())
    no_user = rng.random(n) < 0.1
    c["user_id"] = np.array(
        ["" if nu else f"{v}-u{u}" for nu, v, u in zip(no_user, c["variant"], user, strict=True)],
        dtype=object,
    )
    tokens = np.full(n, 256) if constant_max_tokens else rng.choice([128, 256, 1024], size=n)
    c["max_tokens"] = tokens.astype(np.uint32)
    return c


def close(a, b, rtol=1e-9):
    return (a is None) == (b is None) and (a is None or abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12))


@pytest.mark.parametrize("constant_max_tokens", [False, True])
def test_a_step_reads_one_row_per_arm_and_decides_as_the_per_user_rows_did(store, constant_max_tokens):
    # Random steps: the reading's per-arm moments are those of the per-user rows the step was
    # read as before (and those rows the raw samples'), and every guardrail reads the same
    # numbers from them, to 1e-9; no query returns more than a row per arm.
    exp, rev = "roll-users", 9
    c = step_samples(exp, rev, seed=4, run_id=RUN + 1, constant_max_tokens=constant_max_tokens)
    store.insert_columns(c)
    store.insert_columns(step_samples(exp, rev + 1, seed=5, run_id=RUN + 2))  # the next step's: not read
    plan = Plan(
        candidate="cand",
        control="base",
        steps=(5, 50, 100),
        min_samples=100,
        min_duration_s=0.0,
        guardrails=(),
        on_breach="rollback",
        notify=(),
        alpha=0.05,
    )
    counting = RowCounting(store)
    reading = read_step(counting, exp, rev, plan, Slo(200.0), keep=False)
    assert reading.error == ""
    assert max(counting.rows) == 2 and len(counting.rows) == 2  # totals and moments: a row per arm
    # through the step's kept per-user sums (rollouts.kept): no query returns a row per user either
    counting = RowCounting(store)
    through_kept = read_step(counting, exp, rev, plan, Slo(200.0), keep=True)
    assert through_kept.users == reading.users and max(counting.rows) == 2
    for a, b in ((through_kept.control, reading.control), (through_kept.candidate, reading.candidate)):
        assert (a.n, a.hits, a.errors) == (b.n, b.hits, b.errors)
        np.testing.assert_allclose(a.per_user.attainment.cross, b.per_user.attainment.cross, rtol=1e-12)
    legacy = legacy_user_sums(store, exp, rev, Slo(200.0))
    for variant, snap in (("base", reading.control), ("cand", reading.candidate)):
        u, old = snap.per_user, legacy[variant]
        np.testing.assert_array_equal(read_user_rows(old), raw_user_rows(c, variant, 200.0))
        assert isinstance(u, UserMoments) and u.covariates == ("prompt_tokens", "max_tokens")
        assert u.users == old.users > 100  # every ''-request a user of its own
        assert (snap.n, snap.hits, snap.errors) == (
            old.requests,
            old.events("attainment"),
            old.events("error_rate"),
        )
        assert snap.n == int((c["variant"] == variant).sum())
        for metric in ("attainment", "error_rate"):
            got, want = getattr(u, metric), getattr(old.reduced(), metric)
            assert (got.clusters, got.largest, got.n) == (want.clusters, want.largest, want.n)
            np.testing.assert_allclose(got.total, want.total, rtol=1e-12)
            np.testing.assert_allclose(got.cross, want.cross, rtol=1e-12)
    assert (
        reading.candidate.errors > 0
        and reading.candidate.hits < reading.candidate.n - reading.candidate.errors
    )
    before = [
        ArmSnapshot(s.n, s.hits, s.errors, {}, legacy[v])
        for v, s in (("base", reading.control), ("cand", reading.candidate))
    ]
    guardrails = [
        Guardrail("attainment", "at_least", 0.5),
        Guardrail("attainment", "at_least_over_control", -0.05),
        Guardrail("error_rate", "at_most", 0.1),
        Guardrail("error_rate", "at_most_over_control", 0.01),
    ]
    seen = set()
    for g in guardrails:
        for adjust in (True, False):
            want = check_guardrail(g, *before, 0.0125, adjust=adjust)
            got = check_guardrail(g, reading.control, reading.candidate, 0.0125, adjust=adjust)
            assert (got.status, got.inference, got.inference_note, got.covariates) == (
                want.status,
                want.inference,
                want.inference_note,
                want.covariates,
            )
            for field in ("estimate", "lo", "hi"):
                assert close(getattr(got.interval, field), getattr(want.interval, field)), (g, adjust, field)
            assert close(got.variance_reduction, want.variance_reduction), (g, adjust)
            seen.add((got.inference, got.covariates))
    adjusted_on = ("prompt_tokens",) if constant_max_tokens else ("prompt_tokens", "max_tokens")
    assert {("user-clustered", ()), ("user-clustered, adjusted", adjusted_on)} <= seen
    # Users off (the experiment's analysis.cluster_by_user): totals only, as before.
    plain = read_step(store, exp, rev, dataclasses.replace(plan, cluster_by_user=False), Slo(200.0))
    assert plain.control.per_user is None and plain.candidate.per_user is None
    assert (plain.candidate.n, plain.candidate.hits, plain.candidate.errors) == (
        reading.candidate.n,
        reading.candidate.hits,
        reading.candidate.errors,
    )


def test_an_arm_without_requests_in_the_step_reads_as_no_users(store):
    c = step_samples("roll-empty", 3, seed=6, run_id=RUN + 3)
    keep = c["variant"] == "base"
    store.insert_columns({k: v[keep] for k, v in c.items()})
    plan = Plan(
        candidate="cand",
        control="base",
        steps=(5, 50, 100),
        min_samples=100,
        min_duration_s=0.0,
        guardrails=(),
        on_breach="rollback",
        notify=(),
        alpha=0.05,
    )
    reading = read_step(store, "roll-empty", 3, plan, Slo(200.0))
    assert reading.error == "" and reading.candidate.n == 0 and reading.candidate.per_user.users == 0
    check = check_guardrail(
        Guardrail("attainment", "at_least_over_control", -0.05), reading.control, reading.candidate, 0.05
    )
    assert check.inference == "requests" and "candidate has 0 users" in check.inference_note
