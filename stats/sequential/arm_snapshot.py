"""One arm's reading in a rollout step, as the guardrails take it (stats.sequential.guardrails):
its totals (``ArmSnapshot``: requests, SLA hits, errors, setup errors kept apart), its latency
sources for quantile guardrails, and optionally the per-user aggregates the totals add up from,
a row per user (``UserSums``) or reduced over the users in the store (``UserMoments``), and the
candidate's live requests shadowed to the control (``Shadows``).

The two shares a guardrail reads from the totals: ``ATTAINMENT`` (SLA hits, errors count as
misses) and ``ERROR_RATE`` (errors). The third share, ``IDENTICAL_ANSWERS``, is read from the
shadows: of the shadowed requests both of whose answers came back, those whose answers are the
same.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from stats.adjusted import ArmData
from stats.clustered import ArmMoments, ClusterSums
from stats.sequential._base import SequentialInterval

ATTAINMENT, ERROR_RATE = "attainment", "error_rate"
IDENTICAL_ANSWERS = "identical_answers"


class QuantileSource(Protocol):
    """An arm's latencies: LatencyHistogram or SortedLatencies."""

    @property
    def n(self) -> int: ...

    def quantile_interval(
        self, q: float, alpha: float = ..., prior: tuple[float, float] = ...
    ) -> SequentialInterval: ...


SHARES = {ATTAINMENT: "hits", ERROR_RATE: "errors"}  # the per-request 0/1 value of each share


def _int_array(x: Any, where: str, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.number)) or arr.dtype == bool:
        raise ValueError(f"{where}: {name} must be one count per user, got {arr.dtype} of shape {arr.shape}")
    if arr.size and (not np.isfinite(arr).all() or (arr != np.floor(arr)).any() or arr.min() < 0):
        raise ValueError(f"{where}: {name} must be whole counts >= 0")
    return arr.astype(np.int64)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class UserSums:
    """One arm's per-user aggregates in the step: ``GROUP BY user`` (a request without a user is a
    user of its own) of the requests, SLA hits and errors, and for the regression adjustment the
    per-user sums of the pre-request covariates (``covariates``: their names), of their products,
    and of their products with hits and with errors. Exactly what stats.clustered.ClusterSums
    and stats.adjusted.ArmData need, for either share."""

    n: np.ndarray  # (G,) requests
    hits: np.ndarray  # (G,)
    errors: np.ndarray  # (G,)
    covariates: tuple[str, ...] = ()
    sum_x: np.ndarray | None = None  # (G, p)
    sum_xx: np.ndarray | None = None  # (G, p, p), symmetric
    sum_x_hits: np.ndarray | None = None  # (G, p)
    sum_x_errors: np.ndarray | None = None  # (G, p)

    def __post_init__(self) -> None:
        where = "UserSums"
        n = _int_array(self.n, where, "n")
        hits, errors = _int_array(self.hits, where, "hits"), _int_array(self.errors, where, "errors")
        if hits.shape != n.shape or errors.shape != n.shape:
            raise ValueError(f"{where}: n, hits and errors need one count per user each")
        if (hits + errors > n).any():
            raise ValueError(f"{where}: a user's hits + errors exceed their requests (errors are misses)")
        names = tuple(str(c) for c in self.covariates)
        g, p = n.size, len(names)
        arrays = {"sum_x": (g, p), "sum_xx": (g, p, p), "sum_x_hits": (g, p), "sum_x_errors": (g, p)}
        for name, shape in arrays.items():
            value = getattr(self, name)
            if value is None:
                if p:
                    raise ValueError(f"{where}: covariates {names} named but no {name} given")
                value = np.zeros(shape)
            value = np.asarray(value, dtype=float)
            if value.shape != shape:
                raise ValueError(f"{where}: {name} has shape {value.shape}, expected {shape}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "hits", hits)
        object.__setattr__(self, "errors", errors)
        object.__setattr__(self, "covariates", names)

    @property
    def users(self) -> int:
        return int((self.n > 0).sum())

    @property
    def requests(self) -> int:
        return int(self.n.sum())

    def events(self, metric: str) -> int:
        """Requests whose share value is 1 (attainment: hits; error_rate: errors)."""
        return int(self.values(metric).sum())

    def values(self, metric: str) -> np.ndarray:
        """Per-user sums of the share's 0/1 value (attainment: hits; error_rate: errors)."""
        return self.hits if SHARES[metric] == "hits" else self.errors

    def reduced(self) -> UserMoments:
        """These rows summed over the users, as a store returns them (UserMoments)."""
        if not self.n.sum():
            return UserMoments(self.covariates)
        shares = {}
        for metric in (ATTAINMENT, ERROR_RATE):
            xy = self.sum_x_hits if SHARES[metric] == "hits" else self.sum_x_errors
            shares[metric] = ArmMoments.from_clusters(
                self.n, self.values(metric), self.sum_x, self.sum_xx, xy, None, self.covariates, binary=True
            )
        return UserMoments(self.covariates, shares[ATTAINMENT], shares[ERROR_RATE])

    def clustered_source(self, metric: str) -> ClusterSums:
        """What the clustered sequences of the share take (``cluster_sums``)."""
        return self.cluster_sums(metric)

    def adjusted_source(self, metric: str, keep: Sequence[int]) -> ArmData:
        """What the adjusted sequence of the share takes (``arm_data``)."""
        return self.arm_data(metric, keep)

    def cluster_sums(self, metric: str) -> ClusterSums:
        return ClusterSums(self.n, self.values(metric).astype(float), binary=True)

    def arm_data(self, metric: str, keep: Sequence[int]) -> ArmData:
        """ArmData of the share adjusted on the covariates at positions ``keep``."""
        ix = list(keep)
        xy = self.sum_x_hits if SHARES[metric] == "hits" else self.sum_x_errors
        assert self.sum_x is not None and self.sum_xx is not None and xy is not None  # __post_init__
        y = self.values(metric).astype(float)
        return ArmData(
            n=self.n,
            sum_y=y,
            sum_x=self.sum_x[:, ix],
            sum_xx=self.sum_xx[:, ix][:, :, ix],
            sum_xy=xy[:, ix],
            sum_yy=y,  # a 0/1 value is its own square
            covariates=tuple(self.covariates[i] for i in ix),
        )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class UserMoments:
    """One arm's per-user aggregates in the step reduced over its users: what UserSums holds a
    row per user of, summed in the store instead (rollouts.readings reads one row per arm
    however many users there are). Per share, stats.clustered.ArmMoments of the per-user vector
    [n, y, x, xy, xx] (``moment_layout``) on the covariates ``covariates``, y the share's 0/1
    value: ``attainment`` (hits) and ``error_rate`` (errors). Every guardrail reads the same
    numbers from it as from the per-user rows, to rounding. Both None: no request in the step."""

    covariates: tuple[str, ...]
    attainment: ArmMoments | None = None
    error_rate: ArmMoments | None = None

    def __post_init__(self) -> None:
        where = "UserMoments"
        names = tuple(str(c) for c in self.covariates)
        arms = (self.attainment, self.error_rate)
        if (arms[0] is None) != (arms[1] is None):
            raise ValueError(f"{where}: attainment and error_rate moments come together (or neither)")
        if arms[0] is not None and arms[1] is not None:
            for metric, arm in zip((ATTAINMENT, ERROR_RATE), arms, strict=True):
                if not isinstance(arm, ArmMoments) or not arm.binary or arm.covariates != names:
                    raise ValueError(f"{where}: {metric} must be 0/1 ArmMoments on the covariates {names}")
            a, e = arms
            if (a.n, a.clusters, a.largest) != (e.n, e.clusters, e.largest):
                raise ValueError(f"{where}: attainment and error_rate moments are of different users")
            if a.total[1] + e.total[1] > a.n:
                raise ValueError(f"{where}: hits + errors exceed the requests (errors are misses)")
        object.__setattr__(self, "covariates", names)

    def _arm(self, metric: str) -> ArmMoments | None:
        return self.attainment if SHARES[metric] == "hits" else self.error_rate

    @property
    def users(self) -> int:
        return 0 if self.attainment is None else self.attainment.clusters

    @property
    def requests(self) -> int:
        return 0 if self.attainment is None else self.attainment.n

    def events(self, metric: str) -> int:
        """Requests whose share value is 1 (attainment: hits; error_rate: errors)."""
        arm = self._arm(metric)
        return 0 if arm is None else round(float(arm.total[1]))

    def _present(self, metric: str) -> ArmMoments:
        arm = self._arm(metric)
        if arm is None:
            raise ValueError(f"UserMoments: no request in this arm, no {metric} to read")
        return arm

    def clustered_source(self, metric: str) -> ArmMoments:
        """The share's moments without covariates: what the clustered sequences take."""
        return self._present(metric).select(())

    def adjusted_source(self, metric: str, keep: Sequence[int]) -> ArmMoments:
        """The share's moments on the covariates at positions ``keep``: the adjusted sequence's."""
        return self._present(metric).select([self.covariates[i] for i in keep])


PerUser = UserSums | UserMoments


def _count(v: Any, where: str, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"{where}: {name} must be an integer count >= 0, got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Shadows:
    """The candidate's live requests shadowed to the control in the step (the gateway's
    fidelity_shadows rows under the step's config revision), as the ``identical_answers``
    guardrail reads them.

    ``shadowed``: the rows; ``ok``: those compared (outcome ok: both answers came back), the only
    ones judged; ``identical``: of those, the answers the same as the control's; ``users``: the
    distinct users among the ok ones (a request without a user is a user of its own).
    ``by_user``: read with users as the independent unit (the plan's cluster_by_user); then
    ``per_user`` holds the ok shadows' per-user vector [requests, identical] reduced over the
    users (0/1 ArmMoments without covariates: its sums and the sums of its products), None only
    while no shadow is ok. It offers what the clustered sequences read of a share (``users``,
    ``requests``, ``events``, ``clustered_source``), as UserMoments does for the other two."""

    shadowed: int
    ok: int
    identical: int
    users: int = 0
    per_user: ArmMoments | None = None
    by_user: bool = False

    def __post_init__(self) -> None:
        where = "Shadows"
        shadowed, ok, identical, users = (
            _count(getattr(self, name), where, name) for name in ("shadowed", "ok", "identical", "users")
        )
        if not identical <= ok <= shadowed:
            raise ValueError(
                f"{where}: needs identical <= ok <= shadowed, got {identical}, {ok}, {shadowed} "
                "(only compared shadows are judged)"
            )
        if users > ok or (ok and not users):
            raise ValueError(f"{where}: {users} users cannot have sent {ok} compared shadows")
        u = self.per_user
        if u is not None:
            if not isinstance(u, ArmMoments) or not u.binary or u.covariates:
                raise ValueError(f"{where}: per_user must be 0/1 ArmMoments without covariates")
            if (u.n, round(float(u.total[1])), u.clusters) != (ok, identical, users):
                raise ValueError(
                    f"{where}: the per-user moments hold {u.n} shadows, {float(u.total[1]):g} identical, "
                    f"{u.clusters} users, not ok, identical, users = {ok}, {identical}, {users}"
                )
            object.__setattr__(self, "by_user", True)
        elif self.by_user and ok:
            raise ValueError(f"{where}: read by user, {ok} compared shadows need their per-user moments")
        for name, v in (("shadowed", shadowed), ("ok", ok), ("identical", identical), ("users", users)):
            object.__setattr__(self, name, v)

    @property
    def requests(self) -> int:
        """The judged shadows (outcome ok)."""
        return self.ok

    def events(self, metric: str = IDENTICAL_ANSWERS) -> int:
        """The judged shadows whose answers were identical."""
        return self.identical

    def clustered_source(self, metric: str = IDENTICAL_ANSWERS) -> ArmMoments:
        """The per-user moments the clustered sequence reads."""
        if self.per_user is None:
            raise ValueError("Shadows: no compared shadow read by user, no identical_answers to read")
        return self.per_user

    def counts(self) -> dict[str, int]:
        """What a decision shows of them."""
        return {"shadowed": self.shadowed, "ok": self.ok, "identical": self.identical, "users": self.users}


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ArmSnapshot:
    """One arm's totals in the current step: requests, SLA hits (errors count as misses), errors,
    latency sources by name for quantile guardrails (e.g. {"ttft_ms": LatencyHistogram}), and
    optionally the per-user aggregates those totals add up from (``per_user``: attainment and
    error rate are then read with users as the independent unit).

    ``setup_errors``: the requests the arm answered with a setup error (a 4xx but 408 and 429:
    an unknown model, auth, a bad request; analysis.definitions.SETUP_ERROR), kept out of n,
    hits and errors: they measure how the arm is configured or called, not how it serves, so no
    guardrail reads them (``decide`` checks them on their own, ``setup_error_check``).

    ``shadows``: the candidate's live requests shadowed to the control (``Shadows``), read when
    a plan has an ``identical_answers`` guardrail; None otherwise."""

    n: int
    hits: int
    errors: int
    latencies: Mapping[str, QuantileSource] = dataclasses.field(default_factory=dict)
    per_user: PerUser | None = None
    setup_errors: int = 0
    shadows: Shadows | None = None

    def __post_init__(self) -> None:
        if self.shadows is not None and not isinstance(self.shadows, Shadows):
            raise ValueError(f"ArmSnapshot: shadows must be Shadows, got {type(self.shadows).__name__}")
        for name in ("n", "hits", "errors", "setup_errors"):
            _count(getattr(self, name), "ArmSnapshot", name)
        if self.hits + self.errors > self.n:
            raise ValueError(
                f"ArmSnapshot: hits ({self.hits}) + errors ({self.errors}) exceed n ({self.n}); "
                "errors count as misses, so a request cannot be both"
            )
        u = self.per_user
        if u is not None:
            if not isinstance(u, UserSums | UserMoments):
                raise ValueError(
                    f"ArmSnapshot: per_user must be UserSums or UserMoments, got {type(u).__name__}"
                )
            sums = (u.requests, u.events(ATTAINMENT), u.events(ERROR_RATE))
            if sums != (self.n, self.hits, self.errors):
                raise ValueError(
                    f"ArmSnapshot: the per-user aggregates add up to n, hits, errors = {sums}, "
                    f"not the totals {(self.n, self.hits, self.errors)}"
                )
