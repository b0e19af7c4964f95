"""How many tokens the simulator counts in a text: its stand-in for a model's tokenizer. Pure.

One rule serves both the generation routes (the prompt length that drives prefill, reported as
``usage.prompt_tokens``) and ``POST /tokenize``, so a client that calibrates on ``/tokenize``
gets exactly what a request then reports, as with real vLLM.

- ``bytes4``: ``ceil(UTF-8 bytes / 4)`` (at least 1), the common "4 bytes a token" estimate; on
  the replay's three-letter word pool (replay/prompts.py) one word is one token.
- ``small-vocab``: a small-vocabulary subword tokenizer (as a tiny model's 2k-entry BPE): a word
  in ``COMMON`` is one token, any other word one token per two characters. On the replay's
  word pool that is about 1.5 tokens a word and varies word by word, so a replay that assumes
  one word a token sends prompts that are too long (what calibration is for).

Chat requests add a template: ``CHAT_BASE`` tokens plus ``CHAT_PER_MESSAGE`` per message, like
vLLM's ``add_generation_prompt`` rendering; completions add one BOS token.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

TOKENIZERS = ("bytes4", "small-vocab")
DEFAULT_TOKENIZER = "bytes4"
CHAT_BASE = 3
CHAT_PER_MESSAGE = 4
BOS = 1

# Half of the replay's word pool plus common English: what a small vocabulary keeps whole.
COMMON = frozenset(
    "the and for are but not you all can was one our out day get has new now two way who "
    "use def int str set add sum max min len key a of to in is it that on with as at by be "
    "this from or an model token".split()
)


def check(rule: str) -> str:
    """``rule`` if known, else ValueError naming the known ones."""
    if rule not in TOKENIZERS:
        raise ValueError(f"unknown simulator tokenizer {rule!r}; known: {', '.join(TOKENIZERS)}")
    return rule


def text_tokens(text: Any, rule: str = DEFAULT_TOKENIZER) -> int:
    """Tokens in one text (a message's content may be a list of parts); 0 for a non-text."""
    if isinstance(text, list):  # content parts
        text = " ".join(str(p.get("text", "")) for p in text if isinstance(p, dict))
    if not isinstance(text, str):
        return 0
    if rule == "bytes4":
        return max(1, math.ceil(len(text.encode()) / 4))
    words = text.split()
    return max(1, sum(1 if w in COMMON else math.ceil(len(w) / 2) for w in words))


def prompt_tokens(rule: str, *, prompt: Any = None, messages: Any = None) -> int:
    """Tokens of a whole request as the engine sees it: the chat template around ``messages``,
    or BOS before ``prompt`` (a string, or a list of token ids taken as they are)."""
    if messages is not None:
        return CHAT_BASE + sum(CHAT_PER_MESSAGE + text_tokens(m.get("content"), rule) for m in messages)
    if isinstance(prompt, list):
        return len(prompt)
    return BOS + text_tokens(prompt, rule)


def token_ids(text: str, count: int) -> list[int]:
    """Stand-in token ids for ``/tokenize``: deterministic, ``count`` of them, in a 2k vocabulary."""
    seed = zlib.crc32(text.encode())
    return [(seed + 7919 * i) % 2048 for i in range(count)]
