"""Request shapes: which requests a variant's API can take, decided before anything is sent. Pure.

A request of a replay has one of three shapes:

- ``messages``: chat messages from a JSONL log (rendering them with a chat template is the
  server's job, so they go as they are to ``chat`` variants only);
- ``prompt``: completion text from a JSONL log (for ``completions`` variants);
- synthetic: a trace row that gives only token counts (Azure traces); the replay writes the
  text itself and sends it as ``prompt`` to completions variants and as one ``user`` message
  to chat variants. The trace has no shape, so neither choice changes what it recorded.

A mismatch is never converted silently. The run's options choose:

- ``render_chat``: ``"reject"`` (the default) refuses chat messages for a completions
  variant; ``"plain"`` renders them with :func:`render_plain`, a documented simple template
  (not the model's own chat template, which only the server knows).
- ``wrap_prompt``: False (the default) refuses prompt lines for a chat variant; True sends
  each prompt as a single ``user`` message.

:func:`check` runs on the whole source before a run is created (and again before a shard
sends), and names the offending lines and variants; :func:`payload` builds what one variant
is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CHAT, COMPLETIONS = "chat", "completions"
RENDERINGS = ("reject", "plain")
SHOWN_LINES = 5  # first line numbers named in an error; the count says how many in all


class ShapeError(ValueError):
    """Requests whose shape a variant's API cannot take (nothing was sent)."""


def render_plain(messages: Sequence[Mapping[str, Any]]) -> str:
    """The ``plain`` rendering of chat messages into completion text: one ``role: content``
    block per message, separated by a blank line, ending with ``assistant:`` so the model
    answers as the assistant. Example: ``[{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"}]`` -> ``"system: Be brief.\\n\\nuser: Hi\\n\\nassistant:"``."""
    blocks = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n\n".join([*blocks, "assistant:"])


def shape_of(request) -> str:
    """ "messages", "prompt" or "synthetic" for a replay.sources.TraceRequest."""
    if request.messages is not None:
        return "messages"
    if request.prompt is not None:
        return "prompt"
    return "synthetic"


def _lines(requests: Sequence) -> str:
    numbers = [r.line or r.seq + 1 for r in requests]
    shown = ", ".join(str(n) for n in numbers[:SHOWN_LINES])
    more = f" and {len(numbers) - SHOWN_LINES} more" if len(numbers) > SHOWN_LINES else ""
    return f"{len(numbers)} line(s) ({shown}{more})"


def check(
    requests: Sequence, apis: Mapping[str, str], *, render_chat: str = "reject", wrap_prompt: bool = False
) -> None:
    """Raise ShapeError when a request cannot go to every variant (``apis``: variant -> "chat" |
    "completions") under these options. Every request may reach every variant (mirror sends it
    to all; in split mode a weight change mid-run may route any user anywhere), so each must fit
    all of them."""
    if render_chat not in RENDERINGS:
        raise ValueError(f"render_chat must be one of {RENDERINGS}, got {render_chat!r}")
    bad_api = {v: a for v, a in apis.items() if a not in (CHAT, COMPLETIONS)}
    if bad_api:
        raise ValueError(f"unknown api of variant(s) {bad_api}: must be chat or completions")
    completions = sorted(v for v, a in apis.items() if a == COMPLETIONS)
    chat = sorted(v for v, a in apis.items() if a == CHAT)
    problems = []
    if completions and render_chat == "reject":
        lines = [r for r in requests if r.messages is not None]
        if lines:
            problems.append(
                f"{_lines(lines)} give chat `messages`, but variant(s) {', '.join(completions)} take "
                "completions (a text prompt); send the log to chat variants, or render the messages "
                "as text with --render-chat plain (API: render_chat)"
            )
    if chat and not wrap_prompt:
        lines = [r for r in requests if r.prompt is not None]
        if lines:
            problems.append(
                f"{_lines(lines)} give a completions `prompt`, but variant(s) {', '.join(chat)} take chat "
                "messages; send the log to completions variants, or send each prompt as one user "
                "message with --wrap-prompt (API: wrap_prompt)"
            )
    if problems:
        raise ShapeError("request shape mismatch, nothing was sent: " + "; ".join(problems))


def payload(
    request, text: str | None, api: str, *, render_chat: str = "reject", wrap_prompt: bool = False
) -> str | list[dict]:
    """What a variant of ``api`` is sent for ``request``: a prompt string (completions) or a
    message list (chat). ``text`` is the synthetic prompt of a request without text. Raises
    ShapeError for a mismatch the options do not allow (``check`` finds these up front)."""
    if request.messages is not None:
        if api == CHAT:
            return [dict(m) for m in request.messages]
        if render_chat == "plain":
            return render_plain(request.messages)
        raise ShapeError(f"line {request.line}: chat messages for a completions variant")
    if request.prompt is not None:
        if api == COMPLETIONS:
            return request.prompt
        if wrap_prompt:
            return [{"role": "user", "content": request.prompt}]
        raise ShapeError(f"line {request.line}: a completions prompt for a chat variant")
    if text is None:
        raise ValueError("a synthetic request needs its text")
    return text if api == COMPLETIONS else [{"role": "user", "content": text}]
