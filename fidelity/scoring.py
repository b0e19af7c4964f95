"""Teacher forcing: the control's answer scored under a deployment, position by position (pure:
the standard library).

Two deployments' greedy answers to one request part at the first token where their numbers tip
another way (compare.compare_tokens); after that their next-token distributions condition on
different texts and cannot be compared. So the reference's (the control's) answer is fed to each
deployment as a prompt, and each one's next-token distribution is read at every answer position:
both conditioned on the same tokens, then compared (compare.truncated_kl, compare.top1_agreement).

Against a vLLM OpenAI-compatible server (the names and shapes of vLLM 0.32's completions API,
vllm/entrypoints/openai/completion/protocol.py and serving.py):

1. ``answer_request``: the reference's greedy answer as token ids: ``temperature: 0`` and
   ``return_token_ids: true``, so the choice carries ``prompt_token_ids`` (the prompt as the
   server tokenized it) and ``token_ids`` (the answer); ``parse_answer`` reads them.
   ``chat_answer_request`` asks the chat API the same (vLLM's chat completions take
   ``return_token_ids`` too and put ``prompt_token_ids`` beside the choices: the messages with
   the server's chat template applied), so a chat request is scored as the token ids the server
   actually generated from.
2. ``scoring_request``: the completions API with ``prompt`` the token ids prompt + answer,
   ``max_tokens: 1``, ``temperature: 0`` and vLLM's extra parameter ``prompt_logprobs: k``
   (not streamed: vLLM refuses prompt_logprobs with ``stream: true``; k at most the server's
   ``--max-logprobs``, 20 by default). The choice's ``prompt_logprobs`` is a list with one entry
   per prompt token: ``null`` for the first, then ``{"<token id>": {"logprob": float, "rank":
   int, "decoded_token": str}}`` holding the prompt token at that position (rank: 1 + the number
   of tokens more likely) and the k most likely tokens (ranks 1..k, their places in vLLM's top-k
   list: of tied tokens one ranks after the other); k entries when the prompt token is among
   them (its rank then its place in the list), k + 1 otherwise. vLLM computes them from the raw logits
   (log_softmax in float32, before any sampling parameter) and, for such a request, does not
   read the prefix cache, so every position is computed. A log-probability of -inf is sent as
   -9999.0.
3. ``parse_scoring``: per answer position the forced token's log-probability and rank and the
   top-k ``{token id: logprob}``, or a ValueError naming what is wrong and where.
4. ``score``: per position the top-k truncated KL(reference || candidate) (compare.TRUNCATION),
   their mean and maximum over the positions that measure something (a position whose two
   top-k lists share no token measures nothing: compare.truncated_kl), the candidate's top-1
   agreement with the reference's tokens (a position agrees where no token is strictly more
   likely than the forced token: a tie for first agrees), and the reference's with its own
   (1.0 when the answer is the reference's greedy answer and the server computes the same
   numbers when it scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from fidelity.compare import KL, TRUNCATION, top1_agreement, truncated_kl

PARAMETER = "prompt_logprobs"  # vLLM's extra request parameter, and the choice's field


def _ids(ids: Any, what: str) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ValueError(f"{what}: a list of token ids is required, got {type(ids).__name__}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
    if bad:
        raise ValueError(f"{what}: token ids are non-negative integers, got {bad[0]!r}")
    return list(ids)


def answer_request(
    model: str, prompt: str | Sequence[int], max_tokens: int, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The body of a greedy /v1/completions request whose answer comes back as token ids
    (``extra``: further parameters, e.g. ``ignore_eos``, ``seed``)."""
    if not isinstance(prompt, str):
        prompt = _ids(prompt, "prompt")
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
        "return_token_ids": True,
    }
    return body | dict(extra or {})


def chat_answer_request(
    model: str, messages: Sequence[Mapping[str, Any]], max_tokens: int, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The body of a greedy /v1/chat/completions request whose answer and templated prompt come
    back as token ids."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: a non-empty list of message objects is required")
    body = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
        "return_token_ids": True,
    }
    return body | dict(extra or {})


class Answer(NamedTuple):
    prompt_ids: tuple[int, ...]  # the prompt as the server tokenized it
    answer_ids: tuple[int, ...]
    finish_reason: str | None


def _choice(response: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(response, Mapping):
        raise ValueError(f"{what}: the response is a {type(response).__name__}, not a JSON object")
    if "error" in response:
        raise ValueError(f"{what}: the server answered an error: {response['error']!r:.300}")
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise ValueError(f"{what}: 'choices' must hold exactly one object, got {choices!r:.200}")
    return choices[0]


def parse_answer(response: Any) -> Answer:
    """The prompt's and the answer's token ids from the response to ``answer_request`` (in the
    choice) or ``chat_answer_request`` (the prompt's beside the choices)."""
    choice = _choice(response, "answer")
    prompt_ids, where = choice.get("prompt_token_ids"), "choices[0].prompt_token_ids"
    if prompt_ids is None and response.get("object") == "chat.completion":
        prompt_ids, where = response.get("prompt_token_ids"), "prompt_token_ids"
    for field, value in (("prompt_token_ids", prompt_ids), ("token_ids", choice.get("token_ids"))):
        if value is None:
            raise ValueError(
                f"answer: the response has no {field!r}: the server ignored return_token_ids "
                "(not vLLM, or a vLLM older than the parameter)"
            )
    return Answer(
        tuple(_ids(prompt_ids, f"answer: {where}")),
        tuple(_ids(choice["token_ids"], "answer: choices[0].token_ids")),
        choice.get("finish_reason"),
    )


def _k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: a positive number of log-probabilities per position, got {k!r}")
    return k


def scoring_request(
    model: str, prompt_ids: Sequence[int], answer_ids: Sequence[int], k: int
) -> dict[str, Any]:
    """The body that has a vLLM server score ``answer_ids`` after ``prompt_ids`` (module
    docstring, 2)."""
    prompt, answer = _ids(prompt_ids, "prompt_ids"), _ids(answer_ids, "answer_ids")
    if not prompt:
        raise ValueError("prompt_ids: empty; the first token has no distribution to score")
    if not answer:
        raise ValueError("answer_ids: empty; there is nothing to score")
    return {
        "model": model,
        "prompt": prompt + answer,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        PARAMETER: _k(k),
    }


class Position(NamedTuple):
    token: int  # the reference's token, forced here
    logprob: float  # its log-probability under this deployment
    rank: int  # 1 + the number of tokens this deployment finds more likely
    top: dict[int, float]  # the k most likely tokens, by rank: {token id: logprob}

    @property
    def top1(self) -> int:
        return next(iter(self.top))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _position(entry: Any, token: int, k: int, where: str) -> Position:
    if not isinstance(entry, Mapping) or not entry:
        raise ValueError(f"{where}: expected an object of token ids, got {entry!r:.200}")
    parsed: dict[int, tuple[float, int]] = {}
    for key, value in entry.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: key {key!r} is not a token id") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: token {tid}: expected an object with logprob and rank")
        logprob, rank = value.get("logprob"), value.get("rank")
        if not _number(logprob) or logprob > 1e-9:
            raise ValueError(f"{where}: token {tid}: logprob {logprob!r} is not a number <= 0")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{where}: token {tid}: rank {rank!r} is not an integer >= 1")
        parsed[tid] = (float(logprob), rank)
    if token not in parsed:
        raise ValueError(f"{where}: the forced token {token} is missing (the server scored other tokens)")
    if len(parsed) == k + 1:  # the forced token is outside the top k
        top = {t: v for t, v in parsed.items() if t != token}
    elif len(parsed) == k:  # the forced token is among them
        top = parsed
    else:
        raise ValueError(
            f"{where}: {len(parsed)} tokens, expected the top {k} plus the forced token "
            f"({k} or {k + 1}): the server's k differs from the one asked"
        )
    ranks = sorted(rank for _, rank in top.values())
    if ranks != list(range(1, k + 1)):
        raise ValueError(f"{where}: the top-{k} ranks are {ranks}, not 1..{k}")
    logprob, rank = parsed[token]
    return Position(
        token, logprob, rank, {t: lp for t, (lp, _) in sorted(top.items(), key=lambda x: x[1][1])}
    )


def parse_scoring(
    response: Any, prompt_ids: Sequence[int], answer_ids: Sequence[int], k: int
) -> tuple[Position, ...]:
    """Per answer position, the deployment's distribution there, from the response to
    ``scoring_request(model, prompt_ids, answer_ids, k)`` (module docstring, 3)."""
    prompt, answer, k = list(prompt_ids), list(answer_ids), _k(k)
    choice = _choice(response, "scoring")
    sent = prompt + answer
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != sent:
        raise ValueError(
            f"scoring: the server scored {len(echoed)} prompt tokens other than the {len(sent)} sent"
        )
    entries = choice.get(PARAMETER)
    if not isinstance(entries, list):
        raise ValueError(
            f"scoring: choices[0].{PARAMETER} is {entries!r:.80}, not a list: the server ignored "
            f"the {PARAMETER} parameter (not vLLM?)"
        )
    if len(entries) != len(sent):
        raise ValueError(
            f"scoring: {len(entries)} {PARAMETER} entries for {len(sent)} prompt tokens "
            f"({len(prompt)} prompt + {len(answer)} answer)"
        )
    return tuple(
        _position(
            entries[len(prompt) + i],
            token,
            k,
            f"scoring: answer position {i} ({PARAMETER}[{len(prompt) + i}])",
        )
        for i, token in enumerate(answer)
    )


class Score(NamedTuple):
    kl: tuple[KL, ...]  # per answer position: KL(reference || candidate), nats, top-k truncated
    mean_kl: float | None  # over the measured positions; None where none is
    max_kl: float | None
    measured: int  # positions whose two top-k lists share a token
    top1_agreement: float | None  # the candidate's most likely token is the reference's token
    reference_top1_agreement: float | None  # the same, for the reference scoring its own answer
    k: int
    truncation: str  # compare.TRUNCATION for this k


def _first(p: Position) -> int:
    # A tie for first is agreement: bfloat16 logits tie exactly, and vLLM's greedy sampler may
    # pick either tied token. Not the rank: vLLM's top-k ranks are positions in its top-k list,
    # so of two tied tokens one is ranked 2.
    return p.token if p.logprob >= p.top[p.top1] else p.top1


def score(reference: Sequence[Position], candidate: Sequence[Position]) -> Score:
    """One request's fidelity from the reference's and the candidate's scoring of the same
    answer (module docstring, 4)."""
    if len(reference) != len(candidate):
        raise ValueError(
            f"score: the reference has {len(reference)} positions, the candidate {len(candidate)}: "
            "both must score the same answer"
        )
    tokens = [r.token for r in reference]
    for i, (r, c) in enumerate(zip(reference, candidate)):
        if r.token != c.token:
            raise ValueError(
                f"score: position {i} forces token {r.token} on the reference and {c.token} on the "
                "candidate: both must score the same answer"
            )
    kls = []
    for i, (r, c) in enumerate(zip(reference, candidate)):
        try:
            kls.append(truncated_kl(r.top, c.top))
        except ValueError as exc:
            raise ValueError(f"score: position {i}: {exc}") from None
    measured = [x.kl for x in kls if x.shared > 0]
    k = max((x.k for x in kls), default=0)
    return Score(
        tuple(kls),
        math.fsum(measured) / len(measured) if measured else None,
        max(measured) if measured else None,
        len(measured),
        top1_agreement(tokens, [_first(c) for c in candidate]),
        top1_agreement(tokens, [_first(r) for r in reference]),
        k,
        TRUNCATION.format(k=k),
    )
