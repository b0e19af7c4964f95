"""Synthetic prompts of the trace's length on each variant's own tokenizer. Pure.

A trace row gives a prompt length in tokens, not text; replay/prompts.py grows a prompt from a
word pool, and a word is not one token on every tokenizer (a tiny model's small vocabulary made
64 words 87 tokens, plus 18 of chat template). Calibration asks the variant how many tokens a
text is (``Count``: vLLM's ``/tokenize``, streaming/probe.py) and picks, per request, the word
count whose prompt is exactly the wanted length as the variant will count it (chat template
included), before anything is sent:

1. Fit a line tokens ~ overhead + rate * words from a few measured prompts (``LengthModel``).
2. Per request: start at the line's word count for the wanted length, measure that exact text,
   step by the secant of what was measured, up to ``tries`` measurements; if the length jumps
   over the wanted count (a two-token word), pad the prompt just below with one-token words.
   A prompt that was measured records its measured count (exact even when not the wanted one);
   the measured text is the sent text, so the result is exact by construction.
3. Past ``max_requests`` measured requests (a huge trace), or when the variant cannot count,
   the line's guess (or today's one word a token) is sent and flagged estimated.

The sent length is recorded either way: the server's usage count wins in the sample row
(samples/rows.py) when it reports one, as vLLM and the simulator do.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, Protocol

from replay.plan import MIRROR, request_id
from replay.prompts import synth_words

Count = Callable[[Sequence[str]], Awaitable[list[int]]]  # texts -> tokens as the variant counts them

FIT_WORDS = (8, 64, 256)  # words in the prompts the line is fitted on
FIT_SEQ = 0
PAD = " a"  # one token on every tokenizer seen (BPE, SentencePiece, the simulator's)


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """tokens ~ overhead + rate * words on one variant (least squares over measured points)."""

    overhead: float
    rate: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int]]) -> LengthModel:
        """From (words, tokens) points, at least two distinct word counts; else ValueError."""
        xs = [float(w) for w, _ in points]
        ys = [float(t) for _, t in points]
        if len(set(xs)) < 2:
            raise ValueError(f"LengthModel.fit: need two distinct word counts, got {sorted(set(xs))}")
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        rate = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if rate <= 0:
            raise ValueError(f"LengthModel.fit: tokens do not grow with words ({points})")
        return cls(overhead=my - rate * mx, rate=rate)

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.overhead) / self.rate))

    def tokens_for(self, words: int) -> int:
        return max(1, round(self.overhead + self.rate * words))


IDENTITY = LengthModel(overhead=0.0, rate=1.0)  # today's estimate: one word, one token


@dataclasses.dataclass(frozen=True)
class SentPrompt:
    """What is sent for one request on one variant: its text, its length in the variant's
    tokens (measured, or the model's guess when ``estimated``)."""

    text: str
    tokens: int
    estimated: bool
    words: int = 0  # the text is words(seq, words) + PAD * pad: what a stored plan keeps
    pad: int = 0


class Calibration:
    """Prompts for one variant (or several that share endpoint, model and API)."""

    def __init__(
        self,
        count: Count | None,
        *,
        tries: int = 5,
        max_requests: int = 20_000,
        words: Callable[[int, int], str] = synth_words,
    ) -> None:
        self.count, self.tries, self.max_requests, self.words = count, tries, max_requests, words
        self.model: LengthModel = IDENTITY
        self._cache: dict[str, int] = {}

    async def _measure(self, texts: Sequence[str]) -> list[int]:
        assert self.count is not None
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if todo:
            for text, n in zip(todo, await self.count(todo)):
                self._cache[text] = n
        return [self._cache[t] for t in texts]

    async def fit(self) -> LengthModel:
        """Measure the fit prompts and set ``model``; IDENTITY without a counter."""
        if self.count is not None:
            got = await self._measure([self.words(FIT_SEQ, w) for w in FIT_WORDS])
            self.model = LengthModel.fit(list(zip(FIT_WORDS, got)))
        return self.model

    def estimate(self, seq: int, tokens: int) -> SentPrompt:
        words = self.model.words_for(tokens)
        return SentPrompt(
            self.words(seq, words),
            tokens if self.model is IDENTITY else self.model.tokens_for(words),
            estimated=True,
            words=words,
        )

    async def prompt(self, seq: int, tokens: int) -> SentPrompt:
        """The measured prompt for request ``seq`` closest to ``tokens`` (exact when reachable)."""
        if tokens < 1:
            raise ValueError(f"prompt length must be at least 1 token, got {tokens}")
        seen: dict[int, int] = {}  # words -> tokens, this request
        n = self.model.words_for(tokens)
        for _ in range(self.tries):
            (got,) = await self._measure([self.words(seq, n)])
            seen[n] = got
            if got == tokens:
                return SentPrompt(self.words(seq, n), got, estimated=False, words=n)
            n = self._next(seen, tokens)
            if n in seen:
                break
        below = [w for w, t in seen.items() if t < tokens]
        if below:  # pad the longest prompt under the wanted length with one-token words
            w = max(below, key=lambda k: seen[k])
            text = self.words(seq, w) + PAD * (tokens - seen[w])
            (got,) = await self._measure([text])
            if got == tokens:
                return SentPrompt(text, got, estimated=False, words=w, pad=tokens - seen[w])
        w = min(seen, key=lambda k: (abs(seen[k] - tokens), k))
        return SentPrompt(self.words(seq, w), seen[w], estimated=False, words=w)

    def _next(self, seen: dict[int, int], tokens: int) -> int:
        """The next word count: the secant through the two measured points nearest the wanted
        length (the fitted rate with one point), at least one word away from the last."""
        pts = sorted(seen.items(), key=lambda p: abs(p[1] - tokens))[:2]
        rate = self.model.rate
        if len(pts) == 2 and pts[0][0] != pts[1][0] and pts[0][1] != pts[1][1]:
            rate = max(1e-3, (pts[1][1] - pts[0][1]) / (pts[1][0] - pts[0][0]))
        w, t = pts[0]
        step = round((tokens - t) / rate) or (1 if tokens > t else -1)
        return max(1, w + step)

    async def prepare(self, wanted: Sequence[tuple[int, int]]) -> dict[int, SentPrompt]:
        """seq -> prompt for each (seq, tokens); the first ``max_requests`` measured, the rest
        estimated from the fitted line. Deterministic: the same requests get the same texts."""
        if self.count is None:
            return {seq: self.estimate(seq, tokens) for seq, tokens in wanted}
        await self.fit()
        measured = wanted[: self.max_requests]
        out = dict(
            zip((s for s, _ in measured), await asyncio.gather(*(self.prompt(s, t) for s, t in measured)))
        )
        for seq, tokens in wanted[self.max_requests :]:
            out[seq] = self.estimate(seq, tokens)
        return out


class Counter(Protocol):
    async def count(self, texts: Sequence[str]) -> list[int]: ...
    async def aclose(self) -> None: ...


class Streamer(Protocol):
    async def stream(
        self, request_id: str, prompt: Any, max_tokens: int, extra: Mapping[str, Any] | None = None
    ) -> Any: ...


class CalibratedStreamer:
    """A variant's client that sends the variant's calibrated prompt for each synthetic request
    (looked up by the request's deterministic id) instead of the shared one-word-a-token text."""

    def __init__(self, inner: Streamer, prompts: Mapping[str, SentPrompt]) -> None:
        self.inner, self.prompts = inner, prompts

    def __getattr__(self, name: str) -> Any:  # api, model, endpoint...: the wrapped client's
        return getattr(self.inner, name)

    async def stream(
        self, request_id: str, prompt: Any, max_tokens: int, extra: Mapping[str, Any] | None = None
    ) -> Any:
        sent = self.prompts.get(request_id)
        if sent is not None:
            # The same shape the replay built (replay/shapes.py): one user message for chat.
            prompt = [{"role": "user", "content": sent.text}] if isinstance(prompt, list) else sent.text
        return await self.inner.stream(request_id, prompt, max_tokens, extra)

    async def aclose(self) -> None:
        await self.inner.aclose()  # type: ignore[attr-defined]


@dataclasses.dataclass
class VariantCalibration:
    """For the log and the bench: how a variant's prompts were chosen."""

    variant: str
    counted: bool  # the variant answered /tokenize
    why_not: str
    model: LengthModel
    requests: int
    exact: int  # measured and equal to the trace's length
    estimated: int
    mean_abs_error: float  # |sent - wanted| tokens, measured or guessed


async def plan_prompts(
    requests: Sequence[Any],
    targets: Mapping[str, Hashable],
    open_counter: Callable[..., Awaitable[tuple[Counter | None, str]]],
) -> tuple[dict[str, dict[int, SentPrompt]], list[VariantCalibration]]:
    """Each variant's prompt for every synthetic request (a trace row with a token count and no
    text): of the trace's length on that variant's tokenizer. Runs once per replay, before its
    schedule starts, so the /tokenize calls never make a send late.

    ``targets``: variant -> the arguments of ``open_counter`` (endpoint, model, api); variants
    with equal targets share one calibration. ``open_counter(*target)`` returns (counter, "") or
    (None, why) when the variant cannot count; its prompts are then today's estimate.
    Requests given as text (JSONL logs) are sent as they are, so they are not in the plan.
    """
    wanted = [
        (r.seq, r.prompt_tokens)
        for r in requests
        if r.messages is None and r.prompt is None and r.prompt_tokens > 0
    ]
    if not wanted:
        return {}, []
    books: dict[Hashable, tuple[dict[int, SentPrompt], Calibration, str]] = {}
    for target in dict.fromkeys(targets.values()):
        counter, why = await open_counter(*target)
        try:
            calibration = Calibration(counter.count if counter is not None else None)
            try:
                books[target] = (await calibration.prepare(wanted), calibration, why)
            except Exception as exc:  # noqa: BLE001 - a probe failing midway must not stop the run
                calibration = Calibration(None)
                books[target] = (
                    await calibration.prepare(wanted),
                    calibration,
                    f"{type(exc).__name__}: {exc}",
                )
        finally:
            if counter is not None:
                await counter.aclose()
    plans: dict[str, dict[int, SentPrompt]] = {}
    report = []
    want = dict(wanted)
    for variant, target in targets.items():
        book, calibration, why = books[target]
        plans[variant] = book
        errors = [abs(sent.tokens - want[seq]) for seq, sent in book.items()]
        report.append(
            VariantCalibration(
                variant=variant,
                counted=calibration.count is not None,
                why_not=why,
                model=calibration.model,
                requests=len(book),
                exact=sum(1 for seq, s in book.items() if not s.estimated and s.tokens == want[seq]),
                estimated=sum(1 for s in book.values() if s.estimated),
                mean_abs_error=sum(errors) / len(errors),
            )
        )
    return plans, report


def wrap_streamers(
    clients: Mapping[str, Streamer], plans: Mapping[str, Mapping[int, SentPrompt]], *, run_id: int, mode: str
) -> dict[str, Any]:
    """Each variant's client, sending its planned prompts (found by the request's id)."""
    out: dict[str, Any] = {}
    for variant, client in clients.items():
        book = plans.get(variant)
        if not book:
            out[variant] = client
            continue
        ids = {
            request_id(run_id, seq, variant if mode == MIRROR else None): sent for seq, sent in book.items()
        }
        out[variant] = CalibratedStreamer(client, ids)
    return out


async def calibrate_streamers(
    clients: Mapping[str, Streamer],
    requests: Sequence[Any],
    *,
    run_id: int,
    mode: str,
    targets: Mapping[str, Hashable],
    open_counter: Callable[..., Awaitable[tuple[Counter | None, str]]],
) -> tuple[dict[str, Any], list[VariantCalibration]]:
    """plan_prompts, then wrap_streamers: in one process, for tools and tests."""
    plans, report = await plan_prompts(requests, targets, open_counter)
    if not plans:
        return dict(clients), []
    return wrap_streamers(clients, plans, run_id=run_id, mode=mode), report


def plan_to_json(plans: Mapping[str, Mapping[int, SentPrompt]]) -> dict[str, dict[str, list[int]]]:
    """A plan as JSON (stored with the run): variant -> seq -> [words, pad, tokens, estimated]."""
    return {
        variant: {str(seq): [s.words, s.pad, s.tokens, int(s.estimated)] for seq, s in book.items()}
        for variant, book in plans.items()
    }


def plan_from_json(
    data: Mapping[str, Mapping[str, Sequence[int]]],
    words: Callable[[int, int], str] = synth_words,
    only: Collection[int] | None = None,
) -> dict[str, dict[int, SentPrompt]]:
    """plan_to_json's inverse: the same texts, rebuilt from the pool (deterministic per seq).
    ``only``: just these seqs (a shard rebuilds its own prompts, not the whole run's)."""
    plans: dict[str, dict[int, SentPrompt]] = {}
    for variant, book in data.items():
        out = plans[variant] = {}
        for key, (n_words, pad, tokens, estimated) in book.items():
            seq = int(key)
            if only is not None and seq not in only:
                continue
            text = words(seq, n_words) + PAD * pad
            out[seq] = SentPrompt(text, tokens, bool(estimated), words=n_words, pad=pad)
    return plans
