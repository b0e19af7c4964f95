"""Short questions to a variant before a replay measures it: how many tokens is this prompt?

vLLM serves ``POST /tokenize`` at the server root (not under /v1): ``{"model", "prompt"}`` counts
a completions prompt with its special tokens (BOS), ``{"model", "messages"}`` counts a chat
request through the model's chat template with the generation prompt, exactly as the
generation routes then report in ``usage.prompt_tokens``; the answer is ``{"count", "tokens",
"max_model_len"}``. The simulator serves the same route (simulator/tokens.py).

Every call has a short timeout: a probe must never hold up a replay. A variant that has no
``/tokenize`` (another server, a proxy that hides it) gets ``None`` from ``token_counter`` and the
replay falls back to its estimate, flagged ``prompt_tokens_estimated``.

Counts are kept for ``COUNT_TTL_S`` per process (``CountCache``), keyed by the tokenize URL,
model, API and a digest of the text: a capacity search replays the same requests at step after
step, and each step's prompt plan (replay/calibration.py) would otherwise ask for the same 2,000
counts again (3.6 s a step on the demo's simulators). The liveness probe that opens a counter is
never answered from it. A variant redeployed under the same URL and model name with another
tokenizer is counted afresh after the TTL at most; meanwhile the server's own usage count still
wins in each sample (samples/rows.py).

With ``allow`` the probe dials only addresses the variant allowlist accepts (as the variant
client does); a refusal is a ProbeError like any other unusable answer. ``headers`` carry the
variant's Authorization and are never part of an error message.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import httpx

from streaming.client import APIS
from streaming.egress import Allowlist, EgressRefused
from streaming.endpoint import Endpoint
from streaming.transports import egress_client

PROBE_TIMEOUT_S = 5.0
PROBE_CONCURRENCY = 8  # tokenize calls in flight per variant: a probe, not a load test
COUNT_TTL_S = 600.0
COUNT_CACHE_ENTRIES = 200_000  # ~100 B each: a digest key, a count


class CountCache:
    """Token counts by (url, model, api, text digest), each kept ``ttl_s``; least recently used
    out past ``entries``. Thread-safe: replays run loops in several threads of one process."""

    def __init__(
        self,
        ttl_s: float = COUNT_TTL_S,
        entries: int = COUNT_CACHE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.entries, self.clock = ttl_s, entries, clock
        self._items: OrderedDict[tuple[str, str, str, bytes], tuple[float, int, int | None]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def key(url: str, model: str, api: str, text: str) -> tuple[str, str, str, bytes]:
        return (
            url,
            model,
            api,
            hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest(),
        )

    def get(self, key: tuple[str, str, str, bytes]) -> tuple[int, int | None] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or self.clock() - item[0] > self.ttl_s:
                if item is not None:
                    del self._items[key]
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[1], item[2]

    def put(self, key: tuple[str, str, str, bytes], count: int, max_model_len: int | None) -> None:
        with self._lock:
            self._items[key] = (self.clock(), count, max_model_len)
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0


COUNTS = CountCache()


class ProbeError(RuntimeError):
    """The variant answered a probe with something unusable (status, shape, timeout)."""


class TokenCounter:
    """Counts tokens of user prompts on one variant, as that variant's API will send them.

    ``count(texts)`` returns one count per text: for a ``chat`` variant the text is the single
    user message's content (the chat template's tokens included), for ``completions`` the prompt.
    """

    def __init__(
        self,
        endpoint: str,
        model: str,
        api: str,
        *,
        verify: bool | str | ssl.SSLContext = True,
        timeout_s: float = PROBE_TIMEOUT_S,
        concurrency: int = PROBE_CONCURRENCY,
        allow: Allowlist | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if api not in APIS:
            raise ValueError(f"api {api!r}: must be one of {sorted(APIS)}")
        # /tokenize lives at the server's root, not under /v1
        self.url, self.model, self.api = Endpoint.parse(endpoint).root + "/tokenize", model, api
        self.max_model_len: int | None = None
        self.calls = 0
        self._slots = asyncio.Semaphore(concurrency)
        self._client = egress_client(
            allow=allow,
            verify=verify,
            timeout_s=timeout_s,
            headers={**(headers or {}), "accept": "application/json"},
        )

    def body(self, text: str) -> dict:
        if self.api == "chat":
            return {"model": self.model, "messages": [{"role": "user", "content": text}]}
        return {"model": self.model, "prompt": text}

    async def count_one(self, text: str, *, fresh: bool = False) -> int:
        """Tokens of one prompt (from ``COUNTS`` when counted lately, unless ``fresh``);
        ProbeError when the answer is unusable."""
        key = CountCache.key(self.url, self.model, self.api, text)
        if not fresh:
            known = COUNTS.get(key)
            if known is not None:
                if known[1] is not None:
                    self.max_model_len = known[1]
                return known[0]
        async with self._slots:
            self.calls += 1
            try:
                resp = await self._client.post(self.url, json=self.body(text))
            except (httpx.HTTPError, EgressRefused) as exc:
                raise ProbeError(f"POST {self.url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise ProbeError(f"POST {self.url}: HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
            count = data["count"]
        except (ValueError, KeyError, TypeError):
            raise ProbeError(f"POST {self.url}: not a tokenize answer: {resp.text[:200]}") from None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ProbeError(f"POST {self.url}: count {count!r} is not a token count")
        if isinstance(data.get("max_model_len"), int):
            self.max_model_len = data["max_model_len"]
        COUNTS.put(key, count, self.max_model_len)
        return count

    async def count(self, texts: Sequence[str]) -> list[int]:
        """One count per text, at most ``concurrency`` calls in flight."""
        return list(await asyncio.gather(*(self.count_one(t) for t in texts)))

    async def aclose(self) -> None:
        await self._client.aclose()


async def token_counter(
    endpoint: str,
    model: str,
    api: str,
    *,
    verify: bool | str = True,
    timeout_s: float = PROBE_TIMEOUT_S,
    allow: Allowlist | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[TokenCounter | None, str]:
    """A counter for the variant if its ``/tokenize`` answers a test prompt, else (None, why)."""
    counter = TokenCounter(
        endpoint, model, api, verify=verify, timeout_s=timeout_s, allow=allow, headers=headers
    )
    try:
        await counter.count_one("hello", fresh=True)  # is /tokenize there now: never the cache
    except ProbeError as exc:
        await counter.aclose()
        return None, str(exc)
    return counter, ""
