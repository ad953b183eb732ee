"""Week 10 (issue 17): tool calling. `tools` reach the model through its chat template; calls are
parsed from the answer in the model's format ("json" for Llama 3.x, "tagged" for Hermes/Qwen);
`tool_choice` "required" or a named function constrain the output by a grammar, so that even
the tiny random model writes a call whose arguments validate against the function's schema; a
full round trip (call, result, answer) goes through the official client; bad tools are 400s
naming the field. (Streamed tool calls are week 11's: tests/week11/test_tools_streaming.py.)"""

import importlib.util
import json
import random
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import BadRequestError

from nanoserve.testing import ServerThread, max_bytes, random_object_schema
from nanoserve.model.tiny import TINY_MODEL_DIR
from nanoserve.engine.tokenizer import Tokenizer
from nanoserve.server.tools import (
    TAG_OPEN,
    ToolError,
    ToolUse,
    call_format,
    call_grammar,
    check_tools,
    held_from,
    parse_tool_calls,
    tool_use,
)

# The bundled model's chat template before it took tools: without tools it must render the same.
OLD_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time."}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():  # tool prompts are long: more context than conftest's server
    with ServerThread(engine_kwargs=dict(max_model_len=1024, num_blocks=1024)) as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TINY_MODEL_DIR)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)


def schema_of(name: str, tools: list[dict]) -> dict:
    """The parameters schema of the tool named `name`."""
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


# ------------------------------------------------------------------------------ the template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hi\n"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And {\"json\": 1}?"}],
    [{"role": "user", "content": "é ✓ <tool_call>"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_the_template_renders_as_before(tok, conversation, add_generation_prompt):
    """Every prompt id of the earlier weeks stays what it was."""
    old = tok.hf.apply_chat_template(conversation, chat_template=OLD_TEMPLATE, tokenize=False,
                                     add_generation_prompt=add_generation_prompt)
    new = tok.hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert new == old
    assert tok.apply_chat_template(conversation, add_generation_prompt) == tok.encode(old, add_special_tokens=False)


def test_the_script_and_the_bundled_model_have_the_same_template():
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts" / "make_tiny_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.CHAT_TEMPLATE == json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]


def test_with_tools_the_template_lists_them_and_writes_calls_and_results(tok):
    tools = check_tools(TOOLS)
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": weather},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    text = tok.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    for tool in tools:
        assert json.dumps(tool["function"], ensure_ascii=False) in text
    calls = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "now", "parameters": {}}'
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{calls}<|eot_id|>" in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in text
    # What the model is told to write is what `parse_tool_calls` reads.
    content, parsed = parse_tool_calls(calls, call_format(tok.tool_template), tools)
    assert content is None and [c["function"]["name"] for c in parsed] == ["get_weather", "now"]


def test_takes_tools_parses_the_template(tok):
    assert tok.takes_tools and call_format(tok.tool_template) == "json"
    other = Tokenizer(TINY_MODEL_DIR)
    for template, takes in [(OLD_TEMPLATE, False),
                            ("{% for m in messages %}{{ m['content'] + ' (no tools here)' }}{% endfor %}", False),
                            ("{% if tools is not none %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}",
                             True)]:
        other.hf.chat_template = template
        other.__dict__.pop("takes_tools", None)  # a cached property
        assert other.takes_tools is takes, template
    assert call_format("{{ '<tool_call>' }}") == "tagged"


# ------------------------------------------------------------------------------ parsing


def names(calls: list[dict]) -> list[str]:
    return [c["function"]["name"] for c in calls]


def args(calls: list[dict]) -> list[dict]:
    return [json.loads(c["function"]["arguments"]) for c in calls]


def test_json_calls_are_parsed():
    text = ' {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}} '
    content, calls = parse_tool_calls(text, "json", TOOLS)
    assert content is None and names(calls) == ["get_weather"] and args(calls) == [{"city": "Paris", "days": 2}]
    call = calls[0]
    assert set(call) == {"id", "type", "function"} and call["type"] == "function" and CALL_ID.match(call["id"])
    assert isinstance(call["function"]["arguments"], str)
    # "arguments" for "parameters"; several calls joined by ";" (a ";" inside a string is not one)
    text = '{"name": "now", "arguments": {}};{"name": "get_weather", "parameters": {"city": "a;b", "days": 1}}'
    content, calls = parse_tool_calls(text, "json", TOOLS)
    assert content is None and names(calls) == ["now", "get_weather"] and args(calls)[1]["city"] == "a;b"
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    '{"name": "delete_everything", "parameters": {}}',  # not one of the request's tools
    '{"name": "now", "parameters": {}',  # broken JSON
    '{"name": "now", "parameters": "{}"}',  # arguments not an object
    '{"name": "now"}',  # no arguments
    'Sure: {"name": "now", "parameters": {}}',  # text before: not a call in this format
    '{"name": "now", "parameters": {}} and more',
    '{"name": "now", "parameters": {}}; {"name": "nope", "parameters": {}}',  # all or nothing
    '[{"name": "now", "parameters": {}}]',
    "It is sunny.",
    "",
])
def test_json_text_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, "json", TOOLS) == (text, [])


def test_tagged_calls_are_parsed():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n'
            '</tool_call>\n<tool_call>{"name": "now", "parameters": {}}</tool_call>\n')
    content, calls = parse_tool_calls(text, "tagged", TOOLS)
    assert content == "Let me look.\n" and names(calls) == ["get_weather", "now"]
    assert args(calls) == [{"city": "Oslo", "days": 3}, {}]
    content, calls = parse_tool_calls('<tool_call>{"name": "now", "arguments": {}}</tool_call>', "tagged", TOOLS)
    assert content is None and names(calls) == ["now"]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # unknown name
    '<tool_call>{"name": "now", "arguments": {}</tool_call>',  # bad JSON
    '<tool_call>{"name": "now", "arguments": {}}',  # never closed (cut by max_tokens)
    '<tool_call>{"name": "now", "arguments": {}}</tool_call> Done.',  # text after the calls
    '{"name": "now", "arguments": {}}',  # no tags: not this format
    "Just text.",
])
def test_tagged_text_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, "tagged", TOOLS) == (text, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}'
    use = ToolUse(check_tools(TOOLS), "auto", None, "json", parallel=False)
    assert len(use.parse(text)[1]) == 1
    message, reason = use.message(text, "stop")
    assert reason == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1
    assert use.message("Hello", "length") == ({"role": "assistant", "content": "Hello"}, "length")


def test_held_from_says_what_may_still_become_a_call():
    assert held_from("  ", "json", False) == 0
    assert held_from(' {"na', "json", False) == 0
    assert held_from("Hello {", "json", False) == len("Hello {")
    assert held_from("Hello", "json", True) == 0  # a constrained answer is a call
    assert held_from("Hi <tool", "tagged", False) == 3  # could be the start of a tag
    assert held_from("Hi <tool_call>{", "tagged", False) == 3
    assert held_from("Hi <b>", "tagged", False) == len("Hi <b>")
    assert held_from("a <" + TAG_OPEN[1:-1], "tagged", False) == 2


# ------------------------------------------------------------------------------ the grammar


@pytest.mark.parametrize("fmt", ["json", "tagged"])
def test_the_call_grammar_accepts_a_valid_call_and_nothing_else(tok, fmt):
    from llguidance import LLMatcher

    from nanoserve.sampling.grammar import make_tokenizer

    lltok = make_tokenizer(tok.hf)
    grammar = call_grammar(check_tools(TOOLS), fmt)  # "required": either function
    key = "parameters" if fmt == "json" else "arguments"
    good = f'{{"name":"get_weather","{key}":{{"city":"Oslo","days":3}}}}'
    bad = f'{{"name":"get_weather","{key}":{{"city":"Oslo","days":9}}}}'  # days > maximum
    if fmt == "tagged":
        good, bad = f"{TAG_OPEN}{good}</tool_call>", f"{TAG_OPEN}{bad}</tool_call>"

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltok, grammar)
        return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            matcher.is_stopped()

    assert accepts(good) and not accepts(bad)
    assert parse_tool_calls(good, fmt, TOOLS)[1]


# ------------------------------------------------------------------------------ the server


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_required_call_validates_against_its_schema(client, tool_choice):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                          max_tokens=max_bytes(WEATHER) + 32, temperature=1.0, seed=4)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert CALL_ID.match(call.id) and call.type == "function"
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name, check_tools(TOOLS)))


def test_random_schemas_give_valid_calls(client):
    """Ten random bounded schemas, sampled: every call parses and validates, and is never cut."""
    rng = random.Random(7)
    for i in range(10):
        schema = random_object_schema(rng)
        tools = [{"type": "function", "function": {"name": f"f_{i}", "parameters": schema}}]
        resp = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                              max_tokens=max_bytes(schema) + 32, temperature=1.0, seed=i)
        (call,) = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == f"f_{i}"
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_tool_call_round_trip(client, tok):
    """Call, the function's result, then the model's answer, through the official client."""
    kwargs = dict(model="tiny", tools=TOOLS, max_tokens=max_bytes(WEATHER) + 32, temperature=0)
    first = client.chat.completions.create(messages=ASK, tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}}, **kwargs)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    second = client.chat.completions.create(messages=messages, **{**kwargs, "max_tokens": 8})
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt is the template's rendering of the whole exchange, arguments decoded to an object.
    rendered = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    assert second.usage.prompt_tokens == len(tok.apply_chat_template(rendered, tools=check_tools(TOOLS)))


def test_auto_answers_with_text_or_calls(client, tok):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert isinstance(choice.message.content, str) or choice.message.tool_calls
    # the tools are in the prompt
    assert resp.usage.prompt_tokens == len(tok.apply_chat_template(ASK, tools=check_tools(TOOLS)))


def test_tool_choice_none_hands_no_tools_to_the_template(client, tok):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens == len(tok.apply_chat_template(ASK))
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls


def test_n_choices_and_logprobs_with_a_required_call(client):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=2,
                                          max_tokens=max_bytes(WEATHER) + 32, temperature=1.0, seed=1,
                                          logprobs=True, parallel_tool_calls=False)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert choice.logprobs.content  # the tokens of the call
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)


@pytest.fixture(scope="module")
def toolless_server(tmp_path_factory):
    """The tiny model with its chat template from before tools."""
    model = tmp_path_factory.mktemp("toolless") / "tiny"
    shutil.copytree(TINY_MODEL_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OLD_TEMPLATE}))
    with ServerThread(engine_kwargs=dict(model=str(model), max_model_len=256, num_blocks=64)) as s:
        yield s


def test_a_template_without_tools_is_a_400(toolless_server):
    resp = post(toolless_server, {"messages": ASK, "tools": TOOLS, "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools", resp.text
    assert "does not take tools" in resp.json()["error"]["message"]
    # "none": the tools never reach the template
    resp = post(toolless_server, {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    calls = [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    for message, param in [({"role": "assistant", "content": None, "tool_calls": calls}, "messages[1].tool_calls"),
                           ({"role": "tool", "tool_call_id": "call_1", "content": "noon"}, "messages[1].role")]:
        resp = post(toolless_server, {"messages": ASK + [message], "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(ToolError, match="does not take tools"):
        tool_use({"tools": TOOLS}, OLD_TEMPLATE, takes_tools=False)


# ------------------------------------------------------------------------------ validation

NOW = {"type": "function", "function": {"name": "now"}}
BAD_TOOLS = [
    ({"tools": {"name": "now"}}, "tools"),
    ({"tools": ["now"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "now"}, "extra": 1}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": "now"}]}, "tools[0].function"),
    ({"tools": [NOW, {"type": "function", "function": {"description": "no name"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name"),
    ({"tools": [NOW, NOW]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "now", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "now", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "now", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "now", "returns": {}}}]}, "tools[0].function.returns"),
    ({"tools": [NOW], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}}, "tool_choice"),
    ({"tools": [NOW], "tool_choice": {"type": "function", "name": "now"}}, "tool_choice"),
    ({"tools": [NOW], "tool_choice": 1}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [NOW], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [NOW], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "frobnicate"}}}],
      "tool_choice": "required"}, "tools"),  # llguidance cannot compile it
]


@pytest.mark.parametrize("fields, param", BAD_TOOLS, ids=[f"{p}:{json.dumps(f)[:40]}" for f, p in BAD_TOOLS])
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    resp = post(server, {"messages": ASK, "max_tokens": 2, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


CALL = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
BAD_MESSAGES = [
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "now", "arguments": "{"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "now", "arguments": "[]"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "now", "arguments": {}}}]}],
     "messages[1].tool_calls[0]"),  # arguments travel as a string
    ([{"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "code"}]}], "messages[1].tool_calls[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": {"0": CALL}}], "messages[1].tool_calls"),
    ([{"role": "assistant", "content": None}], "messages"),  # null content without calls
    ([{"role": "tool", "content": "noon"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "noon", "name": "now"}], "messages[1].name"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[1].tool_calls"),
    ([{"role": "function", "content": "x"}], "messages"),
]


@pytest.mark.parametrize("extra, param", BAD_MESSAGES, ids=[p for _, p in BAD_MESSAGES])
def test_bad_tool_messages_are_400s_naming_the_field(server, extra, param):
    resp = post(server, {"messages": ASK + extra, "tools": TOOLS, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_the_official_client_sees_the_400(client):
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "later"}})
    assert "'later'" in err.value.message
