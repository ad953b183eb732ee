"""Issue 38: the tool loop on the engine. A forced call of a server tool (the tiny random model
writes one under `tool_choice`'s grammar) is run by the server, its result appended, and the next
round resumes from the first round's held KV: its prompt tokens are counted as cached, and its
answer equals a fresh request of the whole conversation (float32, greedy). The same through the
stream, through the `openai` client, with an MCP server's tools (run in a subprocess), with a
failing tool, and in a session; no KV is left held at the end.

The loop's rules on scripted answers are tests/week25/test_tool_loop_rules.py."""

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.server.toolbox import ToolBox
from nanoserve.testing import ServerThread

pytestmark = pytest.mark.exercise("tool-round")

ECHO_SERVER = Path(__file__).with_name("mcp_echo_server.py")
ASK = [{"role": "user", "content": "What is two plus three?"}]
# Prefix caching off: the tokens the second round does not prefill come from held KV alone.
ENGINE = dict(max_model_len=1024, num_blocks=512, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("mcp") / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"echo": {"command": sys.executable, "args": [str(ECHO_SERVER)]}}}))
    box = ToolBox.from_options("calculator", mcp_config=str(config), timeout=10)
    with ServerThread(engine_kwargs=ENGINE, app_kwargs=dict(toolbox=box, max_tool_rounds=2)) as s:
        yield s


def chat(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": ASK, "max_tokens": 48, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def forced(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def replayed(server, body: dict) -> dict:
    """The conversation the loop ran (its rounds appended), as one fresh request without the loop."""
    messages = list(ASK)
    for round_ in body["tool_rounds"]:
        messages.append({"role": "assistant", "content": None, "tool_calls": round_["calls"]})
        messages += [{"role": "tool", "tool_call_id": r["tool_call_id"], "content": r["content"]}
                     for r in round_["results"]]
    specs = httpx.get(server.url + "/v1/tools").json()["data"]
    return chat(server, messages=messages, tools=specs, server_tools=False)


def test_a_server_tool_runs_and_the_next_round_resumes_from_held_kv(server):
    body = chat(server, tool_choice=forced("calculator"))
    (round_,) = body["tool_rounds"][:1]
    call = round_["calls"][0]
    assert call["function"]["name"] == "calculator"
    expected = server.app.state.server.toolbox  # the same tool, called again, gives the same answer
    import asyncio

    again = asyncio.run(expected.call("calculator", json.loads(call["function"]["arguments"])))
    assert round_["results"][0]["content"] == again.content and round_["results"][0]["is_error"] == again.is_error
    fresh = replayed(server, body)
    assert body["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == fresh["choices"][0]["finish_reason"]
    # round 1 did not prefill what round 0 had computed: most of round 0's prompt is cached
    first_prompt = body["usage"]["prompt_tokens"] - fresh["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.8 * first_prompt > 0
    assert "prompt_tokens_details" not in fresh["usage"]  # no prefix cache, no session: all prefilled
    assert server.wait_idle() and server.engine.held_kv()["blocks"] == 0


def test_the_stream_shows_the_round_and_ends_as_the_plain_answer(server):
    plain = chat(server, tool_choice=forced("calculator"))
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": ASK, "max_tokens": 48, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "tool_choice": forced("calculator")}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    rounds = [c["tool_round"] for c in chunks if c.get("tool_round")]
    assert rounds and without_ids(rounds) == without_ids(plain["tool_rounds"])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.endswith(plain["choices"][0]["message"]["content"] or "")
    assert chunks[-1]["usage"] == plain["usage"]
    assert server.wait_idle() and server.engine.held_kv()["blocks"] == 0


def test_mcp_tools_in_the_loop_and_a_failing_one_is_a_tool_message(server):
    body = chat(server, tool_choice=forced("echo__add"))
    call, result = body["tool_rounds"][0]["calls"][0], body["tool_rounds"][0]["results"][0]
    arguments = json.loads(call["function"]["arguments"])
    assert result == {"tool_call_id": call["id"], "name": "echo__add", "content": str(arguments["a"] + arguments["b"]),
                      "is_error": False}
    failed = chat(server, tool_choice=forced("echo__fail"))
    result = failed["tool_rounds"][0]["results"][0]
    assert result["is_error"] and "fail" in result["content"]
    assert failed["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_openai_client_and_the_switches(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=48, temperature=0,
                                         tool_choice=forced("calculator"))
    assert out.model_extra["tool_rounds"][0]["calls"][0]["function"]["name"] == "calculator"
    off = chat(server, server_tools=False)
    assert "tool_rounds" not in off
    none = chat(server, tool_choice="none")
    assert "tool_rounds" not in none
    clash = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": ASK, "tools": [{"type": "function", "function": {"name": "calculator"}}]})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "tools"
    two = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "n": 2})
    assert two.status_code == 400 and two.json()["error"]["param"] == "n"


@pytest.mark.exercise("end-of-turn")
def test_a_session_keeps_the_last_rounds_kv_for_its_next_turn(server):
    first = chat(server, tool_choice=forced("calculator"), session_id="agent-1")
    assert server.engine.held_kv()["entries"] == 1  # the session holds the last round's KV
    history = replayed_messages(first) + [{"role": "user", "content": "Thanks."}]
    second = chat(server, messages=history, session_id="agent-1", server_tools=False,
                  tools=httpx.get(server.url + "/v1/tools").json()["data"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def without_ids(rounds: list[dict]) -> list:
    """Rounds as (calls, results) without the call ids, which are random."""
    return [([c["function"] for c in r["calls"]], [(x["name"], x["content"], x["is_error"]) for x in r["results"]])
            for r in rounds]


def replayed_messages(body: dict) -> list[dict]:
    messages = list(ASK)
    for round_ in body["tool_rounds"]:
        messages.append({"role": "assistant", "content": None, "tool_calls": round_["calls"]})
        messages += [{"role": "tool", "tool_call_id": r["tool_call_id"], "content": r["content"]}
                     for r in round_["results"]]
    messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return messages
