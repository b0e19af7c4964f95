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
