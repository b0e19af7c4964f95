"""Fingerprints of an answer: enough to tell two answers apart and where they part, without
keeping what they said (pure: the standard library).

A mirror replay sends every request to every variant; the report pairs each variant's answer
with the control's for the same request (analysis.readers.raw ``fidelity_pairs``). Keeping the
texts would put users' answers in the store, so by default only these are kept:

- ``token_fp``: 32 bits per token chunk (one SSE event's text: one token on vLLM unless a
  speculative decoder sends several at once), CRC-32 of the text's UTF-8 bytes started from
  ``TOKEN_SEED`` so that an empty text is not 0 (a missing position in ClickHouse's array
  reads as 0). Two chunks with different texts share a fingerprint with probability 2^-32, so a
  first divergence is found at its exact chunk but for that chance.
- ``output_fp``: 64 bits of BLAKE2b over the whole answer's text, so "identical" does not depend
  on how the server cut the text into chunks. Never 0 (0 means "not fingerprinted").

The position of the first divergence is a chunk position: a token position where each chunk
holds one token (vLLM's streaming without speculative decoding, the simulator), and the
report says which (chunks against the usage's token count).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable

TOKEN_SEED = 0x9E3779B9  # CRC-32's start value: an empty text fingerprints to this, not to 0


def token_fp(text: str) -> int:
    """One token chunk's 32-bit fingerprint."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"), TOKEN_SEED)


def output_fp(texts: Iterable[str]) -> int:
    """The whole answer's 64-bit fingerprint (never 0): the same for the same text however it
    was cut into chunks."""
    h = hashlib.blake2b(digest_size=8)
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little") or 1
