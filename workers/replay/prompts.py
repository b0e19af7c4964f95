"""Deterministic synthetic prompts of a wanted token length. Pure.

The trace gives prompt sizes, not text. With a tokenizer (a callable text -> token count) the
prompt is grown until it has exactly the wanted count when that is reachable; without one the
length is an estimate (one vocabulary word ~ one token for common English words on BPE
tokenizers) and the sample records it as estimated.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Short, common words: each is a single token for typical BPE vocabularies.
VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will can more out up into do any your what some time about them than only other "
    "new our these two may first then do way could its also after use people made over "
    "def return import class self value list data file code test error print function loop"
).split()


def _word_stream(seq: int, n_words: int) -> list[str]:
    # Prefix-stable: the first k words of a prompt are the same whatever its length, so the
    # token count grows monotonically with the number of words.
    rng = random.Random(seq * 1_000_003)
    return [rng.choice(VOCABULARY) for _ in range(n_words)]


def synth_words(seq: int, n_words: int) -> str:
    return " ".join(_word_stream(seq, n_words))


def synth_prompt(seq: int, tokens: int, count_tokens: Callable[[str], int] | None = None) -> tuple[str, bool]:
    """Return (text, estimated). ``estimated`` is False when ``count_tokens`` confirmed the length."""
    if tokens < 1:
        raise ValueError(f"prompt length must be at least 1 token, got {tokens}")
    words = _word_stream(seq, tokens)  # a word is at least one token: never more words needed
    if count_tokens is None:
        return " ".join(words), True
    # 1. The longest prefix of words that does not exceed the wanted count (binary search).
    lo, hi = 1, tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(words[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    # 2. Pad with one-token words until exact (bounded: a tokenizer may merge the padding).
    for _ in range(64):
        got = count_tokens(text)
        if got >= tokens:
            break
        text += " a"
    return text, count_tokens(text) != tokens
