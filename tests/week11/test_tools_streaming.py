"""Week 11 (with issue 17's tool calling): tool calls in a stream. Text that may still become a
call is held back until the answer is complete, then goes out as one `tool_calls` delta and a
final chunk with finish reason "tool_calls"; held text that was no call goes out as content. The
official client accumulates the stream into the plain response's message, and the chunks'
logprobs add up to the plain response's."""

import asyncio
import json

import httpx
import pytest

from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.sampler import TokenLogprob
from nanoserve.server.tools import ToolCallStream, ToolUse, check_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}



def stream_chunks(server, body: dict) -> list[dict]:
    """The parsed chunks of a chat stream (the usage chunk and [DONE] left out)."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"model": "tiny", "stream": True, **body},
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [c for c in map(json.loads, events[:-1]) if c["choices"]]


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_streamed_call_is_one_delta_then_the_final_chunk(server, client, tool_choice):
    body = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=1.0, seed=3)
    plain = client.chat.completions.create(model="tiny", **body).choices[0]
    chunks = stream_chunks(server, body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d for d in deltas[1:] if d] == [deltas[1]] and set(deltas[1]) == {"tool_calls"}  # no content chunks
    (call,) = deltas[1]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"]))] == calls_of(plain.message)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
    assert deltas[2] == {}


def test_the_official_client_accumulates_the_streamed_call(client):
    body = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=0)
    plain = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert calls_of(final.message) == calls_of(plain.message) and final.message.tool_calls[0].id.startswith("call_")
    # and the plain iterator, as most code reads a stream
    streamed = [c for c in client.chat.completions.create(stream=True, **body) if c.choices]
    pieces = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or []]
    assert [(p.function.name, json.loads(p.function.arguments)) for p in pieces] == calls_of(plain.message)


def test_streamed_logprobs_add_up_with_held_back_text(server, client):
    body = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0, logprobs=True,
                top_logprobs=2)
    plain = client.chat.completions.create(model="tiny", **body).model_dump()["choices"][0]
    chunks = stream_chunks(server, body)
    joined = [item for c in chunks for item in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert joined == plain["logprobs"]["content"] and len(joined) > 5
    assert chunks[1]["choices"][0]["logprobs"]  # they come with the chunk carrying the call


def test_held_text_that_is_no_call_is_sent_as_content(server, client):
    """With "auto" and a JSON-object response format, the answer starts with "{": it may be a call,
    so it is held back; it is not one (not a tool's name), so it comes as content at the end."""
    body = dict(messages=ASK, tools=TOOLS, max_tokens=24, temperature=0, response_format={"type": "json_object"},
                ignore_eos=True)
    plain = client.chat.completions.create(model="tiny", **{k: v for k, v in body.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True}).choices[0]
    assert plain.message.content.startswith("{") and not plain.message.tool_calls
    chunks = stream_chunks(server, body)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[1:]]
    assert texts == [plain.message.content, None]  # all of it at once, then the final chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == plain.finish_reason


def test_auto_text_streams_as_usual(server, client):
    body = dict(messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(model="tiny", **body).choices[0]
    chunks = stream_chunks(server, body)
    if plain.message.tool_calls:
        pytest.fail("the tiny model answered with a call; pick a prompt it answers with text")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:])
    assert text == plain.message.content and chunks[-1]["choices"][0]["finish_reason"] == plain.finish_reason
    assert len(chunks) > 3  # piece by piece, not held back


def test_n_streamed_calls_each_with_its_index(server):
    chunks = stream_chunks(server, dict(messages=ASK, tools=TOOLS, tool_choice="required", n=3, max_tokens=80,
                                        temperature=1.0, seed=5))
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [len(c["delta"].get("tool_calls", [])) for c in mine] == [0, 1, 0]
        assert mine[-1]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------- ToolCallStream, without a server


def outputs(pieces: list[str]):
    """(0, RequestOutput) pairs delivering `pieces`, one token each (logprobs: the token's number)."""
    async def gen():
        text = ""
        for i, piece in enumerate(pieces):
            text += piece
            last = i == len(pieces) - 1
            yield 0, RequestOutput(0, [1], list(range(i + 1)), text, finished=last,
                                   finish_reason="stop" if last else None, delta=piece,
                                   delta_logprobs=[TokenLogprob(i, -1.0, [])])
    return gen()


def run(stream: ToolCallStream, pieces: list[str]) -> list[tuple]:
    async def collect():
        return [(out.delta, [e.token for e in out.delta_logprobs or []], out.finish_reason, stream(index, out))
                async for index, out in stream.wrap(outputs(pieces))]
    return asyncio.run(collect())


def test_tool_call_stream_releases_content_and_holds_a_tagged_call():
    use = ToolUse(check_tools(TOOLS), "auto", None, "tagged")
    got = run(ToolCallStream(use), ["Let me ", "see <tool", "_call>", '{"name": "now", "arguments": {}}',
                                    "</tool_call>"])
    assert [g[0] for g in got] == ["Let me ", "see ", "", "", ""]
    assert [g[1] for g in got] == [[0], [1], [], [], [2, 3, 4]]  # held tokens come with the calls
    assert got[-1][2] == "tool_calls"
    (call,) = got[-1][3]
    assert call["index"] == 0 and call["function"] == {"name": "now", "arguments": "{}"}


def test_tool_call_stream_sends_held_text_that_is_no_call():
    use = ToolUse(check_tools(TOOLS), "auto", None, "tagged")
    got = run(ToolCallStream(use), ["a <tool", "box> b", " <tool_call>oops"])
    assert [g[0] for g in got] == ["a ", "<toolbox> b", " <tool_call>oops"]
    assert [g[1] for g in got] == [[0], [1], [2]] and got[-1][2:] == ("stop", None)
    use = ToolUse(check_tools(TOOLS), "auto", None, "json")
    got = run(ToolCallStream(use), [" ", "{\"a\"", ": 1}"])
    assert [g[0] for g in got] == ["", "", ' {"a": 1}'] and got[-1][1] == [0, 1, 2]
