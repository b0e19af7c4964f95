"""Calibrated synthetic prompts: the wanted length on each variant's own tokenizer."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from replay.calibration import CalibratedStreamer, Calibration, LengthModel, calibrate_streamers
from replay.plan import MIRROR, SPLIT, request_id
from replay.prompts import synth_words

SMALL_VOCAB = {"the", "and", "for", "are", "def", "int", "a"}  # " a": the one-token pad


def linear(text: str) -> int:  # one word, one token, plus a BOS
    return 1 + len(text.split())


def subword(text: str) -> int:  # a small vocabulary: word-dependent, 1 or 2 tokens a word, chat template
    return 18 + sum(1 if w in SMALL_VOCAB else 2 for w in text.split())


def merging(text: str) -> int:  # non-additive: "the and" merges into one token; a growing cost
    words = text.split()
    merges = sum(1 for a, b in zip(words, words[1:]) if (a, b) == ("the", "and"))
    return 3 + len(words) + math.isqrt(len(words)) - merges


def padded_only(text: str) -> int:  # every pool word costs 2: odd lengths need the one-token pad
    return sum(1 if w == "a" else 2 for w in text.split())


def counter(fn, calls: list | None = None):
    async def count(texts):
        if calls is not None:
            calls.extend(texts)
        return [fn(t) for t in texts]

    return count


def prepare(fn, wanted, **kw):
    cal = Calibration(counter(fn), **kw)
    return cal, asyncio.run(cal.prepare(wanted))


WANTED = [(seq, tokens) for seq, tokens in enumerate([25, 64, 88, 150, 333, 511, 1000, 47])]


@pytest.mark.parametrize("fn", [linear, subword, merging, padded_only], ids=lambda f: f.__name__)
def test_every_prompt_is_exactly_the_wanted_length_on_the_tokenizer(fn):
    _, book = prepare(fn, WANTED)
    for seq, tokens in WANTED:
        sent = book[seq]
        assert fn(sent.text) == sent.tokens == tokens and not sent.estimated, (fn.__name__, seq, tokens)


def test_the_fitted_line_matches_a_linear_tokenizer_and_guesses_first_time():
    calls: list[str] = []
    cal = Calibration(counter(lambda t: 18 + 2 * len(t.split()), calls))
    book = asyncio.run(cal.prepare([(1, 100), (2, 118)]))
    assert cal.model == pytest.approx(LengthModel(18.0, 2.0))
    assert len(calls) == 3 + 2  # the fit, then one measurement per request
    assert book[1].text == synth_words(1, 41) and book[2].text == synth_words(2, 50)


def test_an_unreachable_length_records_the_closest_measured_one():
    # A chat template of 18 tokens: a 5-token prompt cannot be made; the shortest is sent and
    # its length is known (not estimated), so the row is exact about what was sent.
    _, book = prepare(subword, [(3, 5)])
    assert book[3].tokens == subword(book[3].text) == 18 + (1 if book[3].text in SMALL_VOCAB else 2)
    assert not book[3].estimated


def test_prompts_are_deterministic_and_differ_between_requests():
    _, a = prepare(subword, WANTED)
    _, b = prepare(subword, list(reversed(WANTED)))
    assert {s: p.text for s, p in a.items()} == {s: p.text for s, p in b.items()}
    assert len({p.text[:40] for p in a.values()}) == len(WANTED)  # no shared prefix to cache


def test_without_a_counter_the_estimate_is_todays_one_word_a_token_flagged():
    book = asyncio.run(Calibration(None).prepare([(1, 120)]))
    assert book[1].estimated and book[1].tokens == 120 and book[1].text == synth_words(1, 120)


def test_past_the_budget_requests_get_the_fitted_guess_flagged_estimated():
    calls: list[str] = []
    cal = Calibration(counter(subword, calls), max_requests=2)
    book = asyncio.run(cal.prepare(WANTED))
    assert [book[s].estimated for s, _ in WANTED] == [False, False] + [True] * (len(WANTED) - 2)
    guess = book[WANTED[4][0]]
    assert abs(subword(guess.text) - WANTED[4][1]) <= 0.1 * WANTED[4][1]  # far closer than 1:1
    assert abs(subword(synth_words(4, 333)) - 333) > 100


def test_fit_needs_two_lengths_and_growth():
    with pytest.raises(ValueError, match="two distinct"):
        LengthModel.fit([(5, 10), (5, 11)])
    with pytest.raises(ValueError, match="do not grow"):
        LengthModel.fit([(5, 10), (9, 10)])
    with pytest.raises(ValueError, match="at least 1 token"):
        asyncio.run(Calibration(counter(linear)).prompt(1, 0))


class Recorder:
    def __init__(self):
        self.sent: dict[str, object] = {}
        self.closed = False

    async def stream(self, rid, prompt, max_tokens, extra=None):
        self.sent[rid] = prompt
        return rid

    async def aclose(self):
        self.closed = True


def _requests():
    def req(seq, tokens, **kw):
        return SimpleNamespace(seq=seq, prompt_tokens=tokens, messages=None, prompt=None, **kw)

    text = SimpleNamespace(seq=9, prompt_tokens=0, messages=None, prompt="given text")
    return [req(0, 64), req(1, 200), text]


@pytest.mark.parametrize("mode", [SPLIT, MIRROR])
def test_each_variant_gets_prompts_for_its_own_tokenizer_and_shared_targets_count_once(mode):
    opened: list[tuple] = []

    class FakeCounter:
        def __init__(self, fn):
            self.count, self.closed = counter(fn), False

        async def aclose(self):
            self.closed = True

    async def open_counter(endpoint, model, api):
        opened.append((endpoint, model, api))
        if endpoint == "http://none":
            return None, "HTTP 404"
        return FakeCounter({"http://a": subword, "http://b": linear}[endpoint]), ""

    targets = {
        "a": ("http://a", "m", "chat"),
        "a2": ("http://a", "m", "chat"),
        "b": ("http://b", "m", "chat"),
        "n": ("http://none", "m", "chat"),
    }
    inner = {v: Recorder() for v in targets}
    clients, report = asyncio.run(
        calibrate_streamers(
            inner, _requests(), run_id=7, mode=mode, targets=targets, open_counter=open_counter
        )
    )
    assert sorted(opened) == sorted(set(targets.values()))  # a and a2 share one calibration
    assert all(isinstance(c, CalibratedStreamer) for c in clients.values())

    async def send(variant, seq, prompt):
        return await clients[variant].stream(
            request_id(7, seq, variant if mode == MIRROR else None), prompt, 4
        )

    for variant, fn in (("a", subword), ("a2", subword), ("b", linear)):
        asyncio.run(send(variant, 0, "shared"))
        asyncio.run(send(variant, 9, "given text"))
        (sent_synth, sent_given) = inner[variant].sent.values()
        assert fn(sent_synth) == 64
        assert sent_given == "given text"  # text from a log is never rewritten
    asyncio.run(send("n", 1, "shared"))
    assert list(inner["n"].sent.values()) == [synth_words(1, 200)]
    by = {r.variant: r for r in report}
    assert by["a"].exact == by["b"].exact == 2 and by["a"].mean_abs_error == 0
    assert not by["n"].counted and by["n"].why_not == "HTTP 404" and by["n"].estimated == 2
    asyncio.run(clients["a"].aclose())
    assert inner["a"].closed


def test_a_log_of_texts_needs_no_calibration():
    async def open_counter(*target):
        raise AssertionError("no counter should be opened")

    text_only = [
        SimpleNamespace(seq=1, prompt_tokens=0, messages=({"role": "user", "content": "x"},), prompt=None)
    ]
    clients, report = asyncio.run(
        calibrate_streamers(
            {"a": Recorder()},
            text_only,
            run_id=1,
            mode=SPLIT,
            targets={"a": ("e", "m", "chat")},
            open_counter=open_counter,
        )
    )
    assert report == [] and isinstance(clients["a"], Recorder)


def test_a_counter_failing_midway_falls_back_to_the_estimate_and_the_run_goes_on():
    class Flaky:
        calls = 0

        async def count(self, texts):
            Flaky.calls += 1
            if Flaky.calls > 1:
                raise RuntimeError("POST /tokenize: ReadTimeout")
            return [subword(t) for t in texts]

        async def aclose(self):
            pass

    async def open_counter(*target):
        return Flaky(), ""

    reqs = [SimpleNamespace(seq=1, prompt_tokens=64, messages=None, prompt=None)]
    clients, (rep,) = asyncio.run(
        calibrate_streamers(
            {"a": Recorder()},
            reqs,
            run_id=1,
            mode=SPLIT,
            targets={"a": ("e", "m", "chat")},
            open_counter=open_counter,
        )
    )
    assert rep.estimated == 1 and "ReadTimeout" in rep.why_not
    assert clients["a"].prompts[request_id(1, 1)].text == synth_words(1, 64)
