"""Issue 38: Anthropic's Messages API, for agents and SDKs written against it.

    POST /v1/messages                 a conversation in, the assistant's message out (or streamed)
    POST /v1/messages/count_tokens    the input tokens the same request would count

The request is read by nanoserve/server/messages_request.py, which writes the chat body that asks
for the same answer; from there the chat endpoint's own functions (nanoserve/server/handlers.py)
pick the model, build the sampling parameters, render the prompt through the chat template, set
up tool calling (and, for a forced call, its grammar), check the context length and the rate
limits, and start the request on the engine. Only the answer's shape is Anthropic's:

    {"id": "msg_...", "type": "message", "role": "assistant", "model": ...,
     "content": [{"type": "text", "text": ...}, {"type": "tool_use", "id": "toolu_...", "name": ...,
                  "input": {...}}],
     "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use",
     "stop_sequence": the stop sequence met, or null,
     "usage": {"input_tokens": ..., "output_tokens": ...}}

A stream is the events of nanoserve/server/messages_stream.py. Errors on these paths come in
Anthropic's shape, `{"type": "error", "error": {"type": ..., "message": ...}}` (`error_response`;
the `Guard` in app.py uses it too, for a missing key on these paths), the OpenAI routes keeping theirs.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanoserve.server import engine_calls, handlers
from nanoserve.server.handlers import ServerState
from nanoserve.server.messages_request import chat_body
from nanoserve.server.messages_schema import CountTokensRequest, MessagesRequest
from nanoserve.server.messages_stream import message_events, stop_reason
from nanoserve.server.protocol import APIError, sampling_params_from, template_messages
from nanoserve.server.schema import request_body
from nanoserve.server.streaming import merged_outputs
from nanoserve.server.tools import ToolCallStream, ToolUse

MESSAGES_PATH, COUNT_TOKENS_PATH = "/v1/messages", "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for "overloaded": the engine's queue is full


def is_messages_path(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object for a status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError) -> JSONResponse:
    """An `APIError` in Anthropic's shape. The engine's full queue (OpenAI's 429 "server_overloaded") is
    Anthropic's 529 "overloaded_error"; a rate limit stays a 429 "rate_limit_error"."""
    status = OVERLOADED if error.code == "server_overloaded" else error.status
    return JSONResponse(error_body(status, error.message), status_code=status, headers=error.headers)


async def messages(state: ServerState, request: Request):
    """`POST /v1/messages`."""
    arrival_time = time.perf_counter()
    body = await handlers.read_json(state, request)
    chat = chat_body(body)
    handlers.limit_requests(state, request)
    async with state.models.use(body["model"]) as model:
        params = sampling_params_from(chat, state.default_max_tokens)
        messages_ = template_messages(chat["messages"], model.engine.tokenizer.takes_tools)
        tools, params = engine_calls.chat_tools(model, chat, params)
        prompt_ids = await state.off_loop(engine_calls.chat_prompt, model, messages_, tools)
        engine_calls.check_length(model, prompt_ids, params, "messages")
        handlers.limit_tokens(state, request, [prompt_ids], params, 1)
        message_id = "msg_" + uuid.uuid4().hex[:24]
        lora = body["model"] if body["model"] != model.name else None
        streams, firsts = await engine_calls.submit(model.engine, [prompt_ids], params, 1, 0, message_id, lora=lora,
                                                arrival_time=arrival_time)
        meta = {"id": message_id, "type": "message", "role": "assistant", "model": body["model"]}
        if body.get("stream"):
            outputs = merged_outputs(streams, firsts)
            tool_calls = None
            if tools is not None:  # text that may be a call is held back (nanoserve/server/tools.py)
                tool_calls = ToolCallStream(tools)
                outputs = tool_calls.wrap(outputs)
            events = message_events(outputs, meta, len(prompt_ids), tool_calls)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        lasts = await engine_calls.collect_all(request, streams, firsts)
        if lasts is None:
            return JSONResponse(error_body(499, "client closed the request"), status_code=499)
        return message(meta, lasts[0], tools, len(prompt_ids))


def message(meta: dict, last, tools: ToolUse | None, input_tokens: int) -> dict:
    """The body of a plain answer, from the request's last output."""
    content, calls = tools.parse(last.text) if tools is not None else (last.text, [])
    blocks = [{"type": "text", "text": content}] if content else []
    blocks += [tool_use_block(call) for call in calls]
    reason, sequence = stop_reason(last, bool(calls))
    return {**meta, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": len(last.token_ids)}}


def tool_use_block(call: dict) -> dict:
    """One parsed call (OpenAI's shape, nanoserve/server/tools.py) as a tool_use block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}


async def count_tokens(state: ServerState, request: Request) -> dict:
    """`POST /v1/messages/count_tokens`: the prompt's tokens, the rendered system, messages and tools
    (the body of a /v1/messages request, max_tokens optional)."""
    body = await handlers.read_json(state, request)
    chat = chat_body(body, counting=True)
    async with state.models.use(body["model"]) as model:
        params = sampling_params_from(chat, state.default_max_tokens)
        messages_ = template_messages(chat["messages"], model.engine.tokenizer.takes_tools)
        tools, _ = engine_calls.chat_tools(model, chat, params)
        prompt_ids = await state.off_loop(engine_calls.chat_prompt, model, messages_, tools)
    return {"input_tokens": len(prompt_ids)}


def add_routes(app: FastAPI, state: ServerState) -> None:
    """The two routes, their errors in Anthropic's shape; their bodies' models are published in
    /openapi.json (`messages_schema.add_messages_models`)."""

    def route(path: str, model, handler, name: str) -> None:
        async def endpoint(request: Request):
            try:
                return await handler(state, request)
            except APIError as e:
                return error_response(e)

        app.post(path, openapi_extra=request_body(model), name=name)(endpoint)

    route(MESSAGES_PATH, MessagesRequest, messages, "messages_endpoint")
    route(COUNT_TOKENS_PATH, CountTokensRequest, count_tokens, "count_tokens_endpoint")
