"""Week 11 (with issue 17's structured output): a stream under `response_format` carries the
same text as the plain answer, ends with "stop", and validates against its schema."""

import json
import random

import jsonschema
import pytest
from openai import OpenAI

from nanoserve.testing import ServerThread, max_bytes, random_object_schema, schema_format

PROMPT = "Answer in JSON."


@pytest.fixture(scope="module")
def client():
    with ServerThread(engine_kwargs=dict(max_model_len=512, num_blocks=512)) as server:
        yield OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_streaming_with_response_format(client):
    rng = random.Random(3)
    schema = random_object_schema(rng)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=max_bytes(schema) + 1,
                  response_format=schema_format(schema, "streamed"), temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert text == whole
    jsonschema.validate(json.loads(text), schema)
