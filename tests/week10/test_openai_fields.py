"""Week 10 (issue 17): the wider OpenAI surface through the official client. Logprobs equal
HF's float32 log-softmax, for completions (with `echo`: the prompt's too) and chat; penalties and
`logit_bias` change the tokens as HF and OpenAI's formula say; `n` choices per prompt; and every
field the server does not honour is refused with a 400 naming it."""

import json
import re
from pathlib import Path

import httpx
import pytest
import torch
from openai import BadRequestError

from nanoserve.server import protocol
from nanoserve.model.tiny import TINY_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is HF's log-softmax after ids[: p + 1], in float32."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def assert_400(resp: httpx.Response, param: str, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error["message"]


# --------------------------------------------------------------------------------- logprobs


def test_completion_logprobs_equal_hf_log_softmax(client, reference, hf):
    llm, _ = reference
    prompt_ids = llm.tokenizer.encode("The list")
    # Sampled, with a temperature, penalties and a bias: the logprobs are still the raw model's.
    resp = client.completions.create(model="tiny", prompt="The list", max_tokens=10, temperature=1.3, seed=5,
                                     presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"42": 3},
                                     logprobs=5, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    tokens = [llm.tokenizer.encode(t, add_special_tokens=False) for t in lp.tokens]
    assert all(len(t) == 1 for t in tokens)  # each shown token is one token id (ASCII text here)
    output = [t[0] for t in tokens]
    assert len(output) == resp.usage.completion_tokens == 10
    assert "".join(lp.tokens) == resp.choices[0].text
    expected = hf_logprobs(hf, prompt_ids + output)
    for i, token in enumerate(output):
        row = expected[len(prompt_ids) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
        values, ids = row.topk(5)
        top = lp.top_logprobs[i]
        assert len(top) in (5, 6)  # the 5 most likely, and the chosen token if it is not among them
        for t, v in zip(ids.tolist(), values.tolist()):
            assert top[llm.tokenizer.decode([t], skip_special_tokens=False)] == pytest.approx(v, abs=1e-4)
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_and_top_logprobs(client, reference, hf):
    llm, _ = reference
    messages = [{"role": "user", "content": "What is a list?"}]
    prompt_ids = llm.tokenizer.apply_chat_template(messages)
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    output = [llm.tokenizer.encode(c.token, add_special_tokens=False)[0] for c in content]
    expected = hf_logprobs(hf, prompt_ids + output)
    for i, c in enumerate(content):
        row = expected[len(prompt_ids) - 1 + i]
        assert c.logprob == pytest.approx(row[output[i]].item(), abs=1e-4)
        assert c.bytes == list(c.token.encode("utf-8"))
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen token is the most likely
    # logprobs without top_logprobs: no alternatives; and none at all when not asked.
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                           logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=3).choices[0].logprobs is None


def test_echo_returns_the_prompt_with_its_logprobs(client, reference, hf):
    """What evaluation harnesses send for log-likelihood: echo, logprobs, one new token."""
    llm, _ = reference
    prompts = ["The list of", "Return the value of x"]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=1, temperature=0, echo=True,
                                     logprobs=1)
    for prompt, choice in zip(prompts, resp.choices):
        ids = llm.tokenizer.encode(prompt)
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first
        assert lp.tokens[0] == llm.tokenizer.decode(ids[:1], skip_special_tokens=False)
        expected = hf_logprobs(hf, ids)
        for p in range(1, len(ids)):
            assert lp.token_logprobs[p] == pytest.approx(expected[p - 1, ids[p]].item(), abs=1e-4)
            greedy = expected[p - 1].argmax().item()
            assert max(lp.top_logprobs[p].values()) == pytest.approx(expected[p - 1, greedy].item(), abs=1e-4)
        assert lp.text_offset[len(ids)] == len(prompt)  # the new token's text starts after the prompt's
    # echo without logprobs: the prompt's text in front, and nothing else changes.
    plain = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[1] + plain.choices[0].text and echoed.choices[0].logprobs is None
    assert echoed.usage == plain.usage
    # A prompt of token ids echoes their text.
    ids = llm.tokenizer.encode(prompts[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(llm.tokenizer.decode(ids))


# -------------------------------------------------------------------- penalties, logit_bias


@torch.no_grad()
def reference_greedy(hf, prompt_ids, max_tokens, presence=0.0, frequency=0.0, bias=None, repetition=1.0):
    """Greedy decoding with HF's model and logits processors, and OpenAI's presence/frequency rule."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = hf(torch.tensor([ids])).logits[:, -1].float()
        if bias:
            logits = SequenceBiasLogitsProcessor({(t,): float(b) for t, b in bias.items()})(torch.tensor([ids]), logits)
        generated = ids[len(prompt_ids):]
        for t in set(generated):
            logits[0, t] -= frequency * generated.count(t) + presence
        if repetition != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits)
        ids.append(logits.argmax().item())
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("fields", [
    dict(presence_penalty=2.0),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=-1.0, frequency_penalty=0.6),
    dict(logit_bias={"303": -100, "18": 4}),
    dict(logit_bias={"88": 2.5}, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3}),
], ids=lambda f: "-".join(sorted(k for k in f if k != "extra_body")))
def test_penalties_and_logit_bias_change_tokens_as_the_reference_does(client, reference, hf, fields):
    llm, _ = reference
    fields = dict(fields)
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    prompt_ids = llm.tokenizer.encode("Return the")
    resp = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=16, temperature=0, logprobs=0,
                                     extra_body=extra, **fields)
    expected = reference_greedy(hf, prompt_ids, 16, fields.get("presence_penalty", 0.0),
                                fields.get("frequency_penalty", 0.0),
                                {int(k): v for k, v in fields.get("logit_bias", {}).items()},
                                extra.get("repetition_penalty", 1.0))
    got = [llm.tokenizer.encode(t, add_special_tokens=False)[0] for t in resp.choices[0].logprobs.tokens]
    assert got == expected
    plain = reference_greedy(hf, prompt_ids, 16)
    assert got != plain  # the settings did change the output


def test_logit_bias_bans_and_forces(client, reference):
    llm, _ = reference
    kw = dict(model="tiny", prompt="The list", max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    first = llm.tokenizer.encode(client.completions.create(**kw).choices[0].logprobs.tokens[0],
                                 add_special_tokens=False)[0]
    banned = client.completions.create(logit_bias={str(first): -100}, **kw).choices[0].logprobs.tokens
    assert llm.tokenizer.encode(banned[0], add_special_tokens=False)[0] != first
    forced = client.completions.create(logit_bias={"400": 100}, **kw).choices[0].text
    assert forced == llm.tokenizer.decode([400] * 6)


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"logit_bias": {"4096": 1}}, "logit_bias.4096"),
    ({"logit_bias": {"-1": 1}}, "logit_bias.-1"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": True}}, "logit_bias.5"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"best_of": 3}, "best_of"),
])
def test_bad_openai_fields(server, fields, param):
    assert_400(post(server, "/v1/completions", {"prompt": "The", "max_tokens": 2, **fields}), param)


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"echo": True}, "echo"),
])
def test_bad_chat_logprobs(server, fields, param):
    assert_400(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **fields}),
               param)


# ----------------------------------------------------------------------------------------- n


def test_n_choices_are_different_reproducible_and_prompt_major(client):
    kw = dict(model="tiny", max_tokens=12, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    four = client.completions.create(prompt="The list", n=4, **kw)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    texts = [c.text for c in four.choices]
    assert len(set(texts)) == 4  # seed, seed + 1, ...: four different samples
    assert [c.text for c in client.completions.create(prompt="The list", n=4, **kw).choices] == texts
    assert client.completions.create(prompt="The list", **kw).choices[0].text == texts[0]  # choice 0: the seed itself
    assert four.usage.prompt_tokens == 3 and four.usage.completion_tokens == 48  # the prompt counted once
    # Two prompts, two choices each: prompt-major order (choice index = prompt index * n + j).
    both = client.completions.create(prompt=["The list", "Return the"], n=2, **kw)
    assert [c.text for c in both.choices[:2]] == texts[:2]
    alone = client.completions.create(prompt="Return the", n=2, **kw)
    assert [c.text for c in both.choices[2:]] == [c.text for c in alone.choices]
    # Chat too.
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3,
                                          max_tokens=8, temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 3


def test_n_with_echo_and_logprobs(client):
    resp = client.completions.create(model="tiny", prompt="The list", n=3, max_tokens=4, temperature=1.0, seed=2,
                                     echo=True, logprobs=2, extra_body={"ignore_eos": True})
    prompt_part = [c.logprobs.token_logprobs[:3] for c in resp.choices]
    assert prompt_part[0][0] is None and prompt_part[0] == prompt_part[1] == prompt_part[2]
    assert all(c.text.startswith("The list") and len(c.logprobs.tokens) == 3 + 4 for c in resp.choices)


# ----------------------------------------------------------------------- nothing silently ignored

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
COMPLETION = {"prompt": "The list", "max_tokens": 3, "temperature": 0}

REFUSED_CHAT = [
    ("functions", [{"name": "f"}], "deprecated name of 'tools'"),  # tools: tests/week10/test_tools.py
    ("function_call", "auto", "deprecated name of 'tool_choice'"),
    ("audio", {"voice": "alloy", "format": "wav"}, "text only"),
    ("modalities", ["text", "audio"], "text only"),
    ("prediction", {"type": "content", "content": "x"}, "not supported"),
    ("reasoning_effort", "low", "reasoning"),
    ("verbosity", "low", "reasoning"),
    ("web_search_options", {}, "web"),
    ("moderation", {"model": "x"}, "moderation"),
    ("prompt_cache_options", {"mode": "implicit"}, "cache"),
    ("prompt_cache_retention", "24h", "cache"),
    ("store", True, "stores nothing"),
    ("service_tier", "flex", "one tier"),
    ("stream_options", {"include_usage": True}, "stream"),
    ("min_p", 0.1, "unknown field"),  # vLLM's extras are not nanoserve's
    ("use_beam_search", True, "unknown field"),
    ("echo", True, "unknown field"),  # a completions field
    ("frobnicate", 1, "unknown field"),
]
REFUSED_COMPLETION = [
    ("suffix", "end", "not supported"),
    ("messages", [], "unknown field"),
    ("top_logprobs", 2, "unknown field"),
    ("stream_options", {"include_usage": True}, "stream"),
    ("guided_json", {}, "unknown field"),
    ("skip_special_tokens", False, "unknown field"),
]


@pytest.mark.parametrize("name, value, words", REFUSED_CHAT,
                         ids=[f"{r[0]}={json.dumps(r[1])[:20]}" for r in REFUSED_CHAT])
def test_unsupported_chat_fields_are_refused(server, name, value, words):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, name: value}), name, words)


@pytest.mark.parametrize("name, value, words", REFUSED_COMPLETION, ids=[r[0] for r in REFUSED_COMPLETION])
def test_unsupported_completion_fields_are_refused(server, name, value, words):
    assert_400(post(server, "/v1/completions", {**COMPLETION, name: value}), name, words)


@pytest.mark.parametrize("fields, param", [
    ({"stream": True, "stream_options": {"include_usage": True, "chunk_size": 3}}, "stream_options.chunk_size"),
    ({"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}, "messages[0].name"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"user": 7}, "user"),
])
def test_unsupported_nested_fields_are_refused(server, fields, param):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, **fields}), param)


NO_EFFECT = {"user": "u-1", "metadata": {"team": "a"}, "safety_identifier": "h", "prompt_cache_key": "k",
             "store": False, "service_tier": "auto", "modalities": ["text"], "response_format": {"type": "text"},
             "tool_choice": "none", "parallel_tool_calls": False, "tools": None, "logit_bias": {}}


def test_informational_and_default_fields_are_accepted_without_effect(server):
    plain = post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    resp = post(server, "/v1/chat/completions", {**CHAT, **NO_EFFECT})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == plain
    resp = post(server, "/v1/completions", {**COMPLETION, "user": "u-1", "best_of": 1, "echo": False})
    assert resp.status_code == 200, resp.text


def test_the_official_client_gets_a_400_for_functions(client):
    """The deprecated `functions` is refused, pointing to `tools` (which works: test_tools.py)."""
    functions = [{"name": "now", "parameters": {"type": "object", "properties": {}}}]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], functions=functions)
    assert "'functions'" in err.value.message and "'tools'" in err.value.message


def openai_fields(module: str) -> set[str]:
    """The request fields of the installed `openai` package's type definitions."""
    import importlib

    params = importlib.import_module(f"openai.types.{module}")
    return set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}


def documented(endpoint: str) -> dict[str, str]:
    """docs/openai_api.md: the table under the endpoint's heading, field -> status."""
    text = (ROOT / "docs" / "openai_api.md").read_text()
    section = text.split(f"## `{endpoint}`")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (supported|refused|accepted, no effect|nanoserve) \|", section, re.M)
    return dict(rows)


@pytest.mark.parametrize("module, endpoint, chat", [("completion_create_params", "/v1/completions", False),
                                                    ("chat.completion_create_params", "/v1/chat/completions", True)])
def test_every_field_has_a_documented_status(module, endpoint, chat):
    """Every field OpenAI defines (and every field nanoserve accepts) is in docs/openai_api.md's
    table, and its status there is what the server does."""
    table = documented(endpoint)
    accepted = protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS
    assert openai_fields(module) | accepted <= set(table), sorted(openai_fields(module) | accepted - set(table))
    for name, status in table.items():
        assert (name in accepted) == (status != "refused"), (name, status)
