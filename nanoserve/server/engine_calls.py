"""Starting a request's choices on its model's engine and collecting what they produce: the part of
the generation endpoints that the chat and completions handlers (nanoserve/server/handlers.py), the
Messages API (nanoserve/server/messages_api.py) and the tool loop (nanoserve/server/tool_loop.py)
share. Each raises an `APIError` for what a client caused, before a byte of the response is sent."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request

from nanoserve.engine.async_engine import AsyncEngine, QueueFull
from nanoserve.engine.distributed import WorkerFailed
from nanoserve.engine.outputs import RequestOutput
from nanoserve.runner.kv_connector import TransferFailed, TransferTimedOut
from nanoserve.sampling.params import SamplingParams
from nanoserve.server.models import ServedModel
from nanoserve.server.protocol import APIError, choice_params
from nanoserve.server.tools import ToolError, ToolUse, tool_use


def check_length(model: ServedModel, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
    """400 unless the prompt and the tokens asked for fit the model's context."""
    max_model_len = model.engine.max_model_len
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt has "
                            f"{len(prompt_ids)} and max_tokens asks for {params.max_tokens} more",
                       param=param if len(prompt_ids) >= max_model_len else "max_tokens",
                       code="context_length_exceeded")


def chat_prompt(model: ServedModel, messages: list[dict], tools: ToolUse | None) -> list[int]:
    """The prompt's token ids: the messages (and the tools) through the model's chat template."""
    try:
        return model.engine.tokenizer.apply_chat_template(messages, tools=tools.tools if tools else None)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def chat_tools(model: ServedModel, body: dict, params: SamplingParams) -> tuple[ToolUse | None, SamplingParams]:
    """A chat request's tools (nanoserve/server/tools.py), and its params with the grammar of a call
    when `tool_choice` requires one."""
    tokenizer = model.engine.tokenizer
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


async def submit(engine: AsyncEngine, prompt_ids: list[list[int]], params: SamplingParams, n: int,
                 priority: int, request_id: str, kv_transfer: dict | None = None,
                 lora: str | None = None, arrival_time: float | None = None,
                 turn=None) -> tuple[list, list[RequestOutput]]:
    """Start every choice on the engine and await its first output: (the engine generators, their
    first outputs), choice k the (k % n)-th of prompt k // n. Every reason to refuse the request
    surfaces here, as an APIError, before a byte of the response is sent; the choices already
    started are then aborted. `turn` (issue 38): the session turn of a one-choice request."""
    total = len(prompt_ids) * n
    if total > engine.max_pending:  # a 429 would have the client retry what can never be admitted
        raise APIError(400, f"this request asks for {total} choices ({len(prompt_ids)} prompt(s) x n = {n}), more than "
                            f"this server ever runs at once (--max-pending {engine.max_pending}): send fewer "
                            "prompts or a smaller 'n'", param="n" if n > 1 else "prompt")
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
                                             request_id=name, kv_transfer=kv_transfer, lora=lora,
                                             arrival_time=arrival_time, **(turn.options() if turn else {}))
                if turn is not None:
                    streams[k] = turn.track(streams[k])
            # admission errors surface here, before any byte is sent
            results = await asyncio.gather(*(anext(streams[k]) for k in wave), return_exceptions=True)
            for k, result in zip(wave, results):
                if isinstance(result, BaseException):
                    raise result
                firsts[k] = result
        started = True
    except WorkerFailed as e:  # week 18: a rank of the engine is gone; nothing more can run
        raise APIError(503, f"the engine cannot serve: {e}", code="engine_failed", type_="server_error") from None
    except TransferTimedOut as e:  # issue 35: this request's KV did not come from the prefill instance in time
        raise APIError(504, str(e), code="kv_transfer_timeout", type_="server_error") from None
    except TransferFailed as e:  # issue 35: the prefill instance is gone, or lost this request's KV
        raise APIError(502, str(e), code="kv_transfer_failed", type_="server_error") from None
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
    return streams, firsts


async def collect_all(request: Request, streams: list, firsts: list[RequestOutput]) -> list[RequestOutput] | None:
    """Every choice's last output (one `collect` each, run together), or None if the client
    disconnected meanwhile."""
    tasks = [asyncio.ensure_future(collect(request, o, f)) for o, f in zip(streams, firsts)]
    try:
        lasts = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # if one failed, stop the others
            task.cancel()
    if any(last is None for last in lasts):
        return None
    return lasts


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
