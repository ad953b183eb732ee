"""Week 10 (issue 17): request shapes real clients send: content parts, batched prompts,
max_completion_tokens, stop lists. Each is honoured or refused with a 400 naming the field."""

import httpx
import pytest
from openai import BadRequestError

from nanoserve.server import protocol


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def assert_400(resp: httpx.Response, param: str, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


# ------------------------------------------------------------------------- content parts


def test_text_parts_are_joined_in_order(client, reference):
    llm, complete = reference
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "a list?"}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": parts}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\na list?"}]
    expected = complete(llm.tokenizer.apply_chat_template(as_strings), 8)
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(as_strings))


@pytest.mark.parametrize("content, param, words", [
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "messages[0].content[1]", ("image_url", "text only")),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "messages[0].content[0]",
     ("input_audio", "text only")),
    ([{"type": "text"}], "messages[0].content[0]", ("text part",)),
    ([{"type": "text", "text": 3}], "messages[0].content[0]", ("text part",)),
    ([{"type": "text", "text": "hi", "cache_control": {}}], "messages[0].content[0]", ("text part",)),
    (["hi"], "messages[0].content[0]", ("text part",)),
    ({"type": "text", "text": "hi"}, "messages", ("content",)),
])
def test_bad_content_parts(server, content, param, words):
    resp = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
    assert_400(resp, param, *words)


def test_an_image_part_with_the_openai_client(client):
    content = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
    assert "text only" in err.value.message


# ---------------------------------------------------------------------------- prompt lists


PROMPTS = ["The list", "Return the", "A"]


def test_a_list_of_prompts_gives_one_choice_each(client, reference):
    llm, complete = reference
    resp = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = [complete(i, 6) for i in ids]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e.text for e in expected]
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    assert resp.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    # The same prompts as token-id lists, and one prompt as a token-id list.
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [e.text for e in expected]
    one = client.completions.create(model="tiny", prompt=ids[1], max_tokens=6, temperature=0)
    assert [(c.index, c.text) for c in one.choices] == [(0, expected[1].text)]


@pytest.mark.parametrize("prompt, param", [
    (["The", ""], "prompt[1]"),
    (["The", 3], "prompt[1]"),
    ([[1, 2], [1, 10 ** 9]], "prompt[1]"),
    ([[1, 2], []], "prompt[1]"),
    ([[1, 2], "The"], "prompt[1]"),
    ([1, "The"], "prompt"),
    ([[1, True]], "prompt[0]"),
    ([], "prompt"),
    ("", "prompt"),
    ({"text": "The"}, "prompt"),
])
def test_bad_prompt_lists(server, prompt, param):
    assert_400(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), param)


def test_a_too_long_prompt_in_a_batch_is_named(server):
    resp = post(server, "/v1/completions", {"prompt": [[5, 6], [5] * 300], "max_tokens": 2})
    assert_400(resp, "prompt[1]", "context")
    assert server.async_engine.num_pending == 0


# ------------------------------------------------------------- max_completion_tokens and stop


def test_max_completion_tokens(client):
    messages = [{"role": "user", "content": "What is a list?"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    same = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3, max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert same.usage.completion_tokens == 3


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": "3"}, "max_completion_tokens"),
    ({"stop": [f"s{i}" for i in range(protocol.MAX_STOP + 1)]}, "stop"),  # 16: more than OpenAI's 4
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": 1}, "stop"),
])
def test_bad_max_completion_tokens_and_stop(server, fields, param):
    resp = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert_400(resp, param)


def test_stop_as_a_string_and_as_four_strings(client):
    kw = dict(model="tiny", prompt="Return the", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[3:6]
    one = client.completions.create(stop=stop, **kw).choices[0]
    assert one.text == full[: full.find(stop)] and one.finish_reason == "stop"
    four = client.completions.create(stop=["zzzz", "qqqq", stop, "xxxx"], **kw).choices[0]
    assert four.text == one.text and four.finish_reason == "stop"
