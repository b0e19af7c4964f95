"""Named simulator profiles.

``fp16``, ``awq`` and ``awq-fa2`` echo the design's table: mean TTFT about 142, 99 and 63 ms at
``model.MODERATE_LOAD`` (pinned by tests/simulator/test_model.py). AWQ mostly speeds decode
(memory-bound), FlashAttention-2 mostly speeds prefill (attention-bound). Their answers
(simulator/answers.py): ``fp16`` is the reference (``divergence_rate`` 0); ``awq`` departs from it
on 6% of requests and ``awq-fa2`` on 8%. The three share their text rates, so a request that does
not diverge gets the reference's text exactly. Every other profile has ``divergence_rate`` 0.
Their log-probabilities (simulator/logprobs.py): ``fp16``'s are the model's own (``logit_noise``
0); ``awq`` and ``awq-fa2`` perturb them by the noise whose flips keep a 16-token answer the
reference's as often as their answers do (``logprobs.noise_for``: 0.0069 and 0.0093 nats).

``saturating`` has a known saturation point (capacity tests). ``chaos`` is a fault drill: every
fault kind at a few percent, and each slow fault lasts longer
than the client's deadline for its phase (streaming/client.py ``Timeouts``), so a drill with the
client's default timeouts records every server-side error class (``chaos_faults``).
"""

from __future__ import annotations

from simulator.latency import Faults, Profile
from simulator.logprobs import noise_for
from streaming.client import Timeouts

# How far past the client's deadline a slow fault lasts: a timeout fires, never a late success.
OVER_DEADLINE = 1.5


def chaos_faults(timeouts: Timeouts | None = None, rate: float = 0.02) -> Faults:
    """Every fault kind at ``rate`` (split_utf8 and malformed as before), with the slow kinds
    lasting ``OVER_DEADLINE`` times the deadline of the phase they slow: a stall past
    ``stall_s``, held headers past ``headers_s``, a held first token past ``first_token_s``.
    Server-side outcome of each kind: http_error -> http_5xx, rate_limited -> http_4xx,
    engine_error, stall, disconnect, malformed, slow_headers -> headers_timeout,
    slow_first_token -> first_token_timeout (split_utf8 is valid: ok)."""
    t = timeouts or Timeouts()
    return Faults(
        http_error_rate=rate,
        engine_error_rate=rate,
        stall_rate=rate,
        stall_ms=OVER_DEADLINE * t.stall_s * 1000.0,
        disconnect_rate=rate,
        malformed_rate=rate / 2,
        split_utf8_rate=2.5 * rate,
        slow_headers_rate=rate,
        slow_headers_ms=OVER_DEADLINE * t.headers_s * 1000.0,
        rate_limited_rate=rate,
        slow_first_token_rate=rate,
        slow_first_token_ms=OVER_DEADLINE * t.first_token_s * 1000.0,
    )


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
            description="FP16 weights: mean TTFT ~142 ms at moderate load; the reference answers",
        ),
        Profile(
            name="awq",
            prefill_ms_per_token=0.103,
            prefill_base_ms=4.0,
            decode_base_ms=14.5,
            decode_ms_per_seq=0.2,
            seed=4,
            divergence_rate=0.06,
            logit_noise=noise_for(0.06),
            description="AWQ 4-bit weights: mean TTFT ~99 ms at moderate load; "
            "6% of answers depart from fp16's",
        ),
        Profile(
            name="awq-fa2",
            prefill_ms_per_token=0.062,
            prefill_base_ms=3.0,
            decode_base_ms=13.0,
            decode_ms_per_seq=0.2,
            seed=42,
            divergence_rate=0.08,
            logit_noise=noise_for(0.08),
            description="AWQ + FlashAttention-2: mean TTFT ~63 ms at moderate load; "
            "8% of answers depart from fp16's",
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
            name="saturating",
            prefill_ms_per_token=0.0,
            prefill_base_ms=0.0,
            decode_base_ms=25.0,
            decode_ms_per_seq=0.0,
            max_num_seqs=1,
            description="one request at a time, 25 ms a token: with max_tokens 2 under evenly spaced "
            "arrivals it keeps up to exactly 20 req/s (a known saturation point for capacity tests)",
        ),
        Profile(
            name="chaos",
            prefill_ms_per_token=0.05,
            prefill_base_ms=2.0,
            decode_base_ms=8.0,
            decode_ms_per_seq=0.1,
            multibyte_rate=0.1,
            empty_token_rate=0.02,
            faults=chaos_faults(),
            description="every fault at a few percent, slow ones past the client's deadlines: fault drills",
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
