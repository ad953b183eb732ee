"""Issue 38: a streamed /v1/messages answer, as Anthropic's server-sent events.

    event: message_start          the message, its content empty, usage.input_tokens counted
    event: content_block_start    a text block (or a tool_use block: id, name, input {})
    event: content_block_delta    text_delta {text} for a text block; input_json_delta {partial_json}
                                  for a tool_use block (here the call's whole input in one delta)
    event: content_block_stop
    ...                           (one start, deltas, stop per block, numbered by `index`)
    event: message_delta          stop_reason, stop_sequence, usage.output_tokens
    event: message_stop

An error once the stream has begun (the engine failed) cannot change the status any more: it comes
as an `error` event, `{"type": "error", "error": {"type": "api_error", "message": ...}}`, and the
stream ends. With tools, text that may still become a call is held back (`ToolCallStream`,
nanoserve/server/tools.py), and the calls come as tool_use blocks once the answer is complete.
"""

from __future__ import annotations

import json
import logging

from nanoserve.engine.outputs import RequestOutput

logger = logging.getLogger("nanoserve.server")


def stop_reason(last: RequestOutput, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer; `called`: it is tool calls."""
    if called or last.finish_reason == "tool_calls":
        return "tool_use", None
    if last.finish_reason == "length":
        return "max_tokens", None
    if last.stop_string is not None:
        return "stop_sequence", last.stop_string
    return "end_turn", None


def event(kind: str, data: dict) -> str:
    """One server-sent event: its name, and its data with the same `type`."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def tool_use_events(index: int, call: dict) -> list[str]:
    """A call (OpenAI's stream shape, from `ToolCallStream`) as one tool_use block's events."""
    block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
             "input": {}}
    delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
    return [event("content_block_start", {"index": index, "content_block": block}),
            event("content_block_delta", {"index": index, "delta": delta}),
            event("content_block_stop", {"index": index})]


async def message_events(outputs, meta: dict, input_tokens: int, tool_calls=None):
    """The events of one answer. `outputs` yields `(0, RequestOutput)` pairs (`merged_outputs`, maybe
    wrapped by `tool_calls`, a `ToolCallStream`, which is then also asked for each output's calls).
    Closing `outputs` (in the `finally`: the client went away, or the answer is complete) aborts the
    request on the engine."""
    message = {**meta, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    yield event("message_start", {"message": message})
    blocks = 0  # blocks started; the text block, when open, is the last
    text_open = False
    try:
        async for _, out in outputs:
            if out.delta:
                if not text_open:
                    yield event("content_block_start", {"index": blocks, "content_block": {"type": "text", "text": ""}})
                    text_open, blocks = True, blocks + 1
                yield event("content_block_delta", {"index": blocks - 1, "delta": {"type": "text_delta",
                                                                                   "text": out.delta}})
            calls = tool_calls(0, out) if tool_calls is not None else None
            if not out.finished:
                continue
            if out.finish_reason == "error":
                raise RuntimeError(str(out.error) if out.error is not None else "the request failed on the engine")
            if text_open:
                yield event("content_block_stop", {"index": blocks - 1})
                text_open = False
            for call in calls or []:
                for line in tool_use_events(blocks, call):
                    yield line
                blocks += 1
            reason, sequence = stop_reason(out, bool(calls))
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"output_tokens": len(out.token_ids)}})
            yield event("message_stop", {})
    except Exception as e:  # the status went out with message_start: an error event is all that is left
        logger.exception("a /v1/messages stream failed")
        yield event("error", {"error": {"type": "api_error", "message": f"{type(e).__name__}: {e}"}})
    finally:
        await outputs.aclose()
