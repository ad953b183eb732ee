"""Issue 38: the tool loop's rules on scripted answers (no model): which calls the server runs,
which go back to the client, the round cap, failing tools, what each round's prompt holds, that
every held KV is released, and the streamed events adding up to the plain answer.

The engine side (KV held and resumed, tokens equal to a fresh run) is tests/week25/test_tool_loop.py."""

import asyncio
import json

import pytest

from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.params import SamplingParams
from nanoserve.server.tool_loop import ToolLoop
from nanoserve.server.toolbox import ToolResult
from nanoserve.server.tools import ToolUse

pytestmark = pytest.mark.exercise("tool-round")

TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
         for n in ("add", "boom", "weather")]


def call(name: str, **arguments) -> str:
    """A call in the "tagged" format (Hermes, Qwen; nanoserve/server/tools.py)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class FakeToolBox:
    """The server owns `add` (works) and `boom` (fails); `weather` is the client's."""

    def __init__(self):
        self.calls = []

    def owns(self, name: str) -> bool:
        return name in ("add", "boom")

    async def call(self, name: str, arguments: dict) -> ToolResult:
        self.calls.append((name, arguments))
        if name == "boom":
            return ToolResult("tool boom failed: it always does", True)
        return ToolResult(str(arguments["a"] + arguments["b"]), False)


class Script:
    """The model's answers, one per round, each streamed in two pieces; records the prompts (the
    rendered messages), the resume ids and the releases."""

    def __init__(self, answers: list[str]):
        self.answers = list(answers)
        self.prompts, self.resumed, self.released = [], [], []
        self.ids = iter(range(100, 200))  # the engine's request ids, one per round

    async def start_round(self, prompt_ids, params, request_id, resume_from, r):
        self.resumed.append(resume_from)
        text, rid = self.answers.pop(0), next(self.ids)
        half = len(text) // 2
        outs = [RequestOutput(rid, prompt_ids, [1] * 3, text[:half], delta=text[:half]),
                RequestOutput(rid, prompt_ids, [1] * 5, text, finished=True, finish_reason="stop", delta=text[half:])]

        async def rest():
            for out in outs[1:]:
                yield out

        return rest(), outs[0]

    async def render(self, messages, use):
        self.prompts.append([dict(m) for m in messages])
        return list(range(10 * len(messages)))

    async def finish(self, held, last):
        self.released.append(held)
        self.finished_with = last


def make_loop(script: Script, box: FakeToolBox, max_rounds: int = 4) -> ToolLoop:
    use = ToolUse(TOOLS, "auto", None, "tagged")
    params = SamplingParams(max_tokens=8)
    return ToolLoop(box, max_rounds, use, params, params, script.start_round, script.render,
                    lambda ids, r: None, script.finish)


async def collect(stream, first):
    last = first
    if not first.finished:
        async for out in stream:
            last = out
    return last


def plain(answers, max_rounds=4):
    script, box = Script(answers), FakeToolBox()
    body = asyncio.run(make_loop(script, box, max_rounds).plain([{"role": "user", "content": "hi"}], collect, "m"))
    return body, script, box


def streamed(answers, max_rounds=4):
    script, box = Script(answers), FakeToolBox()
    loop = make_loop(script, box, max_rounds)

    async def events():
        return [e async for e in loop.events([{"role": "user", "content": "hi"}], "m", True)]

    chunks = [json.loads(e[6:]) for e in asyncio.run(events()) if e != "data: [DONE]\n\n"]
    return chunks, script


def test_a_server_call_is_run_and_the_conversation_resumes_from_the_held_kv():
    body, script, box = plain([call("add", a=2, b=3), "It is 5."])
    assert box.calls == [("add", {"a": 2, "b": 3})]
    (round_,) = body["tool_rounds"]
    assert round_["calls"][0]["function"]["name"] == "add" and round_["results"][0]["content"] == "5"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is 5."}
    assert body["choices"][0]["finish_reason"] == "stop"
    # round 1's prompt: the conversation, the assistant's call, the tool's answer
    second = script.prompts[1]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert second[2] == {"role": "tool", "tool_call_id": round_["calls"][0]["id"], "content": "5"}
    assert script.resumed == [None, 100]  # round 1 resumes from round 0's KV
    assert script.released == [101]  # the last round's KV is released at the end
    assert body["usage"]["prompt_tokens"] == 10 + 30 and body["usage"]["completion_tokens"] == 10


def test_a_client_call_goes_back_to_the_client_and_a_mixed_answer_runs_the_server_part_first():
    body, _, box = plain([call("weather", city="Paris")])
    assert box.calls == [] and body["tool_rounds"] == []
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "weather"
    body, _, box = plain([call("add", a=1, b=1) + call("weather", city="Oslo")])
    assert box.calls == [("add", {"a": 1, "b": 1})] and len(body["tool_rounds"]) == 1
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["weather"]


def test_a_failing_tool_becomes_a_tool_message_and_the_loop_goes_on():
    body, script, _ = plain([call("boom"), "Sorry."])
    result = body["tool_rounds"][0]["results"][0]
    assert result["is_error"] and "failed" in result["content"]
    assert script.prompts[1][-1]["content"] == result["content"]
    assert body["choices"][0]["message"]["content"] == "Sorry."


def test_the_round_cap_returns_the_last_calls_unrun():
    body, script, box = plain([call("add", a=1, b=2)] * 3, max_rounds=2)
    assert len(box.calls) == 2 and len(body["tool_rounds"]) == 2
    assert body["pending_tool_calls"][0]["function"]["name"] == "add"
    assert body["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in body["choices"][0]["message"]
    assert len(script.prompts) == 3 and script.answers == []
    body, _, box = plain([call("add", a=1, b=2)], max_rounds=0)
    assert box.calls == [] and body["pending_tool_calls"]


def test_the_stream_shows_each_round_and_adds_up_to_the_plain_answer():
    answers = ["Let me add. " + call("add", a=2, b=3), "It is 5."]
    plain_body, _, _ = plain(answers)
    chunks, script = streamed(answers)
    rounds = [c["tool_round"] for c in chunks if c.get("tool_round")]
    assert rounds and rounds[0]["results"][0]["content"] == "5"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Let me add." in text and text.endswith("It is 5.")
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == plain_body["usage"]
    assert script.released == [101]
