"""vLLM 0.32's SSE framing, byte for byte (see tests/data/vllm-captures/).

Pure string templates: each request pre-renders its constant prefix once, so a token costs one
``json.dumps`` of its text and one concatenation. vLLM serialises with pydantic: compact
separators, non-ASCII text as raw UTF-8, fields in the order below.
"""

from __future__ import annotations

import json
from typing import Any

SYSTEM_FINGERPRINT = "vllm-0.32.0-3a58068b"
DONE = b"data: [DONE]\n\n"
# vLLM's engine-death error, exactly as it streams it (json.dumps default separators).
ENGINE_ERROR = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) '
    b'for the root cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
)


def _s(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _ids(ids: list[int] | None) -> str:
    return "null" if ids is None else json.dumps(ids, separators=(",", ":"))


class Framer:
    def __init__(self, api: str, request_id: str, created: int, model: str) -> None:
        if api not in ("chat", "completions"):
            raise ValueError(f"api {api!r}: must be 'chat' or 'completions'")
        self.api = api
        obj = "chat.completion.chunk" if api == "chat" else "text_completion"
        self._head = (
            f'data: {{"id":{_s(request_id)},"object":"{obj}","created":{created},'
            f'"model":{_s(model)},"choices":'
        )

    def role(self, prompt_ids: list[int] | None = None) -> bytes:
        """The chat's first event; ``prompt_ids`` with ``return_token_ids``."""
        return (
            self._head + '[{"index":0,"delta":{"role":"assistant","content":""},'
            f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":{_ids(prompt_ids)},'
            '"prompt_text":null}\n\n'
        ).encode()

    def token(
        self,
        text: str,
        finish_reason: str | None = None,
        token_ids: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> bytes:
        """One token event; with ``return_token_ids`` its ``token_ids``, and a completion's first
        event ``prompt_ids`` (a chat sends those in its role event)."""
        ids = _ids(token_ids)
        if self.api == "chat":
            if finish_reason is None:
                tail = f'"finish_reason":null,"token_ids":{ids}}}]}}\n\n'
            else:
                tail = f'"finish_reason":{_s(finish_reason)},"stop_reason":null,"token_ids":{ids}}}]}}\n\n'
            body = f'[{{"index":0,"delta":{{"content":{_s(text)}}},"logprobs":null,{tail}'
        else:
            reason = "null" if finish_reason is None else _s(finish_reason)
            body = (
                f'[{{"index":0,"text":{_s(text)},"logprobs":null,"finish_reason":{reason},'
                f'"stop_reason":null,"prompt_token_ids":{_ids(prompt_ids)},"token_ids":{ids}}}]}}\n\n'
            )
        return (self._head + body).encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, truth: dict[str, Any] | None) -> bytes:
        usage = (
            f'{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens + completion_tokens},'
            f'"completion_tokens":{completion_tokens}'
        )
        if truth is not None:
            # The simulator's ground truth rides in an extra usage key (OpenAI clients ignore
            # unknown usage keys); see simulator/README.md.
            usage += ',"abplat":' + json.dumps(truth, separators=(",", ":"))
        return (
            self._head + f'[],"usage":{usage}}},"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\n'
        ).encode()

    def malformed(self) -> bytes:
        # What a truncated or corrupted event looks like on the wire: cut mid-object.
        return (self._head + '[{"index":0,"delta":{"content":"\n\n').encode()


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    """vLLM's non-streaming error response body (HTTP 4xx/5xx)."""
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    ).encode()
