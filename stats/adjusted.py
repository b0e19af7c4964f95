"""Regression adjustment on pre-request covariates (CUPED, ANCOVA), user-clustered, from sums.

Why: most of the spread of a latency is explained by what the request asked for (TTFT grows
with the prompt, total time with the requested output), and that is the same in both arms on
average. Comparing the arms after removing the part explained by such covariates keeps the
target and shrinks the variance, so the same precision needs fewer requests.

The estimator: OLS of the per-request metric y on [1, T, x] (T = 1 in the variant, x the p
covariates). By Frisch-Waugh the slope theta is the pooled within-arm regression slope of y on
x (CUPED's theta, Deng, Xu, Kohavi & Walker 2013, fitted on both arms) and the coefficient of T
is the difference of the adjusted means,

    tau = (ybar_v - ybar_c) - (xbar_v - xbar_c)' theta.

Randomization makes xbar_v - xbar_c a zero-mean chance imbalance, so removing its effect leaves
the average effect as the target (Lin 2013, "Agnostic notes on regression adjustments to
experimental data": consistent whether or not y is linear in x, with a robust variance; no less
precise than the unadjusted difference asymptotically when the arms are equal in size or the
slopes are equal in both arms. With very unequal arms and different slopes Lin's interacted
regression would be more precise; it is not done here, and the robust variance stays valid).

The variance: the cluster-robust sandwich over users, CR1 exactly as statsmodels'
``cov_type="cluster"`` (and Stata):

    V = c * A^-1 B A^-1,  A = sum_j z_j z_j',  B = sum_g (sum_{j in g} z_j e_j)(...)',
    c = G / (G - 1) * (N - 1) / (N - K),  K = p + 2,

with G the users of both arms and e_j the residuals. ``variance_reduction`` is 1 - V / V_0 with
V_0 the same fit without covariates (the same correction with K = 2), so it measures the
estimator, not the correction.

From sums (what ClickHouse returns): z_j = [1, T, x_j] and T is constant within a user, so A and
each user's score sum_{j in g} z_j e_j = u_g - M_g beta need per user only count(), sum(y),
sum(x_k), sum(x_k * x_l), sum(x_k * y), and sum(y * y) for the unclustered standard error shown
beside. ``ArmData.from_samples`` builds exactly these from raw arrays, so both paths give the
same numbers. Requests without a user are clusters of their own (one request each). With too
many users to read one by one, each arm's sums reduced over users (stats.clustered.ArmMoments:
sum_g v_g and sum_g v_g v_g' of v_g = [n, y, x, xy, xx]) are enough: psi_g is linear in v_g, so
sum_g psi_g^2 is a quadratic form in sum_g v_g v_g' (``adjusted_moments_from_sums``).

Covariates must be fixed before the variant sees the request: prompt tokens, requested output
tokens (max_tokens), their logs, the hour of day; never generated tokens or anything else the
variant's response changes (adjusting on a post-treatment variable biases tau by the variant's
effect on it). Any number of columns; a constant or collinear set is refused.

Binary metrics (attainment, error rate): the same linear fit (a linear probability model);
tau is the difference of adjusted shares.

Quantile metrics (p99 TTFT) are not adjusted. The adjustment works because a mean is linear:
E[y - theta'(x - E x)] = E[y] for every theta, so subtracting a zero-mean covariate term moves
no target and removes variance. No such identity holds for a quantile: the p99 of
y - theta'(x - E x) is not the p99 of y, nor any known shift of it, so an "adjusted p99" would
estimate another quantity. p99s keep the unadjusted order-statistic intervals of
stats.quantiles and stats.sequential.quantiles.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from stats._common import DEFAULT_CONF, AsDict, check_conf, z_of
from stats.clustered import (
    FEW_EFFECTIVE_CLUSTERS,
    ArmMoments,
    check_cluster_counts,
    check_sums,
    cluster_codes,
    clustered_difference,
    moment_layout,
    no_spread,
    normal_p_value,
)

METHOD = (
    "OLS of y on [1, variant, covariates] (pooled-slope adjustment); cluster-robust sandwich over "
    "users, CR1 = G/(G-1) * (N-1)/(N-K); normal CI and two-sided z test"
)
# A covariate whose spread is below this fraction of its mean is constant in floating point.
_CONSTANT_RTOL = 1e-9
# Above this condition number of the (standardized) normal equations the covariates are collinear.
_MAX_CONDITION = 1e10


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ArmData:
    """Per-user sufficient statistics of one arm.

    Arrays end with the cluster axis G (then the covariate axes p, p); leading axes are a batch
    (many simulated experiments at once; clusters padded with n = 0 count for nothing).
    ``sum_x``, ``sum_xx``, ``sum_xy`` come together or not at all (no covariates); a single
    covariate may be given without its axes, as (..., G). ``sum_yy`` is optional (without it the
    unclustered standard error is not given).
    """

    n: np.ndarray  # (..., G) requests
    sum_y: np.ndarray  # (..., G)
    sum_x: np.ndarray | None = None  # (..., G, p)
    sum_xx: np.ndarray | None = None  # (..., G, p, p), symmetric
    sum_xy: np.ndarray | None = None  # (..., G, p)
    sum_yy: np.ndarray | None = None  # (..., G)
    covariates: tuple[str, ...] | None = None  # names, for the report; x1..xp by default

    def __post_init__(self) -> None:
        where = "ArmData"
        n = check_cluster_counts(self.n, where)
        shape = n.shape
        sy = check_sums(self.sum_y, shape, where, "sum_y")
        given = [x is not None for x in (self.sum_x, self.sum_xx, self.sum_xy)]
        if any(given) and not all(given):
            raise ValueError(f"{where}: sum_x, sum_xx and sum_xy must be given together (or none)")
        if self.sum_x is None:
            p = 0 if self.covariates is None else len(self.covariates)
            if p:
                raise ValueError(f"{where}: covariates {self.covariates} named but no sum_x given")
            sx, sxx, sxy = np.zeros((*shape, 0)), np.zeros((*shape, 0, 0)), np.zeros((*shape, 0))
        else:
            sx = np.asarray(self.sum_x, dtype=float)
            if sx.ndim == n.ndim:  # one covariate given as (..., G)
                sx = sx[..., None]
            p = sx.shape[-1] if sx.ndim == n.ndim + 1 else -1
            if p < 0:
                raise ValueError(f"{where}: sum_x has shape {sx.shape}, expected {(*shape, 'p')}")
            sx = check_sums(sx, (*shape, p), where, "sum_x")
            sxx = np.asarray(self.sum_xx, dtype=float)
            sxy = np.asarray(self.sum_xy, dtype=float)
            if p == 1 and sxx.shape == shape:
                sxx = sxx[..., None, None]
            if p == 1 and sxy.shape == shape:
                sxy = sxy[..., None]
            sxx = check_sums(sxx, (*shape, p, p), where, "sum_xx")
            sxy = check_sums(sxy, (*shape, p), where, "sum_xy")
            for k in range(p):
                for m in range(k + 1, p):
                    upper, lower = sxx[..., k, m], sxx[..., m, k]
                    if not (np.array_equal(upper, lower) or np.allclose(upper, lower, rtol=1e-12, atol=0.0)):
                        raise ValueError(f"{where}: sum_xx must be symmetric (sum of x_k * x_l per cluster)")
            if (np.diagonal(sxx, axis1=-2, axis2=-1) < 0).any():
                raise ValueError(f"{where}: sum_xx has a negative sum of squares on its diagonal")
        empty = n == 0
        if empty.any() and (
            (sy[empty] != 0).any()
            or (sx[empty] != 0).any()
            or (sxx[empty] != 0).any()
            or (sxy[empty] != 0).any()
        ):
            raise ValueError(f"{where}: a cluster with n = 0 has nonzero sums")
        if self.sum_yy is not None:
            syy = check_sums(self.sum_yy, shape, where, "sum_yy")
            if (syy < 0).any() or (syy[empty] != 0).any():
                raise ValueError(f"{where}: sum_yy must be >= 0, and 0 where n = 0")
            object.__setattr__(self, "sum_yy", syy)
        names = self.covariates
        if names is None:
            names = tuple(f"x{k + 1}" for k in range(p))
        names = tuple(str(x) for x in names)
        if len(names) != p:
            raise ValueError(f"{where}: {len(names)} covariate names for {p} covariate columns")
        for field, value in (("n", n), ("sum_y", sy), ("sum_x", sx), ("sum_xx", sxx), ("sum_xy", sxy)):
            object.__setattr__(self, field, value)
        object.__setattr__(self, "covariates", names)

    @property
    def p(self) -> int:
        return len(self.covariates or ())

    def arm_moments(self, binary: bool = False) -> ArmMoments:
        """These per-user sums reduced over users (one arm): stats.clustered.ArmMoments."""
        if self.n.ndim != 1:
            raise ValueError(f"ArmData.arm_moments: one arm's clusters, got shape {self.n.shape}")
        return ArmMoments.from_clusters(
            self.n, self.sum_y, self.sum_x, self.sum_xx, self.sum_xy, self.sum_yy, self.covariates, binary
        )

    @classmethod
    def from_samples(
        cls,
        y: np.ndarray | Sequence[float],
        x: np.ndarray | Sequence[float] | Sequence[Sequence[float]] | None = None,
        clusters: Sequence[Hashable] | np.ndarray | None = None,
        covariates: Sequence[str] | None = None,
    ) -> ArmData:
        """From per-request arrays: metric ``y`` (N,), covariates ``x`` (N,) or (N, p), user ids
        ``clusters`` (None: every request its own cluster; a None id: a request without a user)."""
        where = "ArmData.from_samples"
        yy = np.asarray(y, dtype=float)
        if yy.ndim != 1:
            raise ValueError(f"{where}: y must be one-dimensional, got shape {yy.shape}")
        if not np.isfinite(yy).all():
            raise ValueError(
                f"{where}: y contains NaN or infinity; drop requests without this metric first "
                "(a failed request is an SLA miss, not a latency)"
            )
        size = yy.size
        if x is None:
            xx = np.zeros((size, 0))
        else:
            xx = np.asarray(x, dtype=float)
            if xx.ndim == 1:
                xx = xx[:, None]
            if xx.ndim != 2 or xx.shape[0] != size:
                raise ValueError(f"{where}: x has shape {xx.shape}, expected ({size},) or ({size}, p)")
            if not np.isfinite(xx).all():
                raise ValueError(f"{where}: x contains NaN or infinity")
        codes, g = cluster_codes(clusters, size, where)
        p = xx.shape[1]

        def per_cluster(w: np.ndarray) -> np.ndarray:
            return np.bincount(codes, weights=w, minlength=g)

        sxx = np.empty((g, p, p))
        for k in range(p):
            for m in range(k, p):
                sxx[:, k, m] = sxx[:, m, k] = per_cluster(xx[:, k] * xx[:, m])
        return cls(
            n=np.bincount(codes, minlength=g),
            sum_y=per_cluster(yy),
            sum_x=np.stack([per_cluster(xx[:, k]) for k in range(p)], axis=-1) if p else None,
            sum_xx=sxx if p else None,
            sum_xy=np.stack([per_cluster(xx[:, k] * yy) for k in range(p)], axis=-1) if p else None,
            sum_yy=per_cluster(yy * yy),
            covariates=tuple(covariates) if covariates is not None else None,
        )


class AdjustedMoments(NamedTuple):
    """Vectorized fit over the batch axes; NaN where undefined (see ``adjusted_moments``)."""

    estimate: np.ndarray  # tau, the adjusted variant - control
    variance: np.ndarray  # CR1 cluster-robust
    unadjusted: np.ndarray  # ybar_v - ybar_c
    variance_unadjusted: np.ndarray  # CR1 cluster-robust, K = 2
    variance_iid: np.ndarray  # classic OLS (independent requests, equal variance)
    variance_iid_unadjusted: np.ndarray
    theta: np.ndarray  # (..., p) slopes in the covariates' units
    adjusted_means: np.ndarray  # (..., 2): control, variant at the pooled covariate mean
    n: np.ndarray  # (..., 2) requests per arm
    clusters: np.ndarray  # (..., 2) users per arm
    sum_n_sq: np.ndarray  # (..., 2) sum n_g^2 per arm
    degenerate: np.ndarray  # bool: a constant or collinear covariate set; everything else NaN


class _Totals(NamedTuple):
    """Both arms' totals over their users: all the fit needs besides each user's score."""

    n: np.ndarray  # (..., 2) requests per arm
    clusters: np.ndarray  # (..., 2) users per arm
    sum_n_sq: np.ndarray  # (..., 2) sum n_g^2 per arm
    sum_y: np.ndarray  # (..., 2)
    sum_x: np.ndarray  # (..., 2, p)
    sum_xx: np.ndarray  # (..., p, p) over both arms
    sum_xy: np.ndarray  # (..., p) over both arms
    sum_yy: np.ndarray | None  # (...) over both arms; None: no unclustered variance


class _Fit(NamedTuple):
    """Steps 1 and 2 of adjusted_moments (see there); NaN or junk where ``good`` is False."""

    ok: np.ndarray
    degenerate: np.ndarray
    good: np.ndarray
    a_inv: np.ndarray
    u: np.ndarray
    beta: np.ndarray
    tau: np.ndarray
    theta: np.ndarray  # (..., p) in the covariates' units
    b: np.ndarray  # intercept of the control in the covariates' units
    c: np.ndarray  # (..., p) pooled covariate means
    row: np.ndarray  # tau's row of A^-1
    q: np.ndarray  # (..., p) its covariate part back in the covariates' units
    mean_arm: np.ndarray  # (..., 2)
    xs_v: np.ndarray  # (..., p) sum over the variant of the standardized covariates
    ybar: np.ndarray


def _fit(t: _Totals) -> _Fit:
    """Steps 1 and 2: the standardized normal equations from the totals, and beta."""
    p = t.sum_x.shape[-1]
    k_all = p + 2
    big_n = t.n.sum(axis=-1)
    n_v = t.n[..., 1]
    batch = big_n.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        c = t.sum_x.sum(axis=-2) / big_n[..., None]  # pooled covariate means (..., p)
        ybar = t.sum_y.sum(axis=-1) / big_n
        cov_xx = t.sum_xx - big_n[..., None, None] * c[..., :, None] * c[..., None, :]
        sd = np.sqrt(np.maximum(np.diagonal(cov_xx, axis1=-2, axis2=-1) / big_n[..., None], 0.0))
        constant = ~(sd > _CONSTANT_RTOL * np.abs(c))  # also sd == 0 at c == 0, and NaN
        sd = np.where(constant, 1.0, sd)
        a = np.zeros((*batch, k_all, k_all))
        a[..., 0, 0] = big_n
        a[..., 0, 1] = a[..., 1, 0] = a[..., 1, 1] = n_v
        # Centred covariates sum to 0 over both arms: A[0, 2:] = 0 and U[0] = 0.
        xs_v = (t.sum_x[..., 1, :] - n_v[..., None] * c) / sd  # sum over the variant of x~
        a[..., 1, 2:] = a[..., 2:, 1] = xs_v
        a[..., 2:, 2:] = cov_xx / (sd[..., :, None] * sd[..., None, :])
        u = np.zeros((*batch, k_all))
        u[..., 1] = t.sum_y[..., 1] - n_v * ybar
        u[..., 2:] = (t.sum_xy - big_n[..., None] * c * ybar[..., None]) / sd
        ok = np.isfinite(a).all(axis=(-1, -2)) & (t.n > 0).all(axis=-1)
        degenerate = constant.any(axis=-1)
        safe = np.where((ok & ~degenerate)[..., None, None], a, np.eye(k_all))
        degenerate |= ok & ~(np.linalg.cond(safe) < _MAX_CONDITION)
        good = ok & ~degenerate
        a_inv = np.linalg.inv(np.where(good[..., None, None], a, np.eye(k_all)))
        beta = np.einsum("...kl,...l->...k", a_inv, np.where(good[..., None], u, 0.0))

        # 2. Back to the covariates' units: y = b + tau T + theta' x + e.
        tau = beta[..., 1]
        theta = beta[..., 2:] / sd
        b = ybar + beta[..., 0] - (theta * c).sum(axis=-1)
        row = a_inv[..., 1, :]
        q = row[..., 2:] / sd
        mean_arm = t.sum_y / np.where(t.n > 0, t.n, np.nan)
    return _Fit(ok, degenerate, good, a_inv, u, beta, tau, theta, b, c, row, q, mean_arm, xs_v, ybar)


def _arm_weights(f: _Fit, arm: int) -> tuple[np.ndarray, np.ndarray]:
    """(w, intercept) of arm 0 (control) or 1 (variant) in psi_g = w e0_g + (sum x e)_g . q,
    e0_g = s_g - n_g intercept - sum_x_g . theta (step 3 of adjusted_moments)."""
    intercept = f.b + f.tau * arm
    w = f.row[..., 0] + f.row[..., 1] * arm - (f.c * f.q).sum(axis=-1)
    return w, intercept


def _finish(t: _Totals, f: _Fit, variance_cr0: np.ndarray, variance0_cr0: np.ndarray) -> AdjustedMoments:
    """The CR1 corrections, the unclustered variances and the adjusted means around the sums
    of squared scores (sum_g psi_g^2, adjusted and unadjusted)."""
    k_all = t.sum_x.shape[-1] + 2
    big_n = t.n.sum(axis=-1)
    g = t.clusters.sum(axis=-1)
    batch = big_n.shape
    good, ok = f.good, f.ok
    with np.errstate(divide="ignore", invalid="ignore"):
        enough = good & (t.clusters >= 2).all(axis=-1) & (big_n > k_all)
        variance = np.where(enough, g / (g - 1.0) * (big_n - 1.0) / (big_n - k_all) * variance_cr0, np.nan)
        enough0 = ok & (t.clusters >= 2).all(axis=-1) & (big_n > 2)
        variance0 = np.where(enough0, g / (g - 1.0) * (big_n - 1.0) / (big_n - 2.0) * variance0_cr0, np.nan)

        # Classic OLS variances (requests independent, one variance), beside the clustered ones.
        var_iid = np.full(batch, np.nan)
        var_iid0 = np.full(batch, np.nan)
        if t.sum_yy is not None:
            syy_c = t.sum_yy - big_n * f.ybar * f.ybar
            rss = np.maximum(syy_c - (f.beta * f.u).sum(axis=-1), 0.0)
            var_iid = np.where(enough, rss / (big_n - k_all) * f.a_inv[..., 1, 1], np.nan)
            between = ((t.sum_y - t.n * f.ybar[..., None]) ** 2 / t.n).sum(axis=-1)
            rss0 = np.maximum(syy_c - between, 0.0)
            var_iid0 = np.where(enough0, rss0 / (big_n - 2.0) * (1.0 / t.n).sum(axis=-1), np.nan)

        # Adjusted means at the pooled covariate mean: ybar_arm - xbar~_arm . theta~.
        xs_arm = np.stack([-f.xs_v / t.n[..., 0, None], f.xs_v / t.n[..., 1, None]], axis=-2)
        adj_means = f.mean_arm - np.einsum("...ak,...k->...a", xs_arm, f.beta[..., 2:])
        bad = ~good
    return AdjustedMoments(
        estimate=np.where(bad, np.nan, f.tau),
        variance=variance,
        unadjusted=f.mean_arm[..., 1] - f.mean_arm[..., 0],
        variance_unadjusted=variance0,
        variance_iid=var_iid,
        variance_iid_unadjusted=var_iid0,
        theta=np.where(bad[..., None], np.nan, f.theta),
        adjusted_means=np.where(bad[..., None], np.nan, adj_means),
        n=t.n,
        clusters=t.clusters,
        sum_n_sq=t.sum_n_sq,
        degenerate=f.degenerate,
    )


def adjusted_moments(control: ArmData, variant: ArmData) -> AdjustedMoments:
    """The pooled-slope fit for many experiments at once (arrays as in ArmData).

    Steps:
    1. arm totals; the normal equations in standardized coordinates (x centred on its pooled
       mean and scaled to unit pooled variance, y centred), well conditioned whatever the
       units; tau and its variance do not change under this reparametrization;
    2. beta = A^-1 U, back to the covariates' units for the per-user residuals;
    3. each user's score sum_{j in g} z_j e_j from their sums; only its projection psi_g on
       tau's row of A^-1 is needed: V = c * sum psi_g^2 (one pass over the users per arm);
    4. the unadjusted difference in closed form: psi_g = (s_g - n_g ybar_arm) / N_arm.
    """
    if not (isinstance(control, ArmData) and isinstance(variant, ArmData)):
        raise TypeError("adjusted_moments: control and variant must be ArmData")
    if control.n.shape[:-1] != variant.n.shape[:-1]:
        raise ValueError(
            f"adjusted_moments: batch shapes differ (control {control.n.shape[:-1]}, "
            f"variant {variant.n.shape[:-1]})"
        )
    if control.p != variant.p:
        raise ValueError(f"adjusted_moments: control has {control.p} covariates, variant {variant.p}")
    arms = (control, variant)
    sum_x = [a.sum_x for a in arms]
    sum_xx = [a.sum_xx for a in arms]
    sum_xy = [a.sum_xy for a in arms]
    assert all(x is not None for x in (*sum_x, *sum_xx, *sum_xy))  # filled in by __post_init__

    # 1. Totals per arm (the fit: _fit).
    syy = None
    if control.sum_yy is not None and variant.sum_yy is not None:
        syy = control.sum_yy.sum(axis=-1) + variant.sum_yy.sum(axis=-1)
    totals = _Totals(
        n=np.stack([a.n.sum(axis=-1) for a in arms], axis=-1).astype(float),  # (..., 2)
        clusters=np.stack([(a.n > 0).sum(axis=-1) for a in arms], axis=-1).astype(float),
        sum_n_sq=np.stack([np.square(a.n, dtype=float).sum(axis=-1) for a in arms], axis=-1),
        sum_y=np.stack([a.sum_y.sum(axis=-1) for a in arms], axis=-1),
        sum_x=np.stack([x.sum(axis=-2) for x in sum_x], axis=-2),  # type: ignore[union-attr]
        sum_xx=sum_xx[0].sum(axis=-3) + sum_xx[1].sum(axis=-3),  # type: ignore[union-attr]
        sum_xy=sum_xy[0].sum(axis=-2) + sum_xy[1].sum(axis=-2),  # type: ignore[union-attr]
        sum_yy=syy,
    )
    f = _fit(totals)  # 1 and 2
    batch = totals.n.shape[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        # 3. psi_g = row . [e0, T e0, (sum x e - c e0) / sd] with row = tau's row of A^-1,
        #    e0 = sum_{j in g} e_j = s_g - n_g (b + tau T) - sum_x . theta, and
        #    sum x e = sum_xy - sum_x (b + tau T) - sum_xx theta (only its projection on q).
        variance_cr0 = np.zeros(batch)
        variance0_cr0 = np.zeros(batch)
        for t, arm in enumerate(arms):
            sx, sxx, sxy = sum_x[t], sum_xx[t], sum_xy[t]
            w, intercept = _arm_weights(f, t)
            intercept = intercept[..., None]
            e0 = arm.sum_y - arm.n * intercept - np.einsum("...gk,...k->...g", sx, f.theta)
            xe_q = (
                np.einsum("...gk,...k->...g", sxy, f.q)
                - np.einsum("...gk,...k->...g", sx, f.q) * intercept
                - np.einsum("...gkl,...k,...l->...g", sxx, f.q, f.theta)
            )
            psi = w[..., None] * e0 + xe_q
            variance_cr0 += (psi * psi).sum(axis=-1)
            # 4. Unadjusted.
            psi0 = (arm.sum_y - arm.n * f.mean_arm[..., t, None]) / totals.n[..., t, None]
            variance0_cr0 += (psi0 * psi0).sum(axis=-1)
    return _finish(totals, f, variance_cr0, variance0_cr0)


def adjusted_moments_from_sums(control: ArmMoments, variant: ArmMoments) -> AdjustedMoments:
    """adjusted_moments of one experiment from each arm's per-user sums reduced over users
    (stats.clustered.ArmMoments): the same fit from the same totals, and each arm's
    sum_g psi_g^2 as the quadratic form a' (sum_g v_g v_g') a, psi_g = a . v_g being linear in
    the per-user vector v_g = [n, y, x, xy, xx] (stats.clustered.moment_layout):

        psi_g = w (s_g - n_g i - x_g . theta) + xy_g . q - (x_g . q) i - sum_kl xx_g,kl q_k theta_l

    with i the arm's intercept and w, q as in step 3 of adjusted_moments."""
    if not (isinstance(control, ArmMoments) and isinstance(variant, ArmMoments)):
        raise TypeError("adjusted_moments_from_sums: control and variant must be ArmMoments")
    if control.covariates != variant.covariates:
        raise ValueError(
            f"adjusted_moments_from_sums: the arms' covariates differ (control {control.covariates}, "
            f"variant {variant.covariates})"
        )
    p = control.p
    layout = moment_layout(p)
    pairs = [(part[1], part[2]) for part in layout if part[0] == "xx"]

    def xx_of(arm: ArmMoments) -> np.ndarray:
        out = np.zeros((p, p))
        for i, (k, m) in enumerate(pairs):
            out[k, m] = out[m, k] = arm.total[2 + 2 * p + i]
        return out

    arms = (control, variant)
    syy = None
    if control.sum_yy is not None and variant.sum_yy is not None:
        syy = np.float64(control.sum_yy + variant.sum_yy)
    totals = _Totals(
        n=np.array([a.total[0] for a in arms]),
        clusters=np.array([float(a.clusters) for a in arms]),
        sum_n_sq=np.array([a.cross[0, 0] for a in arms]),
        sum_y=np.array([a.total[1] for a in arms]),
        sum_x=np.stack([a.total[2 : 2 + p] for a in arms]),
        sum_xx=xx_of(control) + xx_of(variant),
        sum_xy=control.total[2 + p : 2 + 2 * p] + variant.total[2 + p : 2 + 2 * p],
        sum_yy=syy,
    )
    f = _fit(totals)
    variance_cr0 = variance0_cr0 = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        for t, arm in enumerate(arms):
            w, intercept = _arm_weights(f, t)
            a = np.zeros(len(layout))
            a[0], a[1] = -w * intercept, w
            a[2 : 2 + p] = -w * f.theta - f.q * intercept
            a[2 + p : 2 + 2 * p] = f.q
            for i, (k, m) in enumerate(pairs):
                a[2 + 2 * p + i] = (
                    -f.q[k] * f.theta[k] if k == m else -(f.q[k] * f.theta[m] + f.q[m] * f.theta[k])
                )
            variance_cr0 += max(float(a @ arm.cross @ a), 0.0)
            # Unadjusted: psi0_g = (s_g - n_g ybar_arm) / N_arm.
            a0 = np.zeros(len(layout))
            a0[0], a0[1] = -f.mean_arm[t] / totals.n[t], 1.0 / totals.n[t]
            variance0_cr0 += max(float(a0 @ arm.cross @ a0), 0.0)
    return _finish(totals, f, np.float64(variance_cr0), np.float64(variance0_cr0))


def fit_arms(control: ArmData | ArmMoments, variant: ArmData | ArmMoments, where: str) -> AdjustedMoments:
    """The pooled-slope fit of one experiment's two arms (fixed-horizon or anytime-valid), from
    ArmData (``adjusted_moments``) or ArmMoments (``adjusted_moments_from_sums``).

    Refused first: an arm that is not one experiment's ArmData with at least one request, or an
    ArmMoments; arms of two kinds; covariates that differ in name or order. A wrong kind is a
    TypeError, so that callers which read a ValueError as "constant or collinear covariates"
    (and drop one) do not swallow it. A degenerate fit is the caller's to refuse.
    """
    for label, arm in (("control", control), ("variant", variant)):
        if isinstance(arm, ArmMoments):
            continue  # one arm with at least one request by construction
        if not isinstance(arm, ArmData):
            raise TypeError(f"{where}: {label} must be ArmData or ArmMoments, got {type(arm).__name__}")
        if arm.n.ndim != 1:
            raise ValueError(
                f"{where}: {label} must hold one experiment (clusters on one axis), got {arm.n.shape}"
            )
        if arm.n.sum() == 0:
            raise ValueError(f"{where}: {label} has no requests")
    if type(control) is not type(variant):
        raise TypeError(f"{where}: control and variant must be both ArmData or both ArmMoments")
    if control.covariates != variant.covariates:
        raise ValueError(
            f"{where}: the arms' covariates differ (control {control.covariates}, variant {variant.covariates})"
        )
    if isinstance(control, ArmMoments) and isinstance(variant, ArmMoments):
        return adjusted_moments_from_sums(control, variant)
    return adjusted_moments(control, variant)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class AdjustedDifference(AsDict):
    estimate: float  # tau: variant - control after adjustment
    se: float | None  # cluster-robust CR1; None when an arm has fewer than 2 users
    lo: float | None
    hi: float | None
    conf: float
    p_value: float | None  # two-sided z test of no difference
    unadjusted: float  # ybar_v - ybar_c
    se_unadjusted: float | None  # the same fit without covariates (CR1, K = 2)
    variance_reduction: float | None  # 1 - se^2 / se_unadjusted^2 (negative: adjustment hurt)
    se_iid: float | None  # classic OLS SE: independent requests (None without sum_yy)
    covariates: tuple[str, ...]
    theta: tuple[float, ...]  # pooled slope per covariate, in the metric's units per covariate unit
    control_mean: float  # adjusted means, at the pooled covariate mean; their difference is tau
    variant_mean: float
    control_n: int
    variant_n: int
    control_clusters: int
    variant_clusters: int
    note: str | None
    method: str


def adjusted_difference(
    control: ArmData | ArmMoments, variant: ArmData | ArmMoments, conf: float = DEFAULT_CONF
) -> AdjustedDifference:
    """Variant - control, adjusted on the pre-request covariates, users as the independent unit.

    ``ArmData.from_samples(y, x, user_ids)`` or ``ArmData(n=..., sum_y=..., sum_x=...,
    sum_xx=..., sum_xy=..., sum_yy=...)`` from per-user sums, or both arms' sums reduced over
    users (stats.clustered.ArmMoments, what a store returns when the users are too many to read
    one by one: the same numbers); both arms need the same covariates in the same order.
    Without covariates this is the user-clustered difference of means (with the pooled CR1
    correction, see the module docstring).
    """
    where = "adjusted_difference"
    check_conf(conf, where)
    fit = fit_arms(control, variant, where)
    if bool(fit.degenerate):
        raise ValueError(
            f"{where}: the covariates {control.covariates} are constant or collinear over these "
            "requests; drop the constant or redundant ones"
        )
    est = float(fit.estimate)
    var, var0 = float(fit.variance), float(fit.variance_unadjusted)
    se = math.sqrt(var) if math.isfinite(var) else None
    lo = hi = None
    if se is not None:
        z = z_of(conf)
        lo, hi = est - z * se, est + z * se
    reduction = None
    if math.isfinite(var) and math.isfinite(var0) and var0 > 0:
        reduction = 1.0 - var / var0
    notes = []
    for i, label in enumerate(("control", "variant")):
        g_a = int(fit.clusters[i])
        eff = float(fit.n[i]) ** 2 / float(fit.sum_n_sq[i])
        if g_a < 2:
            notes.append(f"{label}: fewer than 2 users ({g_a}): no variance between users, no interval")
        elif eff < FEW_EFFECTIVE_CLUSTERS:
            notes.append(
                f"{label}: only {eff:.1f} effective users (N^2 / sum n_g^2): the interval is "
                "approximate and tends to be too narrow"
            )
    if se is None and not notes:
        notes.append(f"too few requests for {control.p} covariates")
    p_value = normal_p_value(est, se)
    if (
        isinstance(control, ArmMoments)
        and isinstance(variant, ArmMoments)
        and lo is not None
        and hi is not None
    ):
        flat = [label for label, arm in (("control", control), ("variant", variant)) if no_spread(arm)]
        if flat:
            # A share without events (or all) in an arm: its variance of 0 is no certainty, and
            # the covariates cannot explain a constant. The interval is at least as wide, on each
            # side, as the unadjusted difference's from the arms' Wilson intervals
            # (stats.clustered.clustered_difference), moved to the adjusted estimate.
            plain = clustered_difference(control.select(()), variant.select(()), conf)
            if plain.lo is not None and plain.hi is not None:
                lo = min(lo, est - (plain.estimate - plain.lo))
                hi = max(hi, est + (plain.hi - plain.estimate))
                p_value = normal_p_value(est, (hi - lo) / (2.0 * z_of(conf)))
                notes.append(
                    f"no events (or all events) in {' and '.join(flat)}: no spread between users to "
                    "estimate there; the interval is at least the unadjusted one from the arms' "
                    "Wilson intervals at N"
                )
    var_iid = float(fit.variance_iid)
    return AdjustedDifference(
        estimate=est,
        se=se,
        lo=lo,
        hi=hi,
        conf=conf,
        p_value=p_value,
        unadjusted=float(fit.unadjusted),
        se_unadjusted=math.sqrt(var0) if math.isfinite(var0) else None,
        variance_reduction=reduction,
        se_iid=math.sqrt(var_iid) if math.isfinite(var_iid) else None,
        covariates=tuple(control.covariates or ()),
        theta=tuple(float(x) for x in fit.theta),
        control_mean=float(fit.adjusted_means[0]),
        variant_mean=float(fit.adjusted_means[1]),
        control_n=int(fit.n[0]),
        variant_n=int(fit.n[1]),
        control_clusters=int(fit.clusters[0]),
        variant_clusters=int(fit.clusters[1]),
        note="; ".join(notes) or None,
        method=METHOD,
    )
