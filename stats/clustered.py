"""Statistics at the unit of randomization: user-clustered means and differences from per-user sums.

The router randomizes users; the report counts requests. The requests of one user share the
user's prompts, region, client and habits, so they are correlated, and an interval that treats
them as independent (Wilson, Newcombe, the z test) is too narrow: an A/A test rejects more often
than alpha. The remedy is to treat the user as the independent unit.

The estimator (the ratio metric of Deng, Lu & Litz 2018, "Applying the delta method in metric
analytics", KDD): for one arm with clusters g = 1..G (users), n_g requests and s_g the sum of
the metric over them (hits for attainment, errors for the error rate, the sum of latencies for
a mean latency), the mean per request is the ratio m = S / N with S = sum s_g, N = sum n_g, and
its delta-method variance over clusters is

    Var(m) = G / (G - 1) * sum_g (s_g - m n_g)^2 / N^2.

That is exactly the CR1 cluster-robust variance of the intercept of an OLS of the per-request
metric on a constant, clustered by user (statsmodels ``cov_type="cluster"``, whose correction
G/(G-1) * (N-1)/(N-K) is G/(G-1) for K = 1). The two arms are independent (disjoint users), so the
variance of variant - control is the sum of the two arms' variances: each arm keeps its own
G/(G-1), which matters when one arm is a 1% rollout step with few users. (A single pooled OLS
with a treatment dummy corrects by G/(G-1) * (N-1)/(N-2) over both arms instead; see
stats.adjusted, which does that to match its covariate-adjusted fit.)

Inputs are what ``GROUP BY user_id`` returns: per user count(), sum(metric) and, for the
unclustered standard error shown beside the clustered one, sum(metric * metric) (a 0/1 metric,
``binary=True``, needs none: its square is itself). Requests without a user (served by a rule before any user
was known) are passed as clusters of their own, n_g = 1: they are independent of each other by
construction, so they count as users of one request each. When the users are too many to bring
to Python one by one (the SLA report over millions of users), ``ArmMoments`` holds their sums
reduced over users (sum_g v_g and sum_g v_g v_g' of the per-user vector): every function here and
in stats.adjusted takes it in place of the per-user arrays and gives the same numbers.

The interval of one arm's mean is normal (m +- z se) for a latency; for a 0/1 metric it is the
Wilson interval at the effective sample size m (1 - m) / se^2, which stays in [0, 1] and covers
better near 0 (an error rate of 1% from a few hundred users). Differences use the normal
interval: a difference's sampling distribution is far more symmetric than one skewed share's.

Small samples: the interval is a normal approximation over clusters. With fewer than 2 clusters
in an arm there is no variance estimate and no interval (``None``, the reason in ``note``). With
few *effective* clusters, N^2 / sum n_g^2, the interval is approximate and usually too narrow: a
single heavy user holding most of the requests makes the arm's estimate mostly that user's mean,
and no number of light users fixes that; ``note`` says so below ``FEW_EFFECTIVE_CLUSTERS``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
from scipy import stats as sps

from stats._common import DEFAULT_CONF, AsDict, check_conf, z_of
from stats.proportions import wilson_centre_half

# Below this many effective clusters (N^2 / sum n_g^2) the normal approximation over clusters is
# poor: in seeded A/A simulations with heavy-tailed users a 95% interval covers ~93% of the time
# at 50 effective users (~94.5% at 200), and less below.
FEW_EFFECTIVE_CLUSTERS = 30.0
MEAN_METHOD = "ratio mean; delta method over user clusters (CR1: G/(G-1)); normal CI"
BINARY_MEAN_METHOD = (
    "share; delta method over user clusters (CR1: G/(G-1)); Wilson CI at the effective sample size"
)
DIFFERENCE_METHOD = (
    "difference of ratio means; delta method over user clusters, per-arm CR1 (G_a/(G_a-1)), "
    "arms independent; normal CI and two-sided z test"
)
NEWCOMBE_METHOD = (
    "difference of shares; an arm without events (or all events) has no spread between users to "
    "estimate: Newcombe's square-and-add of the arms' Wilson intervals at their effective sample "
    "sizes (N where the spread is 0), z test at the interval's standard error"
)
NO_SPREAD_NOTE = (
    "no spread between users in {arms} (no events, all events, or every user at one share): the "
    "spread cannot be estimated, so the interval is the Wilson one at N requests, as if they were "
    "independent"
)


def cluster_codes(
    clusters: Sequence[Hashable] | np.ndarray | None, size: int, where: str
) -> tuple[np.ndarray, int]:
    """Integer codes 0..G-1 for per-request cluster ids, and G.

    ``None`` means every request is its own cluster; inside the ids, ``None`` (or NaN in a float
    array) marks a request without a user, which becomes a cluster of its own.
    """
    if clusters is None:
        return np.arange(size, dtype=np.int64), size
    ids = np.asarray(clusters)
    if ids.ndim != 1 or ids.shape[0] != size:
        raise ValueError(f"{where}: clusters has shape {ids.shape}, expected one id per request ({size})")
    if ids.dtype == object:
        # Mixed or None ids: factorize with a dict, giving each None a code of its own.
        lookup: dict[Any, int] = {}
        codes = np.empty(size, dtype=np.int64)
        next_code = 0
        for i, key in enumerate(ids.tolist()):
            if key is None or (isinstance(key, float) and math.isnan(key)):
                codes[i] = next_code
                next_code += 1
                continue
            code = lookup.get(key)
            if code is None:
                code = lookup[key] = next_code
                next_code += 1
            codes[i] = code
        return codes, next_code
    if ids.dtype.kind == "f":
        missing = np.isnan(ids)
        codes = np.empty(size, dtype=np.int64)
        uniq, inverse = np.unique(ids[~missing], return_inverse=True)
        codes[~missing] = inverse
        codes[missing] = uniq.size + np.arange(int(missing.sum()))
        return codes, int(uniq.size + missing.sum())
    uniq, inverse = np.unique(ids, return_inverse=True)
    return inverse.astype(np.int64).ravel(), int(uniq.size)


def check_cluster_counts(n: Any, where: str, name: str = "n") -> np.ndarray:
    """Requests per cluster as int64: finite whole numbers >= 0 (0 is padding, not a cluster)."""
    arr = np.asarray(n)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{where}: {name} must be numeric request counts, got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise ValueError(f"{where}: {name} must be an array with one count per cluster")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.isfinite(arr).all():
            raise ValueError(f"{where}: {name} contains NaN or infinity")
        if (arr != np.floor(arr)).any():
            raise ValueError(f"{where}: {name} must be whole request counts")
    if arr.size and arr.min() < 0:
        raise ValueError(f"{where}: {name} must be >= 0 in every cluster, got {arr.min()}")
    return arr.astype(np.int64, copy=False)


def check_sums(x: Any, shape: tuple[int, ...], where: str, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    if arr.shape != shape:
        raise ValueError(f"{where}: {name} has shape {arr.shape}, expected {shape}")
    # One pass: a NaN or an infinity anywhere makes the sum NaN or infinite.
    if not np.isfinite(arr.sum()) and not np.isfinite(arr).all():
        raise ValueError(
            f"{where}: {name} contains NaN or infinity; drop requests without this metric first "
            "(a failed request is an SLA miss, not a latency)"
        )
    return arr


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ClusterSums:
    """Per-cluster aggregates of one arm: ``GROUP BY user_id`` of count(), sum(y), sum(y*y).

    Arrays end with the cluster axis; leading axes are a batch (many simulated experiments at
    once, clusters padded with n = 0, which count for nothing). ``sums_sq`` is optional: without
    it the unclustered standard error is not given. ``binary``: y is 0/1 (hits, errors), so
    0 <= sums <= n is checked, ``sums_sq`` is the sums themselves, and the mean's interval is
    the Wilson score interval at the effective sample size (see ``clustered_mean``).
    """

    n: np.ndarray
    sums: np.ndarray
    sums_sq: np.ndarray | None = None
    binary: bool = False

    def __post_init__(self) -> None:
        where = "ClusterSums"
        n = check_cluster_counts(self.n, where)
        s = check_sums(self.sums, n.shape, where, "sums")
        if ((n == 0) & (s != 0)).any():
            raise ValueError(f"{where}: a cluster with n = 0 has a nonzero sum")
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "sums", s)
        if self.binary:
            if (s < 0).any() or (s > n).any():
                raise ValueError(f"{where}: a 0/1 metric needs 0 <= sums <= n in every cluster")
            if self.sums_sq is not None and not np.array_equal(np.asarray(self.sums_sq, dtype=float), s):
                raise ValueError(f"{where}: a 0/1 metric's sums_sq must equal its sums (or be omitted)")
            object.__setattr__(self, "sums_sq", s)
        elif self.sums_sq is not None:
            ss = check_sums(self.sums_sq, n.shape, where, "sums_sq")
            if (ss < 0).any() or ((n == 0) & (ss != 0)).any():
                raise ValueError(f"{where}: sums_sq must be >= 0 in every cluster, and 0 where n = 0")
            # Cauchy-Schwarz: s_g^2 <= n_g * sum(y^2); a violation is a mixed-up column.
            if (s * s > n * ss * (1 + 1e-9) + 1e-12).any():
                raise ValueError(f"{where}: sums_sq is too small for sums (s^2 > n * sum of squares)")
            object.__setattr__(self, "sums_sq", ss)

    @classmethod
    def from_aggregates(
        cls,
        n: np.ndarray | Sequence[int],
        sums: np.ndarray | Sequence[float],
        sums_sq: np.ndarray | Sequence[float] | None = None,
        binary: bool = False,
    ) -> ClusterSums:
        """From per-user columns: count(), sum(y) and optionally sum(y * y)."""
        return cls(np.asarray(n), np.asarray(sums), None if sums_sq is None else np.asarray(sums_sq), binary)

    @classmethod
    def from_samples(
        cls,
        values: np.ndarray | Sequence[float],
        clusters: Sequence[Hashable] | np.ndarray | None = None,
        binary: bool = False,
    ) -> ClusterSums:
        """From per-request values and their user ids (None: a request without a user)."""
        y = np.asarray(values, dtype=float)
        if y.ndim != 1:
            raise ValueError(f"ClusterSums.from_samples: values must be one-dimensional, got shape {y.shape}")
        if not np.isfinite(y).all():
            raise ValueError(
                "ClusterSums.from_samples: values contain NaN or infinity; drop requests without "
                "this metric first (a failed request is an SLA miss, not a latency)"
            )
        if binary and not np.isin(y, (0.0, 1.0)).all():
            raise ValueError("ClusterSums.from_samples: binary values must be 0 or 1")
        codes, g = cluster_codes(clusters, y.size, "ClusterSums.from_samples")
        return cls(
            np.bincount(codes, minlength=g),
            np.bincount(codes, weights=y, minlength=g),
            np.bincount(codes, weights=y * y, minlength=g),
            binary,
        )

    def moments(self) -> RatioMoments:
        return ratio_moments(self.n, self.sums, self.sums_sq)

    def arm_moments(self) -> ArmMoments:
        """These clusters reduced over users (one arm, no covariates): ArmMoments."""
        if self.n.ndim != 1:
            raise ValueError(f"ClusterSums.arm_moments: one arm's clusters, got shape {self.n.shape}")
        return ArmMoments.from_clusters(self.n, self.sums, sum_yy=self.sums_sq, binary=self.binary)


def moment_layout(p: int) -> tuple[tuple[Any, ...], ...]:
    """The per-user vector v_g that ``ArmMoments`` reduces, for p covariates, component by
    component: ("n",), ("y",), ("x", k) for each covariate k, ("xy", k), then ("xx", k, l) for
    k <= l, row by row: the sums over one user's requests of 1, the metric y, x_k, x_k * y and
    x_k * x_l."""
    out: list[tuple[Any, ...]] = [("n",), ("y",)]
    out += [("x", k) for k in range(p)]
    out += [("xy", k) for k in range(p)]
    out += [("xx", k, m) for k in range(p) for m in range(k, p)]
    return tuple(out)


def _layout_size(p: int) -> int:
    return 2 + 2 * p + p * (p + 1) // 2


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ArmMoments:
    """One arm's per-user sums reduced over its users: the first and second moments of the
    per-user vector v_g (``moment_layout``) over the users g, with how many users there are and
    the largest one's request count.

    Why: every statistic of this module and of stats.adjusted depends on the users only through
    sums over users of v_g and of products of its components. The clustered variance of a ratio
    mean is G/(G-1) * sum_g (s_g - m n_g)^2 / N^2, a quadratic form in (n_g, s_g); the
    regression adjustment's sandwich is c * sum_g psi_g^2 with psi_g linear in v_g, so
    sum_g psi_g^2 = a' (sum_g v_g v_g') a. A store holding millions of users (a user per request
    in the worst case) returns these few numbers per arm instead of a row per user: ``GROUP BY
    user`` inside, ``sum(v_i * v_j)`` outside. ``ClusterSums.arm_moments`` and
    ``ArmData.arm_moments`` build them from per-user arrays; every function that takes those
    takes this too and gives the same numbers up to rounding.

    ``total`` = sum_g v_g (k,), ``cross`` = sum_g v_g v_g' (k, k), symmetric; ``clusters``: users
    with n_g > 0; ``largest``: max n_g; ``sum_yy``: sum of y^2 over the requests (the unclustered
    standard error; a 0/1 metric's is its sum); ``binary``: y is 0/1 (its mean gets the Wilson
    interval at the effective sample size, as ClusterSums(binary=True)).
    """

    total: np.ndarray
    cross: np.ndarray
    clusters: int
    largest: int
    sum_yy: float | None = None
    covariates: tuple[str, ...] = ()
    binary: bool = False

    def __post_init__(self) -> None:
        where = "ArmMoments"
        names = tuple(str(c) for c in self.covariates)
        k = _layout_size(len(names))
        total = check_sums(self.total, (k,), where, "total")
        cross = check_sums(self.cross, (k, k), where, "cross")
        if not np.allclose(cross, cross.T, rtol=1e-12, atol=0.0):
            raise ValueError(f"{where}: cross must be symmetric (sum over users of v_i * v_j)")
        for name in ("clusters", "largest"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
        big_n = total[0]
        if big_n != math.floor(big_n) or not self.clusters <= big_n <= self.clusters * self.largest:
            raise ValueError(
                f"{where}: {big_n:g} requests cannot come from {self.clusters} users of at most "
                f"{self.largest} requests each"
            )
        if self.largest > big_n:
            raise ValueError(f"{where}: the largest user ({self.largest}) exceeds the requests ({big_n:g})")
        sum_yy = self.sum_yy
        if self.binary:
            if not 0 <= total[1] <= big_n:
                raise ValueError(f"{where}: a 0/1 metric needs 0 <= sum <= n, got {total[1]:g} of {big_n:g}")
            if sum_yy is not None and not math.isclose(float(sum_yy), float(total[1]), rel_tol=1e-12):
                raise ValueError(f"{where}: a 0/1 metric's sum_yy must equal its sum (or be omitted)")
            sum_yy = float(total[1])
        elif sum_yy is not None:
            sum_yy = float(sum_yy)
            if not math.isfinite(sum_yy) or sum_yy < 0:
                raise ValueError(f"{where}: sum_yy must be a finite number >= 0, got {sum_yy!r}")
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "cross", (cross + cross.T) / 2.0)
        object.__setattr__(self, "clusters", int(self.clusters))
        object.__setattr__(self, "largest", int(self.largest))
        object.__setattr__(self, "sum_yy", sum_yy)
        object.__setattr__(self, "covariates", names)

    @property
    def p(self) -> int:
        return len(self.covariates)

    @property
    def n(self) -> int:
        """Requests (sum of n_g)."""
        return int(self.total[0])

    @classmethod
    def from_clusters(
        cls,
        n: np.ndarray | Sequence[int],
        sum_y: np.ndarray | Sequence[float],
        sum_x: np.ndarray | None = None,
        sum_xx: np.ndarray | None = None,
        sum_xy: np.ndarray | None = None,
        sum_yy: np.ndarray | Sequence[float] | None = None,
        covariates: Sequence[str] | None = None,
        binary: bool = False,
    ) -> ArmMoments:
        """From per-user arrays of one arm: n (G,), sum_y (G,), sum_x (G, p), sum_xx (G, p, p),
        sum_xy (G, p), sum_yy (G,) as in stats.adjusted.ArmData; users with n = 0 count for
        nothing."""
        counts = check_cluster_counts(n, "ArmMoments.from_clusters")
        if counts.ndim != 1 or not counts.sum():
            raise ValueError("ArmMoments.from_clusters: one arm's users (one axis) with at least one request")
        g = counts.size
        sx = np.zeros((g, 0)) if sum_x is None else np.asarray(sum_x, dtype=float).reshape(g, -1)
        p = sx.shape[1]
        sxx = np.zeros((g, 0, 0)) if sum_xx is None else np.asarray(sum_xx, dtype=float).reshape(g, p, p)
        sxy = np.zeros((g, 0)) if sum_xy is None else np.asarray(sum_xy, dtype=float).reshape(g, p)
        columns = [counts.astype(float), np.asarray(sum_y, dtype=float)]
        columns += [sx[:, k] for k in range(p)] + [sxy[:, k] for k in range(p)]
        columns += [sxx[:, k, m] for k in range(p) for m in range(k, p)]
        v = np.stack(columns, axis=1)
        names = tuple(covariates) if covariates is not None else tuple(f"x{k + 1}" for k in range(p))
        return cls(
            total=v.sum(axis=0),
            cross=v.T @ v,
            clusters=int((counts > 0).sum()),
            largest=int(counts.max()),
            sum_yy=None if sum_yy is None else float(np.sum(sum_yy)),
            covariates=names,
            binary=binary,
        )

    def select(self, covariates: Sequence[str]) -> ArmMoments:
        """The same users with only these covariates (in this order): the matching rows and
        columns of the moments. A covariate this arm does not hold is a ValueError."""
        missing = [c for c in covariates if c not in self.covariates]
        if missing:
            raise ValueError(f"ArmMoments.select: {missing} not among the covariates {self.covariates}")
        where = {c: i for i, c in enumerate(self.covariates)}
        index = {part: i for i, part in enumerate(moment_layout(self.p))}
        keep = [where[c] for c in covariates]
        picked = []
        for part in moment_layout(len(keep)):
            if part[0] == "xx":
                k, m = sorted((keep[part[1]], keep[part[2]]))
                picked.append(index[("xx", k, m)])
            elif len(part) == 2:
                picked.append(index[(part[0], keep[part[1]])])
            else:
                picked.append(index[part])
        ix = np.asarray(picked)
        return ArmMoments(
            self.total[ix],
            self.cross[np.ix_(ix, ix)],
            self.clusters,
            self.largest,
            self.sum_yy,
            tuple(covariates),
            self.binary,
        )

    def moments(self) -> RatioMoments:
        """The ratio mean's moments (as ratio_moments gives them from per-user arrays):
        sum_g (s_g - m n_g)^2 = S_yy - 2 m S_ny + m^2 S_nn from the cross moments."""
        big_n, s = float(self.total[0]), float(self.total[1])
        m = s / big_n
        c = self.cross
        e2 = max(float(c[1, 1] - 2.0 * m * c[0, 1] + m * m * c[0, 0]), 0.0)
        g = float(self.clusters)
        var = g / (g - 1.0) * e2 / (big_n * big_n) if g >= 2 else math.nan
        var_iid = math.nan
        if self.sum_yy is not None and big_n >= 2:
            var_iid = max(self.sum_yy - big_n * m * m, 0.0) / (big_n - 1.0) / big_n
        f = np.float64
        return RatioMoments(f(m), f(var), f(var_iid), f(big_n), f(g), f(c[0, 0]))


class RatioMoments(NamedTuple):
    """Vectorized ratio mean over the last (cluster) axis; NaN where undefined."""

    estimate: np.ndarray  # S / N
    variance: np.ndarray  # CR1 clustered variance of the estimate (NaN with < 2 clusters)
    variance_iid: np.ndarray  # s^2 / N as if requests were independent (NaN without sums_sq)
    n: np.ndarray  # requests
    clusters: np.ndarray  # clusters with at least one request
    sum_n_sq: np.ndarray  # sum n_g^2 (effective clusters N^2 / this)


def ratio_moments(n: np.ndarray, sums: np.ndarray, sums_sq: np.ndarray | None = None) -> RatioMoments:
    """The ratio estimate and its variances for many arms at once (arrays as in ClusterSums).

    Steps:
    1. m = S / N over the clusters with n_g > 0;
    2. residual sums e_g = s_g - m n_g (they sum to 0), CR1 variance G/(G-1) sum e_g^2 / N^2;
    3. the unclustered variance: the requests' sample variance (sum y^2 - N m^2) / (N - 1), over N.
    """
    nf = np.asarray(n, dtype=float)
    s = np.asarray(sums, dtype=float)
    big_n = nf.sum(axis=-1)
    g = (nf > 0).sum(axis=-1).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = s.sum(axis=-1) / big_n
        e = s - m[..., None] * nf
        var = g / (g - 1.0) * (e * e).sum(axis=-1) / (big_n * big_n)
        var = np.where(g >= 2, var, np.nan)
        if sums_sq is None:
            var_iid = np.full(m.shape, np.nan)
        else:
            ssq = np.asarray(sums_sq, dtype=float).sum(axis=-1) - big_n * m * m
            var_iid = np.where(big_n >= 2, np.maximum(ssq, 0.0) / (big_n - 1.0) / big_n, np.nan)
    return RatioMoments(m, var, var_iid, big_n, g, (nf * nf).sum(axis=-1))


@dataclasses.dataclass(frozen=True, slots=True)
class ClusteredMean(AsDict):
    estimate: float  # S / N: per request, as the report counts
    se: float | None  # clustered (CR1); None with fewer than 2 clusters
    lo: float | None
    hi: float | None
    conf: float
    se_iid: float | None  # as if requests were independent; None without sums of squares
    design_effect: float | None  # (se / se_iid)^2: how many requests are worth one independent one
    n: int
    clusters: int
    effective_clusters: float  # N^2 / sum n_g^2: G when users are equal, ~1 when one dominates
    largest_cluster_share: float  # the heaviest user's share of the requests
    note: str | None  # why there is no interval, or why to distrust it
    method: str


def _design_effect(var: float, var_iid: float) -> float | None:
    if not (math.isfinite(var) and math.isfinite(var_iid)) or var_iid <= 0:
        return None
    return var / var_iid


def _arm_note(clusters: int, effective: float, share: float, label: str = "") -> str | None:
    if clusters < 2:
        return f"{label}fewer than 2 users ({clusters}): no variance between users, no interval"
    if effective < FEW_EFFECTIVE_CLUSTERS:
        return (
            f"{label}only {effective:.1f} effective users (N^2 / sum n_g^2; the heaviest holds "
            f"{share:.0%} of requests): the interval is approximate and tends to be too narrow"
        )
    return None


def _check_1d(arm: ClusterSums | ArmMoments, where: str) -> None:
    if isinstance(arm, ArmMoments):
        return  # one arm with at least one request by construction
    if not isinstance(arm, ClusterSums):
        raise TypeError(f"{where}: expected ClusterSums or ArmMoments, got {type(arm).__name__}")
    if arm.n.ndim != 1:
        raise ValueError(f"{where}: one arm's clusters must be one-dimensional, got shape {arm.n.shape}")
    if arm.n.sum() == 0:
        raise ValueError(f"{where}: no requests, a mean needs at least one")


def mean_bounds(
    mo: RatioMoments, conf: float = DEFAULT_CONF, binary: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized (lo, hi) of the clustered mean's interval; NaN where there is none.

    A latency: the normal interval m +- z se. A 0/1 metric: the Wilson score interval of
    stats.proportions at the effective sample size n_eff = m (1 - m) / se^2 (Kish: N over the
    design effect), capped at N: it stays within [0, 1] and is asymmetric near 0 and 1 like the
    report's Wilson interval. When every request has the same outcome the clustering cannot be
    estimated (se = 0) and n_eff = N, the unclustered Wilson interval.
    """
    check_conf(conf, "mean_bounds")
    z = z_of(conf)
    m, var = mo.estimate, mo.variance
    with np.errstate(divide="ignore", invalid="ignore"):
        if not binary:
            half = z * np.sqrt(var)
            return m - half, m + half
        n_eff = np.where(var > 0, np.minimum(m * (1 - m) / var, mo.n), mo.n)
        n_eff = np.where(np.isfinite(var), n_eff, np.nan)
        centre, half = wilson_centre_half(m, n_eff, z)
        lo = np.clip(np.minimum(m, centre - half), 0.0, 1.0)
        hi = np.clip(np.maximum(m, centre + half), 0.0, 1.0)
    return lo, hi


def no_spread(arm: ClusterSums | ArmMoments) -> bool:
    """A 0/1 arm whose clustered variance is 0 (no events, all events, or every user at the same
    share): a variance of 0 is no evidence of certainty, and an interval built on it would be a
    point. mean_bounds then takes the Wilson interval at N; differences combine those intervals
    (clustered_difference, stats.sequential.adjusted)."""
    if not arm.binary:
        return False
    var = float(arm.moments().variance)
    return math.isfinite(var) and var <= 0.0


def clustered_mean(arm: ClusterSums | ArmMoments, conf: float = DEFAULT_CONF) -> ClusteredMean:
    """Mean per request of one arm with a user-clustered interval (attainment, error rate, latency).

    The interval is normal for a latency and Wilson at the effective sample size for a 0/1
    metric (``ClusterSums(binary=True)``), see ``mean_bounds``.
    """
    _check_1d(arm, "clustered_mean")
    check_conf(conf, "clustered_mean")
    mo = arm.moments()
    m, var, var_iid = float(mo.estimate), float(mo.variance), float(mo.variance_iid)
    big_n, g = int(mo.n), int(mo.clusters)
    effective = float(mo.n) ** 2 / float(mo.sum_n_sq)
    share = float(arm.largest if isinstance(arm, ArmMoments) else arm.n.max()) / big_n
    se = math.sqrt(var) if math.isfinite(var) else None
    lo = hi = None
    if se is not None:
        lo_a, hi_a = mean_bounds(mo, conf, arm.binary)
        lo, hi = float(lo_a), float(hi_a)
    return ClusteredMean(
        estimate=m,
        se=se,
        lo=lo,
        hi=hi,
        conf=conf,
        se_iid=math.sqrt(var_iid) if math.isfinite(var_iid) else None,
        design_effect=_design_effect(var, var_iid),
        n=big_n,
        clusters=g,
        effective_clusters=effective,
        largest_cluster_share=share,
        note=_arm_note(g, effective, share)
        or (NO_SPREAD_NOTE.format(arms="this arm") if g >= 2 and no_spread(arm) else None),
        method=BINARY_MEAN_METHOD if arm.binary else MEAN_METHOD,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ClusteredDifference(AsDict):
    estimate: float  # variant - control, per request
    se: float | None  # clustered: sqrt of the sum of the arms' CR1 variances
    lo: float | None
    hi: float | None
    conf: float
    p_value: float | None  # two-sided z test of no difference
    se_iid: float | None  # as if requests were independent (Welch-type, unpooled)
    design_effect: float | None  # (se / se_iid)^2
    control: ClusteredMean
    variant: ClusteredMean
    note: str | None
    method: str


class DifferenceMoments(NamedTuple):
    estimate: np.ndarray
    variance: np.ndarray  # clustered, per-arm CR1 summed
    variance_iid: np.ndarray


def clustered_difference_moments(
    control: ClusterSums | ArmMoments, variant: ClusterSums | ArmMoments
) -> DifferenceMoments:
    """Variant - control and its variances for many experiments at once (simulations)."""
    c, v = control.moments(), variant.moments()
    return DifferenceMoments(
        v.estimate - c.estimate, c.variance + v.variance, c.variance_iid + v.variance_iid
    )


def normal_p_value(estimate: float, se: float | None) -> float | None:
    """Two-sided p-value of estimate / se; a zero SE rejects any nonzero estimate outright."""
    if se is None:
        return None
    if se == 0:
        return 1.0 if estimate == 0 else 0.0
    return float(2.0 * sps.norm.sf(abs(estimate) / se))


def clustered_difference(
    control: ClusterSums | ArmMoments, variant: ClusterSums | ArmMoments, conf: float = DEFAULT_CONF
) -> ClusteredDifference:
    """Variant - control mean per request, with users (not requests) as the independent unit.

    Each arm needs at least 2 users for an interval; otherwise ``se``, ``lo``, ``hi`` and
    ``p_value`` are None and ``note`` says which arm.
    """
    _check_1d(control, "clustered_difference(control)")
    _check_1d(variant, "clustered_difference(variant)")
    check_conf(conf, "clustered_difference")
    mc, mv = clustered_mean(control, conf), clustered_mean(variant, conf)
    d = clustered_difference_moments(control, variant)
    est, var, var_iid = float(d.estimate), float(d.variance), float(d.variance_iid)
    se = math.sqrt(var) if math.isfinite(var) else None
    lo = hi = None
    if se is not None:
        z = z_of(conf)
        lo, hi = est - z * se, est + z * se
    notes = [
        f"{label}: {arm.note}" for label, arm in (("control", mc), ("variant", mv)) if arm.note is not None
    ]
    p_value = normal_p_value(est, se)
    method = DIFFERENCE_METHOD
    flat = [label for label, arm in (("control", control), ("variant", variant)) if no_spread(arm)]
    if flat and se is not None and mc.lo is not None and mv.lo is not None:
        # 1. each arm's Wilson interval at its effective sample size (N where the spread is 0);
        # 2. Newcombe's square-and-add, as the request-level difference (stats.comparisons);
        # 3. the z test at the standard error that interval implies, so a 0 vs 0 is p = 1 and a
        #    difference of shares without spread is no longer "certain" (p = 0).
        assert mc.hi is not None and mv.hi is not None
        lo = est - math.sqrt((mv.estimate - mv.lo) ** 2 + (mc.hi - mc.estimate) ** 2)
        hi = est + math.sqrt((mv.hi - mv.estimate) ** 2 + (mc.estimate - mc.lo) ** 2)
        lo, hi = max(-1.0, min(est, lo)), min(1.0, max(est, hi))
        p_value = normal_p_value(est, (hi - lo) / (2.0 * z_of(conf)))
        method = NEWCOMBE_METHOD  # the arms' notes say which has no spread
    return ClusteredDifference(
        estimate=est,
        se=se,
        lo=lo,
        hi=hi,
        conf=conf,
        p_value=p_value,
        se_iid=math.sqrt(var_iid) if math.isfinite(var_iid) else None,
        design_effect=_design_effect(var, var_iid),
        control=mc,
        variant=mv,
        note="; ".join(notes) or None,
        method=method,
    )
