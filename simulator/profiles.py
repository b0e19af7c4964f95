"""Named simulator profiles.

``fp16``, ``awq`` and ``awq-fa2`` echo the design's table: mean TTFT about 142, 99 and 63 ms at
``model.MODERATE_LOAD`` (pinned by tests/simulator/test_model.py). AWQ mostly speeds decode
(memory-bound), FlashAttention-2 mostly speeds prefill (attention-bound).
"""

from __future__ import annotations

from simulator.latency import Faults, Profile

DEFAULT = "default"

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="default",
            prefill_ms_per_token=0.08,
            prefill_base_ms=3.0,
            decode_base_ms=12.0,
            decode_ms_per_seq=0.15,
            multibyte_rate=0.05,
            description="a mid-range GPU; no faults",
        ),
        Profile(
            name="fp16",
            prefill_ms_per_token=0.138,
            prefill_base_ms=4.0,
            decode_base_ms=20.0,
            decode_ms_per_seq=0.2,
            seed=16,
            description="FP16 weights: mean TTFT ~142 ms at moderate load",
        ),
        Profile(
            name="awq",
            prefill_ms_per_token=0.103,
            prefill_base_ms=4.0,
            decode_base_ms=14.5,
            decode_ms_per_seq=0.2,
            seed=4,
            description="AWQ 4-bit weights: mean TTFT ~99 ms at moderate load",
        ),
        Profile(
            name="awq-fa2",
            prefill_ms_per_token=0.062,
            prefill_base_ms=3.0,
            decode_base_ms=13.0,
            decode_ms_per_seq=0.2,
            seed=42,
            description="AWQ + FlashAttention-2: mean TTFT ~63 ms at moderate load",
        ),
        Profile(
            name="fast",
            prefill_ms_per_token=0.002,
            prefill_base_ms=0.5,
            decode_base_ms=1.0,
            decode_ms_per_seq=0.01,
            multibyte_rate=0.2,
            empty_token_rate=0.05,
            description="near-instant, for tests and client benchmarks",
        ),
        Profile(
            name="chaos",
            prefill_ms_per_token=0.05,
            prefill_base_ms=2.0,
            decode_base_ms=8.0,
            decode_ms_per_seq=0.1,
            multibyte_rate=0.1,
            empty_token_rate=0.02,
            faults=Faults(
                http_error_rate=0.02,
                engine_error_rate=0.02,
                stall_rate=0.02,
                stall_ms=1500.0,
                disconnect_rate=0.02,
                malformed_rate=0.01,
                split_utf8_rate=0.05,
                slow_headers_rate=0.02,
                slow_headers_ms=1500.0,
            ),
            description="every fault at a few percent, for dashboards and alerting demos",
        ),
    )
}


def get_profile(name: str | None) -> Profile:
    name = name or DEFAULT
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown simulator profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None
