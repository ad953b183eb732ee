"""Weeks 10-11: an OpenAI-compatible HTTP server.

    nanoserve serve --model tiny --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "The list", "max_tokens": 20}'

The server speaks HTTP and the OpenAI wire format; it knows nothing of tensors. It validates a
request, turns it into prompt token ids and `SamplingParams`, and awaits the outputs the
`AsyncEngine` (on its own thread) sends back: all at once for a plain response, chunk by chunk
as server-sent events when `stream` is true.

Every error a client can cause comes back as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status, and the server
goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanoserve.engine import AsyncEngine, QueueFull, RequestOutput
from nanoserve.sampling import SEED_MAX, SEED_MIN, SamplingParams

MAX_BODY_BYTES = 1 << 20  # 1 MiB: prompts for a 1B model do not need more


class APIError(Exception):
    """An error to report to the client, OpenAI-style."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# ------------------------------------------------------------------------- request validation


def _get(body: dict, name: str, kinds: tuple, default: Any = None, check=None, rule: str = "") -> Any:
    """body[name] if present, checked for type (and `check`), else `default`."""
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:  # True is an int in Python; not in JSON
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got a boolean", param=name)
    if not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got {type(value).__name__}", param=name)
    if check is not None and not check(value):
        raise APIError(400, f"'{name}' {rule}, got {value!r}", param=name)
    return value


def _kind_names(kinds: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def sampling_params_from(body: dict, default_max_tokens: int) -> SamplingParams:
    """The sampling fields of a completion or chat request -> SamplingParams (400 on bad input)."""
    # >>> week10: parse-params
    max_tokens = _get(body, "max_tokens", (int,), None, lambda v: v >= 1, "must be at least 1")
    if max_tokens is None:  # the chat API's newer name for the same thing
        max_tokens = _get(body, "max_completion_tokens", (int,), default_max_tokens, lambda v: v >= 1,
                          "must be at least 1")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if _get(body, "echo", (bool,), False):
        raise APIError(400, "echo is not supported", param="echo")
    return SamplingParams(
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "must be in [0, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")),
        top_k=_get(body, "top_k", (int,), 0, lambda v: v >= 0, "must be >= 0 (0 = off)"),
        repetition_penalty=float(_get(body, "repetition_penalty", (int, float), 1.0, lambda v: v > 0, "must be > 0")),
        max_tokens=max_tokens,
        stop=stop,
        seed=_get(body, "seed", (int,), None, lambda v: SEED_MIN <= v <= SEED_MAX,
                  f"must be in [{SEED_MIN}, {SEED_MAX}]"),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
    )
    # <<< week10: parse-params


# ---------------------------------------------------------------------------------- the app


class Guard:
    """Authentication and the body size limit, checked before any handler reads the body."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.api_key is not None and scope["path"].startswith("/v1/"):
                if headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode():
                    error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     code="invalid_api_key", type_="authentication_error")
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > self.max_body_bytes:
                error = APIError(413, f"request body larger than {self.max_body_bytes} bytes", code="body_too_large")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)



def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = 16) -> FastAPI:
    app = FastAPI(title="nanoserve", version="0.1.0")
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    vocab_size = engine.vocab_size
    created = int(time.time())

    # A plain ASGI middleware, not @app.middleware("http"): that wrapper hides client
    # disconnects from the handlers, and we need them to abort abandoned requests.
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a bug, not the client's fault
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    @app.get("/health")
    async def health():
        free, total = engine.kv_blocks()
        return {"status": "ok", "requests_in_flight": engine.num_pending,
                "kv_blocks_free": free, "kv_blocks_total": total}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "nanoserve", "max_model_len": max_model_len}]}

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > max_body_bytes:  # no Content-Length (chunked upload): check what arrived
            raise APIError(413, f"request body larger than {max_body_bytes} bytes", code="body_too_large")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = _get(body, "model", (str,))
        if model is None:
            raise APIError(400, "'model' is required", param="model")
        if model != model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return body

    def check_length(prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        if len(prompt_ids) + params.max_tokens > max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt has "
                                f"{len(prompt_ids)} and max_tokens asks for {params.max_tokens} more",
                           param=param if len(prompt_ids) >= max_model_len else "max_tokens",
                           code="context_length_exceeded")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        params = sampling_params_from(body, default_max_tokens)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            prompt_ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and 0 <= t < vocab_size for t in prompt):
            prompt_ids = list(prompt)  # already tokenized
        else:
            raise APIError(400, f"'prompt' is required: a non-empty string, or a list of token ids in [0, {vocab_size})",
                           param="prompt")
        check_length(prompt_ids, params, "prompt")
        return await respond(request, body, prompt_ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        params = sampling_params_from(body, default_max_tokens)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), str)):
                raise APIError(400, "each message needs a 'role' (system, user or assistant) and a string "
                                    "'content'", param="messages")
        try:
            prompt_ids = tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        check_length(prompt_ids, params, "messages")
        return await respond(request, body, prompt_ids, params, chat=True)

    async def respond(request: Request, body: dict, prompt_ids: list[int], params: SamplingParams, chat: bool):
        stream = _get(body, "stream", (bool,), False)
        include_usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            outputs = engine.generate(prompt_ids, params)
            first = await anext(outputs)  # admission errors surface here, before any byte is sent
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({e}); retry shortly", code="server_overloaded",
                           type_="server_error", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        meta = dict(id=request_id, created=int(time.time()), model=model_name)
        if stream:
            return StreamingResponse(sse_events(outputs, first, meta, chat, include_usage, len(prompt_ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        last = await collect(request, outputs, first)
        if last is None:  # nobody is listening any more
            return JSONResponse({"error": {"message": "client closed the request", "type": "client_closed",
                                           "param": None, "code": None}}, status_code=499)
        usage = _usage(len(prompt_ids), len(last.token_ids))
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": last.text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": last.text, "logprobs": None, "finish_reason": last.finish_reason}
        return {**meta, "object": "text_completion", "choices": [choice], "usage": usage}

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def collect(request: Request, outputs, first: RequestOutput) -> RequestOutput | None:
    """Await the last output. If the client disconnects meanwhile, abort and return None."""
    last = first

    async def consume():
        nonlocal last
        async for out in outputs:
            last = out

    if first.finished:
        await outputs.aclose()
        return last
    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()  # the engine generator's `finally` aborts the request
                await asyncio.wait({task})
                return None
        task.result()  # re-raises what the engine reported, if anything
        return last
    finally:
        if not task.done():  # the handler itself was cancelled
            task.cancel()
        await outputs.aclose()


async def sse_events(outputs, first: RequestOutput, meta: dict, chat: bool, include_usage: bool,
                     prompt_tokens: int):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

    If the client disconnects, Starlette cancels this generator; closing `outputs` in the
    `finally` aborts the request on the engine thread, which frees its KV blocks.
    """
    # >>> week11: sse-events
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish_reason: str | None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        payload = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        out = first
        while True:
            if out.delta:
                yield chunk(out.delta, None)
            if out.finished:
                break
            out = await anext(outputs)
        yield chunk(None if chat else "", out.finish_reason)
        if include_usage:
            usage = {**meta, "object": kind, "choices": [], "usage": _usage(prompt_tokens, len(out.token_ids))}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()
    # <<< week11: sse-events
