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
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
    # the chat API's newer name for the same thing
    newer = _get(body, "max_completion_tokens", (int,), None, lambda v: v >= 1, "must be at least 1")
    if max_tokens is not None and newer is not None and newer != max_tokens:
        raise APIError(400, f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({newer}) disagree; "
                            "send one of them", param="max_completion_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens if newer is None else newer
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


def message_text(content: str | list, index: int) -> str:
    """A message's `content`: a string, or a list of text parts joined in order by newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise APIError(400, f"'{param}' is a '{kind}' part; this server takes text only "
                                "(parts of type 'text')", param=param)
        if not (kind == "text" and isinstance(part.get("text"), str) and set(part) == {"type", "text"}):
            raise APIError(400, f"'{param}' must be a text part: {{\"type\": \"text\", \"text\": \"...\"}}",
                           param=param)
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins them


# ---------------------------------------------------------------------------------- the app


class Guard:
    """Authentication and the body size limit, checked before any handler reads the body; and
    (week 16) every response's status handed to `on_response(path, status)`."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_response=None):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.on_response = on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.on_response is not None:
            inner_send = send

            async def send(message):
                if message["type"] == "http.response.start":
                    self.on_response(scope["path"], message["status"])
                await inner_send(message)

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
               max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = 16,
               metrics: bool = True, log_requests: bool = False) -> FastAPI:
    """The app. `metrics`: serve `GET /metrics` (week 16); `log_requests`: one JSON line per
    finished request on the `nanoserve.requests` logger."""
    from nanoserve.metrics import RequestLog, ServerMetrics

    app = FastAPI(title="nanoserve", version="0.1.0")
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    vocab_size = engine.vocab_size
    created = int(time.time())
    app.state.metrics = server_metrics = ServerMetrics(engine) if metrics else None
    if server_metrics is not None:
        engine.listeners.append(server_metrics.observe_request)
    if log_requests:
        engine.listeners.append(RequestLog())

    # A plain ASGI middleware, not @app.middleware("http"): that wrapper hides client
    # disconnects from the handlers, and we need them to abort abandoned requests.
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       on_response=server_metrics.observe_http if server_metrics else None)

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

    if server_metrics is not None:
        @app.get("/metrics")
        async def metrics_endpoint():
            body, content_type = server_metrics.exposition()
            return Response(body, media_type=content_type)

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
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompts, names = [prompt], ["prompt"]  # one prompt: text, or token ids
        elif isinstance(prompt, list) and prompt:  # a batch: strings, or lists of token ids
            prompts, names = prompt, [f"prompt[{i}]" for i in range(len(prompt))]
        else:
            prompts, names = [None], ["prompt"]
        for p, name in zip(prompts, names):  # a batch is all strings or all token-id lists
            if type(p) is not type(prompts[0]):
                raise APIError(400, f"'{name}' is a {type(p).__name__} but 'prompt[0]' a "
                                    f"{type(prompts[0]).__name__}: a batch of prompts is all strings or all "
                                    "lists of token ids", param=name)
        prompt_ids = [prompt_token_ids(p, name) for p, name in zip(prompts, names)]
        for ids, name in zip(prompt_ids, names):
            check_length(ids, params, name)
        return await respond(request, body, prompt_ids, params, chat=False)

    def prompt_token_ids(prompt: Any, param: str) -> list[int]:
        """One prompt of a completion request, a string or a list of token ids, as token ids."""
        if isinstance(prompt, str) and prompt:
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < vocab_size for t in prompt):
            return list(prompt)  # already tokenized
        raise APIError(400, f"'{param}' must be a non-empty string or a list of token ids in [0, {vocab_size}) "
                            "('prompt' may also be a list of those, one choice each)", param=param)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        params = sampling_params_from(body, default_max_tokens)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), (str, list))):
                raise APIError(400, "each message needs a 'role' (system, user or assistant) and a "
                                    "'content' (a string or a list of text parts)", param="messages")
        try:
            prompt_ids = tokenizer.apply_chat_template(
                [{"role": m["role"], "content": message_text(m["content"], i)} for i, m in enumerate(messages)])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        check_length(prompt_ids, params, "messages")
        return await respond(request, body, [prompt_ids], params, chat=True)

    async def respond(request: Request, body: dict, prompt_ids: list[list[int]], params: SamplingParams,
                      chat: bool):
        """Generate one choice per prompt (choice i for prompt_ids[i]), all at once or streamed."""
        stream = _get(body, "stream", (bool,), False)
        include_usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        priority = _get(body, "priority", (int,), 0)
        if priority != 0 and engine.scheduling_policy != "priority":
            raise APIError(400, "'priority' needs a server started with --scheduling-policy priority "
                                f"(this one schedules by {engine.scheduling_policy})", param="priority")
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        streams, firsts = [], []
        try:
            for i, ids in enumerate(prompt_ids):
                name = request_id if len(prompt_ids) == 1 else f"{request_id}-{i}"
                streams.append(engine.generate(ids, params, priority=priority, request_id=name))
                firsts.append(await anext(streams[-1]))  # admission errors surface here, before any byte is sent
        except (QueueFull, ValueError) as e:
            for outputs in streams:  # abort the prompts already admitted
                await outputs.aclose()
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise APIError(429, f"the server is busy ({e}); retry shortly", code="server_overloaded",
                           type_="server_error", headers={"Retry-After": "1"}) from None
        meta = dict(id=request_id, created=int(time.time()), model=model_name)
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        if stream:
            return StreamingResponse(sse_events(merged_outputs(streams, firsts), meta, chat, include_usage,
                                                prompt_tokens),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        tasks = [asyncio.ensure_future(collect(request, o, f)) for o, f in zip(streams, firsts)]
        try:
            lasts = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # if one failed, stop the others
                task.cancel()
        if any(last is None for last in lasts):  # nobody is listening any more
            return JSONResponse({"error": {"message": "client closed the request", "type": "client_closed",
                                           "param": None, "code": None}}, status_code=499)
        usage = _usage(prompt_tokens, sum(len(last.token_ids) for last in lasts))
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": last.text},
                        "logprobs": None, "finish_reason": last.finish_reason} for i, last in enumerate(lasts)]
            return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}
        choices = [{"index": i, "text": last.text, "logprobs": None, "finish_reason": last.finish_reason}
                   for i, last in enumerate(lasts)]
        return {**meta, "object": "text_completion", "choices": choices, "usage": usage}

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
            await asyncio.wait({task})  # a generator inside a running `anext` cannot be closed
        await outputs.aclose()


async def merged_outputs(streams: list, firsts: list[RequestOutput]):
    """`(index, output)` pairs from several engine generators, as they arrive.

    `firsts[i]` is the output `respond` already took from `streams[i]`; those come first, in order.
    Outputs that arrive together come in index order. However this generator ends, every request
    still running is aborted.
    """
    pending: dict[asyncio.Future, int] = {}  # the next output of each unfinished stream
    try:
        for i, out in enumerate(firsts):
            yield i, out
            if not out.finished:
                pending[asyncio.ensure_future(anext(streams[i]))] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i, out = pending.pop(task), task.result()  # re-raises what the engine reported
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        running = {i for task, i in pending.items() if not task.done()}
        for task in pending:  # cancelling a running `anext` aborts that request
            task.cancel()
        for i, outputs in enumerate(streams):
            if i not in running:  # a generator inside a running `anext` cannot be closed
                await outputs.aclose()


async def sse_events(outputs, meta: dict, chat: bool, include_usage: bool, prompt_tokens: int):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

    `outputs` yields `(choice index, RequestOutput)` pairs (`merged_outputs`). If the client
    disconnects, Starlette cancels this generator; closing `outputs` in the `finally` aborts the
    requests on the engine thread, which frees their KV blocks.
    """
    # >>> week11: sse-events
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, delta: str | None, finish_reason: str | None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": index, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        payload = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    completion_tokens = 0
    try:
        if chat:
            yield chunk(0, None, None, role=True)
        async for index, out in outputs:
            if out.delta:
                yield chunk(index, out.delta, None)
            if out.finished:
                yield chunk(index, None if chat else "", out.finish_reason)
                completion_tokens += len(out.token_ids)
        if include_usage:
            usage = {**meta, "object": kind, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()
    # <<< week11: sse-events
