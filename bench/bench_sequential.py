"""Anytime-valid guardrails: false rollbacks under peeking, coverage, time to detect.

    .venv/bin/python bench/bench_sequential.py            # 2,000 A/A experiments, a few minutes
    .venv/bin/python bench/bench_sequential.py --quick    # 400 experiments, the same tables, ~20-30 s

Pure simulation of stats.sequential against the fixed-horizon statistics of the report
(stats.proportions' Wilson interval, stats.comparisons' Newcombe interval and order-statistic
CI, stats.srm's chi-square), both read after every batch the way a rollout controller reads
them, on the same simulated requests.

The traffic: requests at a steady total rate (--rate, default 20 req/s) split by the step's
share; a look every --look-s seconds (30). TTFT of a healthy arm is lognormal, median 100 ms,
sigma 0.269, so 99.5% of first tokens are under the 200 ms SLA (p99 187 ms); 0.1% of requests
fail (errors count as SLA misses). The regression: 5% of the candidate's requests take 130 ms
longer (a first token at ~120 ms comes at ~250 ms): attainment falls to ~94.5%, p99 rises to
~255 ms. Guardrails: attainment at least 99.2%, error rate at most 0.5 point
over the control, p99 TTFT at most 20 ms over the control, at alpha 0.05 split between them.

Users (the last two tables): the requests above are independent draws. Live traffic comes from
users who send many alike requests, and the rollout reads attainment and error rate with users
as the independent unit when the step's reading carries per-user aggregates
(stats.sequential.guardrails: user-clustered sequences, the differences to the control adjusted
on prompt and requested tokens). Those tables simulate bench/bench_clustered.py's users, with
known truth: heavy-tailed users (lognormal rates) split 50/50 (a 50% step), returning look after
look, each with their own prompts (from the trace), TTFT and error rate; attainment ~85.3%,
error rate 1%. The A/A has --aa-users (500: ~70 requests each in 30 min, ~90 effective users
per arm), the A/B --users (2,000); with fewer users a regression confined to long prompts sits
in too few of them to be shown in an hour, adjusted or not. The vectorized guardrails are
checked against decide() on a sample.

Checks (else `bench FAILED`, exit 1): the sequences' A/A false rollback rates and miss rates are
within the binomial tolerance of alpha (99.9% quantile for the number of experiments), the
fixed-horizon rates are not (peeking is shown), every step detects the regression in most
experiments, the vectorized guardrails equal stats.sequential.guardrails.decide on a sample;
with users, the clustered guardrails' A/A false rollback rate is within alpha's tolerance and
the adjusted one rolls back the users' regression after at least 30% fewer requests (median)
than the unadjusted one.
"""

from __future__ import annotations

import argparse
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

from bench.bench_clustered import TRACES, Trace, Users, load_trace  # noqa: E402
from bench.bench_clustered import truth as users_truth  # noqa: E402
from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from stats.adjusted import ArmData, adjusted_moments  # noqa: E402
from stats.clustered import ClusterSums, clustered_difference_moments, ratio_moments  # noqa: E402
from stats.comparisons import attainment_difference_bounds  # noqa: E402
from stats.proportions import wilson_bounds  # noqa: E402
from stats.quantiles import quantile_ci_ranks  # noqa: E402
from stats.sequential.adjusted import (  # noqa: E402
    DEFAULT_MIN_CLUSTERS,
    asymptotic_cs_bounds,
)
from stats.sequential.arm_snapshot import ArmSnapshot, UserSums  # noqa: E402
from stats.sequential.guardrail_spec import Guardrail  # noqa: E402
from stats.sequential.guardrails import BREACH, decide  # noqa: E402
from stats.sequential.means import difference_cs_bounds, mean_cs_bounds  # noqa: E402
from stats.sequential.quantiles import (  # noqa: E402
    LatencyHistogram,
    histogram_bounds,
    order_statistic_bounds,
    quantile_cs_ranks,
)
from stats.sequential.share_reading import (  # noqa: E402
    ADJUSTED,
    CLUSTERED,
    CLUSTERED_SHARE,
    MIN_EVENTS,
    REQUESTS,
)
from stats.sequential.srm import srm_log_e_values  # noqa: E402

ALPHA = 0.05
SLA_MS = 200.0
MEDIAN_MS, SIGMA = 100.0, 0.269
ERROR_RATE = 0.001
SLOW_SHARE, SLOW_ADD_MS = 0.05, 130.0
Q = 0.99
# 0.5 ms buckets over the region where p99 lives; both methods read the same histogram.
EDGES = np.concatenate([[0.0], np.arange(100.0, 600.25, 0.5)])
STEPS = (1, 5, 25, 50)
GUARDRAILS = ("attainment", "error_rate", "p99_ttft_ms")


def healthy_attainment() -> float:
    return float(sps.norm.cdf(math.log(SLA_MS / MEDIAN_MS) / SIGMA)) * (1 - ERROR_RATE)


def tolerance(sims: int, rate: float) -> int:
    """Most events among ``sims`` consistent with a true rate <= ``rate`` (99.9% binomial quantile)."""
    return int(sps.binom.ppf(0.999, sims, rate))


def fixed_quantile_bounds(cum: np.ndarray, conf: float) -> tuple[np.ndarray, np.ndarray]:
    """stats.quantiles' fixed-horizon order-statistic CI on the same histogram (n equal per row)."""
    n = int(cum[0, -1])
    ranks = quantile_ci_ranks(n, Q, conf)
    lo_r, hi_r = ranks if ranks is not None else (0, n + 1)
    return order_statistic_bounds(cum, EDGES, np.int64(lo_r), np.int64(hi_r))


@dataclasses.dataclass
class Arm:
    """Cumulative counts of one arm across ``sims`` experiments."""

    sims: int
    n: int = 0
    hits: np.ndarray = dataclasses.field(default=None)  # type: ignore[assignment]
    errors: np.ndarray = dataclasses.field(default=None)  # type: ignore[assignment]
    cum: np.ndarray = dataclasses.field(default=None)  # type: ignore[assignment]
    counts: np.ndarray = dataclasses.field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.hits = np.zeros(self.sims, np.int64)
        self.errors = np.zeros(self.sims, np.int64)
        self.counts = np.zeros((self.sims, EDGES.size + 1), np.int64)
        self.cum = self.counts.copy()

    def add(self, m: int, regressed: bool, rng: np.random.Generator) -> None:
        if m == 0:
            return
        x = rng.lognormal(math.log(MEDIAN_MS), SIGMA, size=(self.sims, m))
        if regressed:
            x += SLOW_ADD_MS * (rng.random((self.sims, m)) < SLOW_SHARE)
        failed = rng.random((self.sims, m)) < ERROR_RATE
        self.n += m
        self.hits += ((x <= SLA_MS) & ~failed).sum(axis=1)
        self.errors += failed.sum(axis=1)
        bucket = np.searchsorted(EDGES, x, side="left")
        bucket[failed] = -1  # a failed request has no first token
        keep = bucket >= 0
        flat = (bucket + (EDGES.size + 1) * np.arange(self.sims)[:, None])[keep]
        self.counts += np.bincount(flat, minlength=self.sims * (EDGES.size + 1)).reshape(self.counts.shape)
        self.cum = np.cumsum(self.counts, axis=1)


@dataclasses.dataclass(frozen=True)
class Limits:
    target: float  # attainment at_least
    error_margin: float  # error_rate at_most_over_control
    p99_margin_ms: float  # p99_ttft_ms at_most_over_control
    alpha_each: float  # each guardrail's alpha (decide: alpha / 3)


def breaches(ctrl: Arm, cand: Arm, lim: Limits) -> dict[tuple[str, str], np.ndarray]:
    """{(method, guardrail): breached now?} for method in ours / fixed."""
    a = lim.alpha_each
    out: dict[tuple[str, str], np.ndarray] = {}
    nc = np.full(ctrl.sims, ctrl.n)
    nv = np.full(cand.sims, cand.n)
    if cand.n == 0:
        no = np.zeros(cand.sims, bool)
        return {(m, g): no for m in ("ours", "fixed") for g in GUARDRAILS}
    _, hi = mean_cs_bounds(cand.hits, nv, a)
    out["ours", "attainment"] = hi < lim.target
    _, whi = wilson_bounds(cand.hits, nv, 1 - a)
    out["fixed", "attainment"] = whi < lim.target
    lo, _ = difference_cs_bounds(ctrl.errors, nc, cand.errors, nv, a)
    out["ours", "error_rate"] = lo > lim.error_margin
    nlo, _ = attainment_difference_bounds(ctrl.errors, nc, cand.errors, nv, 1 - a)
    out["fixed", "error_rate"] = nlo > lim.error_margin
    lo_v, _ = histogram_bounds(cand.cum, EDGES, Q, a / 2)
    _, hi_c = histogram_bounds(ctrl.cum, EDGES, Q, a / 2)
    with np.errstate(invalid="ignore"):
        out["ours", "p99_ttft_ms"] = (lo_v - hi_c) > lim.p99_margin_ms
        flo_v, _ = fixed_quantile_bounds(cand.cum, 1 - a / 2)
        _, fhi_c = fixed_quantile_bounds(ctrl.cum, 1 - a / 2)
        out["fixed", "p99_ttft_ms"] = (flo_v - fhi_c) > lim.p99_margin_ms
    return out


@dataclasses.dataclass
class Run:
    first: dict[tuple[str, str], np.ndarray]  # look index of the first breach (inf: none)
    ctrl: Arm
    cand: Arm
    per_look: tuple[int, int]

    def any_first(self, method: str) -> np.ndarray:
        return np.min([self.first[method, g] for g in GUARDRAILS], axis=0)


def simulate(
    sims: int,
    looks: int,
    step_pct: float,
    regressed: bool,
    lim: Limits,
    rate: float,
    look_s: float,
    seed: int,
) -> Run:
    rng = np.random.default_rng(seed)
    per_look = rate * look_s
    m_cand = int(round(per_look * step_pct / 100.0))
    m_ctrl = int(round(per_look)) - m_cand
    ctrl, cand = Arm(sims), Arm(sims)
    first = {(m, g): np.full(sims, np.inf) for m in ("ours", "fixed") for g in GUARDRAILS}
    for look in range(looks):
        ctrl.add(m_ctrl, False, rng)
        cand.add(m_cand, regressed, rng)
        for key, now in breaches(ctrl, cand, lim).items():
            hit = now & np.isinf(first[key])
            first[key][hit] = look
    return Run(first, ctrl, cand, (m_ctrl, m_cand))


def check_against_decide(run: Run, lim: Limits) -> None:
    """The vectorized guardrails must be what decide() says, for a few experiments."""
    specs = [
        Guardrail("attainment", "at_least", lim.target),
        Guardrail("error_rate", "at_most_over_control", lim.error_margin),
        Guardrail("p99_ttft_ms", "at_most_over_control", lim.p99_margin_ms),
    ]
    now = breaches(run.ctrl, run.cand, lim)
    for i in range(min(5, run.ctrl.sims)):
        arms = [
            ArmSnapshot(
                a.n, int(a.hits[i]), int(a.errors[i]), {"ttft_ms": LatencyHistogram(EDGES, a.counts[i])}
            )
            for a in (run.ctrl, run.cand)
        ]
        d = decide(specs, arms[0], arms[1], alpha=lim.alpha_each * len(specs))
        for c in d.checks:
            if (c.status == BREACH) != bool(now["ours", c.metric][i]):
                raise BenchFailed(
                    f"experiment {i}: decide() says {c.status} for {c.metric}, the simulation disagrees"
                )


def fmt_rate(count: int, sims: int) -> str:
    return f"{count / sims:.2%} ({count}/{sims})"


def ratio(a: int, b: int) -> str:
    return f"{a / b:.1f}x" if b else ("inf" if a else "-")


def aa_table(sims: int, looks: int, rate: float, look_s: float, seed: int) -> list[str]:
    """Every guardrail at its boundary (the candidate exactly at the limit), alpha 0.05 each."""
    lim = Limits(healthy_attainment(), 0.0, 0.0, ALPHA)
    run = simulate(sims, looks, 50, False, lim, rate, look_s, seed)
    n_arm = run.per_look[1] * looks
    rows = [
        f"A/A false rollback under continuous peeking: {sims} experiments, 50% step, {rate:g} req/s, "
        f"a look every {look_s:g} s, {looks} looks ({looks * look_s / 60:.0f} min, {n_arm:,} requests per arm), "
        f"alpha {ALPHA} per guardrail, each guardrail at its boundary",
        "",
        "| guardrail (A/A at the limit) | anytime-valid (ours) | fixed-horizon, peeked | fixed / ours | fixed-horizon test |",
        "|---|---:|---:|---:|---|",
    ]
    names = {
        "attainment": (f"attainment at_least {lim.target:.4%} (= true)", "Wilson (stats.proportions)"),
        "error_rate": ("error_rate at_most_over_control 0", "Newcombe (stats.comparisons)"),
        "p99_ttft_ms": ("p99_ttft_ms at_most_over_control 0 ms", "order-statistic CI (stats.quantiles)"),
    }
    tol = tolerance(sims, ALPHA)
    for g in GUARDRAILS:
        ours = int(np.isfinite(run.first["ours", g]).sum())
        fixed = int(np.isfinite(run.first["fixed", g]).sum())
        rows.append(
            f"| {names[g][0]} | {fmt_rate(ours, sims)} | {fmt_rate(fixed, sims)} | {ratio(fixed, ours)} | {names[g][1]} |"
        )
        if ours > tol:
            raise BenchFailed(f"A/A {g}: {ours}/{sims} false breaches, above alpha's tolerance {tol}")
        if g == "attainment" and fixed <= tol:
            raise BenchFailed(
                f"A/A {g}: fixed-horizon peeking gave {fixed}/{sims}, not above alpha: peeking not shown"
            )
    # SRM: the split at the right weights, counted per look.
    rng = np.random.default_rng(seed + 1)
    per_look = int(rate * look_s)
    cand = np.cumsum(rng.binomial(per_look, 0.5, size=(sims, looks)), axis=1)
    n = per_look * np.arange(1, looks + 1)
    log_e = srm_log_e_values(np.stack([n - cand, cand], axis=-1), [50, 50])
    ours = int((log_e >= math.log(1 / ALPHA)).any(axis=1).sum())
    chi2 = (cand - n / 2) ** 2 / (n / 4)
    fixed = int((sps.chi2.sf(chi2, 1) < ALPHA).any(axis=1).sum())
    rows.append(
        f"| sample ratio at the right weights (50/50) | {fmt_rate(ours, sims)} | {fmt_rate(fixed, sims)} | "
        f"{ratio(fixed, ours)} | chi-square (stats.srm) |"
    )
    if ours > tol or fixed <= tol:
        raise BenchFailed(f"A/A SRM: ours {ours}, chi-square {fixed} of {sims} (tolerance {tol})")
    rows.append("")
    rows.append(
        f"Binomial tolerance for alpha {ALPHA} over {sims} experiments (99.9% quantile): {tol / sims:.2%}."
    )
    return rows


def coverage_table(sims: int, looks: int, per_look: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    n = per_look * np.arange(1, looks + 1)
    rows = [
        f"Coverage at every look: {sims} paths, a look every {per_look} samples, {looks} looks "
        f"(to {n[-1]:,}); share of paths whose interval ever excluded the truth (nominal {ALPHA:.0%})",
        "",
        "| quantity | truth | anytime-valid (ours) | fixed-horizon, peeked | fixed / ours |",
        "|---|---:|---:|---:|---:|",
    ]
    tol = tolerance(sims, ALPHA)
    for p in (0.9, 0.99, 0.995, 0.999):
        hits = np.cumsum(rng.binomial(per_look, p, size=(sims, looks)), axis=1)
        nn = np.broadcast_to(n, hits.shape)
        lo, hi = mean_cs_bounds(hits, nn, ALPHA)
        ours = int(((p < lo) | (p > hi)).any(axis=1).sum())
        wlo, whi = wilson_bounds(hits.ravel(), nn.ravel(), 1 - ALPHA)
        fixed = int(((p < wlo) | (p > whi)).reshape(hits.shape).any(axis=1).sum())
        rows.append(
            f"| share (attainment) | {p} | {fmt_rate(ours, sims)} | {fmt_rate(fixed, sims)} | {ratio(fixed, ours)} |"
        )
        if ours > tol:
            raise BenchFailed(
                f"coverage of share {p}: {ours}/{sims} paths excluded the truth (tolerance {tol})"
            )
    # p99: X_(lo) <= xi <= X_(hi) exactly when #(<= xi) >= lo and #(< xi) < hi (continuous: equal).
    xi = MEDIAN_MS * math.exp(SIGMA * sps.norm.ppf(Q))
    below = np.cumsum(
        rng.binomial(per_look, sps.norm.cdf(math.log(xi / MEDIAN_MS) / SIGMA), size=(sims, looks)), axis=1
    )
    lo_r, hi_r = quantile_cs_ranks(np.broadcast_to(n, below.shape), Q, ALPHA)
    ours = int(((below < lo_r) | (below >= hi_r)).any(axis=1).sum())
    fixed_ranks = [quantile_ci_ranks(int(m), Q, 1 - ALPHA) for m in n]
    flo = np.array([r[0] if r else 0 for r in fixed_ranks])
    fhi = np.array([r[1] if r else m + 1 for r, m in zip(fixed_ranks, n)])
    fixed = int(((below < flo) | (below >= fhi)).any(axis=1).sum())
    rows.append(
        f"| p99 TTFT (ms) | {xi:.1f} | {fmt_rate(ours, sims)} | {fmt_rate(fixed, sims)} | {ratio(fixed, ours)} |"
    )
    if ours > tol:
        raise BenchFailed(f"coverage of p99: {ours}/{sims} paths excluded the truth (tolerance {tol})")
    return rows


def power_table(sims: int, looks: int, rate: float, look_s: float, seed: int) -> list[str]:
    issue = Limits(0.992, 0.005, 20.0, ALPHA / 3)
    rows = [
        f"Time to roll back a regressed candidate (5% of requests +{SLOW_ADD_MS:g} ms TTFT: attainment "
        f"{healthy_attainment():.2%} -> ~94.5%, p99 ~187 -> ~255 ms), {rate:g} req/s in all, a look every "
        f"{look_s:g} s for {looks * look_s / 60:.0f} min, {sims} experiments per step; the "
        "guardrails (attainment >= 99.2%, error rate <= control + 0.5 pt, p99 <= control + 20 ms) "
        f"at alpha {ALPHA} split three ways (decide()); healthy candidate: same setup, no regression",
        "",
        "| step | candidate req/s | rolled back (regressed) | median min | p90 min | candidate requests (median) "
        "| breached at that look (attainment / error / p99) | fixed-horizon peeked: median min | healthy rolled back: ours | healthy: fixed-horizon |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for i, step in enumerate(STEPS):
        bad = simulate(sims, looks, step, True, issue, rate, look_s, seed + 10 * i)
        if i == 1:
            check_against_decide(bad, issue)
        good = simulate(sims, looks, step, False, issue, rate, look_s, seed + 10 * i + 5)
        t = bad.any_first("ours")
        found = np.isfinite(t)
        minutes = (t[found] + 1) * look_s / 60
        firsts = np.array([bad.first["ours", g] for g in GUARDRAILS])
        which = [int(((firsts[k] == t) & found).sum()) for k in range(3)]
        tf = bad.any_first("fixed")
        fmin = (tf[np.isfinite(tf)] + 1) * look_s / 60
        per_cand = bad.per_look[1]
        healthy_ours = int(np.isfinite(good.any_first("ours")).sum())
        healthy_fixed = int(np.isfinite(good.any_first("fixed")).sum())
        med = float(np.median(minutes)) if found.any() else math.nan
        rows.append(
            f"| {step}% | {per_cand / look_s:.2f} | {found.mean():.1%} | {med:.1f} | "
            f"{np.percentile(minutes, 90) if found.any() else math.nan:.1f} | {med * 60 / look_s * per_cand:,.0f} | "
            f"{which[0]} / {which[1]} / {which[2]} | {np.median(fmin) if fmin.size else math.nan:.1f} | "
            f"{fmt_rate(healthy_ours, sims)} | {fmt_rate(healthy_fixed, sims)} |"
        )
        if found.mean() < 0.9:
            raise BenchFailed(
                f"step {step}%: the regression was rolled back in only {found.mean():.0%} of experiments"
            )
        if healthy_ours > tolerance(sims, ALPHA):
            raise BenchFailed(f"step {step}%: healthy candidate rolled back in {healthy_ours}/{sims}")
    return rows


# ---- users: the clustered and adjusted guardrails ---------------------------------------------
# Guardrails on the users' traffic, each a share: (metric, over the control, at_least). A/A: the
# candidate's attainment at least the truth, its difference to the control at least 0, the error
# rate's at most 0 (each at its boundary); A/B: attainment at least AB_MARGIN over the control
# (the truth is -2.7 points) and the error rate's at most 0.
USER_GUARDRAILS = {
    "attainment": ("attainment", False, True),
    "attainment_over": ("attainment", True, True),
    "error_rate_over": ("errors", True, False),
}
USER_LABEL = {
    "attainment": "attainment at_least {truth:.2%} (= true)",
    "attainment_over": "attainment at_least_over_control 0",
    "error_rate_over": "error_rate at_most_over_control 0",
}
AB_MARGIN = 0.0  # A/B: attainment at_least_over_control 0 (no worse than the control)


def users_trace() -> Trace:
    paths = [p for p in sorted(TRACES.glob("*.csv")) if "code" in p.name] or sorted(TRACES.glob("*.csv"))
    if not paths:
        raise BenchFailed(f"no trace CSV in {TRACES}")
    return load_trace(paths[0])


@dataclasses.dataclass(frozen=True)
class Share:
    """One share guardrail's numbers at a look, per experiment: the totals of the arms it reads
    and the clustered estimate and variance (of the mean; of the difference, adjusted or not)."""

    over: bool
    totals: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # (n, sum) control, candidate
    ready: np.ndarray  # every arm read has DEFAULT_MIN_CLUSTERS users and MIN_EVENTS of each outcome
    estimate: np.ndarray
    variance: np.ndarray
    n: np.ndarray  # requests the sequence counts

    def bounds(self, a: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(lo, hi) at alpha ``a``: {"requests": the exact sequence on the totals (a reading
        without per-user aggregates), "users": as stats.sequential.guardrails reads per-user
        aggregates, the clustered sequence at CLUSTERED_SHARE * a once ``ready``, the exact
        sequence at the rest of a before}."""
        (nc, yc), (nv, yv) = self.totals
        a_users = a * CLUSTERED_SHARE
        if self.over:
            old = difference_cs_bounds(yc, nc, yv, nv, a)
            early = difference_cs_bounds(yc, nc, yv, nv, a - a_users)
        else:
            old = mean_cs_bounds(yv, nv, a)
            early = mean_cs_bounds(yv, nv, a - a_users)
        late = asymptotic_cs_bounds(self.estimate, self.variance, self.n, a_users)
        users = (np.where(self.ready, late[0], early[0]), np.where(self.ready, late[1], early[1]))
        return {"requests": old, "users": users}


def share(arms: tuple[ArmData, ArmData], over: bool, adjust: bool) -> Share:
    c, v = arms
    totals = ((c.n.sum(axis=-1), c.sum_y.sum(axis=-1)), (v.n.sum(axis=-1), v.sum_y.sum(axis=-1)))
    ready = np.ones(totals[0][0].shape, bool)
    for x, (n, y) in ((c, totals[0]), (v, totals[1])) if over else ((v, totals[1]),):
        ready &= ((x.n > 0).sum(axis=-1) >= DEFAULT_MIN_CLUSTERS) & (np.minimum(y, n - y) >= MIN_EVENTS)
    if not over:
        mo = ratio_moments(v.n, v.sum_y)
        return Share(over, totals, ready, mo.estimate, mo.variance, mo.n)
    if adjust:
        fit = adjusted_moments(c, v)
        if fit.degenerate.any():
            raise BenchFailed("a simulated step's covariates are constant or collinear")
        return Share(over, totals, ready, fit.estimate, fit.variance, fit.n.sum(axis=-1))
    d = clustered_difference_moments(ClusterSums(c.n, c.sum_y), ClusterSums(v.n, v.sum_y))
    return Share(over, totals, ready, d.estimate, d.variance, totals[0][0] + totals[1][0])


@dataclasses.dataclass(frozen=True)
class Reading:
    """One way to read the users' guardrails: alpha per guardrail, adjustment, limits."""

    alpha: float
    adjust: bool
    limits: dict[str, float]  # guardrail -> threshold


def user_breaches(pop: Users, readings: dict[str, Reading]) -> dict[tuple[str, str, str], np.ndarray]:
    """{(name, reading, guardrail): breached now?} for reading in requests / users, each named
    Reading of the same look (each arm's sums and each fit computed once)."""
    arms = {m: pop.arms(m) for m in ("attainment", "errors")}
    shares: dict[tuple[str, bool], Share] = {}
    out: dict[tuple[str, str, str], np.ndarray] = {}
    for name, r in readings.items():
        for g, limit in r.limits.items():
            metric, over, at_least = USER_GUARDRAILS[g]
            key = (g, r.adjust and over)
            if key not in shares:
                shares[key] = share(arms[metric], over, r.adjust)
            for reading, (lo, hi) in shares[key].bounds(r.alpha).items():
                out[name, reading, g] = hi < limit if at_least else lo > limit
    return out


def user_snapshots(pop: Users, i: int) -> tuple[ArmSnapshot, ArmSnapshot]:
    """Experiment i's arms as rollouts.readings gives them (per-user aggregates)."""
    hits, errors = pop.arms("attainment"), pop.arms("errors")
    out = []
    for arm in (0, 1):
        h, e = hits[arm], errors[arm]
        keep = h.n[i] > 0
        assert h.sum_x is not None and h.sum_xx is not None and h.sum_xy is not None and e.sum_xy is not None
        sums = UserSums(
            h.n[i][keep],
            np.rint(h.sum_y[i][keep]).astype(np.int64),
            np.rint(e.sum_y[i][keep]).astype(np.int64),
            h.covariates or (),
            h.sum_x[i][keep],
            h.sum_xx[i][keep],
            h.sum_xy[i][keep],
            e.sum_xy[i][keep],
        )
        out.append(ArmSnapshot(int(sums.n.sum()), int(sums.hits.sum()), int(sums.errors.sum()), {}, sums))
    return out[0], out[1]


def check_users_against_decide(pop: Users, r: Reading) -> None:
    """The vectorized users' guardrails must be what decide() says, for a few experiments."""
    rules = {
        (False, True): "at_least",
        (True, True): "at_least_over_control",
        (True, False): "at_most_over_control",
    }
    specs = []
    for g, limit in r.limits.items():
        metric, over, at_least = USER_GUARDRAILS[g]
        specs.append(
            Guardrail("attainment" if metric == "attainment" else "error_rate", rules[over, at_least], limit)
        )
    now = {k[1:]: v for k, v in user_breaches(pop, {"one": r}).items()}
    for i in range(min(3, pop.sims)):
        c, v = user_snapshots(pop, i)
        d = decide(specs, c, v, alpha=r.alpha * len(specs), adjust=r.adjust)
        for g, check in zip(r.limits, d.checks, strict=True):
            if check.inference not in (REQUESTS, CLUSTERED, ADJUSTED):
                raise BenchFailed(f"experiment {i}: {g} read by {check.inference!r}")
            if (check.status == BREACH) != bool(now["users", g][i]):
                raise BenchFailed(
                    f"experiment {i}: decide() says {check.status} for {g} ({check.inference}), "
                    "the simulation disagrees"
                )


def simulate_users(
    sims: int,
    users: int,
    looks: int,
    rate: float,
    look_s: float,
    readings: dict[str, Reading],
    seed: int,
    chunk: int,
    regressed: bool = False,
) -> dict[tuple[str, str, str], np.ndarray]:
    """{(name, reading, guardrail): requests of both arms at the first breach (inf: none)} for
    each named Reading of the same simulated steps."""
    trace = users_trace()
    rng = np.random.default_rng(seed)
    parts: dict[tuple[str, str, str], list[np.ndarray]] = {}
    done = 0
    while done < sims:
        s = min(chunk, sims - done)
        pop = Users(s, users, trace, rng)
        first: dict[tuple[str, str, str], np.ndarray] = {}
        for _ in range(looks):
            pop.add(rate, look_s, regressed, rng)
            n = pop.acc["all"]["n"].reshape(s, users).sum(axis=1).astype(float)
            for key, now in user_breaches(pop, readings).items():
                f = first.setdefault(key, np.full(s, np.inf))
                new = now & np.isinf(f)
                f[new] = n[new]
            rolled_back = [
                np.isfinite(np.min([f for k, f in first.items() if k[:2] == (name, "users")], axis=0))
                for name in readings
            ]
            if regressed and np.all(rolled_back):
                break  # every experiment rolled back under every reading: nothing more to learn
        if done == 0:
            for r in readings.values():
                check_users_against_decide(pop, r)
        for key, f in first.items():
            parts.setdefault(key, []).append(f)
        done += s
    return {k: np.concatenate(v) for k, v in parts.items()}


def users_aa_table(
    sims: int, users: int, looks: int, rate: float, look_s: float, seed: int, chunk: int
) -> list[str]:
    truth_att = users_truth(users_trace())["attainment"]
    limits = {"attainment": truth_att, "attainment_over": 0.0, "error_rate_over": 0.0}
    readings = {"each": Reading(ALPHA, True, limits), "split": Reading(ALPHA / 3, True, limits)}
    got = simulate_users(sims, users, looks, rate, look_s, readings, seed, chunk)
    rows = [
        f"A/A false rollback with heterogeneous users under continuous peeking: {sims} experiments, "
        f"{users:,} users (heavy-tailed rates; their own prompts, TTFT and error rate), 50% step, {rate:g} "
        f"req/s, a look every {look_s:g} s, {looks} looks ({looks * look_s / 60:.0f} min, "
        f"{rate * look_s * looks:,.0f} requests); alpha {ALPHA} per guardrail, each at its boundary; "
        "target: read with users at most alpha",
        "",
        "| guardrail (A/A at the limit) | users: clustered (ours) | requests as independent (before) "
        "| before / ours | read with users through |",
        "|---|---:|---:|---:|---|",
    ]
    tol = tolerance(sims, ALPHA)
    for g in limits:
        ours = int(np.isfinite(got["each", "users", g]).sum())
        before = int(np.isfinite(got["each", "requests", g]).sum())
        how = "the mean's clustered sequence" if g == "attainment" else "the adjusted difference's"
        rows.append(
            f"| {USER_LABEL[g].format(truth=truth_att)} | {fmt_rate(ours, sims)} | {fmt_rate(before, sims)} | "
            f"{ratio(before, ours)} | {how} |"
        )
        if ours > tol:
            raise BenchFailed(
                f"A/A with users, {g}: {ours}/{sims} false breaches, above alpha's tolerance {tol}"
            )
    any_of = {
        k: np.isfinite(np.min([got["split", k, g] for g in limits], axis=0)).sum()
        for k in ("users", "requests")
    }
    ours, before = int(any_of["users"]), int(any_of["requests"])
    rows.append(
        f"| any of the three: the rollout's false rollback (decide(), alpha {ALPHA} split three ways) | "
        f"{fmt_rate(ours, sims)} | {fmt_rate(before, sims)} | {ratio(before, ours)} | |"
    )
    if ours > tol:
        raise BenchFailed(f"A/A with users: {ours}/{sims} false rollbacks, above alpha's tolerance {tol}")
    rows += [
        "",
        f"Binomial tolerance for alpha {ALPHA} over {sims} experiments (99.9% quantile): {tol / sims:.2%}.",
    ]
    return rows


def users_ab_table(
    sims: int, users: int, looks: int, rate: float, look_s: float, seed: int, chunk: int
) -> list[str]:
    # The rollout's guardrails: attainment at_least_over_control AB_MARGIN, error rate
    # at_most_over_control 0 (not regressed), alpha split two ways; rolled back at the first
    # breach of either.
    limits = {"attainment_over": AB_MARGIN, "error_rate_over": 0.0}
    readings = {"adjusted": Reading(ALPHA / 2, True, limits), "unadjusted": Reading(ALPHA / 2, False, limits)}
    got = simulate_users(sims, users, looks, rate, look_s, readings, seed, chunk, regressed=True)
    rows = [
        f"Requests until a rollback of a regression on long prompts, heterogeneous users: the candidate 30% "
        f"slower to a first token on prompts over 4,096 tokens (14% of the requests; attainment -2.7 points), "
        f"{sims} experiments, {users:,} users, 50% step, {rate:g} req/s, a look every {look_s:g} s for "
        f"{looks * look_s / 60:.0f} min; guardrails attainment at_least_over_control {AB_MARGIN:g} "
        f"and error_rate at_most_over_control 0 at alpha {ALPHA} split two ways; requests of both arms at the "
        "first breach; target: adjusted >= 30% fewer (median)",
        "",
        "| differences read as | rolled back within the horizon | median requests | median min | p90 requests "
        "| adjusted / unadjusted |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def fmt(x: float) -> str:
        return f"{x:,.0f}" if math.isfinite(x) else "beyond the horizon"

    horizon = rate * look_s * looks
    med = {}
    for name, label in (
        ("unadjusted", "users, clustered, unadjusted (analysis.adjust off)"),
        ("adjusted", "users, clustered, adjusted (ours)"),
    ):
        t = np.min([got[name, "users", g] for g in limits], axis=0)
        # An experiment never rolled back counts as infinitely many requests, not as missing.
        med[name] = float(np.quantile(t, 0.5, method="inverted_cdf"))
        p90 = float(np.quantile(t, 0.9, method="inverted_cdf"))
        versus = "-"
        if name == "adjusted":
            # Beyond the horizon the unadjusted median is more than the horizon's requests.
            unadjusted = min(med["unadjusted"], horizon)
            versus = ("" if math.isfinite(med["unadjusted"]) else "< ") + f"{med[name] / unadjusted:.2f}x"
        minutes = f"{med[name] / rate / 60:.1f}" if math.isfinite(med[name]) else "-"
        rows.append(
            f"| {label} | {np.isfinite(t).mean():.1%} | {fmt(med[name])} | {minutes} | {fmt(p90)} | {versus} |"
        )
    rows += ["", f"Horizon: {horizon:,.0f} requests ({looks * look_s / 60:.0f} min)."]
    if not math.isfinite(med["adjusted"]):
        raise BenchFailed("A/B with users: the adjusted guardrail did not roll back most experiments")
    if med["adjusted"] > 0.7 * min(med["unadjusted"], horizon):
        raise BenchFailed(
            f"A/B with users: adjusted median {med['adjusted']:,.0f} requests vs unadjusted "
            f"{med['unadjusted']:,.0f}: not 30% fewer"
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
        "--users", type=int, default=2000, help="users per experiment, A/B with users (default 2000)"
    )
    parser.add_argument(
        "--aa-users", type=int, default=500, help="users per experiment, A/A with users (default 500)"
    )
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args(argv)
    if not (args.rate > 0 and args.look_s > 0 and args.rate * args.look_s >= 100):
        raise BenchFailed("--rate and --look-s must be > 0 with at least 100 requests per look")
    if min(args.users, args.aa_users) < 200:
        raise BenchFailed("--users and --aa-users must be at least 200")
    quick = args.quick
    t0 = time.perf_counter()
    sections = [
        aa_table(400 if quick else 2000, 60 if quick else 240, args.rate, args.look_s, args.seed),
        coverage_table(1000 if quick else 10000, 100 if quick else 1000, 300, args.seed + 1),
        # --quick: 30 min of looks, past the p90 time to detect at the 1% step (~18 min)
        power_table(100 if quick else 500, 60 if quick else 240, args.rate, args.look_s, args.seed + 2),
        users_aa_table(
            160 if quick else 1000,
            args.aa_users,
            60 if quick else 120,
            args.rate,
            args.look_s,
            args.seed + 3,
            160 if quick else 250,
        ),
        users_ab_table(
            40 if quick else 300, args.users, 120, args.rate, args.look_s, args.seed + 4, 40 if quick else 150
        ),
    ]
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} cores, seed {args.seed}"
    )
    for section in sections:
        print()
        print("\n".join(section))
    print()
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
