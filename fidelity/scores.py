"""A mirror run's scoring pass, its pure parts: which requests it scores, what a failed call
means, and the rows it writes (pure: the standard library and fidelity.scoring).

After a mirror run ends, a share of its requests (the experiment document's
``fidelity.score_share``) is scored by teacher forcing (fidelity/scoring.py): the control's
greedy answer is fed back to the control and to every other variant with vLLM's
``prompt_logprobs``, and each variant's next-token distributions along it are compared with the
control's. workers/fidelity_scores.py does the calls; this module decides:

1. ``chosen``: whether a request is scored, from a hash of (run_id, seq) under the share
   (``SELECTION_VERSION`` names the hash): the same requests every time the pass runs, about
   ``share`` of them, and a larger share scores a superset of a smaller one's.
2. ``refusal``: what a scoring call that failed means: a server that does not take
   ``prompt_logprobs`` (refused with an error naming it, or answered without the field:
   ``NO_PROMPT_LOGPROBS``) apart from any other HTTP error or unusable answer.
3. The rows of one request (samples.schema.FIDELITY_SCORES_TABLE, every column but scored_ms):
   one per variant, the control's own included (its answer scored under itself: the noise
   floor, 0 on a deterministic server). ``failed_rows`` when the control gave no answer to
   score (every variant's row says why); ``compared_rows`` otherwise: a variant whose scoring
   failed says so, every variant says so when the control's own scoring failed (nothing to
   compare against), and the others carry their score. No request picked is ever left without
   its rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from fidelity.scoring import PARAMETER, Position, score

SELECTION_VERSION = 1
OK = "ok"
CONTROL_ERROR = "control_error"  # the control's greedy answer could not be had
EMPTY_ANSWER = "empty_answer"  # the control answered no token: nothing to score
NO_PROMPT_LOGPROBS = "no_prompt_logprobs"  # the variant's server does not take prompt_logprobs
HTTP_ERROR = "http_error"  # the scoring call failed otherwise (status, connection, timeout)
BAD_RESPONSE = "bad_response"  # answered, but not a scoring this module can read
REFERENCE_ERROR = "reference_error"  # the control's own scoring failed: nothing to compare with
UNMEASURED = "unmeasured"  # some position's two top-k lists share no token: no KL there
INFINITE_KL = "infinite_kl"  # the variant gives no mass where the control gives some
OUTCOMES = (
    OK,
    CONTROL_ERROR,
    EMPTY_ANSWER,
    NO_PROMPT_LOGPROBS,
    HTTP_ERROR,
    BAD_RESPONSE,
    REFERENCE_ERROR,
    UNMEASURED,
    INFINITE_KL,
)
ERROR_CHARS = 500  # a row's error text is cut here (a server's error body can be long)


def chosen(run_id: int, seq: int, share: float, version: int = SELECTION_VERSION) -> bool:
    """Whether request ``seq`` of run ``run_id`` is scored under ``share`` (module docstring, 1):
    the first 8 bytes of blake2b("fidelity-score:v1:<run>:<seq>") as a uniform in [0, 1), below
    the share."""
    if version != 1:
        raise ValueError(f"selection version {version!r}: only 1 is defined")
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
        raise ValueError(f"share: a number from 0 to 1, got {share!r}")
    digest = hashlib.blake2b(f"fidelity-score:v1:{int(run_id)}:{int(seq)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < share


def choose(run_id: int, seqs: Sequence[int], share: float) -> list[int]:
    """The seqs of ``seqs`` that ``chosen`` picks, ascending, each once."""
    return sorted({int(s) for s in seqs if chosen(run_id, s, share)})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One scored request's key and what every one of its rows repeats."""

    experiment: str
    run_id: int
    seq: int
    user_id: str
    control: str
    top_k: int


class Scoring(NamedTuple):
    """One variant's scoring of the control's answer: its positions, or why there are none."""

    positions: tuple[Position, ...] | None
    outcome: str = OK
    error: str = ""


def refusal(status: int, body: str) -> tuple[str, str]:
    """(outcome, error) of a scoring call answered with HTTP ``status`` (not 200) and ``body``:
    NO_PROMPT_LOGPROBS where the server's error names log-probabilities (vLLM refuses a k above
    its --max-logprobs, or the parameter itself, so), HTTP_ERROR otherwise."""
    text = " ".join(str(body).split())[:ERROR_CHARS]
    if status == 400 and "logprobs" in text.lower():
        return NO_PROMPT_LOGPROBS, f"HTTP 400: the server refuses {PARAMETER}: {text}"
    return HTTP_ERROR, f"HTTP {status}: {text}"


def unreadable(exc: ValueError) -> tuple[str, str]:
    """(outcome, error) of a scoring answer fidelity.scoring.parse_scoring refused: a server that
    ignored the parameter (no prompt_logprobs in its answer) is NO_PROMPT_LOGPROBS."""
    text = str(exc)[:ERROR_CHARS]
    if f"the server ignored the {PARAMETER} parameter" in text:
        return NO_PROMPT_LOGPROBS, text
    return BAD_RESPONSE, text


def _row(request: Request, variant: str, outcome: str, error: str = "", **measured: Any) -> dict[str, Any]:
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r}: must be one of {OUTCOMES}")
    return {
        "experiment": request.experiment,
        "variant": variant,
        "run_id": request.run_id,
        "seq": request.seq,
        "user_id": request.user_id,
        "control": request.control,
        "top_k": request.top_k,
        "outcome": outcome,
        "error": error[:ERROR_CHARS],
        "positions": measured.get("positions", 0),
        "kl_sum": measured.get("kl_sum", 0.0),
        "kl_max": measured.get("kl_max", 0.0),
        "top1_agree": measured.get("top1_agree", 0),
    }


def failed_rows(request: Request, variants: Sequence[str], outcome: str, error: str) -> list[dict[str, Any]]:
    """One row per variant, each saying the request could not be scored and why."""
    return [_row(request, v, outcome, error) for v in variants]


def scored_row(
    request: Request, variant: str, reference: Sequence[Position], candidate: Sequence[Position]
) -> dict[str, Any]:
    """The row of a variant's scoring against the control's: kl_sum and kl_max over the answer's
    positions, top1_agree the positions where the variant's most likely token is the control's
    (fidelity.scoring.score); UNMEASURED or INFINITE_KL where a position gives no finite KL."""
    try:
        s = score(reference, candidate)
    except ValueError as exc:
        return _row(request, variant, BAD_RESPONSE, str(exc))
    n = len(s.kl)
    if s.measured < n:
        return _row(
            request,
            variant,
            UNMEASURED,
            f"{n - s.measured} of {n} answer positions: the two top-{s.k} lists share no token",
        )
    infinite = [i for i, x in enumerate(s.kl) if math.isinf(x.kl)]
    if infinite:
        return _row(
            request,
            variant,
            INFINITE_KL,
            f"answer position {infinite[0]} (of {len(infinite)}): the variant gives no mass to tokens "
            "outside both top-k lists where the control gives some",
        )
    return _row(
        request,
        variant,
        OK,
        positions=n,
        kl_sum=math.fsum(x.kl for x in s.kl),
        kl_max=float(s.max_kl or 0.0),
        top1_agree=round((s.top1_agreement or 0.0) * n),
    )


def compared_rows(request: Request, scorings: Mapping[str, Scoring]) -> list[dict[str, Any]]:
    """One row per variant of ``scorings`` (the control's included) for a request whose control
    answered (module docstring, 3)."""
    if request.control not in scorings:
        raise ValueError(f"compared_rows: no scoring of the control {request.control!r}")
    reference = scorings[request.control]
    rows = []
    for variant, mine in scorings.items():
        if mine.positions is None:
            rows.append(_row(request, variant, mine.outcome, mine.error))
        elif reference.positions is None:
            why = f"the control's own scoring failed ({reference.outcome}): {reference.error}"
            rows.append(_row(request, variant, REFERENCE_ERROR, why))
        else:
            rows.append(scored_row(request, variant, reference.positions, mine.positions))
    return rows
