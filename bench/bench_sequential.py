"""Anytime-valid guardrails: false rollbacks under peeking, coverage, time to detect.

    .venv/bin/python bench/bench_sequential.py            # 2,000 A/A experiments, a few minutes
    .venv/bin/python bench/bench_sequential.py --quick    # 400 experiments, the same tables, ~10 s

Pure simulation of stats.sequential against the fixed-horizon statistics of the report
(stats.proportions' Wilson interval, stats.comparisons' Newcombe interval and order-statistic
CI, stats.srm's chi-square), both read after every batch the way a rollout controller reads
them, on the same simulated requests.

The traffic: requests at a steady total rate (--rate, default 20 req/s) split by the step's
share; a look every --look-s seconds (30). TTFT of a healthy arm is lognormal, median 100 ms,
sigma 0.269, so 99.5% of first tokens are under the 200 ms SLA (p99 187 ms); 0.1% of requests
fail (errors count as SLA misses). The regression: 5% of the candidate's requests take 130 ms
longer (a first token at ~120 ms comes at ~250 ms): attainment falls to ~94.5%, p99 rises to
~255 ms. Guardrails as in the issue: attainment at least 99.2%, error rate at most 0.5 point
over the control, p99 TTFT at most 20 ms over the control, at alpha 0.05 split between them.

Checks (else `bench FAILED`, exit 1): the sequences' A/A false rollback rates and miss rates are
within the binomial tolerance of alpha (99.9% quantile for the number of experiments), the
fixed-horizon rates are not (peeking is shown), every step detects the regression in most
experiments, and the vectorized guardrails equal stats.sequential.guardrails.decide on a sample.
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

from bench.benchlib import BenchFailed, run_checked  # noqa: E402
from stats.comparisons import attainment_difference_bounds  # noqa: E402
from stats.proportions import wilson_bounds  # noqa: E402
from stats.quantiles import quantile_ci_ranks  # noqa: E402
from stats.sequential.guardrails import BREACH, ArmSnapshot, Guardrail, decide  # noqa: E402
from stats.sequential.means import difference_cs_bounds, mean_cs_bounds  # noqa: E402
from stats.sequential.quantiles import (  # noqa: E402
    LatencyHistogram,
    histogram_bounds,
    order_statistic_bounds,
    quantile_cs_ranks,
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
        f"{look_s:g} s for {looks * look_s / 60:.0f} min, {sims} experiments per step; the issue's "
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


def main(argv: list[str] | None = None) -> int:
    return run_checked(run, argv)


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer experiments, the same tables")
    parser.add_argument("--rate", type=float, default=20.0, help="total requests per second (default 20)")
    parser.add_argument("--look-s", type=float, default=30.0, help="seconds between looks (default 30)")
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args(argv)
    if not (args.rate > 0 and args.look_s > 0 and args.rate * args.look_s >= 100):
        raise BenchFailed("--rate and --look-s must be > 0 with at least 100 requests per look")
    quick = args.quick
    t0 = time.perf_counter()
    sections = [
        aa_table(400 if quick else 2000, 60 if quick else 240, args.rate, args.look_s, args.seed),
        coverage_table(1000 if quick else 10000, 100 if quick else 1000, 300, args.seed + 1),
        # --quick: 30 min of looks, past the p90 time to detect at the 1% step (~18 min)
        power_table(100 if quick else 500, 60 if quick else 240, args.rate, args.look_s, args.seed + 2),
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
