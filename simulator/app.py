"""The simulator's ASGI app: vLLM's OpenAI-compatible surface over the latency model.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /tokenize, GET /v1/models,
GET /health, GET /metrics. Prompt lengths (usage and ``/tokenize`` alike) follow the app's
tokenizer rule (simulator/tokens.py). What a request is answered comes from simulator/answers.py:
keyed on its prompt's token ids (and, when it samples, its seed or else its id), departing from the
reference answer at the profile's ``divergence_rate``; the usage event's ``abplat.diverged_at`` says
where. Token ids come from simulator/tokens.py (``return_token_ids``, a prompt given as ids), and
``prompt_logprobs`` from the model of simulator/logprobs.py.
A request may force a fault with the header ``x-abplat-fault: KIND`` (one of
``Faults.KINDS``); otherwise it draws one from the profile's rates, seeded by the profile seed
and the request's X-Request-Id, so a replayed run faults the same requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any

from simulator import answers, logprobs
from simulator.framing import DONE, ENGINE_ERROR, Framer, error_body
from simulator.latency import Faults, Profile, Seq
from simulator.metrics import CONTENT_TYPE, Metrics
from simulator.runtime import Engine
from simulator.tokens import DEFAULT_TOKENIZER, VOCAB_SIZE, answer_id, check, prompt_ids, prompt_tokens

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]


class SimulatedDisconnect(Exception):
    """Raised mid-response so the server drops the connection (the disconnect fault)."""


class _QuietDisconnect(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SimulatedDisconnect)


logging.getLogger("uvicorn.error").addFilter(_QuietDisconnect())


class BadRequest(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


class SimulatorApp:
    def __init__(
        self,
        profile: Profile,
        model: str = "abplat-sim",
        replicas: int = 1,
        tokenizer: str = DEFAULT_TOKENIZER,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if not 0 <= max_logprobs <= logprobs.SUPPORT:
            raise ValueError(
                f"max_logprobs={max_logprobs}: must be within [0, {logprobs.SUPPORT}], the tokens the "
                "simulated model can generate"
            )
        self.profile = profile
        self.model = model
        self.tokenizer = check(tokenizer)
        self.max_logprobs = max_logprobs
        # A deployment of N identical engines behind one endpoint, as behind a load balancer
        # that sends each request to the replica with the fewest outstanding requests.
        self.engines = [Engine(profile) for _ in range(replicas)]
        self.metrics = Metrics(model, self.engines)
        self._counter = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    for engine in self.engines:
                        await engine.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                return await _respond(send, 405, b'{"detail":"Method Not Allowed"}')
            api = "chat" if path == "/v1/chat/completions" else "completions"
            return await self._generate(api, scope, receive, send)
        if path == "/tokenize":
            if method != "POST":
                return await _respond(send, 405, b'{"detail":"Method Not Allowed"}')
            return await self._tokenize(receive, send)
        if method != "GET":
            return await _respond(send, 405, b'{"detail":"Method Not Allowed"}')
        if path == "/health":
            return await _respond(send, 200, b"", [])
        if path == "/v1/models":
            body = {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": self.profile.max_model_len,
                    }
                ],
            }
            return await _respond(send, 200, json.dumps(body).encode())
        if path == "/metrics":
            headers = [(b"content-type", CONTENT_TYPE.encode())]
            return await _respond(send, 200, self.metrics.render(), headers)
        return await _respond(send, 404, b'{"detail":"Not Found"}')

    def _least_loaded(self) -> int:
        """The index of the replica with the fewest outstanding requests."""
        return min(range(len(self.engines)), key=lambda i: self.engines[i].running + self.engines[i].waiting)

    # ------------------------------------------------------------------------------------
    async def _tokenize(self, receive: Any, send: Any) -> None:
        """vLLM's ``POST /tokenize``: {"prompt": str} or {"messages": [...]} (and an optional
        "model") -> {"count", "max_model_len", "tokens"}; counted exactly as a generation
        request with the same prompt reports it in ``usage.prompt_tokens``."""
        try:
            req = _json_object(await _read_body(receive))
            model = req.get("model")
            if model is not None and model != self.model:
                raise BadRequest(404, self._unknown_model(model), "NotFoundError", "model")
            if "messages" in req:
                msgs = req["messages"]
                if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                    raise BadRequest(
                        400, "messages: a list of message objects is required", "BadRequestError"
                    )
                ids = prompt_ids(self.tokenizer, messages=msgs)
            elif isinstance(req.get("prompt"), str):
                ids = prompt_ids(self.tokenizer, prompt=req["prompt"])
            else:
                raise BadRequest(400, "prompt: a string (or messages) is required", "BadRequestError")
        except BadRequest as e:
            return await _respond(send, e.status, error_body(e.message, e.err_type, e.status, e.param))
        body = {"count": len(ids), "max_model_len": self.profile.max_model_len, "tokens": ids}
        return await _respond(send, 200, json.dumps(body).encode())

    async def _generate(self, api: str, scope: dict, receive: Any, send: Any) -> None:
        received_ns = time.perf_counter_ns()
        # The engine's clock (its loop's): the server-side phase times of vllm:* all use it.
        received_at = asyncio.get_running_loop().time()
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self._counter += 1
        rid = headers.get("x-request-id") or f"sim-{self._counter}"
        try:
            req = self._parse(api, body)
            req["rid"] = headers.get("x-request-id") or f"{rng_id(self.profile.seed, rid):016x}"
            fault = self._fault(rid, headers.get("x-abplat-fault", ""))
            key = answers.answer_key(
                req["prompt_key"], temperature=req["temperature"], seed=req["seed"], request_id=rid
            )
        except BadRequest as e:
            self.metrics.request_failed()
            return await _respond(send, e.status, error_body(e.message, e.err_type, e.status, e.param))
        # The request's own draws (where a fault strikes, the texts a split_utf8 fault sends):
        # keyed on the profile seed and request id, apart from the answer.
        rng = random.Random(f"{self.profile.seed}:{rid}")
        if fault == "http_error":
            self.metrics.request_failed()
            msg = "simulated internal server error"
            return await _respond(send, 500, error_body(msg, "InternalServerError", 500))
        if fault == "rate_limited":
            self.metrics.request_failed()
            msg = "simulated rate limit: too many requests"
            return await _respond(send, 429, error_body(msg, "RateLimitError", 429))
        echo = [(b"x-request-id", rid.encode("latin-1"))]
        answer = answers.answer(key, self.profile, req["max_tokens"])
        if not req["stream"]:
            return await self._complete(api, req, answer, rng, send, echo, received_at)
        await self._stream(api, req, answer, rng, fault, received_ns, receive, send, echo, received_at)

    def _fault(self, rid: str, forced: str) -> str:
        if forced:
            if forced not in Faults.KINDS:
                raise BadRequest(
                    400,
                    f"x-abplat-fault: unknown fault {forced!r}; known: {', '.join(Faults.KINDS)}",
                    "BadRequestError",
                )
            return forced
        return self.profile.faults.draw(random.Random(f"fault:{self.profile.seed}:{rid}").random())

    def _unknown_model(self, model: Any) -> str:
        """vLLM's 404 sentence, then the model this simulator does serve and how to serve another:
        a client pointed at the wrong simulator learns what to change."""
        return (
            f"The model `{model}` does not exist. This simulator serves `{self.model}` "
            "(start it with --model NAME, or --experiment KEY to serve each variant's model)."
        )

    def _parse(self, api: str, raw: bytes) -> dict[str, Any]:
        req = _json_object(raw)
        # What vLLM's request model checks first (pydantic, before the model's name).
        stream = bool(req.get("stream", False))
        k = _prompt_logprobs(req.get("prompt_logprobs"), stream)
        with_ids = _lax_bool(req.get("return_token_ids"), "return_token_ids")
        model = req.get("model")
        if model != self.model:
            raise BadRequest(404, self._unknown_model(model), "NotFoundError", "model")
        ids: list[int] | None = None
        if api == "chat":
            msgs = req.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest(400, "messages: a non-empty list is required", "BadRequestError")
            n_prompt = prompt_tokens(self.tokenizer, messages=msgs)
            if with_ids or k is not None:
                ids = prompt_ids(self.tokenizer, messages=msgs)
            key = answers.prompt_key(messages=msgs)
            max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
        else:
            # A text prompt answers as its token ids do: the model sees only the ids (as on vLLM,
            # where a prompt and its ids from /tokenize get the same answer).
            prompt = req.get("prompt")
            if isinstance(prompt, str):
                ids = prompt_ids(self.tokenizer, prompt=prompt)
            elif isinstance(prompt, list) and not any(isinstance(t, list) for t in prompt):
                ids = _token_ids(prompt)
            elif isinstance(prompt, list):
                raise BadRequest(
                    400,
                    "prompt: the simulator answers one prompt a request (a string or a list of token "
                    "ids), not a batch of them",
                    "BadRequestError",
                )
            else:
                raise BadRequest(
                    400, "prompt: a string or a list of token ids is required", "BadRequestError"
                )
            n_prompt = len(ids)
            key = answers.prompt_key(prompt=ids)
            max_tokens = req.get("max_tokens", 16)
        limit = self.profile.max_model_len
        if max_tokens is None:
            max_tokens = max(1, min(256, limit - n_prompt))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(400, "max_tokens must be at least 1", "BadRequestError", "max_tokens")
        if n_prompt + max_tokens > limit:
            raise BadRequest(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                "BadRequestError",
            )
        # Sampling as vLLM's OpenAI server reads it: temperature absent is its default 1.0.
        try:
            temperature = answers.check_temperature(req.get("temperature"))
        except ValueError as e:
            raise BadRequest(400, str(e), "BadRequestError", "temperature") from None
        try:
            seed = answers.check_seed(req.get("seed"))
        except ValueError as e:
            raise BadRequest(400, str(e), "BadRequestError", "seed") from None
        if k:
            # vLLM checks it against --max-logprobs when it builds the sampling parameters.
            asked = VOCAB_SIZE if k == -1 else k
            if asked > self.max_logprobs:
                raise _vllm_error(
                    f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
                    f"{self.max_logprobs}",
                    "prompt_logprobs",
                    asked,
                )
        opts = req.get("stream_options") or {}
        return {
            "model": model,
            "prompt_tokens": n_prompt,
            "prompt_key": key,
            "prompt_ids": ids,
            "return_token_ids": with_ids,
            "prompt_logprobs": None if stream else k,
            "temperature": temperature,
            "seed": seed,
            "max_tokens": max_tokens,
            "stream": stream,
            "usage": bool(isinstance(opts, dict) and opts.get("include_usage")),
        }

    async def _stream(
        self,
        api: str,
        req: dict[str, Any],
        answer: answers.Answer,
        rng: random.Random,
        fault: str,
        received_ns: int,
        receive: Any,
        send: Any,
        echo: list[tuple[bytes, bytes]],
        received_at: float,
    ) -> None:
        p = self.profile
        max_tokens = req["max_tokens"]
        prefix = "chatcmpl-" if api == "chat" else "cmpl-"
        # Like vLLM, the event id carries the client's X-Request-Id when it sent one.
        framer = Framer(api, prefix + req["rid"], int(time.time()), req["model"])
        # Mid-stream faults strike after at least one token (when there is more than one), so
        # a stall is a stall between tokens, not a slow first token.
        fault_at = -1
        if fault:
            fault_at = 1 + rng.randrange(max(1, (max_tokens - 1) // 2)) if max_tokens > 1 else 0
        if fault == "slow_headers":
            await asyncio.sleep(p.faults.slow_headers_ms / 1000.0)
        seq = Seq(prompt_tokens=req["prompt_tokens"], max_tokens=max_tokens)
        index = self._least_loaded()
        engine = self.engines[index]
        run = engine.submit(seq)
        loop = asyncio.get_running_loop()
        first_token_at: float | None = None
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, engine, run))
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + echo})
        perf = time.perf_counter_ns
        first_content_ns: int | None = None
        emitted = 0
        try:
            while emitted < max_tokens:
                await run.wait_tokens(emitted)
                if run.gone:
                    self.metrics.request_aborted(index)
                    return
                while emitted < run.ready:
                    if emitted == 0 and fault == "slow_first_token":
                        await asyncio.sleep(p.faults.slow_first_token_ms / 1000.0)
                    if emitted == fault_at:
                        fault_at = -1
                        if fault == "engine_error":
                            engine.abort(run)
                            self.metrics.request_failed(index)
                            await _body(send, ENGINE_ERROR + DONE, more=False)
                            return
                        if fault == "disconnect":
                            engine.abort(run)
                            self.metrics.request_failed(index)
                            raise SimulatedDisconnect()
                        if fault == "stall":
                            await asyncio.sleep(p.faults.stall_ms / 1000.0)
                        if fault == "malformed":
                            await _body(send, framer.malformed())
                    # With return_token_ids, vLLM sends the prompt's ids once, in the first event
                    # (chat: its role event), and each token event its token's id.
                    echoed = req["prompt_ids"] if req["return_token_ids"] and emitted == 0 else None
                    if emitted == 0:
                        first_token_at = loop.time()  # handed to the stream: the server's TTFT
                        if api == "chat":
                            await _body(send, framer.role(echoed))
                            echoed = None
                    emitted += 1
                    split = fault == "split_utf8" and emitted <= 4  # the first tokens
                    # The fault replaces the first tokens' texts with multi-byte ones to split.
                    text = rng.choice(answers.MULTIBYTE[:5]) if split else answer.texts[emitted - 1]
                    finish = "length" if emitted == max_tokens else None
                    ids = [answer_id(text)] if req["return_token_ids"] else None
                    data = framer.token(text, finish, ids, echoed)
                    if text and first_content_ns is None:
                        first_content_ns = perf()  # ground truth: just before the write
                    if split:
                        cut = _inside_multibyte(data)
                        await _body(send, data[:cut])
                        await asyncio.sleep(0.002)  # make the split reach the client on its own
                        await _body(send, data[cut:])
                    else:
                        await _body(send, data)
            if req["usage"]:
                truth = {
                    "server_ttft_ms": (
                        None if first_content_ns is None else round((first_content_ns - received_ns) / 1e6, 6)
                    ),
                    "first_content_ns": first_content_ns,
                    "received_ns": received_ns,
                    "queue_ms": round(((seq.admitted_at or seq.arrival) - seq.arrival) * 1e3, 6),
                    "fault": fault,
                    "diverged_at": answer.diverged_at,
                }
                await _body(send, framer.usage(req["prompt_tokens"], emitted, truth))
            await _body(send, DONE, more=False)
            self._observe(index, seq, req, received_at, first_token_at, loop.time())
        finally:
            watcher.cancel()
            if not seq.finished:
                engine.abort(run)

    async def _complete(
        self,
        api: str,
        req: dict[str, Any],
        answer: answers.Answer,
        rng: random.Random,
        send: Any,
        echo: list[tuple[bytes, bytes]],
        received_at: float,
    ) -> None:
        seq = Seq(prompt_tokens=req["prompt_tokens"], max_tokens=req["max_tokens"])
        index = self._least_loaded()
        run = self.engines[index].submit(seq)
        while not seq.finished:
            await run.wait_tokens(run.ready)
        now = asyncio.get_running_loop().time()
        self._observe(index, seq, req, received_at, seq.first_token_at, now)
        texts = answer.texts[: seq.generated]
        text = "".join(texts)
        with_ids = req["return_token_ids"]
        token_ids = [answer_id(t) for t in texts] if with_ids else None
        echoed = req["prompt_ids"] if with_ids else None
        scored = None
        if req["prompt_logprobs"] is not None:
            # Pure Python at ~0.2 ms a position: off the event loop, which keeps streaming other
            # requests' tokens meanwhile.
            scored = await asyncio.to_thread(self._prompt_logprobs, req["prompt_ids"], req["prompt_logprobs"])
        usage = {
            "prompt_tokens": req["prompt_tokens"],
            "total_tokens": req["prompt_tokens"] + seq.generated,
            "completion_tokens": seq.generated,
            # The answer's ground truth, as the stream's usage event carries it (no timings: a
            # whole response has no first content event to time).
            "abplat": {"diverged_at": answer.diverged_at},
        }
        # vLLM's fields in vLLM's order: a chat carries the prompt's ids and log-probabilities
        # beside its choices, a completion in its choice.
        common = {"logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": token_ids}
        prompt_fields = {"prompt_logprobs": scored, "prompt_token_ids": echoed}
        if api == "chat":
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "message": message, **common}
            obj, rid, top = "chat.completion", "chatcmpl-", prompt_fields
        else:
            choice = {"index": 0, "text": text, **common, **prompt_fields}
            obj, rid, top = "text_completion", "cmpl-", {}
        out = {
            "id": rid + f"{rng.getrandbits(64):016x}",
            "object": obj,
            "created": int(time.time()),
            "model": req["model"],
            "choices": [choice],
            "usage": usage,
            **top,
        }
        await _respond(send, 200, json.dumps(out, ensure_ascii=False).encode(), JSON_HEADERS + echo)

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict | None]:
        return logprobs.as_vllm(logprobs.prompt_logprobs(ids, self.profile, k))

    def _observe(
        self,
        index: int,
        seq: Seq,
        req: dict[str, Any],
        received_at: float,
        first_token_at: float | None,
        done_at: float,
    ) -> None:
        """A finished request's series, as vLLM records them: queue = first scheduling - arrival
        at the engine, prefill = first token - first scheduling, decode = last token - first
        token (all on the engine's clock, so queue + prefill <= the TTFT it served)."""
        admitted = seq.admitted_at if seq.admitted_at is not None else seq.arrival
        first = seq.first_token_at if seq.first_token_at is not None else admitted
        last = seq.finished_at if seq.finished_at is not None else first
        self.metrics.request_done(
            index,
            prompt_tokens=req["prompt_tokens"],
            generated=seq.generated,
            max_tokens=req["max_tokens"],
            ttft_s=None if first_token_at is None else first_token_at - received_at,
            e2e_s=done_at - received_at,
            queue_s=admitted - seq.arrival,
            prefill_s=first - admitted,
            decode_s=last - first,
            inference_s=last - admitted,
        )


async def _watch_disconnect(receive: Any, engine: Engine, run: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            engine.abort(run)
            return


async def _body(send: Any, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


async def _respond(
    send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    hdrs = JSON_HEADERS if headers is None else headers
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def rng_id(seed: int, rid: str) -> int:
    return random.Random(f"id:{seed}:{rid}").getrandbits(64)


async def _read_body(receive: Any) -> bytes:
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return body
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        req = json.loads(raw)
    except ValueError:
        raise BadRequest(400, "request body is not valid JSON", "BadRequestError") from None
    if not isinstance(req, dict):
        raise BadRequest(400, "request body must be a JSON object", "BadRequestError")
    return req


def _inside_multibyte(data: bytes) -> int:
    """An offset that falls inside a multi-byte UTF-8 character (after its lead byte)."""
    for i, b in enumerate(data):
        if b >= 0xC0:
            return i + 1
    return len(data) // 2


def _vllm_error(message: str, parameter: str | None = None, value: Any = None) -> BadRequest:
    """A 400 as vLLM sends its VLLMValidationError: the message ends with the parameter and
    value it names, in parentheses."""
    extras = [f"{name}={v}" for name, v in (("parameter", parameter), ("value", value)) if v is not None]
    suffix = f" ({', '.join(extras)})" if extras else ""
    return BadRequest(400, message + suffix, "BadRequestError", parameter)


def _invalid(loc: str, kind: str, msg: str, value: Any, **ctx: Any) -> BadRequest:
    """A 400 as vLLM sends a request its pydantic model rejects: type "Bad Request", ``param``
    the field's location, the error in pydantic's words. (vLLM lists the error of every branch
    of a union-typed field such as ``prompt``; the simulator names the first.)"""
    error = {"type": kind, "loc": loc, "msg": msg, "input": str(value)}
    if ctx:
        error["ctx"] = ctx
    return BadRequest(400, f"1 validation error:\n  {error}", "Bad Request", loc)


def _prompt_logprobs(value: Any, stream: bool) -> int | None:
    """A request's ``prompt_logprobs`` as vLLM's request model checks it (None when absent); its
    bound, the server's --max-logprobs, is checked later, as vLLM does."""
    if value is None:
        return None
    if not isinstance(value, int | float):
        raise _vllm_error("`prompt_logprobs` must be an integer.", "prompt_logprobs", value)
    if stream and (value > 0 or value == -1):
        raise _vllm_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if value < 0 and value != -1:
        raise _vllm_error("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", value)
    if isinstance(value, float) and not value.is_integer():
        raise _invalid(
            "body.prompt_logprobs",
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
            value,
        )
    return int(value)


_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def _lax_bool(value: Any, field: str) -> bool:
    """A boolean field as pydantic reads JSON in lax mode (false when absent)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    kind = "bool_parsing" if isinstance(value, str) else "bool_type"
    raise _invalid(f"body.{field}", kind, "Input should be a valid boolean", value)


def _token_ids(prompt: list[Any]) -> list[int]:
    """A prompt given as token ids, checked as vLLM checks it: integers (pydantic's lax ones:
    booleans, integral floats and integer strings pass), not negative, not empty, within the
    vocabulary."""
    ids = []
    for i, token in enumerate(prompt):
        loc = f"body.prompt.{i}"
        if isinstance(token, float) and not token.is_integer():
            msg = "Input should be a valid integer, got a number with a fractional part"
            raise _invalid(loc, "int_from_float", msg, token)
        if isinstance(token, str):
            try:
                token = int(token)
            except ValueError:
                msg = "Input should be a valid integer, unable to parse string as an integer"
                raise _invalid(loc, "int_parsing", msg, token) from None
        if not isinstance(token, int | float):
            raise _invalid(loc, "int_type", "Input should be a valid integer", token)
        if token < 0:
            raise _invalid(
                loc, "greater_than_equal", "Input should be greater than or equal to 0", token, ge=0
            )
        ids.append(int(token))
    if not ids:
        raise _vllm_error("The decoder prompt cannot be empty")
    if max(ids) >= VOCAB_SIZE:
        raise _vllm_error(f"Token id {max(ids)} is out of vocabulary")
    return ids
