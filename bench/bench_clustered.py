"""Statistics at the unit of randomization: A/A error rates, coverage, variance reduction, time to detect.

    .venv/bin/python bench/bench_clustered.py            # 2,000 A/A and 500 A/B experiments, ~5 min
    .venv/bin/python bench/bench_clustered.py --quick    # 160 A/A and 60 A/B experiments of 30 looks, ~13 s

Pure simulation with known truth of stats.clustered (user-clustered ratio means and their
difference), stats.adjusted (regression adjustment on pre-request covariates) and
stats.sequential.adjusted (their anytime-valid sequences), against the statistics that treat
requests as independent.

The traffic: --users users per experiment (2,000), split 50/50 between the arms by user, at
--rate requests per second in all (20) for --looks looks of --look-s seconds (30; the A/B runs
twice as long). The same users return look after look. A user's rate is heavy-tailed
(lognormal weights, sigma 1.0: ~375 effective users per arm, N^2 / sum n_g^2); a second A/A run
with sigma 1.5 (~140 effective users per arm, the heaviest user ~3% of the requests) is reported
beside, unchecked, to show where the clustered intervals start to undercover. Each user has 5
habitual requests drawn from the trace (ContextTokens as the prompt, GeneratedTokens as the
requested output) and each of their requests repeats one of them: a user's prompts are alike.
TTFT (ms) = (60 + 0.03 * prompt tokens) * exp(u_user + e), u_user ~ N(0, 0.15^2) (a user's
region and client), e ~ N(0, 0.25^2); a request fails with the user's own probability,
Beta(0.5, 49.5) (mean 1%: some users send requests that fail); attainment = ok and
TTFT <= 200 ms. Mean TTFT is over the ok requests. The covariates of the adjustment: prompt
tokens and requested output tokens (both fixed before the variant sees the request). The A/B
regression: the candidate is 30% slower to a first token on prompts over 4,096 tokens (14% of
the code trace's requests).

Truth: mean TTFT = (60 + 0.03 E[prompt]) exp((0.15^2 + 0.25^2) / 2) over the trace's rows, the
error rate 1%, attainment 0.99 * mean over rows of Phi(log(200 / (60 + 0.03 prompt)) / sd); the
A/B difference 0.3 * E[(60 + 0.03 prompt) 1{prompt > 4096}] exp(sd^2 / 2).

Why the adjustment shortens the A/B so much here: the users are a fixed, finite set, so as time
passes the unadjusted difference settles on this particular split of users, chance imbalance in
their prompt sizes included, and its clustered variance stops shrinking; adjusting on the
prompt removes that imbalance.

Checks (else `bench FAILED`, exit 1), each with a binomial tolerance for the number of
experiments (99.9% quantile): at the horizon the clustered and adjusted tests' A/A false
positive rates are within [3%, 7%] and an unclustered one is above 5%; every clustered and
adjusted interval covers the truth at least 94% of the time; the anytime-valid sequences' A/A
false rejection under a look every --look-s seconds is at most alpha; the adjusted sequence
detects the A/B regression with at least 30% fewer requests (median) than the unadjusted one;
the vectorized statistics equal the one-experiment API on a sample.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from stats.adjusted import ArmData, adjusted_difference, adjusted_moments  # noqa: E402
from stats.clustered import (  # noqa: E402
    ClusterSums,
    clustered_difference,
    clustered_difference_moments,
    mean_bounds,
)
from stats.sequential.adjusted import asymptotic_cs_bounds  # noqa: E402

ALPHA = 0.05
Z = float(sps.norm.ppf(1 - ALPHA / 2))
SLA_MS = 200.0
BASE_MS, MS_PER_TOKEN = 60.0, 0.03
SIGMA_USER, SIGMA_REQ = 0.15, 0.25
ERR_A, ERR_B = 0.5, 49.5
USER_SIGMA = 1.0  # lognormal sigma of a user's rate
STRESS_SIGMA = 1.5  # heavier users, reported beside without checks: where the clustered intervals degrade
HABITS = 5  # habitual requests per user
LONG_PROMPT, REGRESSION = 4096, 0.30  # the candidate is 30% slower to a first token on long prompts
TRACES = ROOT / "data" / "traces"
METRICS = ("ttft", "attainment", "errors")
LABEL = {"ttft": "mean TTFT (ms)", "attainment": "attainment (TTFT <= 200 ms, ok)", "errors": "error rate"}


@dataclasses.dataclass(frozen=True)
class Trace:
    name: str
    prompt: np.ndarray  # ContextTokens per row
    output: np.ndarray  # GeneratedTokens per row


def load_trace(path: Path) -> Trace:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise BenchFailed(f"{path}: no column(s) {sorted(missing)}")
        rows = [(float(r["ContextTokens"]), float(r["GeneratedTokens"])) for r in reader]
    if len(rows) < 100:
        raise BenchFailed(f"{path}: only {len(rows)} rows")
    arr = np.array(rows)
    return Trace(path.stem, arr[:, 0], arr[:, 1])


def truth(trace: Trace) -> dict[str, float]:
    sd = math.hypot(SIGMA_USER, SIGMA_REQ)
    scale = BASE_MS + MS_PER_TOKEN * trace.prompt
    return {
        "ttft": float(scale.mean() * math.exp(sd * sd / 2)),
        "attainment": float((1 - ERR_A / (ERR_A + ERR_B)) * sps.norm.cdf(np.log(SLA_MS / scale) / sd).mean()),
        "errors": ERR_A / (ERR_A + ERR_B),
        "regression": float(
            REGRESSION * (scale * (trace.prompt > LONG_PROMPT)).mean() * math.exp(sd * sd / 2)
        ),
    }


# Per-user sums kept for each metric: y over the requests the metric counts, covariates x (2).
SUMS = ("n", "sx", "sxx", "sy", "syy", "sxy")


class Users:
    """Cumulative per-user sums of ``sims`` experiments, updated look by look."""

    def __init__(
        self, sims: int, users: int, trace: Trace, rng: np.random.Generator, user_sigma: float = USER_SIGMA
    ):
        self.sims, self.users, self.trace = sims, users, trace
        w = rng.lognormal(0.0, user_sigma, size=(sims, users))
        self.share = w / w.sum(axis=1, keepdims=True)
        self.habits = rng.integers(0, trace.prompt.size, size=(sims * users, HABITS))
        self.u = rng.normal(0.0, SIGMA_USER, size=sims * users)
        self.p_err = rng.beta(ERR_A, ERR_B, size=sims * users)
        self.variant = (np.arange(users) % 2 == 1)[None, :].repeat(sims, 0).ravel()
        size = sims * users
        # "all": every request (attainment, errors); "ok": the requests with a first token (TTFT).
        self.acc: dict[str, dict[str, np.ndarray]] = {}
        for group in ("all", "ok"):
            self.acc[group] = {
                "n": np.zeros(size, np.int64),
                "sx": np.zeros((size, 2)),
                "sxx": np.zeros((size, 2, 2)),
            }
        for m in METRICS:
            self.acc[m] = {"sy": np.zeros(size), "syy": np.zeros(size), "sxy": np.zeros((size, 2))}

    def add(self, rate: float, seconds: float, regressed: bool, rng: np.random.Generator) -> None:
        counts = rng.poisson(self.share * rate * seconds).ravel()
        who = np.repeat(np.arange(counts.size), counts)  # sorted by user
        active = np.flatnonzero(counts)
        starts = np.concatenate([[0], np.cumsum(counts[active])[:-1]])
        row = self.habits[who, rng.integers(0, HABITS, who.size)]
        prompt, out = self.trace.prompt[row], self.trace.output[row]
        ttft = (BASE_MS + MS_PER_TOKEN * prompt) * np.exp(self.u[who] + rng.normal(0.0, SIGMA_REQ, who.size))
        if regressed:
            ttft *= 1.0 + REGRESSION * ((prompt > LONG_PROMPT) & self.variant[who])
        failed = rng.random(who.size) < self.p_err[who]
        ok = (~failed).astype(float)
        x = np.stack([prompt, out], axis=1)

        def add(target: np.ndarray, w: np.ndarray) -> None:
            # Per-user sums of this look's requests: ``who`` is sorted, so one reduceat each.
            if active.size:
                target[active] += np.add.reduceat(w, starts, axis=0)

        # "all": every request (attainment, errors); "ok": the requests with a first token (TTFT),
        # a 0/1 weight instead of a filter.
        for group, weight in (("all", np.ones(who.size)), ("ok", ok)):
            acc = self.acc[group]
            add(acc["n"], weight.astype(np.int64))
            add(acc["sx"], x * weight[:, None])
            add(acc["sxx"], x[:, :, None] * x[:, None, :] * weight[:, None, None])
        values = {
            "ttft": ttft * ok,
            "attainment": ((ttft <= SLA_MS) & ~failed).astype(float),
            "errors": failed.astype(float),
        }
        for m, y in values.items():
            acc = self.acc[m]
            add(acc["sy"], y)
            add(acc["syy"], y * y)
            add(acc["sxy"], x * y[:, None])

    def arms(self, metric: str) -> tuple[ArmData, ArmData]:
        """Both arms' per-user sums for ``metric``, batched over the experiments."""
        group = self.acc["ok" if metric == "ttft" else "all"]
        acc = self.acc[metric]
        s, u = self.sims, self.users

        def pick(a: np.ndarray, arm: int) -> np.ndarray:
            return a.reshape(s, u, *a.shape[1:])[:, arm::2]

        out = []
        for arm in (0, 1):
            out.append(
                ArmData(
                    n=pick(group["n"], arm),
                    sum_y=pick(acc["sy"], arm),
                    sum_x=pick(group["sx"], arm),
                    sum_xx=pick(group["sxx"], arm),
                    sum_xy=pick(acc["sxy"], arm),
                    sum_yy=pick(acc["syy"], arm),
                    covariates=("prompt_tokens", "requested_output_tokens"),
                )
            )
        return out[0], out[1]


def cluster_sums(arm: ArmData, metric: str) -> ClusterSums:
    assert arm.sum_yy is not None
    return ClusterSums(arm.n, arm.sum_y, arm.sum_yy, binary=metric != "ttft")


def fields_of(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@dataclasses.dataclass
class Look:
    """What one look gives for one metric, one value per experiment (arm rows: control, variant)."""

    n: np.ndarray  # requests of both arms that the metric counts
    clustered: np.ndarray  # variant - control, per-arm CR1 variance (stats.clustered)
    clustered_var: np.ndarray
    iid_var: np.ndarray  # requests as independent
    adjusted: np.ndarray  # stats.adjusted
    adjusted_var: np.ndarray
    unadjusted_pooled_var: np.ndarray  # the adjusted fit's own unadjusted variance (same correction)
    arm_lo: np.ndarray  # (2, sims) clustered interval of each arm's mean
    arm_hi: np.ndarray
    arm_iid_lo: np.ndarray  # the same with the unclustered variance
    arm_iid_hi: np.ndarray
    effective_users: np.ndarray  # (2, sims) N^2 / sum n_g^2


def join(parts: list[Look]) -> Look:
    return Look(*[np.concatenate([getattr(p, f) for p in parts], axis=-1) for f in fields_of(Look)])


def look(users: Users, metric: str) -> Look:
    control, variant = users.arms(metric)
    binary = metric != "ttft"
    c, v = cluster_sums(control, metric), cluster_sums(variant, metric)
    d = clustered_difference_moments(c, v)
    fit = adjusted_moments(control, variant)
    arms = [c.moments(), v.moments()]
    clu = [mean_bounds(m, 1 - ALPHA, binary) for m in arms]
    iid = [mean_bounds(m._replace(variance=m.variance_iid), 1 - ALPHA, binary) for m in arms]
    return Look(
        n=fit.n.sum(axis=-1),
        clustered=d.estimate,
        clustered_var=d.variance,
        iid_var=d.variance_iid,
        adjusted=fit.estimate,
        adjusted_var=fit.variance,
        unadjusted_pooled_var=fit.variance_unadjusted,
        arm_lo=np.stack([b[0] for b in clu]),
        arm_hi=np.stack([b[1] for b in clu]),
        arm_iid_lo=np.stack([b[0] for b in iid]),
        arm_iid_hi=np.stack([b[1] for b in iid]),
        effective_users=np.stack([m.n**2 / m.sum_n_sq for m in arms]),
    )


def check_against_api(users: Users) -> None:
    """The batched statistics must equal the one-experiment API on a few experiments."""
    for metric in METRICS:
        control, variant = users.arms(metric)
        batch = look(users, metric)
        for i in range(min(3, users.sims)):

            def one(arm: ArmData, i: int = i) -> ArmData:
                keep = arm.n[i] > 0
                assert arm.sum_x is not None and arm.sum_xx is not None and arm.sum_xy is not None
                assert arm.sum_yy is not None
                return ArmData(
                    arm.n[i][keep],
                    arm.sum_y[i][keep],
                    arm.sum_x[i][keep],
                    arm.sum_xx[i][keep],
                    arm.sum_xy[i][keep],
                    arm.sum_yy[i][keep],
                    arm.covariates,
                )

            c1, v1 = one(control), one(variant)
            a = adjusted_difference(c1, v1, 1 - ALPHA)
            cd = clustered_difference(cluster_sums(c1, metric), cluster_sums(v1, metric), 1 - ALPHA)
            pairs = [
                (a.estimate, batch.adjusted[i]),
                (a.se, math.sqrt(batch.adjusted_var[i])),
                (cd.estimate, batch.clustered[i]),
                (cd.se, math.sqrt(batch.clustered_var[i])),
                (cd.se_iid, math.sqrt(batch.iid_var[i])),
                (cd.control.lo, batch.arm_lo[0, i]),
                (cd.variant.hi, batch.arm_hi[1, i]),
            ]
            for api, vec in pairs:
                if api is None or not math.isclose(api, vec, rel_tol=1e-9, abs_tol=1e-12):
                    raise BenchFailed(f"experiment {i}, {metric}: the API gives {api}, the batch {vec}")


def tolerance(sims: int, rate: float) -> int:
    """Most events among ``sims`` consistent with a true rate <= ``rate`` (99.9% binomial quantile)."""
    return int(sps.binom.ppf(0.999, sims, rate))


def floor_tolerance(sims: int, rate: float) -> int:
    """Fewest events among ``sims`` consistent with a true rate >= ``rate`` (0.1% binomial quantile)."""
    return int(sps.binom.ppf(0.001, sims, rate))


def fmt_rate(count: int, sims: int) -> str:
    return f"{count / sims:.2%} ({count}/{sims})"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("inf" if a else "-")


def excludes(est: np.ndarray, var: np.ndarray, value: float | np.ndarray) -> np.ndarray:
    """The fixed-horizon normal interval est +- z sqrt(var) excludes ``value`` (NaN variance: no)."""
    with np.errstate(invalid="ignore"):
        return np.abs(est - value) > Z * np.sqrt(var)


@dataclasses.dataclass
class Run:
    sims: int
    user_sigma: float
    horizon: dict[str, Look]  # the last look, per metric
    any_reject: dict[tuple[str, str], np.ndarray]  # (metric, sequence) -> rejected at some look
    first_reject: dict[str, np.ndarray]  # sequence -> requests at the first rejection (inf: never)
    reductions: dict[str, np.ndarray]  # metric -> reported variance reduction at the horizon


SEQUENCES = ("adjusted", "clustered", "iid", "fixed")


def simulate(
    sims: int,
    users: int,
    looks: int,
    rate: float,
    look_s: float,
    trace: Trace,
    seed: int,
    chunk: int,
    user_sigma: float = USER_SIGMA,
    regressed: bool = False,
    peek: tuple[str, ...] = ("ttft", "attainment"),
) -> Run:
    """``sims`` experiments in chunks; the metrics in ``peek`` are read at every look."""
    rng = np.random.default_rng(seed)
    horizon: dict[str, list[Look]] = {m: [] for m in METRICS}
    any_reject: dict[tuple[str, str], list[np.ndarray]] = {(m, k): [] for m in peek for k in SEQUENCES}
    first_reject: dict[str, list[np.ndarray]] = {k: [] for k in ("adjusted", "clustered")}
    reductions: dict[str, list[np.ndarray]] = {m: [] for m in METRICS}
    done = 0
    while done < sims:
        s = min(chunk, sims - done)
        pop = Users(s, users, trace, rng, user_sigma)
        ever = {key: np.zeros(s, bool) for key in any_reject}
        first = {k: np.full(s, np.inf) for k in first_reject}
        for _ in range(looks):
            pop.add(rate, look_s, regressed, rng)
            for m in peek:
                lk = look(pop, m)
                for kind, est, var in (
                    ("adjusted", lk.adjusted, lk.adjusted_var),
                    ("clustered", lk.clustered, lk.clustered_var),
                    ("iid", lk.clustered, lk.iid_var),
                ):
                    lo, hi = asymptotic_cs_bounds(est, var, lk.n, ALPHA)
                    ever[m, kind] |= (lo > 0) | (hi < 0)
                    if m == "ttft" and kind in first:
                        new = (lo > 0) & np.isinf(first[kind])
                        first[kind][new] = lk.n[new]
                ever[m, "fixed"] |= excludes(lk.clustered, lk.clustered_var, 0.0)
        if done == 0:
            check_against_api(pop)
        for m in METRICS:
            lk = look(pop, m)
            horizon[m].append(lk)
            reductions[m].append(1 - lk.adjusted_var / lk.unadjusted_pooled_var)
        for key, val in ever.items():
            any_reject[key].append(val)
        for k, val in first.items():
            first_reject[k].append(val)
        done += s
    return Run(
        sims,
        user_sigma,
        {m: join(v) for m, v in horizon.items()},
        {k: np.concatenate(v) for k, v in any_reject.items()},
        {k: np.concatenate(v) for k, v in first_reject.items()},
        {m: np.concatenate(v) for m, v in reductions.items()},
    )


def users_label(run: Run) -> str:
    eff = float(np.median(run.horizon["ttft"].effective_users))
    return f"sigma {run.user_sigma:g}, ~{eff:.0f} effective users per arm"


def fixed_horizon_table(run: Run, stress: Run, n_requests: float) -> list[str]:
    sims = run.sims
    rows = [
        f"A/A false positives at the horizon (one test, no peeking): {sims} experiments, ~{n_requests:,.0f} "
        f"requests each, alpha {ALPHA}; target: clustered within [3%, 7%] (checked at {users_label(run)}; "
        f"heavier users, {users_label(stress)}, reported only)",
        "",
        "| metric | users | unclustered (requests iid) | clustered (users) | adjusted, clustered "
        "| unclustered / clustered | median design effect |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lo_tol, hi_tol = floor_tolerance(sims, 0.03), tolerance(sims, 0.07)
    iid_above = False
    for r, checked in ((run, True), (stress, False)):
        for m in METRICS:
            lk = r.horizon[m]
            iid = int(excludes(lk.clustered, lk.iid_var, 0.0).sum())
            clu = int(excludes(lk.clustered, lk.clustered_var, 0.0).sum())
            adj = int(excludes(lk.adjusted, lk.adjusted_var, 0.0).sum())
            deff = float(np.nanmedian(lk.clustered_var / lk.iid_var))
            rows.append(
                f"| {LABEL[m]} | sigma {r.user_sigma:g} | {fmt_rate(iid, r.sims)} | {fmt_rate(clu, r.sims)} | "
                f"{fmt_rate(adj, r.sims)} | {ratio(iid, clu)} | {deff:.1f} |"
            )
            if not checked:
                continue
            for name, count in (("clustered", clu), ("adjusted", adj)):
                if not lo_tol <= count <= hi_tol:
                    raise BenchFailed(
                        f"A/A {m} {name}: {count}/{sims} false positives, outside [3%, 7%] "
                        f"(tolerance {lo_tol}..{hi_tol})"
                    )
            iid_above |= iid > tolerance(sims, ALPHA)
    if not iid_above:
        raise BenchFailed("A/A: no unclustered test rejects above alpha: the clustering is not shown")
    rows += [
        "",
        f"Binomial tolerance of [3%, 7%] over {sims} experiments (99.9%): [{lo_tol / sims:.2%}, {hi_tol / sims:.2%}].",
    ]
    return rows


def coverage_table(run: Run, stress: Run, ab: Run, truth_: dict[str, float]) -> list[str]:
    rows = [
        f"Coverage at the horizon of the {1 - ALPHA:.0%} intervals: share of experiments whose interval holds "
        "the truth; target >= 94% for clustered and adjusted (checked at "
        f"{users_label(run)}; {users_label(stress)} reported only). Means of 0/1 metrics: Wilson at the "
        "effective sample size (stats.clustered.mean_bounds)",
        "",
        "| quantity | users | truth | unclustered (requests iid) | clustered (users) | adjusted, clustered |",
        "|---|---|---:|---:|---:|---:|",
    ]

    def cov(miss: np.ndarray) -> str:
        return fmt_rate(int((~miss).sum()), miss.size)

    def check(miss: np.ndarray, what: str, checked: bool) -> None:
        tol = tolerance(miss.size, 0.06)
        if checked and int(miss.sum()) > tol:
            raise BenchFailed(f"coverage of {what}: {int(miss.sum())}/{miss.size} missed (tolerance {tol})")

    for r, checked in ((run, True), (stress, False)):
        for m in METRICS:
            lk = r.horizon[m]
            tv = truth_[m]
            for i, arm in enumerate(("control", "variant")):
                miss_c = (lk.arm_lo[i] > tv) | (lk.arm_hi[i] < tv)
                miss_i = (lk.arm_iid_lo[i] > tv) | (lk.arm_iid_hi[i] < tv)
                rows.append(
                    f"| {LABEL[m]}, {arm} mean | sigma {r.user_sigma:g} | {tv:.4g} | {cov(miss_i)} | {cov(miss_c)} | - |"
                )
                check(miss_c, f"{m} {arm} clustered mean", checked)
            miss_i = excludes(lk.clustered, lk.iid_var, 0.0)
            miss_c = excludes(lk.clustered, lk.clustered_var, 0.0)
            miss_a = excludes(lk.adjusted, lk.adjusted_var, 0.0)
            rows.append(
                f"| {LABEL[m]}, A/A difference | sigma {r.user_sigma:g} | 0 | {cov(miss_i)} | {cov(miss_c)} | {cov(miss_a)} |"
            )
            check(miss_c, f"{m} clustered difference", checked)
            check(miss_a, f"{m} adjusted difference", checked)
    lk = ab.horizon["ttft"]
    d = truth_["regression"]
    miss_i = excludes(lk.clustered, lk.iid_var, d)
    miss_c = excludes(lk.clustered, lk.clustered_var, d)
    miss_a = excludes(lk.adjusted, lk.adjusted_var, d)
    rows.append(
        f"| mean TTFT (ms), A/B difference (+{REGRESSION:.0%} on prompts > {LONG_PROMPT}), {ab.sims} experiments "
        f"| sigma {ab.user_sigma:g} | {d:.3f} | {cov(miss_i)} | {cov(miss_c)} | {cov(miss_a)} |"
    )
    check(miss_c, "A/B clustered difference", True)
    check(miss_a, "A/B adjusted difference", True)
    return rows


def anytime_table(run: Run, looks: int, look_s: float) -> list[str]:
    sims = run.sims
    rows = [
        f"A/A false rejection under continuous peeking: a look every {look_s:g} s for {looks} looks "
        f"({looks * look_s / 60:.0f} min), {sims} experiments, alpha {ALPHA} "
        "(stats.sequential.adjusted, target_n 10,000); target: anytime-valid <= alpha",
        "",
        "| metric | anytime-valid, adjusted | anytime-valid, clustered | same boundary, iid variance "
        "| fixed-horizon clustered CI, peeked | peeked / anytime clustered |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    tol = tolerance(sims, ALPHA)
    for m in ("ttft", "attainment"):
        c = {k: int(run.any_reject[m, k].sum()) for k in SEQUENCES}
        rows.append(
            f"| {LABEL[m]} | {fmt_rate(c['adjusted'], sims)} | {fmt_rate(c['clustered'], sims)} | "
            f"{fmt_rate(c['iid'], sims)} | {fmt_rate(c['fixed'], sims)} | {ratio(c['fixed'], c['clustered'])} |"
        )
        for k in ("adjusted", "clustered"):
            if c[k] > tol:
                raise BenchFailed(f"anytime A/A {m} {k}: {c[k]}/{sims} false rejections (tolerance {tol})")
    rows += ["", f"Binomial tolerance for alpha {ALPHA} over {sims} experiments (99.9%): {tol / sims:.2%}."]
    return rows


def reduction_rows(run: Run, trace: str) -> list[str]:
    rows = []
    for m in METRICS:
        lk = run.horizon[m]
        reported = float(np.nanmean(run.reductions[m]))
        empirical = 1 - float(np.nanvar(lk.adjusted) / np.nanvar(lk.clustered))
        se_ratio = float(np.nanmedian(np.sqrt(lk.adjusted_var / lk.unadjusted_pooled_var)))
        rows.append(f"| {trace} | {LABEL[m]} | {reported:.1%} | {empirical:.1%} | {se_ratio:.2f} |")
    return rows


def detection_table(ab: Run, looks: int, rate: float, look_s: float, regression: float) -> list[str]:
    req = ab.first_reject

    def pct(k: str, q: float) -> float:
        # An experiment that never rejected counts as infinitely many requests, not as missing.
        return float(np.quantile(req[k], q, method="inverted_cdf"))

    def fmt(x: float) -> str:
        return f"{x:,.0f}" if math.isfinite(x) else "beyond the horizon"

    med = {k: pct(k, 0.5) for k in req}
    rows = [
        f"Time to detect a TTFT regression (the candidate {REGRESSION:.0%} slower to a first token on prompts over "
        f"{LONG_PROMPT} tokens: +{regression:.2f} ms on the mean): {ab.sims} experiments, 50/50, {rate:g} req/s, "
        f"a look every {look_s:g} s for {looks * look_s / 60:.0f} min; requests (both arms) until the anytime-valid "
        f"sequence's lower bound passes 0, alpha {ALPHA}; target: adjusted >= 30% fewer",
        "",
        "| sequence | detected within the horizon | median requests | median min | p90 requests | adjusted / unadjusted |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, label in (("clustered", "unadjusted, clustered"), ("adjusted", "adjusted, clustered")):
        rows.append(
            f"| {label} | {np.isfinite(req[k]).mean():.1%} | {fmt(med[k])} | {med[k] / rate / 60:.1f} | "
            f"{fmt(pct(k, 0.9))} | {'-' if k == 'clustered' else ratio(med['adjusted'], med['clustered'])} |"
        )
    if not (math.isfinite(med["clustered"]) and math.isfinite(med["adjusted"])):
        raise BenchFailed("A/B: the regression was not detected in most experiments within the horizon")
    if med["adjusted"] > 0.7 * med["clustered"]:
        raise BenchFailed(
            f"A/B: adjusted median {med['adjusted']:,.0f} requests vs unadjusted {med['clustered']:,.0f}: "
            "not 30% fewer"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer experiments, the same tables")
    parser.add_argument("--rate", type=float, default=20.0, help="total requests per second (default 20)")
    parser.add_argument("--look-s", type=float, default=30.0, help="seconds between looks (default 30)")
    parser.add_argument(
        "--looks", type=int, default=None, help="A/A looks per experiment (default 60: 30 min; --quick 30)"
    )
    parser.add_argument("--users", type=int, default=2000, help="users per experiment (default 2000)")
    parser.add_argument(
        "--trace",
        action="append",
        type=Path,
        help="a trace CSV with ContextTokens and GeneratedTokens (repeatable; default: data/traces/*.csv)",
    )
    parser.add_argument("--seed", type=int, default=29)
    args = parser.parse_args(argv)
    if args.looks is None:
        args.looks = 30 if args.quick else 60
    if not (args.rate > 0 and args.look_s > 0 and args.looks >= 1 and args.users >= 200):
        raise BenchFailed("--rate, --look-s and --looks must be > 0, --users at least 200")
    paths = args.trace or sorted(TRACES.glob("*.csv"))
    if not paths:
        raise BenchFailed(f"no trace CSV in {TRACES}")
    traces = [load_trace(p) for p in paths]
    main_trace = next((t for t in traces if "code" in t.name), traces[0])
    quick = args.quick
    sims_aa, sims_ab, chunk = (160, 60, 160) if quick else (2000, 500, 250)
    looks_ab = 2 * args.looks
    horizon_s = args.look_s * args.looks
    t0 = time.perf_counter()
    truth_ = truth(main_trace)
    aa = simulate(sims_aa, args.users, args.looks, args.rate, args.look_s, main_trace, args.seed, chunk)
    stress = simulate(
        sims_aa, args.users, 1, args.rate, horizon_s, main_trace, args.seed + 1, chunk, STRESS_SIGMA, peek=()
    )
    ab = simulate(
        sims_ab,
        args.users,
        looks_ab,
        args.rate,
        args.look_s,
        main_trace,
        args.seed + 2,
        chunk,
        regressed=True,
        peek=("ttft",),
    )
    red = [
        "Variance reduction of the adjustment (prompt tokens, requested output tokens) at the horizon, A/A: "
        "reported = mean of 1 - V_adj / V_unadj (both CR1); empirical = 1 - var(adjusted) / var(unadjusted) "
        "across the experiments",
        "",
        "| trace | metric | reported | empirical | median SE ratio adjusted / unadjusted |",
        "|---|---|---:|---:|---:|",
        *reduction_rows(aa, main_trace.name),
    ]
    for i, t in enumerate(traces):
        if t is not main_trace:
            other = simulate(
                sims_ab, args.users, 1, args.rate, horizon_s, t, args.seed + 10 + i, chunk, peek=()
            )
            red += reduction_rows(other, t.name)
    if not any("conv" in t.name for t in traces):
        red += [
            "",
            f"No conversation trace in {TRACES.relative_to(ROOT)} (only {', '.join(t.name for t in traces)}); "
            "pass --trace PATH to add one.",
        ]
    sections = [
        fixed_horizon_table(aa, stress, args.rate * horizon_s),
        coverage_table(aa, stress, ab, truth_),
        anytime_table(aa, args.looks, args.look_s),
        red,
        detection_table(ab, looks_ab, args.rate, args.look_s, truth_["regression"]),
    ]
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} cores, seed {args.seed}"
    )
    print(
        f"traffic: {args.users} users per experiment, {args.rate:g} req/s, trace {main_trace.name} "
        f"({main_trace.prompt.size:,} rows)"
    )
    for section in sections:
        print()
        print("\n".join(section))
    print()
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
