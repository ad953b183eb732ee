"""Week 10 (issue 17): structured output. `response_format` json_object and json_schema, through
the official client: the tiny random model's output parses, and validates against 50 random
schemas, greedy and sampled, plain and streamed; a bad response format is a 400 naming the field.

Every schema here is bounded (strings have a maxLength, integers a range, arrays a maxItems, no
free whitespace in nanoserve's JSON), so its longest valid answer has a known number of bytes.
A token is at least one byte, so with max_tokens at that bound the answer cannot be cut: each
one must end with finish reason "stop", the grammar complete.
"""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from openai import BadRequestError, OpenAI

from nanoserve.sampling.sampler import Sampler
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.grammar import TokenConstraint, grammar_for, make_tokenizer
from nanoserve.testing import ServerThread, max_bytes, random_object_schema, schema_format

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=dict(max_model_len=MAX_MODEL_LEN, num_blocks=1024)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ------------------------------------------------------------------ random schemas, and their bounds


PROMPT = "Answer in JSON."


def test_max_bytes_bounds_the_schemas():
    """The bound is a real one for the values json.dumps writes, and fits the context."""
    rng = random.Random(0)
    for _ in range(50):
        schema = random_object_schema(rng)
        assert max_bytes(schema) + 32 < MAX_MODEL_LEN, schema
    assert max_bytes({"type": "string", "maxLength": 3}) >= len(json.dumps("\U0001F600" * 3))


# ---------------------------------------------------------------------------------------- tests


def test_the_mask_covers_the_models_whole_vocabulary(server):
    """The model's vocabulary may be larger than the tokenizer's: the extra ids are never allowed.
    The first token of a JSON object must start it; with a mask on one row only, the other row
    samples as before."""
    hf = server.engine.tokenizer.hf
    tokenizer = make_tokenizer(hf)
    n = tokenizer.vocab_size
    constraint = TokenConstraint(tokenizer, grammar_for({"type": "json_object"}), n + 64, frozenset({hf.eos_token_id}))
    mask = constraint.allowed()
    assert mask.shape == (n + 64,) and not mask[n:].any()
    allowed = mask.nonzero().flatten().tolist()
    assert allowed and all(hf.decode([t]).lstrip().startswith("{") for t in allowed)
    sampler = Sampler("cpu")
    sampler.add(1, SamplingParams(temperature=0))
    sampler.add(2, SamplingParams(temperature=0), constraint=constraint)
    logits = torch.randn(2, n + 64, generator=torch.Generator().manual_seed(0))
    logits[:, n:] = 1e4  # the padding ids would win if they were not masked
    first, second = sampler(logits, [1, 2], [SamplingParams(temperature=0)] * 2).tolist()
    assert first == logits[0].argmax().item()
    assert second in allowed and second == max(allowed, key=lambda t: logits[1, t])


def test_json_object_outputs_parse(client, server):
    """Any JSON object, greedy and sampled, chat and completions. `json_object` bounds nothing (a
    tiny model writes keys for ever), so the test leans on `logit_bias` to make the closing tokens
    (`"` and `}`) likely: the mask still decides where they may go, and the grammar ends the answer."""
    vocab = server.engine.tokenizer.hf.get_vocab()
    bias = {str(vocab[t]): 8 for t in ('"', "}")}
    for seed in range(4):
        kwargs = dict(model="tiny", max_tokens=200, seed=seed, temperature=0 if seed == 0 else 1.0,
                      logit_bias=bias)
        if seed % 2:
            choice = client.completions.create(prompt=PROMPT, extra_body={"response_format": {"type": "json_object"}},
                                               **kwargs).choices[0]
            text = choice.text
        else:
            choice = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}],
                                                    response_format={"type": "json_object"}, **kwargs).choices[0]
            text = choice.message.content
        assert choice.finish_reason == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_50_random_schemas_parse_and_validate(client):
    """50 random schemas (half greedy, half sampled at temperature 1.2; chat and completions),
    all sent at once so that the constrained rows share their batches."""
    rng = random.Random(17)
    schemas = [random_object_schema(rng) for _ in range(50)]

    def ask(i: int):
        schema = schemas[i]
        kwargs = dict(model="tiny", max_tokens=max_bytes(schema) + 1, response_format=schema_format(schema, f"s{i}"),
                      temperature=0 if i % 2 else 1.2, seed=i)
        if i % 4 < 2:
            choice = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kwargs).choices[0]
            return choice.message.content, choice.finish_reason
        choice = client.completions.create(prompt=PROMPT, extra_body={"response_format": kwargs.pop("response_format")},
                                           **kwargs).choices[0]
        return choice.text, choice.finish_reason

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    for schema, (text, finish) in zip(schemas, answers):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_text_format_changes_nothing(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    text = client.chat.completions.create(response_format={"type": "text"}, **kwargs).choices[0].message.content
    assert text == plain


BAD_FORMATS = [
    ("not an object", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nowhere"}}},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("response_format, param", BAD_FORMATS, ids=[p for _, p in BAD_FORMATS])
def test_bad_response_format_is_a_400(server, response_format, param):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Hi"})):
        resp = httpx.post(server.url + path, json={"model": "tiny", "response_format": response_format, **body},
                          timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text


def test_the_official_client_gets_a_400_for_a_bad_schema(client):
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       response_format=schema_format({"type": "frob"}, "bad"))
    assert "frob" in err.value.message


def test_constrained_requests_survive_preemption():
    """A pool too small for all requests preempts and recomputes sequences (week 9): the grammar
    keeps the tokens it consumed, and the answers are those of a run with room to spare."""
    from nanoserve.engine.engine import LLM

    properties = {"a": {"type": "string", "maxLength": 4}, "b": {"type": "integer", "minimum": 0, "maximum": 999},
                  "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}
    schema = {"type": "object", "properties": properties, "required": ["a", "b", "c"], "additionalProperties": False}
    schemas = [schema] * 8
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=max_bytes(s) + 1,
                             grammar=grammar_for(schema_format(s, f"p{i}"))) for i, s in enumerate(schemas)]
    prompts = [f"The list {i} of values and keys" for i in range(8)]

    def run(**kw):
        llm = LLM("tiny", device="cpu", block_size=4, max_model_len=MAX_MODEL_LEN, **kw)
        return llm, llm.generate(prompts, params)

    _, ample = run(num_blocks=512)
    longest = max(len(a.prompt_token_ids) + p.max_tokens for a, p in zip(ample, params))
    small, tight = run(num_blocks=-(-longest // 4) + 1)  # room for the longest one alone, and one block
    assert small.engine.scheduler.num_preemptions > 0
    for schema, a, b in zip(schemas, ample, tight):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, "stop")
        jsonschema.validate(json.loads(b.text), schema)


@pytest.mark.parametrize("vocab_size", [4096, 4200])  # the model's vocabulary may exceed the tokenizer's
def test_packed_masks_equal_the_bool_masks(vocab_size):
    """What the sampler uses (`token_bitmasks`: llguidance fills a batch of packed rows on its own
    threads; unpacked on the device) allows exactly what `TokenConstraint.allowed` does, the stop
    tokens joining EOS included, at every step of random walks through random schemas."""
    from nanoserve.sampling.grammar import apply_token_bitmasks, make_tokenizer, token_bitmasks
    from nanoserve.engine.tokenizer import Tokenizer

    tokenizer = make_tokenizer(Tokenizer("tiny").hf)
    rng = random.Random(1)
    for i in range(4):
        fmt = {"type": "json_object"} if i == 0 else schema_format(random_object_schema(rng), "x")
        stops = frozenset([tokenizer.eos_token, 3])
        rows = [TokenConstraint(tokenizer, grammar_for(fmt), vocab_size, stops) for _ in range(2)]
        for _ in range(30):
            expected = torch.stack([c.allowed() for c in rows])
            got = apply_token_bitmasks(torch.zeros(3, vocab_size), [0, 2], token_bitmasks(rows, vocab_size))
            assert torch.equal(got[[0, 2]] == 0, expected) and (got[1] == 0).all()
            token = rng.choice(expected[0].nonzero().flatten().tolist())
            if any([c.consume(token) for c in rows]):
                break
