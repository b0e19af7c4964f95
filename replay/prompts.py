"""Deterministic synthetic prompts of a wanted token length. Pure.

The trace gives prompt sizes, not text. With a tokenizer (a callable text -> token count) the
prompt is grown until it has exactly the wanted count when that is reachable; without one the
length is an estimate (one vocabulary word ~ one token for common English words on BPE
tokenizers, and exactly one under the 4-bytes-a-token estimate) and the sample records it as
estimated.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Common three-letter words: one token each on typical BPE vocabularies (with the leading
# space), and exactly four bytes with their separator, so the widespread "4 bytes a token"
# estimate (which the simulator uses) agrees: n words are n tokens either way.
VOCABULARY = (
    "the and for are but not you all any can had her was one our out day get has him his how "
    "man new now old see two way who boy did its let put say she too use def int str var ret "
    "try map set add sum max min len key val obj arr buf end row col"
).split()
assert all(len(w) == 3 for w in VOCABULARY)


# One fixed pool of words, built once per process; a prompt is a slice of it (doubled so any
# start can take up to a pool's worth of words). Slicing is ~100x cheaper than drawing words,
# which matters because the replay builds each prompt on its send path.
_POOL_WORDS = 1 << 15
_POOL = " ".join(random.Random(20231116).choices(VOCABULARY, k=_POOL_WORDS))
_POOL2 = _POOL + " " + _POOL


def synth_words(seq: int, n_words: int) -> str:
    """``n_words`` words for request ``seq``; prefix-stable: the first k words of a prompt are
    the same whatever its length, so the token count grows monotonically with ``n_words``."""
    start = (seq * 2654435761) % _POOL_WORDS * 4
    if n_words <= _POOL_WORDS:
        return _POOL2[start : start + 4 * n_words - 1]
    whole, rest = divmod(n_words, _POOL_WORDS)
    parts = [_POOL2[start : start + 4 * _POOL_WORDS - 1]] * whole
    if rest:
        parts.append(_POOL2[start : start + 4 * rest - 1])
    return " ".join(parts)


def synth_prompt(seq: int, tokens: int, count_tokens: Callable[[str], int] | None = None) -> tuple[str, bool]:
    """Return (text, estimated). ``estimated`` is False when ``count_tokens`` confirmed the length."""
    if tokens < 1:
        raise ValueError(f"prompt length must be at least 1 token, got {tokens}")
    if count_tokens is None:
        return synth_words(seq, tokens), True
    # 1. The longest prefix of words that does not exceed the wanted count (binary search).
    lo, hi = 1, tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(synth_words(seq, mid)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = synth_words(seq, lo)  # a word is at least one token: never more words needed
    # 2. Pad with one-token words until exact (bounded: a tokenizer may merge the padding).
    for _ in range(64):
        got = count_tokens(text)
        if got >= tokens:
            break
        text += " a"
    return text, count_tokens(text) != tokens
