from __future__ import annotations

import dataclasses
import statistics

import pytest

from simulator.latency import (
    MODERATE_LOAD,
    Faults,
    Profile,
    Scheduler,
    Seq,
    poisson_arrivals,
    simulate,
)
from simulator.profiles import PROFILES, get_profile


def ttfts(profile: Profile, rate: float, prompt: int = 512, n: int = 800) -> list[float]:
    seqs = simulate(profile, poisson_arrivals(rate, n, prompt, 128, seed=1))
    return [(s.first_token_at - s.arrival) * 1000 for s in seqs]


@pytest.mark.parametrize("name, target", [("fp16", 142), ("awq", 99), ("awq-fa2", 63)])
def test_profiles_echo_the_design_table_at_moderate_load(name, target):
    load = MODERATE_LOAD
    seqs = simulate(
        get_profile(name),
        poisson_arrivals(load["rate_per_s"], 2000, load["prompt_tokens"], load["max_tokens"], 1),
    )
    mean = statistics.mean((s.first_token_at - s.arrival) * 1000 for s in seqs)
    assert mean == pytest.approx(target, rel=0.05)


def test_ttft_grows_with_load_and_with_prompt_length():
    p = get_profile("awq")
    light, heavy = statistics.mean(ttfts(p, 1.0)), statistics.mean(ttfts(p, 7.0))
    assert heavy > light * 1.3
    short, long_ = statistics.mean(ttfts(p, 2.0, 128)), statistics.mean(ttfts(p, 2.0, 1024))
    assert long_ > short * 2


def test_littles_law_holds_in_the_queue():
    # L = lambda * W for the waiting queue, L measured as a time average of the queue length.
    p = dataclasses.replace(get_profile("fp16"), max_num_seqs=8)
    arrivals = poisson_arrivals(3.0, 1500, 256, 64, seed=3)
    seqs = simulate(p, arrivals)
    span = max(s.finished_at for s in seqs)
    waits = [s.admitted_at - s.arrival for s in seqs]
    lam = len(seqs) / span
    # time-average queue length by integrating the step function of arrivals/admissions
    events = sorted([(s.arrival, 1) for s in seqs] + [(s.admitted_at, -1) for s in seqs])
    area, depth, last = 0.0, 0, 0.0
    for t, d in events:
        area += depth * (t - last)
        depth, last = depth + d, t
    assert statistics.mean(waits) > 0.05  # the queue is really used at this load
    assert area / span == pytest.approx(lam * statistics.mean(waits), rel=1e-6)


def test_running_batch_never_exceeds_max_num_seqs():
    p = dataclasses.replace(get_profile("fast"), max_num_seqs=3)
    sched = Scheduler(p)
    for _ in range(10):
        sched.add(Seq(prompt_tokens=10, max_tokens=5))
    now = 0.0
    while (step := sched.plan(now)) is not None:
        assert len(step.batch) <= 3
        now += step.duration_s
        sched.complete(step, now)
    assert not sched.waiting


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    p = dataclasses.replace(get_profile("fast"), chunked_prefill_tokens=100)
    sched = Scheduler(p)
    seq = Seq(prompt_tokens=250, max_tokens=2)
    sched.add(seq)
    steps = 0
    now = 0.0
    while seq.first_token_at is None:
        step = sched.plan(now)
        assert sum(n for _, n in step.prefill) <= 100
        now += step.duration_s
        sched.complete(step, now)
        steps += 1
    assert steps == 3


def test_aborted_sequence_leaves_the_batch():
    sched = Scheduler(get_profile("fast"))
    a, b = Seq(prompt_tokens=5, max_tokens=100), Seq(prompt_tokens=5, max_tokens=100)
    sched.add(a)
    sched.add(b)
    step = sched.plan(0.0)
    sched.complete(step, step.duration_s)
    sched.abort(a)
    assert sched.plan(1.0).batch == [b]


def test_fault_draw_follows_the_rates_and_rejects_bad_ones():
    f = Faults(stall_rate=0.25, disconnect_rate=0.25)
    assert [f.draw(u) for u in (0.1, 0.3, 0.6)] == ["stall", "disconnect", ""]
    with pytest.raises(ValueError, match="add up to"):
        Faults(stall_rate=0.6, disconnect_rate=0.6)
    with pytest.raises(ValueError, match="malformed_rate"):
        Faults(malformed_rate=-0.1)


def test_bad_profiles_and_unknown_names_are_rejected_clearly():
    with pytest.raises(ValueError, match="max_num_seqs"):
        dataclasses.replace(get_profile("fast"), max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown simulator profile 'nope'"):
        get_profile("nope")
    assert get_profile(None).name == "default"
    assert {"default", "fp16", "awq", "awq-fa2"} <= set(PROFILES)
