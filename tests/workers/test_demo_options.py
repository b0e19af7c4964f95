"""The benches that run the demo run it as `make demo` does (bench_itl's default load)."""

import importlib.util
import pathlib
import sys

from workers import demo

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_itl_replays_the_demos_own_load_by_default():
    spec = importlib.util.spec_from_file_location("bench_itl_under_test", ROOT / "bench" / "bench_itl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert (module.DEMO_LIMIT, module.DEMO_SPEED) == (demo.LIMIT, demo.SPEED)


def test_the_demo_starts_each_search_from_the_main_replays_verdict():
    assert demo.start_rate(met=True) == demo.CAPACITY_MAX_RPS
    assert demo.start_rate(met=False) == demo.CAPACITY_MAX_RPS / 2
    args = demo.capacity_arguments(pathlib.Path("t.csv"), 2000, 2, {"fp16": 64.0, "awq-fa2": 128.0})
    assert args[args.index("--start-rates") + 1] == "fp16=64,awq-fa2=128"
    assert "--start-rates" not in demo.capacity_arguments(pathlib.Path("t.csv"))


def _variant(key, verdict, estimate, control=False):
    return {
        "key": key,
        "control": control,
        "verdict": {"verdict": verdict},
        "attainment": None if estimate is None else {"estimate": estimate},
    }


def test_the_demo_searches_the_control_and_the_variants_that_met():
    got = demo.capacity_candidates(
        [
            _variant("fp16", "misses", 0.87, True),
            _variant("awq", "misses", 0.97),
            _variant("awq-fa2", "meets", 0.999),
        ],
        0.992,
    )
    assert got == {"fp16": demo.CAPACITY_MAX_RPS / 2, "awq-fa2": demo.CAPACITY_MAX_RPS}


def test_when_no_variant_met_the_demo_still_searches_the_closest_one():
    # a burst measured late leaves the best deployment at "not enough data" in the main replay:
    # the search still prices it against the control, from the top when its estimate is above
    # the target, from half when below
    rows = [
        _variant("fp16", "misses", 0.89, True),
        _variant("awq", "misses", 0.97),
        _variant("awq-fa2", "not enough data", 0.9964),
    ]
    assert demo.capacity_candidates(rows, 0.992) == {"fp16": 64.0, "awq-fa2": 128.0}
    rows[2] = _variant("awq-fa2", "not enough data", 0.990)
    assert demo.capacity_candidates(rows, 0.992) == {"fp16": 64.0, "awq-fa2": 64.0}
    # no variant has samples: the control alone
    only = [_variant("fp16", "misses", 0.89, True), _variant("awq", "not enough data", None)]
    assert demo.capacity_candidates(only, 0.992) == {"fp16": 64.0}


def _searched(capacity, upper, limited_by, per_million=None, rates=()):
    cost = {"per_million_requests": per_million, "currency": "USD"} if per_million else None
    return {
        "capacity_rps": capacity,
        "upper_rps": upper,
        "limited_by": limited_by,
        "cost": cost,
        "steps": [{"rate_rps": r} for r in rates],
    }


def test_the_demos_last_line_states_the_ratio_as_the_brackets_allow():
    doc = {
        "ranking": ["awq-fa2", "fp16"],
        "variants": {
            "awq-fa2": _searched(128.0, None, "max_rate", 34.72),
            "fp16": _searched(32.0, 64.0, "steps", 138.89),
        },
    }
    line = demo.capacity_summary(doc, "fp16")
    # awq-fa2 >= 128, fp16 in [32, 64): the ratio is at least 128 / 64, not 128 / 32
    assert line == (
        "awq-fa2 carries at least 128 req/s within the SLA (the most this search sends), at least "
        "2.0x fp16 (fp16 meets it at 32, not at 64 req/s), at 34.72 USD per million requests "
        "(fp16: 138.89)."
    )
    doc["variants"]["awq-fa2"] = _searched(181.0, 215.0, "sla", 12.28)
    assert "2.8x to 6.7x fp16" in demo.capacity_summary(doc, "fp16")  # 181 / 64 and 215 / 32
    doc["variants"]["fp16"] = _searched(None, 8.0, "min_rate", None, rates=(64.0, 32.0, 16.0, 8.0))
    assert demo.capacity_summary(doc, "fp16").endswith(
        "; fp16 met it with confidence at no rate tried (down to 8 req/s), at 12.28 USD per million requests."
    )
    doc["variants"]["awq-fa2"] = _searched(None, 64.0, "min_rate")
    doc["variants"]["fp16"] = _searched(None, 8.0, "min_rate")
    assert (
        demo.capacity_summary(doc, "fp16")
        == "No deployment met the SLA with confidence at any rate the search tried."
    )


def test_a_capacity_the_load_generator_capped_says_so():
    doc = {
        "ranking": ["awq-fa2", "fp16"],
        "variants": {"awq-fa2": _searched(64.0, 128.0, "generator"), "fp16": _searched(32.0, 64.0, "steps")},
    }
    line = demo.capacity_summary(doc, "fp16")
    assert line.startswith(
        "awq-fa2 carries at least 64 req/s within the SLA (the most the load generator sent within its lag limit), "
        "at least 1.0x fp16"
    )


def test_a_control_whose_step_above_was_not_judged_has_no_upper_end():
    # fp16 met at 32; at 64 the replay lagged past its limit, so 64 says nothing about fp16
    doc = {
        "ranking": ["awq-fa2", "fp16"],
        "variants": {
            "awq-fa2": _searched(128.0, None, "max_rate"),
            "fp16": _searched(32.0, 64.0, "generator"),
        },
    }
    line = demo.capacity_summary(doc, "fp16")
    assert line == (
        "awq-fa2 carries at least 128 req/s within the SLA (the most this search sends) (fp16 meets it at 32 "
        "req/s; at 64 the load generator lagged too much to judge)."
    )


def test_the_demos_last_line_and_table_carry_the_answers_identical_to_the_control():
    doc = {
        "search": "halving",
        "seconds": 40.0,
        "target": 0.992,
        "ranking": ["awq-fa2", "fp16"],
        "variants": {
            "awq-fa2": {**_searched(128.0, None, "max_rate", 34.72), "search_s": 20.0},
            "fp16": {**_searched(32.0, 64.0, "steps", 138.89), "search_s": 20.0},
        },
    }
    fid = {"identical": {"estimate": 0.9236}}
    line = demo.capacity_summary(doc, "fp16", {"fp16": None, "awq-fa2": fid})
    assert line.endswith("(fp16: 138.89); 92.4% of its answers identical to fp16's.")
    # nothing compared (a split replay, or rows without fingerprints): the line says nothing of it
    assert "identical" not in demo.capacity_summary(doc, "fp16", {"awq-fa2": {"identical": None}})
    assert "identical" not in demo.capacity_summary(doc, "fp16")
    from workers.management.commands.demo import render_capacity

    table = render_capacity(doc, 4, {"awq-fa2": fid, "fp16": None}, "fp16").splitlines()
    assert "identical" in table[1]
    row = {line.split()[0]: line for line in table[3:]}
    assert " 92.4% " in row["awq-fa2"] and " ref " in row["fp16"]
    from analysis.answer_fidelity import identical_share

    assert identical_share(None) == "-" == identical_share({"identical": None})
