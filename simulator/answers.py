"""What the simulated model answers: token texts keyed on the prompt, and where a variant departs
from the reference answer (pure: the standard library and the profile).

A serving change that alters the numbers a model computes (AWQ quantization, a kernel) may change
its answers; the platform measures that as fidelity. The simulator models it so:

1. ``prompt_key``: a blake2b digest of the prompt: a completion's token ids as unsigned 64-bit
   big-endian integers (the app passes a ``prompt`` string through its tokenizer,
   simulator/tokens.py, so a text and its ids answer alike), a chat's ``messages`` as canonical
   JSON (sorted keys, compact separators). The same prompt has the same key on every variant.
2. ``answer_key``: what the answer is drawn from, with vLLM's sampling semantics. Greedy decoding
   (``temperature`` below vLLM's 1e-5) answers from the prompt key alone. Sampling (``temperature``
   absent, which is vLLM's default 1.0, or above 0) answers from the prompt key, the temperature
   and the request's ``seed`` when given (same seed, same answer), else the request id (a fresh
   answer per request).
3. ``reference``: the reference answer, token i drawn with the profile's text rule (``token_text``:
   empty tokens at ``empty_token_rate``, multi-byte ones at ``multibyte_rate``, words otherwise)
   from an rng seeded by the answer key alone, neither the profile's seed nor max_tokens: every
   variant shares it, and the answer to a shorter max_tokens is a prefix of a longer one. Each
   token takes exactly two draws whatever its kind, so profiles whose empty or multi-byte rates
   differ give different texts exactly at the positions where their rules pick different kinds
   (``fp16``, ``awq`` and ``awq-fa2`` share the rates, so they share the reference).
4. ``diverges_at``: whether and where a profile's answer departs from the reference. With
   probability ``Profile.divergence_rate`` (a draw seeded by the profile's seed and the answer key,
   so each request is an independent Bernoulli draw and two diverging profiles diverge on
   different requests), at a position uniform over ``range(max_tokens)`` (0-based, counting every
   token event, empty ones included).
5. ``answer``: the tokens a profile sends. Before the departure, the reference's; at it, a
   non-empty text other than the reference's; after it, texts from an rng seeded by the profile's
   seed and the answer key. A request that does not diverge gets exactly the reference.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

from simulator.latency import Profile

WORDS = (
    "the a of to and in is it that for on with as was at by be this from or an are not "
    "model token latency server batch queue prefill decode cache stream request GPU fast slow "
    "test binary icode enum md so per address bu nce iltin ader vo"
).split(" ")
MULTIBYTE = ("你好", "世界", "模型", "延迟", "吞吐", "😀", "🚀", "✨", "café", "naïve", "Ж", "λ")
_WORD_TOKENS = tuple(" " + w for w in WORDS)  # a word token carries its leading space
# Every token text an answer can hold: what the model generates (simulator/tokens.py numbers them).
VOCABULARY = ("", *_WORD_TOKENS, *MULTIBYTE)
# vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding.
GREEDY_BELOW = 1e-5
DEFAULT_TEMPERATURE = 1.0  # vLLM's default when neither the request nor the model says otherwise


class Answer(NamedTuple):
    texts: tuple[str, ...]  # one per token event, empty texts included
    diverged_at: int | None  # 0-based token position of the departure from the reference


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def prompt_key(*, prompt: str | list[int] | None = None, messages: list[Any] | None = None) -> str:
    """The stable key of a request's prompt: give a completion's ``prompt`` or a chat's
    ``messages``. Each form is tagged, so a string, a token-id list and a chat never share one."""
    if (prompt is None) == (messages is None):
        raise ValueError("prompt_key: give exactly one of prompt or messages")
    if messages is not None:
        return _digest(b"chat:" + json.dumps(messages, sort_keys=True, separators=(",", ":")).encode())
    if isinstance(prompt, str):
        return _digest(b"text:" + prompt.encode("utf-8", "surrogatepass"))
    return _digest(b"ids:" + struct.pack(f">{len(prompt)}Q", *prompt))


def prefix_keys(ids: list[int]) -> list[str]:
    """``prompt_key(prompt=ids[:s])`` for every s from 0 to len(ids), in one pass, the digest
    extended id by id (simulator/logprobs.py keys every context of a scored sequence so)."""
    h = hashlib.blake2b(b"ids:", digest_size=16)
    keys = [h.hexdigest()]
    for token in ids:
        h.update(struct.pack(">Q", token))
        keys.append(h.hexdigest())
    return keys


def is_greedy(temperature: float | None) -> bool:
    return temperature is not None and temperature < GREEDY_BELOW


def answer_key(prompt: str, *, temperature: float | None, seed: int | None, request_id: str) -> str:
    """The key the answer is drawn from (module docstring, 2). ``temperature`` None is absent
    (vLLM samples at 1.0); ``seed`` None is absent."""
    if is_greedy(temperature):
        return prompt
    t = DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    source = f"seed:{seed}" if seed is not None else f"rid:{request_id}"
    return _digest(f"sample:{prompt}:{t!r}:{source}".encode("utf-8", "surrogatepass"))


def token_text(profile: Profile, kind: float, pick: float) -> str:
    """One token's text from two uniform draws: ``kind`` chooses empty, multi-byte or a word by
    the profile's rates, ``pick`` the entry of that pool."""
    if kind < profile.empty_token_rate:
        return ""
    if kind < profile.empty_token_rate + profile.multibyte_rate:
        return MULTIBYTE[int(pick * len(MULTIBYTE))]
    return _WORD_TOKENS[int(pick * len(_WORD_TOKENS))]


def _texts(profile: Profile, rng: random.Random) -> Iterator[str]:
    while True:
        kind = rng.random()
        yield token_text(profile, kind, rng.random())


def reference(key: str, profile: Profile) -> Iterator[str]:
    """The reference answer's token texts, without end (module docstring, 3)."""
    return _texts(profile, random.Random(f"answer:{key}"))


def diverges_at(key: str, profile: Profile, max_tokens: int) -> int | None:
    """The 0-based position where this profile's answer departs from the reference, or None
    (module docstring, 4). The first draw alone decides whether, so the decision does not depend
    on max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be at least 1")
    rng = random.Random(f"diverge:{profile.seed}:{key}")
    if rng.random() >= profile.divergence_rate:
        return None
    return rng.randrange(max_tokens)


def _departure(profile: Profile, rng: random.Random, avoid: str) -> str:
    """A non-empty text other than ``avoid``: the profile's rule given that the token is not empty."""
    non_empty = 1.0 - profile.empty_token_rate
    multibyte = profile.multibyte_rate / non_empty if non_empty > 0 else 0.0
    while True:  # each pool has many entries, so a redraw is rare
        pool = MULTIBYTE if rng.random() < multibyte else _WORD_TOKENS
        text = pool[int(rng.random() * len(pool))]
        if text != avoid:
            return text


def answer(key: str, profile: Profile, max_tokens: int) -> Answer:
    """The ``max_tokens`` token texts this profile answers for the answer key ``key``, and where
    they depart from the reference (module docstring, 5)."""
    at = diverges_at(key, profile, max_tokens)
    ref = reference(key, profile)
    if at is None:
        return Answer(tuple(itertools.islice(ref, max_tokens)), None)
    texts = list(itertools.islice(ref, at + 1))
    rng = random.Random(f"diverged:{profile.seed}:{key}")
    texts[at] = _departure(profile, rng, avoid=texts[at])
    texts.extend(itertools.islice(_texts(profile, rng), max_tokens - at - 1))
    return Answer(tuple(texts), at)


def check_temperature(value: Any) -> float | None:
    """A request's ``temperature`` (None when absent); ValueError says why not."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {json.dumps(value)}")
    return float(value)


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's bounds on a request's seed


def check_seed(value: Any) -> int | None:
    """A request's ``seed`` (None when absent); ValueError says why not."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(
            f"seed must be an integer between {SEED_MIN} and {SEED_MAX}, got {json.dumps(value)}"
        )
    return value
