"""Issue 38: the server-side tool loop (week 25).

A model that calls a tool the *server* owns (nanoserve/server/toolbox.py: the built-ins and the
tools of MCP servers) does not send the call back to the client. The server runs it and the same
request goes on:

    round 0   prompt = the conversation (+ every tool's schema) -> the model answers
              a call of a server tool?  no  -> the answer goes to the client, as without the loop
                                        yes -> run it (with its timeout), then
    round 1   prompt = the conversation + the assistant's call + the tool's result -> the model answers
    ...       up to --max-tool-rounds rounds of calls

Why here, next to the engine, rather than in the client: every round's prompt is the last
round's prompt plus a few dozen tokens (the call and its result). Each round runs with its KV
held when it finishes (`hold_kv`), and the next round resumes from it (`resume_from`): the engine
keeps the blocks of the longest prefix the two prompts share, so only the new tokens are
prefilled. A client driving the same loop sends the whole conversation back every round, and
the server prefills all of it again unless its prefix cache still holds it.

The rules, as a client sees them:
- The server's tools are offered to the model with the request's own `tools`, unless the request
  sets `"server_tools": false` (a nanoserve field) or `tool_choice: "none"`, or the model's chat
  template takes no tools (then they are not offered, and the chat runs as before). A request tool
  named like a server tool is a 400.
- `tool_choice` "required" or a named function constrains round 0 only; later rounds are "auto"
  (otherwise a required call would be forced again every round, until the cap).
- Calls of client tools end the loop: they go back to the client as today. In an answer that mixes
  both, the server's calls are run first and the client's are returned.
- A tool that fails, is refused or times out gives the model a tool message saying so
  (`ToolResult.is_error`); the request goes on. It is never a 500.
- After `--max-tool-rounds` rounds of calls, an answer that still calls server tools is returned
  as it is, its calls not run: listed under `pending_tool_calls`, with finish reason "stop".
- What the server ran is in the response: `tool_rounds` (plain) or one chunk per round with a
  `tool_round` field (streamed), each the calls and their results. `usage` sums every round, and
  `prompt_tokens_details.cached_tokens` counts the prompt tokens the rounds did not prefill.
- n > 1 and logprobs are refused with server tools (one conversation, one answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.params import SamplingParams
from nanoserve.server.protocol import APIError
from nanoserve.server.tools import ToolCallStream, ToolUse


@dataclass
class LoopState:
    """One request's loop: the conversation so far, what each round cost, what the server ran."""

    messages: list[dict]
    rounds: list[dict] = field(default_factory=list)  # {"calls": [...], "results": [...]} per round run
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    held: int | None = None  # the engine request whose KV the next round resumes from

    def count(self, last: RequestOutput, prompt_len: int) -> None:
        self.prompt_tokens += prompt_len
        self.completion_tokens += len(last.token_ids)
        self.cached_tokens += last.num_cached_tokens

    def usage(self) -> dict:
        """OpenAI's `usage`, summed over the rounds (`cached_tokens` left out when 0, as without the loop)."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def split_calls(calls: list[dict], toolbox) -> tuple[list[dict], list[dict]]:
    """An answer's calls -> (the server's, the client's)."""
    mine = [c for c in calls if toolbox.owns(c["function"]["name"])]
    return mine, [c for c in calls if not toolbox.owns(c["function"]["name"])]


def append_round(messages: list[dict], content: str | None, calls: list[dict], results: list[dict]) -> None:
    """The assistant's calls and the tools' answers, as the chat template reads them (arguments as
    objects, HuggingFace's convention; nanoserve/server/protocol.py's `template_tool_call`)."""
    messages.append({"role": "assistant", "content": content,
                     "tool_calls": [{"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"],
                                                  "arguments": json.loads(c["function"]["arguments"])}}
                                    for c in calls]})
    for r in results:
        messages.append({"role": "tool", "tool_call_id": r["tool_call_id"], "content": r["content"]})


class ToolLoop:
    """One chat request run through the loop, on callbacks that the chat handler gives it
    (`with_tool_loop` in nanoserve/server/handlers.py):
    `start_round(prompt_ids, params, request_id, resume_from, round)` starts a round on the engine and returns
    (its output stream, its first output), the request's errors mapped to APIErrors;
    `render(messages, use)` gives a prompt's token ids (off the event loop); `check_fits(prompt_ids,
    round)` refuses a prompt that does not fit; `finish(held, last)` ends the request: `held` the
    engine id whose KV the last round holds (None: nothing), `last` that round's final output (None
    when the request failed or was cancelled)."""

    def __init__(self, toolbox, max_rounds: int, use: ToolUse, params: SamplingParams,
                 round_params: SamplingParams, start_round, render, check_fits, finish):
        self.toolbox, self.max_rounds = toolbox, max_rounds
        self.use, self.later_use = use, dataclasses.replace(use, mode="auto", name=None)
        self.params, self.round_params = params, round_params  # round 0's (a required call's grammar), the rest's
        self.start_round, self.render, self.check_fits, self.finish = start_round, render, check_fits, finish
        self.request_id = "chatcmpl-" + uuid.uuid4().hex[:24]

    async def round(self, loop: LoopState, r: int):
        """Start round r: (its use of the tools, its prompt's length, its stream, its first output)."""
        use = self.use if r == 0 else self.later_use
        prompt_ids = await self.render(loop.messages, use)
        self.check_fits(prompt_ids, r)
        params = self.params if r == 0 else self.round_params
        resume_from, loop.held = loop.held, None  # the engine takes that entry: it is not released twice
        stream, first = await self.start_round(prompt_ids, params, f"{self.request_id}-round{r}", resume_from, r)
        loop.held = first.request_id  # the engine's id, which holds this round's KV once it finishes
        return use, len(prompt_ids), stream, first

    async def after(self, loop: LoopState, r: int, use: ToolUse, text: str):
        """A finished round's answer -> (content, the client's calls, the server's calls not run, the
        results of the server's calls run: None when the loop ends here). When the loop goes on, the
        server's calls have been run, together, and the round appended to `loop`."""
        # >>> week25: tool-round
        content, calls = use.parse(text)
        mine, theirs = split_calls(calls, self.toolbox)
        if not mine:
            return content, theirs, [], None
        if r >= self.max_rounds:  # the cap: these calls go back as they are, not run
            return content, theirs, mine, None

        async def run(call: dict) -> dict:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:  # the parser only returns calls whose arguments are a JSON object
                arguments = None
            if not isinstance(arguments, dict):
                answer, is_error = "the call's arguments are not a JSON object", True
            else:  # ToolBox.call never raises: a tool's failure comes back as is_error
                result = await self.toolbox.call(call["function"]["name"], arguments)
                answer, is_error = result.content, result.is_error
            return {"tool_call_id": call["id"], "name": call["function"]["name"], "content": answer,
                    "is_error": is_error}

        results = list(await asyncio.gather(*(run(c) for c in mine)))  # together: one slow tool holds up no other
        loop.rounds.append({"calls": mine, "results": results})
        append_round(loop.messages, content, mine, results)
        return content, theirs, [], results
        # <<< week25: tool-round

    # ------------------------------------------------------------------------- a plain answer

    async def plain(self, messages: list[dict], collect, model_name: str, resume_from: int | None = None) -> dict | None:
        """The response's body (None if the client went away). `resume_from`: held KV for round 0 (a
        session's last turn)."""
        loop, last, done = LoopState(list(messages), held=resume_from), None, False
        try:
            for r in range(self.max_rounds + 1):
                use, prompt_len, stream, first = await self.round(loop, r)
                last = await collect(stream, first)
                if last is None:
                    return None  # the client went away (the round was aborted): nothing to answer
                loop.count(last, prompt_len)
                content, theirs, pending, results = await self.after(loop, r, use, last.text)
                if results is None or theirs:
                    done = True
                    return self.answer(loop, model_name, last, content, theirs, pending)
            raise AssertionError("the loop always answers by its last round")
        finally:
            await self.finish(loop.held, last if done else None)

    def answer(self, loop: LoopState, model_name: str, last: RequestOutput, content, theirs, pending) -> dict:
        message = {"role": "assistant", "content": content if (theirs or pending) else last_text(content, last)}
        reason = last.finish_reason
        if theirs:
            message["tool_calls"], reason = theirs, "tool_calls"
        elif pending:
            reason = "stop"
        body = {"id": self.request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                "usage": loop.usage(), "tool_rounds": loop.rounds}
        if pending:
            body["pending_tool_calls"] = pending
        return body

    # ------------------------------------------------------------------------- a streamed answer

    def streamed(self, messages: list[dict], model_name: str, include_usage: bool,
                 resume_from: int | None = None) -> StreamingResponse:
        return StreamingResponse(self.events(messages, model_name, include_usage, resume_from), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def events(self, messages: list[dict], model_name: str, include_usage: bool, resume_from: int | None = None):
        meta = {"id": self.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}

        def chunk(delta: dict, finish_reason=None, **extra) -> str:
            payload = {**meta, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish_reason}], **extra}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        loop, last, done = LoopState(list(messages), held=resume_from), None, False
        yield chunk({"role": "assistant", "content": ""})
        try:
            for r in range(self.max_rounds + 1):
                use, prompt_len, stream, first = await self.round(loop, r)
                held_back = ToolCallStream(use)  # text that may be a call waits until the answer is known
                text, last, rest = "", first, ""
                async for out in chain(first, stream):
                    text, last = text + out.delta, out
                    shown = held_back.step(0, out).delta
                    if out.finished:
                        rest = shown  # what is left of the text once any calls are taken out
                    elif shown:
                        yield chunk({"content": shown})
                loop.count(last, prompt_len)
                content, theirs, pending, results = await self.after(loop, r, use, text)
                delta = {"content": rest} if rest else {}
                extra = {"tool_round": loop.rounds[-1]} if results is not None else {}
                if results is not None and not theirs:  # the server ran its calls: show the round, go on
                    yield chunk(delta, **extra)
                    continue
                if theirs:
                    delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(theirs)]
                if pending:
                    extra["pending_tool_calls"] = pending
                reason = "tool_calls" if theirs else ("stop" if pending else last.finish_reason)
                done = True
                yield chunk(delta, reason, **extra)
                break
            if include_usage:
                yield f"data: {json.dumps({**meta, 'choices': [], 'usage': loop.usage()})}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:  # a later round's refusal, after the stream has started
            error = {"message": e.message, "type": e.type, "param": e.param, "code": e.code}
            yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await self.finish(loop.held, last if done else None)


def last_text(content: str | None, last: RequestOutput) -> str:
    """The final answer's text: the whole of it when it calls nothing."""
    return last.text if content is None else content


async def chain(first: RequestOutput, stream):
    """The first output (already taken by `start_round`), then the rest of the stream."""
    try:
        yield first
        if not first.finished:
            async for out in stream:
                yield out
    finally:
        await stream.aclose()


# ------------------------------------------------------------------------- the chat endpoint's side


class RoundOptions:
    """What `engine_calls.submit` asks of a session turn, for one round: hold its KV, resume from
    the last round's."""

    def __init__(self, resume_from: int | None):
        self.resume_from = resume_from

    def options(self) -> dict:
        return dict(hold_kv=True, resume_from=self.resume_from)

    def track(self, outputs):
        return outputs


def offered(state, model, body: dict) -> bool:
    """Whether this chat request runs through the loop: the server has tools, the request did not
    turn them off (`"server_tools": false`, `tool_choice: "none"`), and the model's chat template
    can be told about tools."""
    if state.toolbox is None or not state.toolbox.specs():
        return False
    wanted = body.get("server_tools", True)
    if not isinstance(wanted, bool):
        raise APIError(400, "'server_tools' must be a boolean: false keeps the server's tools out of this request",
                       param="server_tools")
    if not wanted or body.get("tool_choice") == "none":
        return False
    if not model.engine.tokenizer.takes_tools:
        if "server_tools" in body:
            raise APIError(400, "this model's chat template takes no tools, so the server's tools cannot be offered "
                                "to it (serve it with --tool-template hermes)", param="server_tools")
        return False
    return True


def with_server_tools(body: dict, toolbox) -> dict:
    """The body with the server's tools added to its own (400 for a name both have)."""
    own = body.get("tools") or []
    names = {t.get("function", {}).get("name") for t in own if isinstance(t, dict) and isinstance(t.get("function"), dict)}
    clash = sorted(n for n in names if isinstance(n, str) and toolbox.owns(n))
    if clash:
        raise APIError(400, f"the request's tool {clash[0]!r} has the name of one of the server's own tools (GET "
                            "/v1/tools): rename it, or send \"server_tools\": false", param="tools")
    return {**body, "tools": own + toolbox.specs()}
