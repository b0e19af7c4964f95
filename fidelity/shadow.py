"""Shadowing live answers to the control: which requests, what is sent, what a row says (pure:
the standard library).

The live gateway (gateway/shadow.py) re-sends a share of the requests a variant served to the
experiment's control, greedily, and compares the answers by their fingerprints
(fidelity/fingerprints.py). What is decided here:

1. ``sampled(key, share)``: whether a request is shadowed, from a hash of its request id alone,
   versioned (SAMPLE_VERSION): every gateway process decides alike for the same id, whatever
   else it knows, and a change of the rule is a new version, never a silent reshuffle.
2. ``is_greedy(request)``: whether the live request was itself greedy decoding, so that its
   answer as served can be compared with the control's greedy one (``compared='live'``).
   Greedy: ``temperature`` given and below vLLM's sampling epsilon (1e-5; absent is vLLM's
   and OpenAI's default 1.0), one choice (``n`` and ``best_of`` absent or 1) and no beam search.
   At temperature 0 ``top_p``, ``top_k``, ``min_p`` and ``seed`` change nothing; ``logit_bias``,
   the presence, frequency and repetition penalties, ``stop`` and the like change the logits or
   the end deterministically, so they are kept in the shadow and both sides see them.
3. ``shadow_body(request, model)``: the request as re-sent: the same body (messages or prompt,
   max_tokens, stop, penalties, logit_bias, tools, ...) with the given model name, temperature
   0, the fixed seed SHADOW_SEED, one choice, streamed with the usage event, and without the
   parameters that only matter when sampling (SAMPLING_ONLY) or that change the stream's shape
   (logprobs).
4. ``compare(variant, control)``: the row's comparison columns from two answers' fingerprints;
   ``unit`` says whether a chunk position is a token position (one token a chunk on both sides).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from fidelity.compare import compare_tokens

SAMPLE_VERSION = 1
_SAMPLE_SALT = {1: b"abplat-shadow-v1:"}
SHADOW_SEED = (
    1234  # any fixed seed: at temperature 0 it changes nothing, a server that samples anyway repeats
)
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding
# Parameters that matter only when sampling (irrelevant at temperature 0), or that ask for more
# than one answer or for log-probabilities (another stream shape): dropped from a shadow.
SAMPLING_ONLY = ("top_p", "top_k", "min_p", "n", "best_of", "use_beam_search", "logprobs", "top_logprobs")
COMPARED_LIVE, COMPARED_PAIR = "live", "greedy_pair"


def sampled(key: str, share: float, version: int = SAMPLE_VERSION) -> bool:
    """Whether the request whose id is ``key`` is shadowed under ``share`` (0..1): the first 8
    bytes of BLAKE2b(salt + key) as a fraction of 2^64, below ``share``."""
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    digest = hashlib.blake2b(_SAMPLE_SALT[version] + key.encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big") < share * 2.0**64


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def is_greedy(request: Mapping[str, Any]) -> bool:
    """Whether the request was greedy decoding (module docstring, 2)."""
    temperature = _number(request.get("temperature"))
    if temperature is None or temperature >= GREEDY_BELOW:
        return False
    for name in ("n", "best_of"):
        value = request.get(name)
        if value is not None and value != 1:
            return False
    return not request.get("use_beam_search")


def shadow_body(request: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The body re-sent to a variant for a shadow (module docstring, 3)."""
    body = {k: v for k, v in request.items() if k not in SAMPLING_ONLY}
    body.update(
        model=model,
        temperature=0,
        seed=SHADOW_SEED,
        stream=True,
        stream_options={"include_usage": True},
    )
    return body


class Answer(NamedTuple):
    """What a comparison needs of one answer (streaming.result.StreamResult's fields)."""

    token_fps: Sequence[int]  # one per token chunk
    output_fp: int  # the whole text's; 0: not fingerprinted
    output_tokens: int  # the usage event's count, else the chunks'
    usage_reported: bool


class Comparison(NamedTuple):
    identical: int  # 1: the same text
    first_divergence: int  # the chunk position where they part; -1: identical
    unit: str  # "token" when every chunk is one token on both sides, else "chunk"
    variant_tokens: int
    control_tokens: int
    variant_fp: int
    control_fp: int


def _one_token_a_chunk(a: Answer) -> bool:
    return a.usage_reported and a.output_tokens == len(a.token_fps)


def compare(variant: Answer, control: Answer) -> Comparison:
    """The variant's answer against the control's (the reference). Identical is the whole text's
    fingerprint (however the servers cut it into chunks); the first divergence is the first chunk
    position whose fingerprints differ (fidelity.compare.compare_tokens), -1 when identical."""
    identical = variant.output_fp == control.output_fp
    chunks = compare_tokens(control.token_fps, variant.token_fps)
    first = -1 if identical or chunks.first_divergence is None else chunks.first_divergence
    unit = "token" if _one_token_a_chunk(variant) and _one_token_a_chunk(control) else "chunk"
    return Comparison(
        int(identical),
        first,
        unit,
        variant.output_tokens,
        control.output_tokens,
        variant.output_fp,
        control.output_fp,
    )


NOT_COMPARED = Comparison(0, -1, "chunk", 0, 0, 0, 0)  # a shadow that failed: nothing to compare
