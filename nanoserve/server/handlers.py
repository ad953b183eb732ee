"""Weeks 10-11: what each route of the HTTP app does (nanoserve/server/app.py holds the routes).

Every handler is a plain function of a `ServerState` (the models, each with its engine, and the
server's settings) and the request. The two generation endpoints share one path:

    completions / chat_completions     read_json, check_fields, the model (issue 38: loaded if it
                                       is not), the params, the prompt token ids (tokenized on a
                                       worker thread), the rate limits
      -> respond                       submit (admit), then answer:
           streamed                    sse_events over the merged outputs (nanoserve/server/streaming.py)
           plain                       collect each choice's last output, then the body

An error a client can cause is raised as an `APIError` anywhere on that path; the app's
exception handler turns it into OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.sampling.params import SamplingParams
from nanoserve.server import tool_loop
from nanoserve.server.engine_calls import chat_prompt, chat_tools, check_length, collect, collect_all, submit
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.models import ModelRegistry, ServedModel
from nanoserve.server.protocol import (
    APIError,
    check_fields,
    check_schema,
    load_json,
    openai_fields,
    request_priority,
    sampling_params_from,
    stream_fields,
    template_messages,
)
from nanoserve.server.rate_limits import RateLimiter
from nanoserve.server.sessions import SessionStore, session_id_of
from nanoserve.server.streaming import (
    StreamLogprobs,
    chat_completion,
    merged_outputs,
    no_tool_calls,
    sse_events,
    text_completion,
    with_cached_tokens,
    with_echo,
)
from nanoserve.server.toolbox import MAX_TOOL_ROUNDS, ToolBox
from nanoserve.server.tools import ToolCallStream, ToolUse

MAX_BODY_BYTES = 1 << 20  # 1 MiB: prompts for a 1B model do not need more
# Issue 38: the threads that tokenize prompts, off the event loop. A core is left to the loop: with
# as many tokenizing threads as cores, measured on 2 cores, the loop waited up to 0.2 s for the CPU
# and the GIL (which the tokenizer takes back between its Rust parts); with one, 0.02 s.
TOKENIZER_THREADS = min(4, max(1, (os.cpu_count() or 2) - 1))


@dataclass
class ServerState:
    """What the handlers share: the models (issue 38: one or several, each with its engine), and the
    server's settings, fixed at start-up."""

    models: ModelRegistry  # the `model`s this server answers to, and their engines
    api_key: str | Sequence[str] | None = None  # checked by the `Guard` middleware, before any handler
    max_body_bytes: int = MAX_BODY_BYTES
    default_max_tokens: int = 16
    metrics: ServerMetrics | None = None  # week 16: GET /metrics, when on
    created: int = field(default_factory=lambda: int(time.time()))  # the models' `created` in /v1/models
    rate_limits: RateLimiter | None = None  # issue 38: --rate-limit-rpm / --rate-limit-tpm, when set
    sessions: SessionStore | None = None  # issue 38: conversations whose KV stays between turns
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="nanoserve-tokenizer"))
    toolbox: ToolBox | None = None  # issue 38: the server's own tools (--server-tools, --mcp-config)
    max_tool_rounds: int = MAX_TOOL_ROUNDS  # issue 38: used by the tool loop (--max-tool-rounds)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The app's lifespan (FastAPI's): the toolbox's MCP servers start before the first request
        and stop with the app; the tokenizer threads and the sessions end with it."""
        if self.toolbox is not None:
            try:  # an MCP server that fails to start stops the start-up: uvicorn says why and exits
                await self.toolbox.start()
            except ValueError as e:  # ToolBoxError: its one line, without the frames below
                raise type(e)(str(e)) from None
        try:
            yield
        finally:
            if self.toolbox is not None:
                await self.toolbox.close()
            self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            if self.sessions is not None:
                self.sessions.close()

    async def off_loop(self, work, *args):
        """`work(*args)` on a tokenizer thread (issue 38): a prompt of 100,000 characters takes about
        0.15 s to tokenize on a 2-core CPU, and on the event loop it would stall every other stream
        meanwhile. (HuggingFace's tokenizers let go of the GIL while their Rust code runs.)"""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, functools.partial(work, *args))


# ------------------------------------------------------------------------- the small routes


def health(state: ServerState) -> dict | JSONResponse:
    """`GET /health`: the engines' load, or 503 once one has failed (issue 38: summed over the models
    loaded; with several models, which are)."""
    loaded = state.models.loaded()
    several = len(state.models.names) > 1
    failed = [(m.name, m.engine.failed) for m in loaded if m.engine.failed is not None]
    if failed:  # week 18: a load balancer should take this replica out
        error = "; ".join(f"{name}: {why}" if several else why for name, why in failed)
        return JSONResponse({"status": "failed", "error": error}, status_code=503)
    blocks = [m.engine.kv_blocks() for m in loaded]
    body = {"status": "ok", "requests_in_flight": sum(m.engine.num_pending for m in loaded),
            "kv_blocks_free": sum(free for free, _ in blocks), "kv_blocks_total": sum(total for _, total in blocks)}
    if several:
        body["models"] = {slot.name: slot.state for slot in state.models.slots.values()}
    return body


def metrics_page(state: ServerState) -> Response:
    """`GET /metrics` (week 16): every metric in Prometheus' text format."""
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)


def list_models(state: ServerState) -> dict:
    """`GET /v1/models`: each model served (issue 38: loaded or not), then its LoRA adapters (week 23)."""
    cards = []
    for slot in state.models.slots.values():
        cards.append(model_card(state, slot.name))
        cards += [model_card(state, adapter) for adapter in state.models.adapters_of(slot)]
    return {"object": "list", "data": cards}


def retrieve_model(state: ServerState, model_id: str) -> dict:
    """`GET /v1/models/{id}`: a served model or one of its adapters, or a 404 for any other id."""
    state.models.check({"model": model_id})
    return model_card(state, model_id)


def model_card(state: ServerState, name: str) -> dict:
    """A served model, as OpenAI's model object (and its context length, as vLLM adds, once the model
    has been loaded; an adapter's `parent` is its base model, as vLLM has it). With several models
    (issue 38), `loaded` says whether the model is resident now."""
    slot = state.models.slot_of(name)
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "nanoserve"}
    if slot.max_model_len is not None:
        card["max_model_len"] = slot.max_model_len
    if name != slot.name:
        card["parent"] = slot.name
    elif len(state.models.names) > 1:
        card["loaded"] = slot.served is not None
    return card


# ----------------------------------------------------------------------------- the requests


async def read_json(state: ServerState, request: Request, model_required: bool = True) -> dict:
    """The body: a JSON object that names the model served (`model_required=False`: or names none,
    as the tokenizer endpoints' clients send it)."""
    # Without a Content-Length (a chunked upload) the Guard cannot refuse it up front: count the
    # bytes as they arrive, and stop reading at the limit rather than buffer a body of any size.
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:
            raise APIError(413, f"request body larger than {state.max_body_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    body = load_json(raw)  # within the limits on nesting, integers and Unicode
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if model_required or body.get("model") is not None:
        state.models.check(body)
    return body


async def completions(state: ServerState, request: Request):
    """`POST /v1/completions`."""
    arrival_time = time.perf_counter()  # TTFT counts from here: the model's load and the tokenizing too
    body = await read_json(state, request)
    check_fields(body, chat=False)
    limit_requests(state, request)
    async with state.models.use(body["model"]) as model:
        params = sampling_params_from(body, state.default_max_tokens)
        params, n, echo = openai_fields(body, params, chat=False, vocab_size=model.engine.vocab_size)
        prompts, names = completion_prompts(body.get("prompt"))
        prompt_ids = await asyncio.gather(*(state.off_loop(prompt_token_ids, model, p, name)
                                            for p, name in zip(prompts, names)))
        for ids, name in zip(prompt_ids, names):
            check_length(model, ids, params, name)
        limit_tokens(state, request, prompt_ids, params, n)
        echoed = [p if isinstance(p, str) else model.engine.tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids)]
        return await respond(state, model, request, body, prompt_ids, params, chat=False, n=n,
                             echo=echoed if echo else None, arrival_time=arrival_time)


def completion_prompts(prompt: Any) -> tuple[list, list[str]]:
    """A completion request's `prompt` as (a list of prompts, each one's name for errors)."""
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
    return prompts, names


def prompt_token_ids(model: ServedModel, prompt: Any, param: str) -> list[int]:
    """One prompt of a completion request, a string or a list of token ids, as token ids."""
    vocab_size = model.engine.vocab_size
    if isinstance(prompt, str) and prompt:
        return model.engine.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < vocab_size for t in prompt):
        return list(prompt)  # already tokenized
    raise APIError(400, f"'{param}' must be a non-empty string or a list of token ids in [0, {vocab_size}) "
                        "('prompt' may also be a list of those, one choice each)", param=param)


async def chat_completions(state: ServerState, request: Request):
    """`POST /v1/chat/completions`."""
    arrival_time = time.perf_counter()  # TTFT counts from here: the model's load and the tokenizing too
    body = await read_json(state, request)
    check_fields(body, chat=True)
    limit_requests(state, request)
    async with state.models.use(body["model"]) as model:
        params = sampling_params_from(body, state.default_max_tokens)
        params, n, _ = openai_fields(body, params, chat=True, vocab_size=model.engine.vocab_size)
        messages = template_messages(body.get("messages"), model.engine.tokenizer.takes_tools)
        if tool_loop.offered(state, model, body):  # issue 38: the server runs its own tools' calls
            return await with_tool_loop(state, model, request, body, messages, params, n, arrival_time)
        tools, params = chat_tools(model, body, params)
        prompt_ids = await state.off_loop(chat_prompt, model, messages, tools)
        check_length(model, prompt_ids, params, "messages")
        limit_tokens(state, request, [prompt_ids], params, n)
        return await respond(state, model, request, body, [prompt_ids], params, chat=True, n=n, tools=tools,
                             arrival_time=arrival_time)


async def with_tool_loop(state: ServerState, model: ServedModel, request: Request, body: dict, messages: list[dict],
                         params: SamplingParams, n: int, arrival_time: float):
    """Issue 38: a chat request offered the server's tools, answered by the tool loop
    (nanoserve/server/tool_loop.py), each round on the engine as `respond` starts a request."""
    if n != 1 or body.get("logprobs"):
        raise APIError(400, "with the server's tools a request asks for one answer and no logprobs (n = 1): send "
                            "\"server_tools\": false for more", param="n" if n != 1 else "logprobs")
    use, first_params = chat_tools(model, tool_loop.with_server_tools(body, state.toolbox), params)
    stream, include_usage = stream_fields(body)
    priority = request_priority(body, model.engine.scheduling_policy)
    check_schema(body, True)
    turn = await session_turn(state, model, request, body, 1, None)
    lora = body["model"] if body["model"] != model.name else None

    async def start_round(prompt_ids, round_params, request_id, resume_from, r):
        streams, firsts = await submit(model.engine, [prompt_ids], round_params, 1, priority, request_id, lora=lora,
                                       arrival_time=arrival_time if r == 0 else None,  # TTFT: round 0's
                                       turn=tool_loop.RoundOptions(resume_from))
        return streams[0], firsts[0]

    def check_fits(prompt_ids: list[int], r: int) -> None:
        check_length(model, prompt_ids, first_params if r == 0 else params, "messages")
        limit_tokens(state, request, [prompt_ids], params, 1)  # every round draws on the client's tokens

    async def finish(held: int | None, last) -> None:
        if turn is not None:
            turn.end(last)  # the session keeps the last round's KV for its next turn
        if held is not None and (turn is None or last is None):
            await model.engine.release_held(held)

    loop = tool_loop.ToolLoop(state.toolbox, state.max_tool_rounds, use, first_params, params, start_round,
                              lambda m, u: state.off_loop(chat_prompt, model, m, u), check_fits, finish)
    resume_from = turn.resume_from if turn is not None else None  # a session's last turn: round 0 starts from it
    if stream:
        return loop.streamed(messages, body["model"], include_usage, resume_from)
    answer = await loop.plain(messages, functools.partial(collect, request), body["model"], resume_from)
    if answer is None:  # nobody is listening any more
        return JSONResponse({"error": {"message": "client closed the request", "type": "client_closed",
                                       "param": None, "code": None}}, status_code=499)
    return answer


def limit_requests(state: ServerState, request: Request) -> None:
    """Issue 38: one request from the client's request bucket, or a 429 (with rate limits on)."""
    if state.rate_limits is not None:
        state.rate_limits.take_request(client_of(state, request))


def limit_tokens(state: ServerState, request: Request, prompt_ids: list[list[int]], params: SamplingParams,
                 n: int) -> None:
    """Issue 38: the request's tokens from the client's token bucket (every prompt, and max_tokens for
    each of its n choices), or a 429."""
    if state.rate_limits is not None:
        tokens = sum(len(ids) + n * params.max_tokens for ids in prompt_ids)
        state.rate_limits.take_tokens(client_of(state, request), tokens)


def client_of(state: ServerState, request: Request) -> str:
    """Whose buckets a request draws from: its API key (the `Guard` has checked it; sent as a Bearer
    token, or, by Anthropic's clients, as `x-api-key`), or, on a server without keys, its address."""
    if state.api_key:
        bearer = request.headers.get("authorization", "").partition(" ")[2].strip()
        return bearer or request.headers.get("x-api-key", "").strip()
    return request.client.host if request.client else "unknown"


# ---------------------------------------------------------------------------- the answers


async def respond(state: ServerState, model: ServedModel, request: Request, body: dict, prompt_ids: list[list[int]],
                  params: SamplingParams, chat: bool, n: int = 1, echo: list[str] | None = None,
                  tools: ToolUse | None = None, arrival_time: float | None = None):
    """Generate n choices per prompt on `model`, all at once or streamed: choice k is the (k % n)-th
    of prompt k // n (OpenAI's order). `echo`: completions' prompt texts, to put in front; `tools`: a
    chat's tools, whose calls are parsed from the answers; `arrival_time`: when the request came
    (`time.perf_counter()`), which its TTFT counts from."""
    stream, include_usage = stream_fields(body)
    priority = request_priority(body, model.engine.scheduling_policy)
    check_schema(body, chat)  # the last check before the engine: the body fits its published model
    kv_transfer = kv_transfer_params(body, prompt_ids, n, stream, echo)
    turn = await session_turn(state, model, request, body, len(prompt_ids) * n, kv_transfer)
    if kv_transfer is not None and isinstance(kv_transfer.get("prompt_token_ids"), list):
        prompt_ids = [kv_transfer["prompt_token_ids"]]  # a decode instance: the prompt whose KV comes
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    lora = body["model"] if body["model"] != model.name else None  # week 23: an adapter, by name
    try:
        streams, firsts = await submit(model.engine, prompt_ids, params, n, priority, request_id, kv_transfer, lora,
                                       arrival_time, turn)
    except BaseException:
        if turn is not None:
            turn.end(None)
        raise
    meta = dict(id=request_id, created=int(time.time()), model=body["model"])
    prompt_tokens = sum(len(ids) for ids in prompt_ids)  # once per prompt, whatever n
    total = len(streams)
    if stream:
        outputs = merged_outputs(streams, firsts)
        if echo is not None:  # a prompt's first choice has its logprobs (when asked), for all n
            outputs = with_echo(outputs, [echo[k // n] for k in range(total)],
                                [firsts[k - k % n].prompt_logprobs for k in range(total)])
        logprobs = StreamLogprobs(model.token_strings, chat)
        tool_calls = no_tool_calls
        if tools is not None:  # text that may be a tool call is held back (nanoserve/server/tools.py)
            tool_calls = ToolCallStream(tools)
            outputs = tool_calls.wrap(outputs)
        events = sse_events(outputs, meta, chat, include_usage, prompt_tokens, logprobs, tool_calls)
        events = with_cached_tokens(events, sum(first.num_cached_tokens for first in firsts[::n]))  # issue 38
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    lasts = await collect_all(request, streams, firsts)
    if lasts is None:  # nobody is listening any more
        return JSONResponse({"error": {"message": "client closed the request", "type": "client_closed",
                                       "param": None, "code": None}}, status_code=499)
    if chat:
        answer = chat_completion(meta, lasts, tools, model.token_strings, prompt_tokens)
    else:
        answer = text_completion(meta, lasts, n, echo, model.token_strings, prompt_tokens)
    if kv_transfer is not None:  # issue 35, a prefill instance: what the decode instance needs (None: all done)
        answer["kv_transfer_params"] = lasts[0].kv_transfer
    return answer


async def session_turn(state: ServerState, model: ServedModel, request: Request, body: dict, total: int,
                       kv_transfer: dict | None):
    """Issue 38: the request's session turn (nanoserve/server/sessions.py), or None without a session id."""
    session_id = session_id_of(body, request.headers)
    if session_id is None or state.sessions is None:
        return None
    if total != 1 or kv_transfer is not None:
        raise APIError(400, "a session turn is one prompt with n = 1 (and no 'kv_transfer_params')", param="session_id")
    return await state.sessions.begin(model.name, model.engine, session_id)


def kv_transfer_params(body: dict, prompt_ids: list[list[int]], n: int, stream: bool,
                       echo: list[str] | None) -> dict | None:
    """Issue 35: the request's `kv_transfer_params` (disaggregated serving: what the proxy sends a
    prefill or decode instance, nanoserve/server/disaggregated.py), or None."""
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if len(prompt_ids) != 1 or n != 1 or echo is not None:
        raise APIError(400, "'kv_transfer_params' takes one prompt, n = 1 and no echo", param="kv_transfer_params")
    if value.get("send") and stream:
        raise APIError(400, "a prefill instance answers 'kv_transfer_params' in one JSON body: send 'stream': false",
                       param="stream")
    return value


