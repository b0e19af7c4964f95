"""Statistics at the unit of randomization in the SLA report: the per-user moments of every
variant (one query, raw or from the rollup) and the user-clustered and covariate-adjusted numbers
built from them, beside the report's request-level ones.

Why: the router assigns users, not requests, and the requests of one user are alike (same
prompts, region, client), so intervals that treat requests as independent draws (the report's
Wilson, Newcombe and order-statistic intervals) are too narrow when users send many requests.
stats.clustered takes the user as the independent unit; stats.adjusted also removes the part of
the spread explained by what each request asked for before any variant saw it.

The query: per variant and cluster (a user; a request without a user, user_id '', is a cluster
of its own: the key is the user id, or the request id when there is none), the sums over the
cluster's requests of a vector v (below); then per variant the sums over clusters of v and of
every product of two of its components, the number of clusters and the largest one's request
count. Those are stats.clustered.ArmMoments: a few hundred numbers per variant however many users
there are (a user per request in the 10M-sample bench), and every clustered and adjusted
statistic comes from them exactly. Unit "request" (the experiment's analysis.cluster_by_user
off) makes every request its own cluster: the same query without the inner GROUP BY.

Two blocks of components, each over its own requests:
- "all", every request: count, SLA hits (analysis.sql.hit_expr), errors (outcome != 'ok'), each
  covariate, each product of two covariates, covariate * hit and covariate * error;
- "ttft", the successful requests with a TTFT (the report's latency population): count, TTFT,
  TTFT^2 (the unclustered standard error), each covariate and product, covariate * TTFT.
Products are taken within a block, and not between two metrics' own components (hits and
errors): no statistic needs those. A reader that needs some metrics alone reads their blocks
alone (``blocks``, blocks_of: a rollout step's guardrails read "all", not "ttft"); the arrays keep
their layout, the blocks not read hold zeros, and UnitMoments refuses to build a metric from one.

Covariates (COVARIATES): prompt_tokens and max_tokens, both fixed by the client before the
variant sees the request. Never output tokens, chunks or anything the variant's response
changes: adjusting on those biases the difference by the variant's effect on them. A covariate
constant over the requests compared (a replay that asks every request for the same max_tokens)
is dropped from that comparison, and the JSON says so.

Rollups (analysis.rollup) store each run's moments for both units. Per-request moments add up
over runs; per-user ones do not (a user may appear in several runs), so a report over several
runs, or over a run still replaying beside finished ones, reads the per-user moments from the
raw samples, as SRM's distinct users.

Cost on the raw samples (ClickHouse 18.16, 2 cores, 1M samples of as many users, the worst case):
~1.0 s per user, ~0.5 s per request, most of it the ~140 sums over the clusters (each aggregate
is a call per row on 18.16); with users who send many requests the clusters are fewer and the
GROUP BY inside dominates (~0.12 s per 1M samples). From a rollup: one read of a few rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from analysis.definitions import Filters, Slo
from analysis.sql import JUDGED, SAMPLES, from_where, hit_expr, metric_ok
from stats._common import DEFAULT_CONF
from stats.adjusted import adjusted_difference
from stats.clustered import ArmMoments, clustered_difference, clustered_mean
from stats.comparisons import holm_adjust

T = TypeVar("T")

# The pre-request covariates offered to the adjustment, as Float64 SQL over the samples table.
COVARIATES: dict[str, str] = {
    "prompt_tokens": "toFloat64(prompt_tokens)",
    "max_tokens": "toFloat64(max_tokens)",
}
UNITS = ("user", "request")
# A request's cluster within its variant: its user, or the request itself when it came without
# one. Hashed with the variant into one UInt64 (as sql.DISTINCT_USERS): grouping on it was 3x
# faster on 18.16 than on (variant, key) and far faster than on the strings; a collision (~3e-6
# at 10^7 users) merges two users into one cluster.
CLUSTER_KEY = "cityHash64(variant, user_id, if(user_id = '', request_id, ''))"

INFERENCE_USER = "user-clustered"
INFERENCE_REQUEST = "requests"
# The report's keys that treat requests as independent draws, whatever the experiment's switch.
REQUEST_LEVEL = (
    "variants[].attainment, verdict, percentiles, vs_control.attainment_difference, "
    "p99_ttft_difference, mann_whitney_ttft, segments and anytime's sequences but its clustered and "
    "adjusted ones treat requests as independent draws"
)
NOT_ADJUSTED = (
    "p99 TTFT and the other percentiles are not adjusted: the adjustment subtracts a zero-mean "
    "covariate term, which leaves a mean where it is but moves a quantile to another quantity "
    "(stats.adjusted); they keep their order-statistic intervals"
)
MIRROR_NOTE = (
    "mirror mode: every request went to every variant, so the arms share their requests and "
    "users; differences are paired (vs_control.paired), not clustered or adjusted"
)


@dataclasses.dataclass(frozen=True)
class Metric:
    block: str
    y: str  # the component of the block holding the metric's per-request value
    binary: bool


METRICS: dict[str, Metric] = {
    "attainment": Metric("all", "hits", True),
    "error_rate": Metric("all", "errors", True),
    "mean_ttft_ms": Metric("ttft", "ttft", False),
}
# The key of each metric's difference to the control in vs_control.clustered / .adjusted.
DIFFERENCES = {
    "attainment": "attainment_difference",
    "error_rate": "error_rate_difference",
    "mean_ttft_ms": "mean_ttft_difference",
}


# ---------------------------------------------------------------------------------------------
# The vector v and the flat layout of the query's sums


def _blocks(slo: Slo) -> tuple[list[tuple[str, str | None, list[tuple[str, str]], list[str]]], dict]:
    """[(block, condition, [(component, per-request SQL)], squared components)] and the SQL
    parameters: the components whose per-cluster sums make v (see the module docstring)."""
    hit, params = hit_expr(slo)
    ttft = "assumeNotNull(ttft_ms)"
    x = list(COVARIATES.items())
    pairs = [(a, b) for i, a in enumerate(x) for b in x[i:]]

    def block(ys: list[tuple[str, str]]) -> list[tuple[str, str]]:
        out = [("n", "toFloat64(1)"), *ys]
        out += [(f"x.{name}", expr) for name, expr in x]
        out += [(f"xy.{y}.{name}", f"{expr} * {y_sql}") for y, y_sql in ys for name, expr in x]
        out += [(f"xx.{a}.{b}", f"{ea} * {eb}") for (a, ea), (b, eb) in pairs]
        return out

    every = block([("hits", f"toFloat64({hit})"), ("errors", "toFloat64(outcome != 'ok')")])
    ok = block([("ttft", ttft)]) + [("sq.ttft", f"{ttft} * {ttft}")]
    return [("all", None, every, []), ("ttft", metric_ok("ttft_ms"), ok, ["sq.ttft"])], params


def _metric_of(component: str) -> str | None:
    """The metric a component belongs to alone ("hits" for hits and xy.hits.*), None for the
    ones every metric of the block shares (n, x.*, xx.*)."""
    if component.startswith("xy."):
        return component.split(".")[1]
    return None if component == "n" or component.startswith(("x.", "xx.")) else component


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each number sits in the flat arrays the query (and the rollup) returns:
    counts [clusters, largest] per block; sums [totals of every component, then the products of
    the non-squared components, i <= j], block after block."""

    blocks: tuple[str, ...]
    components: Mapping[str, tuple[str, ...]]  # block -> its components, in order
    total: Mapping[tuple[str, str], int]  # (block, component) -> index in sums
    cross: Mapping[tuple[str, str, str], int]  # (block, a, b), a before b or equal -> index

    def count_index(self, block: str, what: str) -> int:
        return 2 * self.blocks.index(block) + (0 if what == "clusters" else 1)


def layout(slo: Slo | None = None) -> Layout:
    """The flat layout (it depends on the component names only, never on the SLO's values)."""
    blocks, _params = _blocks(slo or Slo(1.0))
    total: dict[tuple[str, str], int] = {}
    cross: dict[tuple[str, str, str], int] = {}
    comps: dict[str, tuple[str, ...]] = {}
    i = 0
    for name, _cond, parts, squares in blocks:
        comps[name] = tuple(c for c, _e in parts)
        for c, _e in parts:
            total[(name, c)] = i
            i += 1
        plain = [c for c, _e in parts if c not in squares]
        for a_i, a in enumerate(plain):
            for b in plain[a_i:]:
                if _metric_of(a) and _metric_of(b) and _metric_of(a) != _metric_of(b):
                    continue  # two metrics' own components: no statistic needs their product
                cross[(name, a, b)] = i
                i += 1
    return Layout(tuple(b[0] for b in blocks), comps, total, cross)


# Every block, in layout order ("all", "ttft").
BLOCKS = layout().blocks


def moments_select(
    f: Filters,
    slo: Slo,
    unit: str,
    head: Sequence[str] = (),
    extra: Sequence[str] = (),
    table: str = SAMPLES,
    blocks: Sequence[str] | None = None,
) -> tuple[str, dict[str, Any]]:
    """SELECT variant[, head...], counts (Array(UInt64)), sums (Array(Float64)) per variant over
    the samples in f: the per-unit moments (module docstring), for the raw reader, the rollup
    build and a rollout step's reading. ``head``: SQL placed before variant (the rollup's build
    id); ``extra``: more conditions on the samples (a rollout step's config revision; their
    parameters are the caller's to add); ``table``: the samples table read (a shard's own,
    SampleStore.unit_shards); ``blocks``: those alone (every one by default), the others zeros."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    chosen = _chosen(blocks)
    parts_of, params = _blocks(slo)
    lay = layout(slo)
    inner: list[str] = []
    names: dict[tuple[str, str], str] = {}
    for name, cond, parts, _squares in parts_of:
        if name not in chosen:
            continue
        for c, expr in parts:
            alias = f"c{len(inner)}"
            names[(name, c)] = alias
            if unit == "user":
                inner.append(f"{'sumIf' if cond else 'sum'}({expr}{f', {cond}' if cond else ''}) AS {alias}")
            else:
                inner.append(f"{f'if({cond}, {expr}, 0)' if cond else expr} AS {alias}")
    counts, sums = _unread(lay, chosen)
    for b_i, name in enumerate(lay.blocks):
        if name in chosen:
            n = names[(name, "n")]
            counts[2 * b_i : 2 * b_i + 2] = [f"toUInt64(countIf({n} > 0))", f"toUInt64(max({n}))"]
    for (name, c), i in lay.total.items():
        if name in chosen:
            sums[i] = f"sum({names[(name, c)]})"
    for (name, a, b), i in lay.cross.items():
        if name in chosen:
            sums[i] = f"sum({names[(name, a)]} * {names[(name, b)]})"
    fw, fparams = from_where(f, extra, table)
    if unit == "user":
        arm, group = "any(variant)", f" GROUP BY {CLUSTER_KEY}"  # one variant per key
    else:
        arm, group = "variant", ""
    sql = (
        f"SELECT {''.join(h + ', ' for h in head)}toString(arm) AS variant, "
        f"[{', '.join(map(str, counts))}] AS counts, [{', '.join(map(str, sums))}] AS sums "
        f"FROM (SELECT {arm} AS arm, {', '.join(inner)} {fw}{group}) GROUP BY arm"
    )
    return sql, {**params, **fparams}


def blocks_of(metrics: Sequence[str]) -> tuple[str, ...]:
    """The blocks holding these metrics (METRICS), in layout order."""
    want = {METRICS[m].block for m in metrics}
    return tuple(b for b in BLOCKS if b in want)


def _chosen(blocks: Sequence[str] | None) -> tuple[str, ...]:
    """``blocks`` checked (None: every block), in layout order."""
    if blocks is None:
        return BLOCKS
    unknown = set(blocks) - set(BLOCKS)
    if unknown or not blocks:
        raise ValueError(f"blocks must be some of {BLOCKS}, got {tuple(blocks)}")
    return tuple(b for b in BLOCKS if b in blocks)


def vector_sums(slo: Slo, blocks: Sequence[str] | None = None) -> tuple[list[str], dict[str, Any]]:
    """The per-unit sums of v's components (of ``blocks``, every one by default) as aggregates
    over the samples, one per component in ``vector_positions`` order, for a query that reads
    setup errors too (a rollout step's kept sums count them apart): every sum is conditioned on
    JUDGED, the "ttft" block's also on a successful TTFT, so the sums are moments_select's inner
    ones. Their SQL parameters."""
    chosen = _chosen(blocks)
    parts_of, params = _blocks(slo)
    out = []
    for name, cond, parts, _squares in parts_of:
        if name in chosen:
            where = f"{JUDGED} AND {cond}" if cond else JUDGED
            out += [f"sumIf({expr}, {where})" for _c, expr in parts]
    return out, params


def vector_positions(blocks: Sequence[str] | None = None) -> dict[tuple[str, str], int]:
    """(block, component) -> its 0-based position in a unit's vector of sums of ``blocks``
    (vector_sums)."""
    chosen = _chosen(blocks)
    return {key: i for i, key in enumerate(k for k in layout().total if k[0] in chosen)}


def _unread(lay: Layout, chosen: tuple[str, ...]) -> tuple[list[str | None], list[str | None]]:
    """The counts and sums arrays of a query over ``chosen`` blocks: zeros in the others' places
    (literal SQL), None where the query computes the number."""
    counts: list[str | None] = []
    for block in lay.blocks:
        counts += [None, None] if block in chosen else ["toUInt64(0)", "toUInt64(0)"]
    sums: list[str | None] = [None] * (len(lay.total) + len(lay.cross))
    for key, i in [*lay.total.items(), *lay.cross.items()]:
        if key[0] not in chosen:
            sums[i] = "toFloat64(0)"
    return counts, sums


def moments_of_vectors(k: str, d: str | None = None, blocks: Sequence[str] | None = None) -> tuple[str, str]:
    """(counts, sums) SELECT expressions, in layout() order, over units whose sums of v (of
    ``blocks``, every one by default) are an Array(Float64) column (vector_sums' order):
    moments_select's outer part; the blocks not read are zeros.

    With ``d``: the moments' increment when units holding ``k`` (kept; an empty array for a unit
    not seen before) gain ``d``: the clusters that are new (k's count 0, d's above 0), the
    largest count after the gain, the totals of d, and per product a*b the sum of
    (k_a + d_a)(k_b + d_b) - k_a k_b. UnitMoments.add of the kept moments and this increment is
    the moments of k + d (an empty array reads 0 at every index)."""
    chosen = _chosen(blocks)
    lay, pos = layout(), vector_positions(chosen)

    def at(col: str, key: tuple[str, str]) -> str:
        return f"{col}[{pos[key] + 1}]"

    def now(key: tuple[str, str]) -> str:
        return at(k, key) if d is None else f"({at(k, key)} + {at(d, key)})"

    counts, sums = _unread(lay, chosen)
    for b_i, block in enumerate(lay.blocks):
        if block in chosen:
            n = (block, "n")
            new = f"{now(n)} > 0" if d is None else f"{at(k, n)} = 0 AND {at(d, n)} > 0"
            counts[2 * b_i : 2 * b_i + 2] = [f"toUInt64(countIf({new}))", f"toUInt64(max({now(n)}))"]
    for key, i in lay.total.items():
        if key[0] in chosen:
            sums[i] = f"sum({at(k if d is None else d, key)})"
    for (block, a, b), i in lay.cross.items():
        if block not in chosen:
            continue
        ka, kb = (block, a), (block, b)
        if d is None:
            sums[i] = f"sum({at(k, ka)} * {at(k, kb)})"
        else:
            sums[i] = f"sum({now(ka)} * {now(kb)} - {at(k, ka)} * {at(k, kb)})"
    return f"[{', '.join(map(str, counts))}]", f"[{', '.join(map(str, sums))}]"


# ---------------------------------------------------------------------------------------------
# One variant's moments


@dataclasses.dataclass(frozen=True)
class UnitMoments:
    """One variant's moments as the query returns them (flat arrays in ``layout()`` order), of
    the blocks read (``blocks``; the others hold zeros)."""

    counts: tuple[int, ...]
    sums: np.ndarray
    blocks: tuple[str, ...] = ()  # () for every block (BLOCKS)

    @classmethod
    def from_row(
        cls, counts: Sequence[Any], sums: Sequence[Any], blocks: Sequence[str] | None = None
    ) -> UnitMoments:
        lay = layout()
        want = (2 * len(lay.blocks), len(lay.total) + len(lay.cross))
        if (len(counts), len(sums)) != want:
            raise ValueError(f"moments row: {len(counts)} counts and {len(sums)} sums, expected {want}")
        chosen = _chosen(blocks)
        return cls(
            tuple(int(c) for c in counts), np.asarray(sums, dtype=float), () if chosen == BLOCKS else chosen
        )

    def read(self) -> tuple[str, ...]:
        """The blocks these moments hold."""
        return self.blocks or BLOCKS

    def add(self, other: UnitMoments) -> UnitMoments:
        """The moments of two disjoint sets of clusters (runs read per request; the shards of a
        cluster whose samples are sharded by the unit, which hold disjoint users): clusters add,
        the largest is the larger, sums add. Not for the users of two runs, who may appear in
        both. Both must hold the same blocks."""
        if self.read() != other.read():
            raise ValueError(f"moments of blocks {self.read()} and {other.read()} do not add")
        counts = [
            a + b if i % 2 == 0 else max(a, b) for i, (a, b) in enumerate(zip(self.counts, other.counts))
        ]
        return UnitMoments(tuple(counts), self.sums + other.sums, self.blocks)

    def arm(self, metric: str, covariates: Sequence[str] = ()) -> ArmMoments | None:
        """stats.clustered.ArmMoments of one metric (METRICS) with these covariates; None when
        the variant has no request in the metric's block (no successful TTFT). A metric whose
        block was not read raises ValueError."""
        m = METRICS[metric]
        if m.block not in self.read():
            raise ValueError(
                f"{metric}: its block {m.block!r} was not read (these moments hold {self.read()})"
            )
        lay = layout()
        clusters = self.counts[lay.count_index(m.block, "clusters")]
        if not clusters:
            return None
        parts = [f"x.{c}" for c in covariates] + [f"xy.{m.y}.{c}" for c in covariates]
        order = list(COVARIATES)
        for i, a in enumerate(covariates):
            for b in covariates[i:]:
                first, second = sorted((a, b), key=order.index)
                parts.append(f"xx.{first}.{second}")
        comps = ["n", m.y, *parts]
        block = lay.components[m.block]
        total = np.array([self.sums[lay.total[(m.block, c)]] for c in comps])
        cross = np.empty((len(comps), len(comps)))
        for i, a in enumerate(comps):
            for j, b in enumerate(comps):
                first, second = sorted((a, b), key=block.index)
                cross[i, j] = self.sums[lay.cross[(m.block, first, second)]]
        sq = None if m.binary else float(self.sums[lay.total[(m.block, f"sq.{m.y}")]])
        return ArmMoments(
            total,
            cross,
            clusters,
            self.counts[lay.count_index(m.block, "largest")],
            sq,
            tuple(covariates),
            m.binary,
        )


def rows_to_moments(
    rows: Sequence[Sequence[Any]], blocks: Sequence[str] | None = None
) -> dict[str, UnitMoments]:
    """{variant: UnitMoments} from (variant, counts, sums) rows (of ``blocks``, every one by
    default); rows of one variant (several rollup builds read per request) are added up."""
    out: dict[str, UnitMoments] = {}
    for variant, counts, sums in rows:
        got = UnitMoments.from_row(counts, sums, blocks)
        out[str(variant)] = out[str(variant)].add(got) if str(variant) in out else got
    return out


def merge(*parts: Mapping[str, UnitMoments]) -> dict[str, UnitMoments]:
    """Moments of disjoint sets of clusters (per-request moments of disjoint runs, per-user
    moments of the shards of a cluster sharded by the unit), added up per variant
    (UnitMoments.add)."""
    out: dict[str, UnitMoments] = {}
    for part in parts:
        for v, um in part.items():
            out[v] = out[v].add(um) if v in out else um
    return out


# ---------------------------------------------------------------------------------------------
# The report's numbers


def _covariates_for(control: ArmMoments, variant: ArmMoments) -> tuple[list[str], dict[str, str]]:
    """The covariates that vary over the two arms' requests, and why the others are left out."""
    used: list[str] = []
    left: dict[str, str] = {}
    n = control.total[0] + variant.total[0]
    for k, name in enumerate(control.covariates):
        sx = control.total[2 + k] + variant.total[2 + k]
        idx = 2 + 2 * control.p + sum(control.p - j for j in range(k))  # ("xx", k, k)
        sxx = control.total[idx] + variant.total[idx]
        mean = sx / n
        spread = math.sqrt(max(sxx / n - mean * mean, 0.0))
        if spread > 1e-9 * abs(mean) and spread > 0:
            used.append(name)
        else:
            left[name] = f"constant over these requests ({mean:g})"
    return used, left


def fit_on_varying(
    control: ArmMoments, variant: ArmMoments, fit: Callable[[ArmMoments, ArmMoments], T]
) -> tuple[T | None, list[str], dict[str, str], str]:
    """``fit`` (an adjusted difference, fixed-horizon or anytime-valid) on the covariates that
    vary over the two arms' requests, collinear ones dropped from the last one back until the
    fit is well posed (it raises ValueError when not): (its result, or None when even no
    covariate fails; the covariates used; {covariate left out: why}; the last error, or "")."""
    used, left = _covariates_for(control, variant)
    while True:
        try:
            return fit(control.select(used), variant.select(used)), used, left, ""
        except ValueError as e:  # collinear (constant ones are already out): drop the last one
            if not used:
                return None, used, left, str(e)
            left[used[-1]] = "collinear with " + (", ".join(used[:-1]) or "the arm (it tells them apart)")
            used = used[:-1]


def adjusted_entry(
    control: ArmMoments, variant: ArmMoments, inference: str, conf: float = DEFAULT_CONF
) -> dict[str, Any]:
    """stats.adjusted.adjusted_difference on the covariates that vary (``fit_on_varying``), as
    the report shows it: labelled with its inference and what it was adjusted on."""
    d, _used, left, error = fit_on_varying(control, variant, lambda c, v: adjusted_difference(c, v, conf))
    if d is None:  # no fit at all: say why rather than fail the whole report
        label = {"covariates": [], "variance_reduction": None, "not_used": left}
        empty = dict.fromkeys(("estimate", "lo", "hi", "se", "se_iid", "p_value", "variance_reduction"))
        return {"inference": inference, "adjusted": label, **empty, "note": error}
    label = {"covariates": list(d.covariates), "variance_reduction": d.variance_reduction, "not_used": left}
    return {
        "inference": inference,
        "adjusted": label,
        **d.as_dict(),
        "covariates": list(d.covariates),
        "theta": list(d.theta),
    }


def _difference_entry(control: ArmMoments, variant: ArmMoments, conf: float) -> dict[str, Any]:
    d = clustered_difference(control, variant, conf).as_dict()
    d.pop("control")
    d.pop("variant")  # the arms' own intervals are in variants[].clustered
    return {"inference": INFERENCE_USER, **d}


def _finite(x: Any) -> Any:
    """NaN and infinities as None, recursively (the report JSON holds finite numbers only)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def statistics(
    moments: Mapping[str, UnitMoments] | None,
    order: Sequence[str],
    control: str,
    modes: Mapping[str, int],
    cluster_by_user: bool,
    adjust: bool,
    conf: float = DEFAULT_CONF,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """(the report's "inference" key, {variant: its "clustered" entry or None}, {variant:
    {"clustered": ..., "adjusted": ...}} for vs_control) from the per-unit moments."""
    unit = "user" if cluster_by_user else "request"
    info: dict[str, Any] = {
        "unit": unit,
        "cluster_by_user": cluster_by_user,
        "adjust": adjust,
        "covariates": list(COVARIATES),
        "request_level": REQUEST_LEVEL,
        "not_adjusted": NOT_ADJUSTED,
        "note": "",
    }
    per_variant: dict[str, Any] = dict.fromkeys(order)
    vs: dict[str, dict[str, Any]] = {}
    if not cluster_by_user and not adjust:
        info["note"] = (
            "off for this experiment (analysis: cluster_by_user false, adjust false): every interval "
            "treats requests as independent draws"
        )
        return info, per_variant, vs
    notes = []
    if cluster_by_user:
        notes.append(
            "clustered: users are the independent unit (the router assigns users); a request "
            "without a user is a unit of its own"
        )
    else:
        notes.append(
            "analysis.cluster_by_user is off: the adjusted differences treat requests as independent"
        )
    notes.append(
        f"adjusted: regression on {', '.join(COVARIATES)} (fixed before the variant sees the request)"
        if adjust
        else "analysis.adjust is off: no adjusted differences"
    )
    moments = moments or {}
    if cluster_by_user:
        for v in order:
            um = moments.get(v)
            if um is None:
                continue
            entry: dict[str, Any] = {"inference": INFERENCE_USER}
            for metric in METRICS:
                arm = um.arm(metric)
                entry[metric] = None if arm is None else clustered_mean(arm, conf).as_dict()
            per_variant[v] = _finite(entry)
    mirror = bool(modes.get("mirror"))
    if mirror:
        notes.append(MIRROR_NOTE)
    others = [v for v in order if v != control and v in moments]
    if control in moments and not mirror:
        inference = INFERENCE_USER if cluster_by_user else INFERENCE_REQUEST
        for v in others:
            comp: dict[str, Any] = {"clustered": None, "adjusted": None}
            if cluster_by_user:
                comp["clustered"] = {"inference": INFERENCE_USER}
            if adjust:
                comp["adjusted"] = {"inference": inference, "note": NOT_ADJUSTED}
            for metric, name in DIFFERENCES.items():
                c_arm, v_arm = moments[control].arm(metric), moments[v].arm(metric)
                if c_arm is None or v_arm is None:
                    for part in ("clustered", "adjusted"):
                        if comp[part] is not None:
                            comp[part][name] = None
                    continue
                if cluster_by_user:
                    comp["clustered"][name] = _difference_entry(c_arm, v_arm, conf)
                if adjust:
                    full = list(COVARIATES)
                    c_full, v_full = moments[control].arm(metric, full), moments[v].arm(metric, full)
                    assert c_full is not None and v_full is not None
                    comp["adjusted"][name] = adjusted_entry(c_full, v_full, inference, conf)
            vs[v] = comp
        _holm(vs)
    info["note"] = "; ".join(notes)
    return info, per_variant, {v: _finite(c) for v, c in vs.items()}


def _holm(vs: Mapping[str, dict[str, Any]]) -> None:
    """Holm-adjusted p-values across variants, per kind and quantity (p_holm), in place."""
    for part in ("clustered", "adjusted"):
        for name in DIFFERENCES.values():
            ps = {
                v: e[name]["p_value"]
                for v, c in vs.items()
                if (e := c.get(part)) and e.get(name) and e[name]["p_value"] is not None
            }
            adjusted = holm_adjust(ps) if ps else {}
            for v, c in vs.items():
                e = c.get(part)
                if e and e.get(name):
                    e[name]["p_holm"] = adjusted.get(v)
