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
goes on serving. Nothing is silently ignored: a field the server does not honour is refused with
a 400 naming it (`check_fields`; docs/openai_api.md lists every field and its status).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.engine.async_engine import AsyncEngine, QueueFull
from nanoserve.engine.distributed import WorkerFailed
from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import TokenLogprob
from nanoserve.server.protocol import (
    APIError,
    _get,
    check_fields,
    choice_params,
    openai_fields,
    sampling_params_from,
    template_messages,
)
from nanoserve.server.streaming import (
    StreamLogprobs,
    TokenStrings,
    _usage,
    chat_logprobs,
    completion_logprobs,
)
from nanoserve.server.tools import ToolCallStream, ToolError, ToolUse, tool_use

MAX_BODY_BYTES = 1 << 20  # 1 MiB: prompts for a 1B model do not need more


# ------------------------------------------------------------------------- request validation








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
    from nanoserve.server.metrics import RequestLog, ServerMetrics

    app = FastAPI(title="nanoserve", version="0.1.0")
    tokenizer = engine.tokenizer
    token_strings = TokenStrings(tokenizer)
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
        if engine.failed is not None:  # week 18: a load balancer should take this replica out
            return JSONResponse({"status": "failed", "error": engine.failed}, status_code=503)
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
        check_fields(body, chat=False)
        params = sampling_params_from(body, default_max_tokens)
        params, n, echo = openai_fields(body, params, chat=False, vocab_size=vocab_size)
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
        echoed = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids)]
        return await respond(request, body, prompt_ids, params, chat=False, n=n, echo=echoed if echo else None)

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
        check_fields(body, chat=True)
        params = sampling_params_from(body, default_max_tokens)
        params, n, _ = openai_fields(body, params, chat=True, vocab_size=vocab_size)
        messages = template_messages(body.get("messages"), tokenizer.takes_tools)
        tools, params = chat_tools(body, params)
        try:
            prompt_ids = tokenizer.apply_chat_template(messages, tools=tools.tools if tools else None)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        check_length(prompt_ids, params, "messages")
        return await respond(request, body, [prompt_ids], params, chat=True, n=n, tools=tools)

    def chat_tools(body: dict, params: SamplingParams) -> tuple[ToolUse | None, SamplingParams]:
        """A chat request's tools (nanoserve/server/tools.py), and its params with the grammar of a call
        when `tool_choice` requires one."""
        try:
            tools = tool_use(body, tokenizer.tool_template, tokenizer.takes_tools)
            grammar = tools.grammar() if tools else None
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if grammar is None:
            return tools, params
        if params.grammar is not None:
            raise APIError(400, "'response_format' cannot be used with a 'tool_choice' that requires a call: the "
                                "call's own schema constrains the output", param="response_format")
        return tools, dataclasses.replace(params, grammar=grammar)

    async def respond(request: Request, body: dict, prompt_ids: list[list[int]], params: SamplingParams,
                      chat: bool, n: int = 1, echo: list[str] | None = None, tools: ToolUse | None = None):
        """Generate n choices per prompt, all at once or streamed: choice k is the (k % n)-th of
        prompt k // n (OpenAI's order). `echo`: completions' prompt texts, to put in front;
        `tools`: a chat's tools, whose calls are parsed from the answers."""
        stream = _get(body, "stream", (bool,), False)
        include_usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
        priority = _get(body, "priority", (int,), 0)
        if priority != 0 and engine.scheduling_policy != "priority":
            raise APIError(400, "'priority' needs a server started with --scheduling-policy priority "
                                f"(this one schedules by {engine.scheduling_policy})", param="priority")
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        total = len(prompt_ids) * n
        streams: list = [None] * total
        firsts: list = [None] * total
        # With prefix caching, the other n - 1 choices of a prompt start once its first one has
        # been prefilled: they find the prompt's full blocks in the cache and share them, so the
        # prompt is prefilled once. Without it, the n choices are n independent requests.
        later = n > 1 and engine.prefix_caching
        waves = [[k for k in range(total) if k % n == 0 or not later], [k for k in range(total) if k % n and later]]
        started = False
        try:
            for wave in waves:
                for k in wave:
                    name = request_id if total == 1 else f"{request_id}-{k}"
                    streams[k] = engine.generate(prompt_ids[k // n], choice_params(params, k % n), priority=priority,
                                                 request_id=name)
                # admission errors surface here, before any byte is sent
                results = await asyncio.gather(*(anext(streams[k]) for k in wave), return_exceptions=True)
                for k, result in zip(wave, results):
                    if isinstance(result, BaseException):
                        raise result
                    firsts[k] = result
            started = True
        except WorkerFailed as e:  # week 18: a rank of the engine is gone; nothing more can run
            raise APIError(503, f"the engine cannot serve: {e}", code="engine_failed", type_="server_error") from None
        except (QueueFull, ValueError) as e:
            if isinstance(e, ValueError):
                raise APIError(400, str(e)) from None
            raise APIError(429, f"the server is busy ({e}); retry shortly", code="server_overloaded",
                           type_="server_error", headers={"Retry-After": "1"}) from None
        finally:
            if not started:  # abort the choices already admitted
                for outputs in streams:
                    if outputs is not None:
                        await outputs.aclose()
        meta = dict(id=request_id, created=int(time.time()), model=model_name)
        prompt_tokens = sum(len(ids) for ids in prompt_ids)  # once per prompt, whatever n
        if stream:
            outputs = merged_outputs(streams, firsts)
            if echo is not None:  # a prompt's first choice has its logprobs (when asked), for all n
                outputs = with_echo(outputs, [echo[k // n] for k in range(total)],
                                    [firsts[k - k % n].prompt_logprobs for k in range(total)])
            logprobs = StreamLogprobs(token_strings, chat)
            tool_calls = _no_tool_calls
            if tools is not None:  # text that may be a tool call is held back (nanoserve/server/tools.py)
                tool_calls = ToolCallStream(tools)
                outputs = tool_calls.wrap(outputs)
            events = sse_events(outputs, meta, chat, include_usage, prompt_tokens, logprobs, tool_calls)
            return StreamingResponse(events, media_type="text/event-stream",
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
        if chat:  # with tools, an answer may be tool calls (nanoserve/server/tools.py)
            answers = [tools.message(last.text, last.finish_reason) if tools else
                       ({"role": "assistant", "content": last.text}, last.finish_reason) for last in lasts]
            choices = [{"index": k, "message": message,
                        "logprobs": None if last.logprobs is None else chat_logprobs(last.logprobs, token_strings),
                        "finish_reason": reason} for k, (last, (message, reason)) in enumerate(zip(lasts, answers))]
            return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}
        choices = []
        for k, last in enumerate(lasts):
            entries = last.logprobs
            if echo is not None and entries is not None:
                entries = lasts[k - k % n].prompt_logprobs + entries
            choices.append({"index": k, "text": (echo[k // n] if echo is not None else "") + last.text,
                            "logprobs": None if entries is None else completion_logprobs(entries, token_strings)[0],
                            "finish_reason": last.finish_reason})
        return {**meta, "object": "text_completion", "choices": choices, "usage": usage}

    return app


# ------------------------------------------------------------------------------------ logprobs


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


async def with_echo(outputs, texts: list[str], prompt_logprobs: list[list[TokenLogprob] | None]):
    """Completions' `echo` in a stream: choice k's prompt text (and, when asked, its logprobs) in
    front of its first output's delta. (An empty prompt text waits for an output that is
    delivered: one with text, or the last.)"""
    waiting = dict(enumerate(zip(texts, prompt_logprobs)))  # choice index -> what it has not sent yet
    try:
        async for index, out in outputs:
            if index in waiting and (waiting[index][0] or out.delta or out.finished):
                text, logprobs = waiting.pop(index)
                delta_logprobs = out.delta_logprobs if logprobs is None else logprobs + out.delta_logprobs
                out = dataclasses.replace(out, delta=text + out.delta, delta_logprobs=delta_logprobs)
            yield index, out
    finally:
        await outputs.aclose()


def _no_logprobs(index: int, out: RequestOutput) -> None:
    return None


def _no_tool_calls(index: int, out: RequestOutput) -> None:
    return None


async def sse_events(outputs, meta: dict, chat: bool, include_usage: bool, prompt_tokens: int,
                     logprobs=_no_logprobs, tool_calls=_no_tool_calls):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

    `outputs` yields `(choice index, RequestOutput)` pairs (`merged_outputs`). `logprobs(index,
    out)` gives the choice's `logprobs` object for the tokens an output delivers (`StreamLogprobs`;
    None when the request did not ask for them). `tool_calls(index, out)` gives the tool calls a
    chat choice's output delivers (`ToolCallStream`; None without tools). If the client
    disconnects, Starlette cancels this generator; closing `outputs` in the `finally` aborts the
    requests on the engine thread, which frees their KV blocks.
    """
    # >>> week11: sse-events
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, delta: str | None, finish_reason: str | None, role: bool = False,
              found: dict | None = None, calls: list | None = None) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            if calls:
                d["tool_calls"] = calls
            choice = {"index": index, "delta": d, "logprobs": found, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": found, "finish_reason": finish_reason}
        payload = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    completion_tokens = 0
    started = set()  # the chat choices that had their role chunk
    try:
        async for index, out in outputs:
            if chat and index not in started:
                started.add(index)
                yield chunk(index, None, None, role=True)
            found = logprobs(index, out)  # on the chunk with the text, else on the final one
            calls = tool_calls(index, out)
            if out.delta or calls:
                yield chunk(index, out.delta or None, None, found=found, calls=calls)
                found = None
            if out.finished:
                yield chunk(index, None if chat else "", out.finish_reason, found=found)
                completion_tokens += len(out.token_ids)
        if include_usage:
            usage = {**meta, "object": kind, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()
    # <<< week11: sse-events
