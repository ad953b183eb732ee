"""Issue 30: the tokenizer endpoints (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`,
nanoserve/server/tokenizer_api.py) give exactly the engine's tokenizer, refuse bad bodies in OpenAI's
error shape, are published in /openapi.json, and let lm-evaluation-harness's `local-completions`
model run against the server with no `tokenizer=`: it finds these endpoints by itself, counts
tokens through them, and its log-likelihoods and generations equal the model's own."""

import httpx
import pytest
import torch

from nanoserve.model.tiny import TINY_MODEL_DIR
from nanoserve.testing import ServerThread

TEXTS = ["hello world", "The list of things to do", "", "  spaces  and\nnewlines\t", "naïve café 😀 日本語"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None, *words: str) -> None:
    """OpenAI's error shape, with the status, the param and the words expected."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


# ------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_text_equals_the_engine_tokenizer(server, reference, text):
    llm, _ = reference
    for extra, special in [({}, True), ({"add_special_tokens": True}, True), ({"add_special_tokens": False}, False)]:
        body = post(server, "/tokenize", {"model": "tiny", "prompt": text, **extra}).json()
        ids = llm.tokenizer.encode(text, add_special_tokens=special)
        assert body == {"tokens": ids, "count": len(ids), "max_model_len": 256, "token_strs": None}
    # vLLM's `return_token_strs`: each token as the tokenizer spells it; `model` may be left out.
    body = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert body["token_strs"] == llm.tokenizer.hf.convert_ids_to_tokens(body["tokens"])


def test_tokenize_messages_equals_the_chat_template(server, client, reference):
    llm, _ = reference
    ids = llm.tokenizer.apply_chat_template(MESSAGES)
    body = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES}).json()
    assert body == {"tokens": ids, "count": len(ids), "max_model_len": 256, "token_strs": None}
    # The very prompt a chat request runs on.
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == body["count"]
    no_header = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_header["tokens"] == llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert len(no_header["tokens"]) < len(ids)
    # Text parts are joined as /v1/chat/completions joins them.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "What is"},
                                                       {"type": "text", "text": "a list?"}]}]
    joined = [MESSAGES[0], {"role": "user", "content": "What is\na list?"}]
    assert post(server, "/tokenize", {"messages": parts}).json()["tokens"] == llm.tokenizer.apply_chat_template(joined)


@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_inverts_tokenize(server, reference, text):
    llm, _ = reference
    ids = llm.tokenizer.encode(text)  # with BOS: special tokens come back spelled out
    prompt = post(server, "/detokenize", {"model": "tiny", "tokens": ids}).json()["prompt"]
    assert prompt == llm.tokenizer.decode(ids, skip_special_tokens=False)
    # ... so that the text tokenizes back to the same ids (what lm-eval relies on when it sends text).
    assert post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"] == ids
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenizer_info(server, reference):
    llm, _ = reference
    hf = llm.tokenizer.hf
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["bos_token"] == hf.bos_token == "<|begin_of_text|>" and info["bos_token_id"] == hf.bos_token_id
    assert info["eos_token"] == hf.eos_token and info["eos_token_id"] == llm.tokenizer.eos_token_id
    assert info["pad_token"] is None and info["unk_token"] is None
    assert info["chat_template"] == hf.get_chat_template() and info["tokenizer_class"] == type(hf).__name__
    assert info["max_model_len"] == info["model_max_length"] == 256 and info["vocab_size"] == 4096
    assert info["add_bos_token"] is True  # /tokenize's default adds BOS: see the round trip above


# ----------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/detokenize", {"tokens": [0, 4096]}, 400, "tokens[1]", ["[0, 4096)", "4096"]),
    ("/detokenize", {"tokens": [5, -1]}, 400, "tokens[1]", ["greater than or equal to 0"]),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]", ["integer"]),
    ("/detokenize", {"tokens": [True]}, 400, "tokens[0]", ["integer"]),
    ("/detokenize", {"tokens": "0 1 2"}, 400, "tokens", ["list"]),
    ("/detokenize", {"model": "tiny"}, 400, "tokens", ["required"]),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", ["gpt-4", "tiny"]),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model", ["gpt-4"]),
    ("/tokenize", {"model": 7, "prompt": "x"}, 400, "model", ["string"]),
    ("/tokenize", {"prompt": 3}, 400, "prompt", ["string"]),
    ("/tokenize", {"model": "tiny"}, 400, "prompt", ["'messages'"]),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "messages", ["not both"]),
    ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "temperature", ["unknown field", "/tokenize"]),
    ("/tokenize", {"messages": MESSAGES, "tools": []}, 400, "tools", ["unknown field"]),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens", ["/detokenize"]),
    ("/detokenize", {"tokens": [], "": None}, 400, "", ["unknown field"]),  # null or not (found by the fuzz)
    ("/tokenize", {"prompt": "x", "extra": None}, 400, "extra", ["unknown field"]),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", ["boolean"]),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens", ["chat template"]),
    ("/tokenize", {"messages": []}, 400, "messages", ["at least 1"]),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]", ["robot"]),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type", ["text"]),
    ("/tokenize", ["hello"], 400, None, ["JSON object"]),
])
def test_bad_bodies_are_refused(server, path, body, status, param, words):
    assert_error(post(server, path, body), status, param, *words)


JSON = {"Content-Type": "application/json"}  # a body sent as anything else is a 415 (browser safety)


def test_body_limits_apply(server):
    """The bodies are read as every other endpoint's: JSON within the limits, the size counted as
    it arrives (a chunked upload, with no Content-Length for the Guard to check)."""
    resp = httpx.post(server.url + "/tokenize", content=b'{"prompt": "x",', headers=JSON, timeout=60)
    assert_error(resp, 400, None, "not valid JSON")
    deep: list = []
    for _ in range(70):  # past MAX_JSON_DEPTH (64)
        deep = [deep]
    assert_error(post(server, "/tokenize", {"prompt": "x", "extra": deep}), 400, None, "nests")

    def chunks():
        for _ in range(1100):
            yield b" " * 1024

    assert_error(httpx.post(server.url + "/tokenize", content=chunks(), headers=JSON, timeout=60), 413, None,
                 "larger than")
    assert post(server, "/tokenize", {"prompt": "x", "model": None, "return_token_strs": None}).status_code == 200


def test_wrong_method_is_a_405(server):
    resp = httpx.get(server.url + "/tokenize")
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"


def test_openapi_lists_the_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    ref = "#/components/schemas/"
    body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"oneOf": [{"$ref": ref + "TokenizeCompletionRequest"}, {"$ref": ref + "TokenizeChatRequest"}]}
    body = doc["paths"]["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": ref + "DetokenizeRequest"}
    assert "get" in doc["paths"]["/tokenizer_info"]
    schemas = doc["components"]["schemas"]
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["minimum"] == 0
    assert schemas["DetokenizeRequest"]["additionalProperties"] is False
    assert schemas["TokenizeCompletionRequest"]["required"] == ["prompt"]
    assert set(schemas["TokenizeChatRequest"]["properties"]) == {
        "model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
    assert "ChatCompletionRequest" in schemas and "UserMessage" in schemas  # the others' models stay


# ---------------------------------------------------------------------------------- API key


@pytest.fixture(scope="module")
def keyed_server():
    with ServerThread(engine_kwargs={"max_model_len": 256, "num_blocks": 64}, api_key="sesame") as s:
        yield s


TOKENIZER_CALLS = [("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                   ("GET", "/tokenizer_info", None)]


def test_the_api_key_opens_the_tokenizer_endpoints(keyed_server):
    for method, path, body in TOKENIZER_CALLS:
        resp = httpx.request(method, keyed_server.url + path, json=body, headers={"Authorization": "Bearer sesame"})
        assert resp.status_code == 200, resp.text


def test_the_tokenizer_endpoints_need_the_api_key(keyed_server):
    for method, path, body in TOKENIZER_CALLS:
        resp = httpx.request(method, keyed_server.url + path, json=body)
        assert resp.status_code == 401, f"{method} {path}: {resp.status_code}"


# ------------------------------------------------------------------------ lm-evaluation-harness
# lm-eval's `local-completions` model, pointed at the server with no `tokenizer=`, as a user runs
# it (docs/openai_api.md, "Tokenizer endpoints"). It is in the dev extras (about 40 s and 80 MB of
# wheels to install, no torch of its own); its requests are built here, so no dataset is fetched.

LM_EVAL = "lm-eval 0.4.10+ (its remote tokenizer) is in the dev extras: pip install -e '.[dev]'"


def local_completions(server, **kwargs):
    pytest.importorskip("lm_eval", minversion="0.4.10", reason=LM_EVAL)
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # lm-eval does not read the server's context length: max_length tells it (its default is 2048).
    return LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", max_length=256,
                               max_retries=1, **kwargs)


def instances(kind: str, *arguments) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


@pytest.fixture(scope="module")
def lm(server):
    return local_completions(server)


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


@torch.no_grad()
def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """HF's float32 log-likelihood of `continuation` after `context`, and whether every one of its
    tokens is the most likely one: what lm-eval computes from the server's echoed logprobs."""
    ids = context + continuation
    rows = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)[len(context) - 1 : len(ids) - 1]
    target = torch.tensor(continuation)
    return rows[torch.arange(len(continuation)), target].sum().item(), bool((rows.argmax(-1) == target).all())


def test_lm_eval_finds_the_remote_tokenizer(lm, reference):
    llm, _ = reference
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize ("auto")
    assert lm.eos_string == "<|end_of_text|>" and lm.eot_token_id == llm.tokenizer.eos_token_id
    assert lm.tok_encode("hello world") == llm.tokenizer.encode("hello world", add_special_tokens=False)
    ids = llm.tokenizer.encode("hello world")
    assert lm.decode_batch([ids]) == [llm.tokenizer.decode(ids, skip_special_tokens=False)]
    # lm-eval 0.4.13's remote backend takes `bos_token_id or eos_token_id`: the tiny model's BOS is
    # id 0, which reads as missing, so it prefixes empty contexts with EOS (its HF backend: BOS).
    assert lm.prefix_token_id in (llm.tokenizer.bos_token_id, llm.tokenizer.eos_token_id)


def test_lm_eval_loglikelihood_equals_the_model(lm, reference, hf):
    """lm-eval sends each pair as token ids with echo, logprobs 1 and max_tokens 1, and sums the
    continuation's logprobs: they must be HF's, split where lm-eval's own tokenizing splits."""
    llm, complete = reference

    def encode(text: str) -> list[int]:  # as lm-eval's remote tokenizer does
        return llm.tokenizer.encode(text, add_special_tokens=False)

    greedy = llm.tokenizer.decode(complete(encode("The list"), 4).token_ids)  # a continuation the model picks
    pairs = [("The list", " of things"), ("Return the value", " of x"), ("", "hello world"), ("The list", greedy)]
    results = lm.loglikelihood(instances("loglikelihood", *pairs), disable_tqdm=True)
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results):
        if context:
            context_ids = encode(context)
            continuation_ids = encode(context + continuation)[len(context_ids):]
        else:
            context_ids, continuation_ids = [lm.prefix_token_id], encode(continuation)
        expected, expected_greedy = hf_loglikelihood(hf, context_ids, continuation_ids)
        assert logprob == pytest.approx(expected, abs=1e-3) and is_greedy == expected_greedy, (context, continuation)
    assert [g for _, g in results] == [False, False, False, True]


def test_lm_eval_loglikelihood_rolling(lm, reference, hf):
    llm, _ = reference
    text = "The list of things to do, and the things not to do"
    [logprob] = lm.loglikelihood_rolling(instances("loglikelihood_rolling", (text,)), disable_tqdm=True)
    # One window (the text is shorter than max_length): every token, after the prefix token.
    expected, _ = hf_loglikelihood(hf, [lm.prefix_token_id], llm.tokenizer.encode(text, add_special_tokens=False))
    assert logprob == pytest.approx(expected, abs=1e-3)


def test_lm_eval_generate_until_with_many_stop_strings(lm, reference):
    """lm-eval sends every `until` string plus the EOS text as `stop`: six here, past OpenAI's
    four (a 400, retried, then an exception, before nanoserve took 16)."""
    llm, complete = reference
    ids = llm.tokenizer.encode("The list", add_special_tokens=False)
    full = complete(ids, 12).text
    word = full.split()[1]  # a stop string the answer reaches, before any of the others
    until = [["\n\n", "Q:", "###", "</s>", "Answer:"], ["\n\n", "Q:", word, "###", "</s>"]]
    requests = instances("generate_until", *[("The list", {"until": u, "max_gen_toks": 12}) for u in until])
    results = lm.generate_until(requests, disable_tqdm=True)
    assert results == [complete(ids, 12, stop=u + [lm.eos_string]).text for u in until]
    assert results[1] == full[: full.index(word)] and results[1] != results[0]


def test_lm_eval_with_an_api_key(keyed_server, reference, monkeypatch):
    """With `--api-key`: lm-eval sends `auth_token` to the tokenizer endpoints, and OPENAI_API_KEY
    to /v1/completions."""
    llm, complete = reference
    monkeypatch.setenv("OPENAI_API_KEY", "sesame")
    lm = local_completions(keyed_server, auth_token="sesame")
    assert lm.tokenizer_backend == "remote"
    [(logprob, _)] = lm.loglikelihood(instances("loglikelihood", ("The list", " of things")), disable_tqdm=True)
    assert logprob < 0
    [text] = lm.generate_until(instances("generate_until", ("The list", {"until": ["\n"], "max_gen_toks": 4})),
                               disable_tqdm=True)
    assert text == complete(llm.tokenizer.encode("The list", add_special_tokens=False), 4, stop=["\n", "<|end_of_text|>"]).text
