"""How far a variant's answer is from the control's, for one request (pure: the standard library).

A serving change that changes the numbers a model computes (a quantization, a KV-cache dtype, an
attention kernel) can change its answers while its latency improves. For one request answered by
the control (the reference) and by a variant (the candidate), with the same prompt, greedy
decoding (temperature 0) and the same seed, these say how the two differ:

1. ``compare_tokens``: whether the outputs are identical, the token position of the first
   divergence (0-based; a prefix of the other diverges where it ends), and the common prefix's
   length. Tokens are compared as given (ids, or texts where ids are not returned). Without
   greedy decoding and a shared seed two answers of the same deployment differ too: then an
   identical share measures the sampling as much as the serving change, and says so only
   against the control compared with itself.
2. ``truncated_kl``: at one position, KL(P || Q) between the reference's next-token distribution
   P and the candidate's Q, each known only through its top-k log-probabilities (vLLM's
   ``logprobs``, or ``prompt_logprobs`` to score the reference's output under the candidate by
   teacher forcing). Both are coarsened to the tokens in both top-k lists plus one bucket for the
   rest of each one's mass: the KL of the coarsened pair, which by the data-processing inequality
   is never above the full KL. ``TRUNCATION`` states it wherever the figure is shown.
3. ``top1_agreement``: over positions where the candidate is teacher-forced on the reference's
   tokens, the share at which the candidate's most likely token is the reference's token
   (vLLM's own tests check the weaker "each side's token is in the other's top-k").
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

TRUNCATION = (
    "top-{k} truncated KL: both distributions coarsened to the tokens in both top-{k} lists plus "
    "one bucket for the rest of each one's mass; never above the full KL"
)
# A log-probability a server reports may round to just above 0 (or a top-k sum to just above 1).
_SLACK = 1e-9


class TokenComparison(NamedTuple):
    identical: bool
    first_divergence: int | None  # 0-based token position; None when identical
    common_prefix: int  # tokens equal from the start
    reference_tokens: int
    candidate_tokens: int


def compare_tokens(reference: Sequence[Hashable], candidate: Sequence[Hashable]) -> TokenComparison:
    """The two outputs token by token (module docstring, 1)."""
    n = min(len(reference), len(candidate))
    prefix = next((i for i in range(n) if reference[i] != candidate[i]), n)
    identical = prefix == n and len(reference) == len(candidate)
    return TokenComparison(identical, None if identical else prefix, prefix, len(reference), len(candidate))


class KL(NamedTuple):
    kl: float  # nats
    shared: int  # tokens in both top-k lists
    k: int  # the larger of the two lists' lengths


def _probabilities(top: Mapping[Hashable, float], where: str) -> dict[Hashable, float]:
    if not top:
        raise ValueError(f"{where}: no log-probabilities")
    probs = {}
    for token, logprob in top.items():
        if not isinstance(logprob, int | float) or math.isnan(logprob) or logprob > _SLACK:
            raise ValueError(f"{where}: log-probability of {token!r} is {logprob!r}, not <= 0")
        probs[token] = math.exp(min(float(logprob), 0.0))
    total = sum(probs.values())
    if total > 1.0 + 1e-6:
        raise ValueError(f"{where}: top log-probabilities sum to probability {total:.6f}, over 1")
    return probs


def truncated_kl(reference: Mapping[Hashable, float], candidate: Mapping[Hashable, float]) -> KL:
    """KL(P || Q) in nats from two top-k log-probability maps {token: logprob} (module
    docstring, 2). Mass of the reference's the candidate cannot produce (the candidate's rest
    empty while the reference's is not) makes the KL infinite, as the full KL would be. Lists
    with no token in common coarsen both to one bucket: KL 0 with ``shared`` 0, which measures
    nothing (a caller shows it as not measured)."""
    p = _probabilities(reference, "reference")
    q = _probabilities(candidate, "candidate")
    shared = [t for t in p if t in q]
    p_rest = max(0.0, 1.0 - sum(p[t] for t in shared))
    q_rest = max(0.0, 1.0 - sum(q[t] for t in shared))
    kl = 0.0
    for pi, qi in [(p[t], q[t]) for t in shared] + [(p_rest, q_rest)]:
        if pi <= 0.0:
            continue
        if qi <= 0.0:
            return KL(math.inf, len(shared), max(len(p), len(q)))
        kl += pi * math.log(pi / qi)
    return KL(max(kl, 0.0), len(shared), max(len(p), len(q)))


def top1_agreement(reference_tokens: Sequence[Hashable], candidate_top1: Sequence[Hashable]) -> float | None:
    """The share of positions at which the candidate's most likely token (teacher-forced on the
    reference's tokens) is the reference's token; None for no position."""
    if len(reference_tokens) != len(candidate_top1):
        raise ValueError(
            f"top1_agreement: {len(reference_tokens)} reference tokens but {len(candidate_top1)} "
            "candidate positions (teacher forcing scores each reference token once)"
        )
    if not reference_tokens:
        return None
    return sum(r == c for r, c in zip(reference_tokens, candidate_top1, strict=True)) / len(reference_tokens)
