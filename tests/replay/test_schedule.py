"""Arrival processes, shards, deterministic ids and synthetic prompts."""

import statistics

import pytest

from replay import plan
from replay.arrivals import Arrival
from replay.prompts import synth_prompt
from replay.runner import ShardStats


def test_recorded_arrivals_scale_by_speed():
    assert Arrival(mode="recorded", speed=20).offsets([0.0, 2.0, 4.0]) == [0.0, 0.1, 0.2]


def test_poisson_rate_and_reproducible():
    offsets = Arrival(mode="poisson", rate=50, seed=1).offsets([0.0] * 20001)
    assert offsets == Arrival(mode="poisson", rate=50, seed=1).offsets([0.0] * 20001)
    assert offsets[0] == 0.0
    assert 20000 / offsets[-1] == pytest.approx(50, rel=0.03)


def test_gamma_burstiness_shows_in_gap_cv():
    offsets = Arrival(mode="gamma", rate=50, cv=3.0, seed=2).offsets([0.0] * 20001)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(3.0, rel=0.1)
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)


def test_closed_loop_has_no_schedule():
    assert Arrival(mode="closed", concurrency=8).offsets([0.0, 1.0]) is None


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"mode": "warp"}, "mode must be"),
        ({"speed": 0}, "speed must be at least 1e-06"),
        ({"speed": 1e-300}, "speed must be at least"),
        ({"mode": "poisson"}, "rate must be 1e-06 to"),
        ({"mode": "gamma", "rate": 1, "cv": 0}, "cv must be"),
        ({"mode": "gamma", "rate": 1, "cv": 1e300}, "cv must be 0.001 to 1000"),
        ({"mode": "poisson", "rate": 1e9}, "rate must be"),
        ({"mode": "closed"}, "concurrency must be"),
    ],
)
def test_bad_arrival_settings_named(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Arrival(**kwargs)


def test_shards_partition_every_request_exactly_once():
    total = 1003
    cut = plan.shards(total, 4)
    owned = sorted(seq for s in cut for seq in s.seqs(total))
    assert owned == list(range(total))
    assert all(s.owns(seq) for s in cut for seq in s.seqs(total))
    assert len(plan.shards(2, 8)) == 2


def test_request_ids_deterministic_and_distinct_per_mode():
    assert plan.request_id(7, 42) == "r7-42"
    assert plan.request_id(7, 42, "awq") == "r7-42-awq"
    assert plan.expected_samples(8819, "split", 3) == 8819
    assert plan.expected_samples(8819, "mirror", 3) == 26457


def test_synthetic_prompt_exact_length_with_a_tokenizer():
    def count(text: str) -> int:  # a tokenizer that splits long words in two
        return sum(2 if len(w) > 4 else 1 for w in text.split())

    text, estimated = synth_prompt(3, 500, count)
    assert count(text) == 500 and not estimated
    assert synth_prompt(3, 500, count)[0] == text  # deterministic


def test_synthetic_prompt_estimated_without_a_tokenizer():
    text, estimated = synth_prompt(1, 120)
    assert estimated and len(text.split()) == 120
    with pytest.raises(ValueError):
        synth_prompt(1, 0)


def test_synthetic_words_are_prefix_stable_exact_and_long_prompts_work():
    from replay.prompts import _POOL_WORDS, synth_words

    a, b = synth_words(5, 100), synth_words(5, 300)
    assert b.startswith(a) and len(a.split()) == 100 and len(a) == 4 * 100 - 1  # 4 bytes a token
    assert synth_words(6, 100) != a
    huge = synth_words(1, _POOL_WORDS * 2 + 7)
    assert len(huge.split()) == _POOL_WORDS * 2 + 7


def test_shard_lag_quantiles_are_exact_order_statistics():
    stats = ShardStats(lags_ms=[5.0, 1.0, 4.0, 2.0, 3.0], sent=5, recorded=5)
    assert (stats.lag_quantile(0.5), stats.lag_quantile(0.99)) == (3.0, 5.0)  # ranks ceil(2.5), ceil(4.95)
    assert ShardStats().lag_quantile(0.99) == 0.0  # nothing sent yet
    summary = stats.summary()
    assert (summary["lag_p50_ms"], summary["lag_p99_ms"], summary["lag_max_ms"]) == (3.0, 5.0, 5.0)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"mode": "recorded", "rate": 10}, "rate applies to poisson or gamma arrivals, not recorded"),
        (
            {"mode": "closed", "concurrency": 4, "rate": 5},
            "rate applies to poisson or gamma arrivals, not closed",
        ),
        ({"mode": "poisson", "rate": 10, "cv": 3}, "cv applies to gamma arrivals, not poisson"),
        ({"mode": "recorded", "cv": 2}, "cv applies to gamma arrivals, not recorded"),
        ({"mode": "poisson", "rate": 10, "speed": 20}, "speed applies to recorded arrivals, not poisson"),
    ],
)
def test_contradictory_arrival_options_are_rejected_not_ignored(kwargs, says):
    """--rate was silently ignored without --arrival poisson|gamma, --cv with poisson; now refused."""
    with pytest.raises(ValueError, match=says):
        Arrival(**kwargs)


def test_planned_duration_of_each_arrival_process():
    recorded = [0.0, 10.0, 3600.0]
    assert Arrival(mode="recorded", speed=2).duration_s(recorded) == 1800.0
    poisson = Arrival(mode="poisson", rate=10, seed=3)
    assert poisson.duration_s(recorded) == max(poisson.offsets(recorded))
    assert Arrival(mode="closed", concurrency=2).duration_s(recorded) is None
    assert Arrival().duration_s([]) == 0.0


def test_windows_cut_the_schedule_by_time_and_slot_each_request_once():
    offsets = [0.0, 0.4, 1.0, 4.9, 5.0, 5.1, 12.0, 12.5, 29.99]
    cut = plan.window_shards(offsets, len(offsets), 2, 5.0)
    assert [(c.window, c.slot) for c in cut] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (5, 0)]
    assert sorted(p for c in cut for p in c.positions) == list(range(len(offsets)))
    for c in cut:
        assert all(c.start_s <= offsets[p] < c.end_s for p in c.positions)
        assert all(p % 2 == c.slot for p in c.positions)  # the same slot as without windows
        assert list(c.positions) == sorted(c.positions)
    # windows 3 and 4 have no request: no shard (nothing to queue, nothing to wait for)
    assert {c.window for c in cut} == {0, 1, 2, 5}


def test_no_windows_or_closed_loop_is_one_window_per_slot():
    assert plan.window_shards(None, 5, 2, 5.0) == plan.window_shards([0.0] * 5, 5, 2, None)
    one = plan.window_shards(None, 5, 2, 5.0)
    assert [(c.window, c.slot, c.positions) for c in one] == [(0, 0, (0, 2, 4)), (0, 1, (1, 3))]
    assert plan.window_shards([], 0, 3, 5.0) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (([0.0], 1, 0, 5.0), "slot count"),
        (([0.0, 1.0], 1, 1, 5.0), "2 offsets for 1"),
        (([0.0], 1, 1, 0.0), "window_s must be > 0"),
    ],
)
def test_bad_window_cuts_named(args, says):
    with pytest.raises(ValueError, match=says):
        plan.window_shards(*args)
