"""What the simulated model's next-token distributions are, so that vLLM's ``prompt_logprobs`` can
be answered with a known truth (pure: the standard library and the simulator's answers and
tokens).

fidelity/scoring.py teacher-forces the reference's answer through each deployment and compares
their distributions position by position. The model below makes those distributions agree with
the answers the simulator sends (simulator/answers.py), and makes a numerical change perturb
them by a known amount:

1. Support: the model generates the answer vocabulary only (``tokens.ANSWER_TOKENS``); every
   other id (a prompt's pieces, chat template tokens) has probability 0, log-probability -inf
   (which vLLM sends as -9999.0).
2. Anchor: the context ``ids[:j]`` continues the answer of the earliest prompt it extends: the
   smallest s such that ``ids[s:j]`` is the start of the profile's reference answer to the prompt
   ``ids[:s]`` (``answers.reference`` under the key ``answers.prompt_key(prompt=ids[:s])``). s = j
   always qualifies, so a context that continues no answer is a prompt of its own. The anchor's
   key and ``j - s`` (the answer position) key the distribution, and the reference's token there
   is the greedy token. A text prompt's ids are never answer ids (simulator/tokens.py), so for a
   prompt followed by its reference answer, the anchor of every answer position is the prompt:
   the reference's own token is its most likely one there, and after a whole prompt it is the
   first token the server answers to that prompt.
3. Base logits, per (key, position): an rng seeded by both draws a logit for each support token
   from N(0, SPREAD²); the greedy token's logit is then set to the largest other one plus a margin
   drawn from an exponential of mean MARGIN nats. On average the most likely token holds about
   0.42 of the mass and the top 20 about 0.93, as a trained model's might.
4. A numerical change, ``Profile.logit_noise`` > 0: every logit gets independent N(0, noise²)
   noise from an rng seeded by the profile's seed, the key and the position. The base is every
   profile's; where the noise beats the margin, the most likely token changes (a flip).
5. Log-probabilities: log_softmax of the logits, in float64 (vLLM's are float32).
6. ``prompt_logprobs(ids, profile, k)``: vLLM's list, ``None`` first, then per position the
   forced token's log-probability and rank (the number of tokens at least as likely, itself
   included: vLLM's count, so a token of probability 0 ranks ``VOCAB_SIZE``) and the top k
   (ranks 1..k, by log-probability, ties by id).
7. Noise and ``divergence_rate``: in a real model a flip is the teacher-forced trace of a
   departure (a greedy answer departs where a flip falls on its path), and with flips at a rate
   q per position an answer of L tokens keeps the reference's with probability (1 - q)^L. The
   simulator draws its departures apart (simulator/answers.py: a share ``divergence_rate`` of
   requests whatever their length, at a uniform position), so the two agree in rate, not in
   place: ``noise_for`` calibrates them at ``NOMINAL_POSITIONS`` (16, vLLM's default
   max_tokens), (1 - q)^16 = 1 - divergence_rate. q(noise) is ``flip_probability``: the chance that the
   runner-up's noise beats the greedy token's by more than the margin, ½ - exp(x²/2)·Φ̄(x) with
   x = √2·noise / MARGIN (tokens further down add a few percent at large noise; the tests measure
   it). The KL of a small noise is about noise²/2 · (1 - Σp²) nats a position, 0.3 to 0.4
   noise² here (awq ~1.7e-5 nats, awq-fa2 ~2.6e-5).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from simulator import answers, tokens
from simulator.latency import Profile

SPREAD = 2.0  # standard deviation of the base logits, nats
MARGIN = 1.0  # mean lead of the greedy token's logit over the next, nats
NOMINAL_POSITIONS = 16  # the answer length at which noise_for matches divergence_rate
SUPPORT = len(tokens.ANSWER_TOKENS)  # support index i is token id tokens.ANSWER_BASE + i


class Context(NamedTuple):
    key: str  # the anchor prompt's key (module docstring, 2)
    position: int  # the answer position after the anchor
    greedy: int  # support index of the reference's token there


def _greedy_path(key: str, profile: Profile) -> Iterator[int]:
    for text in answers.reference(key, profile):
        yield tokens.answer_id(text) - tokens.ANSWER_BASE


def contexts(ids: Sequence[int], profile: Profile) -> Iterator[Context]:
    """The context of each prefix ``ids[:j]``, j from 1 to len(ids) (module docstring, 2)."""
    keys = answers.prefix_keys(list(ids))
    # Anchors still followed by their answer, earliest first: [s, greedy path, its next token].
    alive: list[list] = []
    for j in range(1, len(ids) + 1):
        path = _greedy_path(keys[j], profile)
        alive.append([j, path, next(path)])
        s, _, greedy = alive[0]
        yield Context(keys[s], j - s, greedy)
        if j < len(ids):
            observed = ids[j] - tokens.ANSWER_BASE
            alive = [a for a in alive if a[2] == observed]
            for a in alive:
                a[2] = next(a[1])


def logits(context: Context, profile: Profile) -> list[float]:
    """The logits over the support (module docstring, 3 and 4)."""
    rng = random.Random(f"logits:{context.key}:{context.position}")
    z = [rng.gauss(0.0, SPREAD) for _ in range(SUPPORT)]
    g = context.greedy
    z[g] = max(z[:g] + z[g + 1 :]) + rng.expovariate(1.0 / MARGIN)
    if profile.logit_noise > 0:
        noise = random.Random(f"noise:{profile.seed}:{context.key}:{context.position}")
        z = [v + noise.gauss(0.0, profile.logit_noise) for v in z]
    return z


def log_softmax(z: Sequence[float]) -> list[float]:
    top = max(z)
    norm = top + math.log(math.fsum(math.exp(v - top) for v in z))
    return [v - norm for v in z]


def distribution(context: Context, profile: Profile) -> list[float]:
    """Log-probabilities over the support, index i for token id ``tokens.ANSWER_BASE + i``."""
    return log_softmax(logits(context, profile))


class Position(NamedTuple):
    token: int  # the token forced at this position
    logprob: float  # its log-probability (-inf outside the support)
    rank: int  # the number of tokens at least as likely, itself included
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, log-probability), by rank


def score_position(logprobs: Sequence[float], token: int, k: int) -> Position:
    """One position of ``prompt_logprobs`` from its distribution (module docstring, 6)."""
    if not 0 <= k <= SUPPORT:
        raise ValueError(f"k={k}: the simulated model has {SUPPORT} tokens with a probability")
    order = sorted(range(SUPPORT), key=lambda i: (-logprobs[i], i))[:k]
    top = tuple((tokens.ANSWER_BASE + i, logprobs[i]) for i in order)
    if tokens.is_answer_id(token):
        lp = logprobs[token - tokens.ANSWER_BASE]
        return Position(token, lp, sum(v >= lp for v in logprobs), top)
    return Position(token, -math.inf, tokens.VOCAB_SIZE, top)


def prompt_logprobs(ids: Sequence[int], profile: Profile, k: int) -> list[Position | None]:
    """vLLM's ``prompt_logprobs`` for the prompt ``ids``: ``None`` for the first token, then each
    token scored in the context before it."""
    out: list[Position | None] = [None]
    for j, context in enumerate(contexts(ids[:-1], profile), start=1):
        out.append(score_position(distribution(context, profile), ids[j], k))
    return out


def flip_probability(noise: float) -> float:
    """Per position, the chance that ``noise`` makes another token than the reference's the most
    likely, counting the runner-up alone (module docstring, 7)."""
    x = math.sqrt(2.0) * noise / MARGIN
    if x > 25.0:  # exp(x²/2) overflows long before; the tail's expansion is exact enough there
        return 0.5 - 1.0 / (x * math.sqrt(2.0 * math.pi)) * (1.0 - 1.0 / x**2)
    return 0.5 - math.exp(x * x / 2.0) * 0.5 * math.erfc(x / math.sqrt(2.0))


def noise_for(divergence_rate: float, positions: int = NOMINAL_POSITIONS) -> float:
    """The ``logit_noise`` whose flips leave an answer of ``positions`` tokens the reference's
    with probability ``1 - divergence_rate`` (module docstring, 7)."""
    if not 0.0 <= divergence_rate < 1.0 or positions < 1:
        raise ValueError(
            f"noise_for: divergence_rate={divergence_rate!r} must be within [0, 1) and "
            f"positions={positions!r} at least 1"
        )
    q = 1.0 - (1.0 - divergence_rate) ** (1.0 / positions)
    if q >= 0.5:
        raise ValueError(
            f"noise_for: divergence_rate={divergence_rate} needs a flip at {q:.3f} of positions; "
            "noise flips at most half of them"
        )
    lo, hi = 0.0, MARGIN
    while flip_probability(hi) < q:
        hi *= 2.0
    for _ in range(100):  # bisection to float precision
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if flip_probability(mid) < q else (lo, mid)
    return hi


CLAMPED = -9999.0  # what vLLM sends for a log-probability of -inf


def _entry(logprob: float, rank: int, token: int) -> dict:
    lp = CLAMPED if logprob == -math.inf else logprob
    return {"logprob": lp, "rank": rank, "decoded_token": tokens.decode(token)}


def as_vllm(positions: Sequence[Position | None]) -> list[dict | None]:
    """``prompt_logprobs`` as vLLM's JSON carries it: per position ``{"<token id>": {"logprob",
    "rank", "decoded_token"}}``, the forced token first with its rank, then the top k with ranks
    1..k. Where the forced token is among them it keeps its first place and takes its place in
    the list as its rank, as vLLM's dict does (simulator/logprobs.py module docstring, 6)."""
    out: list[dict | None] = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        entry = {str(p.token): _entry(p.logprob, p.rank, p.token)}
        for rank, (token, logprob) in enumerate(p.top, start=1):
            entry[str(token)] = _entry(logprob, rank, token)
        out.append(entry)
    return out
