"""How the simulator tokenizes: its stand-in for a model's tokenizer, counts and ids. Pure.

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

Token ids (``return_token_ids``, ``/tokenize``, prompts given as ids, ``prompt_logprobs``): one
vocabulary of ``VOCAB_SIZE`` ids, ranges in this order, each id naming one token:

1. ``SPECIALS`` (``<s>`` is the BOS a completion prompt starts with; ChatML's ``<|im_start|>``,
   ``<|im_end|>`` and a newline frame a chat) and ``ROLES`` (a chat message's role; another
   role is ``<unk>``).
2. ``ANSWER_TOKENS``: what the simulated model generates (simulator/answers.py: the empty
   token, the word tokens, the multi-byte ones); ``answer_id`` maps an answer's token text to
   its id, so an answer's ids are exactly its token events.
3. ``bytes4`` pieces: a prompt's UTF-8 bytes in chunks of four (the last shorter), a chunk of
   L bytes numbered in bijective base 256, so every id of the range is a byte string of 0..4
   bytes and decodes back to exactly it.
4. ``small-vocab`` pieces: per word, the word itself when in ``COMMON``, else its characters
   two by two; a word's first piece carries a flag for the whitespace before it (decoded as one
   space: runs of whitespace come back as one space). Characters are numbered by code point.

A text prompt's ids are therefore never answer ids: where a scored sequence leaves its prompt
and enters an answer is never ambiguous (simulator/logprobs.py relies on it). The same text
gives the same ids on every simulator with the same rule, and ``prompt_ids`` gives exactly
``prompt_tokens`` of them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

from simulator.answers import VOCABULARY

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

# -- the vocabulary (module docstring, "Token ids") ------------------------------------------
SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "\n")
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, NEWLINE_ID = range(len(SPECIALS))
ROLES = ("system", "user", "assistant", "tool", "developer")
ROLE_BASE = len(SPECIALS)
ANSWER_TOKENS = VOCABULARY
ANSWER_BASE = ROLE_BASE + len(ROLES)
_ANSWER_IDS = {text: ANSWER_BASE + i for i, text in enumerate(ANSWER_TOKENS)}
if len(_ANSWER_IDS) != len(ANSWER_TOKENS):  # a text named twice would have two ids
    raise ImportError("simulator.tokens: the answer vocabulary has a repeated token text")
BYTES_BASE = ANSWER_BASE + len(ANSWER_TOKENS)
# Bijective base 256: the byte strings of length L are numbered from _FIRST[L] on.
_FIRST = [(256**n - 1) // 255 for n in range(6)]  # 0, 1, 257, 65793, 16843009, ...
BYTES_COUNT = _FIRST[5]  # every string of 0..4 bytes
_COMMON_WORDS = tuple(sorted(COMMON))
_PLANE = 0x110000  # code points
CHARS_BASE = BYTES_BASE + BYTES_COUNT
# A small-vocab piece's number: a COMMON word by its index, else its 0..2 code points; times two
# plus the whitespace flag.
_CHAR_CODES = len(_COMMON_WORDS) + 1 + _PLANE + _PLANE * _PLANE
VOCAB_SIZE = CHARS_BASE + 2 * _CHAR_CODES


def check(rule: str) -> str:
    """``rule`` if known, else ValueError naming the known ones."""
    if rule not in TOKENIZERS:
        raise ValueError(f"unknown simulator tokenizer {rule!r}; known: {', '.join(TOKENIZERS)}")
    return rule


def _text(text: Any) -> str | None:
    """A message's content as one text (a list of parts joined); None for a non-text."""
    if isinstance(text, list):  # content parts
        text = " ".join(str(p.get("text", "")) for p in text if isinstance(p, dict))
    return text if isinstance(text, str) else None


def text_tokens(text: Any, rule: str = DEFAULT_TOKENIZER) -> int:
    """Tokens in one text (a message's content may be a list of parts); 0 for a non-text."""
    text = _text(text)
    if text is None:
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


def _bytes4_ids(text: str) -> list[int]:
    data = text.encode("utf-8", "surrogatepass")
    # Every request with a text prompt comes here: the whole chunks in one C call.
    whole = len(data) // 4
    first4 = BYTES_BASE + _FIRST[4]
    ids = [first4 + v for v in struct.unpack(f">{whole}I", data[: 4 * whole])]
    rest = data[4 * whole :]
    if rest or not data:
        ids.append(BYTES_BASE + _FIRST[len(rest)] + int.from_bytes(rest, "big"))
    return ids


def _char_code(piece: str) -> int:
    if piece in COMMON:
        return _COMMON_WORDS.index(piece)
    code = len(_COMMON_WORDS)
    if not piece:
        return code
    if len(piece) == 1:
        return code + 1 + ord(piece)
    return code + 1 + _PLANE + ord(piece[0]) * _PLANE + ord(piece[1])


def _small_vocab_ids(text: str) -> list[int]:
    words = text.split()
    if not words:
        return [CHARS_BASE + 2 * _char_code("")]
    spaced = text[0].isspace()  # the first word has whitespace before it only if the text does
    ids = []
    for word in words:
        pieces = [word] if word in COMMON else [word[i : i + 2] for i in range(0, len(word), 2)]
        for n, piece in enumerate(pieces):
            ids.append(CHARS_BASE + 2 * _char_code(piece) + (spaced and n == 0))
        spaced = True
    return ids


def text_ids(text: Any, rule: str = DEFAULT_TOKENIZER) -> list[int]:
    """The ids of one text under ``rule``: ``text_tokens(text, rule)`` of them (none for a
    non-text)."""
    text = _text(text)
    if text is None:
        return []
    return _bytes4_ids(text) if check(rule) == "bytes4" else _small_vocab_ids(text)


def prompt_ids(rule: str, *, prompt: Any = None, messages: Any = None) -> list[int]:
    """A whole request's ids as the engine sees them, ``prompt_tokens`` of them: BOS and the
    prompt's (a list of ids is taken as it is), or ChatML around ``messages`` (each message
    ``<|im_start|>`` role newline content ``<|im_end|>``, then the generation prompt
    ``<|im_start|>assistant`` newline)."""
    if messages is None:
        return list(prompt) if isinstance(prompt, list) else [BOS_ID, *text_ids(prompt, rule)]
    ids: list[int] = []
    for m in messages:
        ids += [IM_START_ID, _role_id(m.get("role")), NEWLINE_ID]
        ids += text_ids(m.get("content"), rule)
        ids.append(IM_END_ID)
    return ids + [IM_START_ID, _role_id("assistant"), NEWLINE_ID]


def _role_id(role: Any) -> int:
    return ROLE_BASE + ROLES.index(role) if role in ROLES else UNK_ID


def answer_id(text: str) -> int:
    """The id of one of the model's token texts (an answer's token event); KeyError names a
    text outside the answer vocabulary."""
    try:
        return _ANSWER_IDS[text]
    except KeyError:
        raise KeyError(f"{text!r} is not a token the simulated model generates") from None


def is_answer_id(token: int) -> bool:
    return ANSWER_BASE <= token < BYTES_BASE


def _piece_bytes(token: int) -> bytes:
    """A ``bytes4`` piece's bytes (bijective base 256)."""
    code = token - BYTES_BASE
    n = max(i for i in range(5) if _FIRST[i] <= code)
    return (code - _FIRST[n]).to_bytes(n, "big")


def decode(token: int) -> str:
    """The text one id stands for (vLLM's ``decoded_token``): a byte piece that ends inside a
    multi-byte character shows U+FFFD for it, a small-vocab word start its one space."""
    if not 0 <= token < VOCAB_SIZE:
        raise ValueError(f"token id {token} is outside the vocabulary [0, {VOCAB_SIZE})")
    if token < ROLE_BASE:
        return SPECIALS[token]
    if token < ANSWER_BASE:
        return ROLES[token - ROLE_BASE]
    if token < BYTES_BASE:
        return ANSWER_TOKENS[token - ANSWER_BASE]
    if token < CHARS_BASE:
        return _piece_bytes(token).decode("utf-8", "replace")
    code, spaced = divmod(token - CHARS_BASE, 2)
    space = " " if spaced else ""
    if code < len(_COMMON_WORDS):
        return space + _COMMON_WORDS[code]
    code -= len(_COMMON_WORDS) + 1
    if code < 0:
        return space
    chars = [code] if code < _PLANE else list(divmod(code - _PLANE, _PLANE))
    # A lone surrogate cannot be sent as UTF-8: it shows as U+FFFD, as invalid bytes do.
    return space + "".join("\ufffd" if 0xD800 <= c < 0xE000 else chr(c) for c in chars)


def decode_ids(ids: Sequence[int]) -> str:
    """Ids back to text: a ``bytes4`` prompt's exactly, byte pieces joined before decoding."""
    out: list[str] = []
    pending = b""
    for token in ids:
        if BYTES_BASE <= token < CHARS_BASE:
            pending += _piece_bytes(token)
            continue
        if pending:
            out.append(pending.decode("utf-8", "replace"))
            pending = b""
        out.append(decode(token))
    if pending:
        out.append(pending.decode("utf-8", "replace"))
    return "".join(out)
