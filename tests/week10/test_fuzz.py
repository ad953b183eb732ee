"""Week 10 (issue 30): a property-based fuzz of every endpoint, generated from the server's own
/openapi.json by schemathesis (on hypothesis): bodies that fit the published schema and bodies
that break it, sent to the real server on the tiny model. Whatever arrives:

- no answer is a 5xx;
- every error is OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`;
- a body the schema refuses is never answered 2xx (the schema is the contract it publishes);
- the server is still whole afterwards: a plain request works and every KV block is free.

CI runs FUZZ_CASES cases (a few hundred, derandomized so a run is reproducible). The figure the
issue asks for, 10,000 and more, is the same test with `NANOSERVE_FUZZ_CASES=10000`
(docs/openai_api.md records the run)."""

import os
import warnings
from collections import Counter

import httpx
import pytest

from nanoserve.course.stubs import stubbed_weeks
from nanoserve.testing import ServerThread

schemathesis = pytest.importorskip("schemathesis", reason="pip install -e '.[dev]' installs schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

FUZZ_CASES = int(os.environ.get("NANOSERVE_FUZZ_CASES", "400"))
MAX_PENDING = 16  # a valid request may ask for n = 128 choices: at most 16 sequences run at once
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    # A short context keeps every request the schema accepts cheap: at most 64 tokens, 16 sequences.
    with ServerThread(engine_kwargs=dict(max_model_len=64, num_blocks=256), max_pending=MAX_PENDING) as s:
        yield s


@pytest.fixture(scope="module")
def operations(server):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}
    if 16 in stubbed_weeks():  # a learner's workspace before week 16: /metrics is that week's stub
        operations.pop("GET /metrics", None)
    return operations


def for_the_served_model(case):
    """A generated body names some random model, which is a 404 before any other field is read:
    name the served one, so the fuzz reaches the rest. In a learner's workspace where week 11 is
    not written yet, no body asks for a stream (its code is a stub there)."""
    if isinstance(case.body, dict):
        case.body["model"] = "tiny"
        if 11 in stubbed_weeks():
            case.body.pop("stream", None)
            case.body.pop("stream_options", None)
        if 25 in stubbed_weeks():  # sessions are week 25's: their end of turn is a stub there
            case.body.pop("session_id", None)
    return case


def fuzz(server, operation, mode: GenerationMode, cases: int, statuses: Counter) -> int:
    """Send `cases` generated requests for one operation (one keep-alive session, so a request
    that broke the connection would fail the next); returns how many were sent."""
    import requests

    sent = 0
    with requests.Session() as session:

        @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode).map(for_the_served_model))
        def one(case):
            nonlocal sent
            sent += 1
            resp = case.call(base_url=server.url, session=session, timeout=60)
            statuses[f"{operation.path} {mode.value} {resp.status_code}"] += 1
            where = f"{case.method} {case.formatted_path} {case.media_type} {str(case.body)[:300]}"
            assert resp.status_code < 500, f"{where} -> {resp.status_code} {resp.text[:300]}"
            if resp.status_code >= 400 and operation.path.startswith("/v1/messages"):  # Anthropic's shape there
                body = resp.json()
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, f"{where} -> {resp.text[:300]}"
            elif resp.status_code >= 400:
                assert set(resp.json()["error"]) == ERROR_KEYS, f"{where} -> {resp.text[:300]}"
            elif mode == GenerationMode.NEGATIVE and operation.method.upper() == "POST":
                assert conforms(operation, case.body), f"{where}: the schema refuses it, the server took it"

        one()
    return sent


def conforms(operation, body) -> bool:
    """Whether `body` fits one of the operation's published request models after all: a negative
    case is sometimes valid once `model` is set to the served one."""
    from nanoserve.server.messages_schema import MESSAGES_REQUEST_MODELS
    from nanoserve.server.schema import REQUEST_MODELS
    from nanoserve.server.tokenizer_api import TOKENIZER_REQUEST_MODELS

    by_name = {m.__name__: m for m in REQUEST_MODELS + TOKENIZER_REQUEST_MODELS + MESSAGES_REQUEST_MODELS}
    schema = operation.definition.raw["requestBody"]["content"]["application/json"]["schema"]
    refs = [s["$ref"] for s in schema.get("oneOf", [schema])]
    for ref in refs:
        try:
            by_name[ref.rsplit("/", 1)[1]].model_validate(body)
            return True
        except Exception:
            continue
    return False


def test_every_endpoint_is_in_the_schema(operations):
    metrics = set() if 16 in stubbed_weeks() else {"GET /metrics"}  # week 16's: off in a workspace until written
    assert set(operations) >= {"GET /health", "GET /v1/models", "GET /v1/models/{model_id}",
                               "POST /v1/completions", "POST /v1/chat/completions"} | metrics, sorted(operations)


@pytest.mark.slow
def test_fuzz_no_5xx_and_openai_errors(server, operations):
    """FUZZ_CASES requests to the two generation endpoints, half fitting the schema and half
    breaking it, plus a few to each GET endpoint; then the server still answers and holds no KV."""
    posts = [op for name, op in operations.items() if name.startswith("POST")]
    # Both modes for each, but no negative one without a body to break (issue 38's POST
    # /v1/models/{name}/load: a name can only be unknown)
    # The Messages routes (issue 38) get fitting bodies only: schemathesis 4.32.5 fails while
    # generating breaking ones for their content-block unions ("Cannot generate an array with 1
    # demanded elements"), before any request is sent. Their refusals are tested one by one in
    # tests/week25/test_messages_api.py.
    runs = [(op, mode) for op in posts for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            if mode == GenerationMode.POSITIVE
            or ("requestBody" in op.definition.raw and not op.path.startswith("/v1/messages"))]
    sent, statuses = 0, Counter()
    for op, mode in runs:
        sent += fuzz(server, op, mode, FUZZ_CASES // len(runs) + 1, statuses)
    for name, op in operations.items():
        if name.startswith("GET"):
            sent += fuzz(server, op, GenerationMode.POSITIVE, 20, statuses)
    assert sent >= FUZZ_CASES, sent
    good = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "The list", "max_tokens": 2})
    assert good.status_code == 200, good.text
    assert server.wait_idle(), "KV blocks still held after the fuzz"
    print(f"fuzz: {sent} requests, no 5xx:", dict(sorted(statuses.items())))

