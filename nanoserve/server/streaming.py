"""What goes back out: the body of a plain response (`chat_completion`, `text_completion`), the
server-sent events of a streamed one (`sse_events`, week 11), the logprob objects and token
strings inside both, and the usage counts."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.sampler import TokenLogprob
from nanoserve.server.tools import ToolUse


class TokenStrings:
    """What the logprobs fields show of a token id: its text (special tokens spelled out), its
    width in the output text (0 for a special token, which the text skips), and its bytes.
    Cached: the same alternatives come back at every position."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, int, list[int]]] = {}
        try:  # byte-level BPE (Llama 3): each character of a raw token stands for one byte
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_of = {c: b for b, c in bytes_to_unicode().items()}
        except ImportError:
            self.byte_of = {}

    def __call__(self, token: int) -> tuple[str, int, list[int]]:
        if token not in self.cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            width = len(self.tokenizer.decode([token], skip_special_tokens=True))
            raw = self.tokenizer.hf.convert_ids_to_tokens(token)
            if isinstance(raw, str) and raw and all(c in self.byte_of for c in raw):
                data = [self.byte_of[c] for c in raw]  # exact, even for half a character
            else:
                data = list(text.encode("utf-8"))
            self.cache[token] = (text, width, data)
        return self.cache[token]


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # OpenAI's floor ("very unlikely"), and never -inf in JSON


def completion_logprobs(entries: list[TokenLogprob], strings: TokenStrings, offset: int = 0) -> tuple[dict, int]:
    """Completions' (legacy) logprobs object for `entries`, whose first token's text starts at
    `offset` in the choice's text; also returns where the next token's text starts. Each
    `top_logprobs` dict holds the requested alternatives and the chosen token (OpenAI: up to
    logprobs + 1 entries); a position nothing predicts (the first prompt token) has None."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text, width, _ = strings(e.token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += width
        if e.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_logprob(e.logprob))
        top = {strings(t)[0]: _logprob(lp) for t, lp in e.top}
        top.setdefault(text, _logprob(e.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries: list[TokenLogprob], strings: TokenStrings) -> dict:
    """Chat's logprobs object: `content`, one item per token, with its text, logprob, UTF-8 bytes
    and its `top_logprobs` alternatives (as many as asked)."""
    def item(token: int, logprob: float) -> dict:
        text, _, data = strings(token)
        return {"token": text, "logprob": _logprob(logprob), "bytes": data}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


class StreamLogprobs:
    """`sse_events`' `logprobs(index, out)`: the logprobs object of the tokens an output
    delivers (`out.delta_logprobs`), or None when it delivers none. Keeps each choice's text
    offset (completions) from chunk to chunk."""

    def __init__(self, strings: TokenStrings, chat: bool):
        self.strings, self.chat = strings, chat
        self.offsets: dict[int, int] = {}

    def __call__(self, index: int, out: RequestOutput) -> dict | None:
        if not out.delta_logprobs:
            return None
        if self.chat:
            return chat_logprobs(out.delta_logprobs, self.strings)
        found, self.offsets[index] = completion_logprobs(out.delta_logprobs, self.strings, self.offsets.get(index, 0))
        return found


def _usage(prompt_tokens: int, completion_tokens: int, cached: list[RequestOutput] = ()) -> dict:
    """OpenAI's `usage` object, at the end of a plain body or in a stream's usage chunk. `cached`:
    each prompt's first choice; when their prompts had tokens not prefilled (found in the prefix
    cache, or a session's held KV: issue 38), `prompt_tokens_details.cached_tokens` counts them."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    cached_tokens = sum(out.num_cached_tokens for out in cached)
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


# ------------------------------------------------------------------------------ plain responses


def chat_completion(meta: dict, lasts: list[RequestOutput], tools: ToolUse | None, strings: TokenStrings,
                    prompt_tokens: int) -> dict:
    """The body of a plain chat response, from each choice's last output. With tools, an answer
    may be tool calls (nanoserve/server/tools.py)."""
    answers = [tools.message(last.text, last.finish_reason) if tools else
               ({"role": "assistant", "content": last.text}, last.finish_reason) for last in lasts]
    choices = [{"index": k, "message": message,
                "logprobs": None if last.logprobs is None else chat_logprobs(last.logprobs, strings),
                "finish_reason": reason} for k, (last, (message, reason)) in enumerate(zip(lasts, answers))]
    usage = _usage(prompt_tokens, sum(len(last.token_ids) for last in lasts), lasts[:1])
    return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}


def text_completion(meta: dict, lasts: list[RequestOutput], n: int, echo: list[str] | None, strings: TokenStrings,
                    prompt_tokens: int) -> dict:
    """The body of a plain completions response, from each choice's last output: choice k is the
    (k % n)-th of prompt k // n. `echo`: the prompts' texts, to put in front of their choices
    (with the prompt's logprobs, which its first choice has, when asked)."""
    choices = []
    for k, last in enumerate(lasts):
        entries = last.logprobs
        if echo is not None and entries is not None:
            entries = lasts[k - k % n].prompt_logprobs + entries
        choices.append({"index": k, "text": (echo[k // n] if echo is not None else "") + last.text,
                        "logprobs": None if entries is None else completion_logprobs(entries, strings)[0],
                        "finish_reason": last.finish_reason})
    usage = _usage(prompt_tokens, sum(len(last.token_ids) for last in lasts), lasts[::n])
    return {**meta, "object": "text_completion", "choices": choices, "usage": usage}


# ---------------------------------------------------------------------- streamed responses (SSE)


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


def no_logprobs(index: int, out: RequestOutput) -> None:
    return None


def no_tool_calls(index: int, out: RequestOutput) -> None:
    return None


async def sse_events(outputs, meta: dict, chat: bool, include_usage: bool, prompt_tokens: int,
                     logprobs=no_logprobs, tool_calls=no_tool_calls):
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


async def with_cached_tokens(events, cached_tokens: int):
    """Issue 38: `prompt_tokens_details.cached_tokens` written into a stream's usage chunk (the one
    with no choices, which `sse_events` ends with when asked). The count is known before the stream
    starts, from each prompt's first output; passing it through here keeps week 11's `sse_events` as
    it was taught."""
    try:
        async for event in events:
            if cached_tokens and event.startswith('data: {"') and '"choices": []' in event:
                payload = json.loads(event[len("data: "):])
                payload["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
                event = f"data: {json.dumps(payload)}\n\n"
            yield event
    finally:
        await events.aclose()
