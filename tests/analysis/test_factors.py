"""Factor attribution on synthetic experiments with known effects."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.factors import ADDITIVE, SHAPLEY, Cell, attribute_factors, render_attribution
from stats.quantiles import quantile_estimate

BASE = {"quantization": "fp16", "attention": "sdpa"}
LABELS = {"awq": "AWQ", "fa2": "FlashAttention-2"}


def _grid_cells(value_of, rng=None):
    cells = {}
    for q, a in itertools.product(("fp16", "awq"), ("sdpa", "fa2")):
        key = "control" if (q, a) == ("fp16", "sdpa") else f"{q}-{a}"
        cells[key] = Cell({"quantization": q, "attention": a}, value_of(q, a))
    return cells


def test_additive_attainment_effects_are_recovered_by_shapley():
    rng = np.random.default_rng(31)
    n = 200_000
    effect = {"awq": 0.03, "fa2": 0.02}

    def attainment(q, a):
        p = 0.85 + (effect["awq"] if q == "awq" else 0) + (effect["fa2"] if a == "fa2" else 0)
        return rng.binomial(n, p) / n  # what countIf / count would give

    out = attribute_factors(_grid_cells(attainment), "control")["awq-fa2"]
    assert out["method"] == SHAPLEY
    assert out["contributions"]["quantization"] == pytest.approx(0.03, abs=0.003)
    assert out["contributions"]["attention"] == pytest.approx(0.02, abs=0.003)
    assert sum(out["contributions"].values()) == pytest.approx(out["total"], abs=1e-12)
    assert out["residual"] == 0.0


def test_additive_p99_ttft_shifts_are_recovered_from_raw_samples():
    rng = np.random.default_rng(32)
    shift = {"awq": -40.0, "fa2": -25.0}  # ms: both make TTFT faster

    def p99(q, a):
        ttft = rng.lognormal(6.0, 0.3, size=20_000) + 100.0
        ttft += (shift["awq"] if q == "awq" else 0) + (shift["fa2"] if a == "fa2" else 0)
        return quantile_estimate(ttft, 0.99).value

    out = attribute_factors(_grid_cells(p99), "control")["awq-fa2"]
    assert out["contributions"]["quantization"] == pytest.approx(-40.0, abs=20.0)
    assert out["contributions"]["attention"] == pytest.approx(-25.0, abs=20.0)
    assert out["contributions"]["quantization"] < 0 and out["contributions"]["attention"] < 0


def test_shapley_splits_a_pure_interaction_equally():
    # Neither factor helps alone; together they add 6 points.
    values = {("fp16", "sdpa"): 0.80, ("awq", "sdpa"): 0.80, ("fp16", "fa2"): 0.80}
    cells = _grid_cells(lambda q, a: values.get((q, a), 0.86))
    out = attribute_factors(cells, "control")["awq-fa2"]
    assert out["contributions"] == pytest.approx({"quantization": 0.03, "attention": 0.03})
    assert out["shares"] == pytest.approx({"quantization": 0.5, "attention": 0.5})


def test_single_factor_variants_get_the_whole_difference_of_their_factor():
    cells = _grid_cells(lambda q, a: 0.8 + 0.03 * (q == "awq") + 0.02 * (a == "fa2"))
    out = attribute_factors(cells, "control")
    assert out["awq-sdpa"]["contributions"] == pytest.approx({"quantization": 0.03})
    assert out["fp16-fa2"]["levels"] == {"attention": {"control": "sdpa", "variant": "fa2"}}


def _brute_shapley(players, v):
    """Average marginal contribution over every ordering of the players."""
    phi = dict.fromkeys(players, 0.0)
    perms = list(itertools.permutations(players))
    for order in perms:
        seen: frozenset = frozenset()
        for p in order:
            phi[p] += (v[seen | {p}] - v[seen]) / len(perms)
            seen = seen | {p}
    return phi


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 4),
    data=st.data(),
)
def test_shapley_sums_to_the_total_and_equals_the_permutation_definition(k, data):
    factors = [f"f{i}" for i in range(k)]
    values = data.draw(st.lists(st.floats(-1, 1, allow_nan=False), min_size=2**k, max_size=2**k))
    cells = {}
    v = {}
    for mask in range(2**k):
        tags = {f: ("new" if mask >> i & 1 else "old") for i, f in enumerate(factors)}
        key = "control" if mask == 0 else ("variant" if mask == 2**k - 1 else f"cell{mask}")
        cells[key] = Cell(tags, values[mask])
        v[frozenset(f for i, f in enumerate(factors) if mask >> i & 1)] = values[mask]
    out = attribute_factors(cells, "control", ["variant"])["variant"]
    assert out["method"] == SHAPLEY
    assert sum(out["contributions"].values()) == pytest.approx(out["total"], abs=1e-9)
    assert out["contributions"] == pytest.approx(_brute_shapley(factors, v), abs=1e-9)


def _three_factor_cells(value_of, combos):
    cells = {}
    for combo in combos:
        tags = dict(zip(("quantization", "attention", "kv_cache"), combo, strict=True))
        key = "control" if combo == ("fp16", "sdpa", "fp16") else "-".join(combo)
        cells[key] = Cell(tags, value_of(*combo))
    return cells


INCOMPLETE = [
    ("fp16", "sdpa", "fp16"),
    ("awq", "sdpa", "fp16"),
    ("fp16", "fa2", "fp16"),
    ("fp16", "sdpa", "fp8"),
    ("awq", "fa2", "fp8"),
]


def test_incomplete_design_uses_the_additive_model_and_recovers_effects():
    def value(q, a, kv):
        return 0.80 + 0.03 * (q == "awq") + 0.02 * (a == "fa2") - 0.01 * (kv == "fp8")

    out = attribute_factors(_three_factor_cells(value, INCOMPLETE), "control")["awq-fa2-fp8"]
    assert out["method"] == ADDITIVE
    assert out["contributions"] == pytest.approx({"quantization": 0.03, "attention": 0.02, "kv_cache": -0.01})
    assert out["residual"] == pytest.approx(0.0, abs=1e-12)
    text = render_attribution(out, {**LABELS, "fp8": "FP8 KV cache"})
    assert text == "AWQ: 75% of the gain, FlashAttention-2: 50%, FP8 KV cache: -25%"


def test_incomplete_design_with_an_interaction_reports_it_as_residual():
    def value(q, a, kv):
        synergy = 0.04 if (q, a, kv) == ("awq", "fa2", "fp8") else 0.0
        return 0.80 + 0.03 * (q == "awq") + 0.02 * (a == "fa2") + synergy

    out = attribute_factors(_three_factor_cells(value, INCOMPLETE), "control")["awq-fa2-fp8"]
    assert out["method"] == ADDITIVE
    # 5 cells, 4 parameters: the synergy is spread by least squares, the rest is residual.
    assert sum(out["contributions"].values()) + out["residual"] == pytest.approx(out["total"])
    assert out["residual"] != pytest.approx(0.0, abs=1e-6)
    assert "residual" in out["note"]


def test_factors_that_always_change_together_get_one_joint_contribution():
    cells = {
        "control": Cell(BASE, 0.80),
        "both": Cell({"quantization": "awq", "attention": "fa2"}, 0.85),
    }
    out = attribute_factors(cells, "control")["both"]
    assert out["method"] == ADDITIVE
    assert out["contributions"] == pytest.approx({"attention+quantization": 0.05})
    assert "never varied apart" in out["note"]
    assert render_attribution(out, LABELS) == "FlashAttention-2 + AWQ: 100% of the gain"


def test_weights_make_the_larger_duplicate_cell_count_more():
    cells = {
        "control": Cell(BASE, 0.80),
        "awq-a": Cell({"quantization": "awq", "attention": "sdpa"}, 0.90, weight=3),
        "awq-b": Cell({"quantization": "awq", "attention": "sdpa"}, 0.70, weight=1),
        "fa2": Cell({"quantization": "fp16", "attention": "fa2"}, 0.80),
        "both": Cell({"quantization": "awq", "attention": "fa2"}, 0.85),
    }
    out = attribute_factors(cells, "control", ["both"])["both"]
    # v({awq}) = (3 * 0.9 + 0.7) / 4 = 0.85; Shapley: awq (0.05 + 0.05) / 2, fa2 (0 + 0) / 2
    assert out["contributions"] == pytest.approx({"quantization": 0.05, "attention": 0.0})


def test_render_reads_a_drop_in_p99_as_a_gain_when_lower_is_better():
    entry = {
        "total": -100.0,
        "contributions": {"quantization": -60.0, "attention": -40.0},
        "residual": 0.0,
        "levels": {
            "quantization": {"control": "fp16", "variant": "awq"},
            "attention": {"control": "sdpa", "variant": "fa2"},
        },
    }
    assert (
        render_attribution(entry, LABELS, higher_is_better=False)
        == "AWQ: 60% of the gain, FlashAttention-2: 40%"
    )
    assert render_attribution(entry, LABELS).startswith("AWQ: 60% of the loss")


def test_render_says_0_percent_for_a_factor_whose_share_rounds_to_nothing_never_minus_0():
    entry = {
        "total": 100.0,
        "contributions": {"attention": 100.3, "quantization": -0.3},
        "residual": 0.0,
        "levels": {
            "quantization": {"control": "fp16", "variant": "awq"},
            "attention": {"control": "sdpa", "variant": "fa2"},
        },
    }
    assert render_attribution(entry, LABELS) == "FlashAttention-2: 100% of the gain, AWQ: 0%"


def test_variant_with_the_control_levels_has_nothing_to_attribute():
    cells = {"control": Cell(BASE, 0.80), "twin": Cell(BASE, 0.82)}
    out = attribute_factors(cells, "control")["twin"]
    assert out["contributions"] == {} and out["residual"] == pytest.approx(0.02)
    assert "unexplained" in render_attribution(out)


def test_mismatched_factor_tags_are_named():
    cells = {"control": Cell(BASE, 0.8), "odd": Cell({"quantization": "awq"}, 0.9)}
    with pytest.raises(ValueError, match="variant 'odd' has factors \\['quantization'\\]"):
        attribute_factors(cells, "control")
    with pytest.raises(ValueError, match="control 'nope'"):
        attribute_factors(cells, "nope")
    with pytest.raises(ValueError, match="non-finite"):
        attribute_factors({"control": Cell(BASE, math.nan)}, "control")
