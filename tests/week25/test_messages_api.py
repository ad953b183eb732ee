"""Issue 38: Anthropic's Messages API (`POST /v1/messages`) through the official `anthropic` client,
against a real loopback server of the tiny random model (float32 on the CPU): the same greedy text as
the chat endpoint for the same conversation, streamed events that add up to the plain message, the
stop reasons (end of turn, max_tokens, a stop sequence, a tool call), a forced tool call whose input
follows the tool's schema, tool results in the prompt, count_tokens, and errors in Anthropic's shape.

The `anthropic` client 2.x no longer has `temperature` among `messages.create`'s arguments (the API
still takes it): the tests send it through `extra_body`."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from nanoserve.server.rate_limits import RateLimiter
from nanoserve.testing import ServerThread

KEY = "test-key"
GREEDY = {"extra_body": {"temperature": 0}}
CONVERSATION = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
SYSTEM = "You are brief."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
         {"name": "now", "description": "The time.", "input_schema": {"type": "object", "properties": {},
                                                                "additionalProperties": False}}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=dict(max_model_len=1024, num_blocks=256), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def openai_text(server, messages: list[dict], max_tokens: int, **extra) -> str:
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                            **extra)
    return answer.choices[0].message.content


def test_the_answer_is_the_chat_endpoints_greedy_answer(server, client):
    message = client.messages.create(model="tiny", max_tokens=24, system=SYSTEM, messages=CONVERSATION, **GREEDY)
    expected = openai_text(server, [{"role": "system", "content": SYSTEM}, *CONVERSATION[:2],
                                    {"role": "user", "content": "Tell me\na story"}], 24)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None  # a random model: no EOS in 24
    assert message.usage.output_tokens == 24
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=CONVERSATION)
    assert message.usage.input_tokens == counted.input_tokens > 0


def test_the_stream_adds_up_to_the_message(server, client):
    args = dict(model="tiny", max_tokens=20, system=[{"type": "text", "text": SYSTEM}], messages=CONVERSATION,
                metadata={"user_id": "u-1"}, **GREEDY)
    plain = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == plain.content[0].text
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == ("max_tokens", None, 20)
    assert final.usage.input_tokens == plain.usage.input_tokens
    raw = [k for k in kinds if k not in ("text",)]  # the helper adds "text" events of its own
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == ["content_block_stop", "message_delta",
                                                                              "message_stop"]


def test_a_stop_sequence_ends_the_turn_and_is_reported(client):
    free = client.messages.create(model="tiny", max_tokens=24, messages=CONVERSATION, **GREEDY).content[0].text
    stop = free.strip()[3:6]  # three characters from inside the answer
    assert stop.strip()
    for streamed in (False, True):
        args = dict(model="tiny", max_tokens=24, messages=CONVERSATION, stop_sequences=["~never~", stop], **GREEDY)
        if streamed:
            with client.messages.stream(**args) as stream:
                message = stream.get_final_message()
        else:
            message = client.messages.create(**args)
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert message.content[0].text == free[:free.index(stop)]


def test_a_named_tool_is_called_with_input_that_fits_its_schema(client):
    args = dict(model="tiny", max_tokens=80, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    message = client.messages.create(**args)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER)
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", calls[0].input)]


def test_any_tool_and_no_tool(client):
    ask = [{"role": "user", "content": "What time is it?"}]
    message = client.messages.create(model="tiny", max_tokens=80, messages=ask, tools=TOOLS,
                                     tool_choice={"type": "any"}, **GREEDY)
    assert message.stop_reason == "tool_use" and message.content[-1].name in ("get_weather", "now")
    plain = client.messages.create(model="tiny", max_tokens=8, messages=ask, **GREEDY)
    none = client.messages.create(model="tiny", max_tokens=8, messages=ask, tools=TOOLS, tool_choice={"type": "none"},
                                  **GREEDY)
    assert none.content[0].text == plain.content[0].text  # "none": as if no tools were sent


def test_a_tool_result_turn_renders_as_the_chat_endpoints_tool_message(server, client):
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                 {"type": "text", "text": "And tomorrow?"}]}]
    message = client.messages.create(model="tiny", max_tokens=12, messages=turns, tools=TOOLS, **GREEDY)
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in TOOLS]
    chat = [turns[0],
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"}]
    assert message.content[0].text == openai_text(server, chat, 12, tools=openai_tools)
    errored = [*turns[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout", "is_error": True}]}]
    counted = client.messages.count_tokens(model="tiny", messages=errored, tools=TOOLS)
    assert counted.input_tokens > client.messages.count_tokens(model="tiny", messages=turns[:1], tools=TOOLS).input_tokens


def bad_request(client, **args) -> anthropic.APIStatusError:
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**{"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                                  **args})
    return e.value


@pytest.mark.parametrize("args, param", [
    (dict(extra_body={"max_tokens": None}), "max_tokens"),  # sent as null: the client itself requires it
    (dict(messages=[{"role": "system", "content": "Hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]), "image"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (dict(extra_body={"logprobs": True}), "logprobs"),
    (dict(extra_body={"temperature": 1.5}), "temperature"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0]"),
])
def test_a_bad_request_is_a_400_in_anthropics_shape(client, args, param):
    error = bad_request(client, **args)
    assert isinstance(error, anthropic.BadRequestError) and error.status_code == 400
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
    assert param in error.body["error"]["message"]


def test_a_bad_key_and_an_unknown_model(server, client):
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        stranger.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "'tiny'" in e.value.body["error"]["message"]
    # A Bearer token works here too, and the OpenAI routes keep OpenAI's shape.
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []},
                          headers={"x-api-key": KEY})
    assert response.status_code == 400 and set(response.json()) == {"error"}


@pytest.mark.exercise("token-bucket")  # the rate limits run through the buckets
def test_rate_limits_count_an_x_api_key_as_its_key():
    limits = RateLimiter(requests_per_minute=2)
    with ServerThread(api_key=["alice", "bob"], app_kwargs=dict(rate_limits=limits)) as server:
        alice = anthropic.Anthropic(base_url=server.url, api_key="alice", max_retries=0)
        ask = dict(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        alice.messages.create(**ask)
        httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer alice"},
                   json={"model": "tiny", "max_tokens": 1, "messages": ask["messages"]}).raise_for_status()
        with pytest.raises(anthropic.RateLimitError) as e:
            alice.messages.create(**ask)
        assert e.value.body["error"]["type"] == "rate_limit_error"
        anthropic.Anthropic(base_url=server.url, api_key="bob", max_retries=0).messages.create(**ask)


def test_an_error_after_the_stream_began_is_an_error_event():
    import asyncio

    from nanoserve.engine.outputs import RequestOutput
    from nanoserve.server.messages_stream import message_events

    async def outputs():
        yield 0, RequestOutput(request_id=0, prompt_token_ids=[1], token_ids=[5], text="Hi", delta="Hi")
        raise RuntimeError("the engine failed")

    async def events():
        return [e async for e in message_events(outputs(), {"id": "msg_1", "type": "message"}, 1)]

    lines = asyncio.run(events())
    assert [e.split("\n")[0] for e in lines] == ["event: message_start", "event: content_block_start",
                                                 "event: content_block_delta", "event: error"]
    error = json.loads(lines[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "api_error", "message": "RuntimeError: the engine failed"}}


def test_the_engine_reports_the_stop_string_it_stopped_at():
    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    llm = LLM("tiny", device="cpu", num_blocks=32, max_model_len=128)
    prompt = llm.tokenizer.encode("The list")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    assert free.stop_string is None
    stop = free.text.strip()[2:5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=["~never~", stop]))[0]
    assert (out.finish_reason, out.stop_string, out.text) == ("stop", stop, free.text[:free.text.index(stop)])


def test_the_request_models_are_published_and_held_to(server):
    """/openapi.json publishes both bodies (nanoserve/server/messages_schema.py); a body the models
    refuse is refused, in Anthropic's shape, naming the field; count_tokens takes no max_tokens."""
    paths = httpx.get(server.url + "/openapi.json", headers={"x-api-key": KEY}).json()["paths"]
    for path, name in (("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest")):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    ask = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"x-api-key": KEY}
    bad = [({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": 3}]}]},
            "'messages[0].content[0].cache_control'"),
           ({"temperature": 0.0005}, "'temperature' must be 0 (greedy) or a number in [0.001, 1]"),
           ({"tools": [{"name": "two words", "input_schema": {}}]}, "'tools[0].name'"),
           ({"stream": False, "unknown": None}, "unknown field 'unknown'")]
    for change, words in bad:
        response = httpx.post(server.url + "/v1/messages", json={**ask, **change}, headers=headers)
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
        assert words in response.json()["error"]["message"], response.text
    assert httpx.post(server.url + "/v1/messages", json={**ask, "max_tokens": 2.0, "stream": None},
                      headers=headers).status_code == 200
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": ask["messages"]},
                         headers=headers)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
