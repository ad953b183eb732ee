"""Week 23 over HTTP: a request picks an adapter by `model` (the official openai client), /v1/models
lists the base model and its adapters, adapters are loaded and unloaded while the server runs
(the same checks, each refusal a 400 with one line; behind the API key)."""

import httpx
import pytest

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import ServerThread

openai = pytest.importorskip("openai")
PROMPT = [1, 45, 802, 13, 99, 7, 1200, 64, 3000]
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def server(tiny, adapters):
    kwargs = dict(model=str(tiny[0]), lora_modules={"attn8": str(adapters["attn8"])}, max_loras=2)
    with ServerThread(engine_kwargs=kwargs, model_name="base", api_key="sesame") as s:
        yield s


def test_requests_pick_adapters_by_model(server, tiny, adapters):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame")
    assert [m.id for m in client.models.list().data] == ["base", "attn8"]
    llm = LLM(str(tiny[0]), device="cpu", lora_modules={"attn8": str(adapters["attn8"])})
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for model, lora in (("attn8", "attn8"), ("base", None)):
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.model == model
        assert answer.choices[0].text == llm.generate(PROMPT, greedy, lora=lora)[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist; this server serves 'base' and the adapters attn8"):
        client.completions.create(model="mlp4", prompt="hi", max_tokens=2)


def test_load_and_unload_at_run_time(server, adapters, tmp_path):
    post = lambda path, body, headers=KEY: httpx.post(server.url + path, json=body, headers=headers, timeout=30)  # noqa: E731
    assert post("/v1/load_lora_adapter", {"lora_name": "mlp4", "lora_path": str(adapters["mlp4"])}, {}).status_code == 401
    r = post("/v1/load_lora_adapter", {"lora_name": "mlp4", "lora_path": str(adapters["mlp4"])})
    assert r.status_code == 200 and r.json()["id"] == "mlp4"
    models = httpx.get(server.url + "/v1/models", headers=KEY).json()["data"]
    assert [m["id"] for m in models] == ["base", "attn8", "mlp4"] and models[2]["parent"] == "base"
    r = httpx.post(server.url + "/v1/completions", headers=KEY, timeout=30,
                   json={"model": "mlp4", "prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "mlp4"
    for body, status, message in [
        ({"lora_name": "big", "lora_path": str(adapters["all16"]) + "/missing"}, 400, "no adapter_config.json"),
        ({"lora_name": "mlp4", "lora_path": str(adapters["qv2"])}, 400, "adapter name 'mlp4' is taken"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "base", "lora_path": str(adapters["qv2"])}, 400, "the served model's name"),
        ({"lora_name": "x", "lora_path": "y", "extra": 1}, 400, "unknown field 'extra'"),
    ]:
        r = post("/v1/load_lora_adapter", body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert post("/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "mlp4"}).status_code == 200
    r = httpx.post(server.url + "/v1/completions", headers=KEY, json={"model": "mlp4", "prompt": "hi"})
    assert r.status_code == 404


def test_an_adapter_above_the_rank_limit_is_a_400(server, adapters, tmp_path):
    r = httpx.post(server.url + "/v1/load_lora_adapter", headers=KEY, timeout=30,
                   json={"lora_name": "all16", "lora_path": str(adapters["all16"])})
    assert r.status_code == 200  # 16 is the default --max-lora-rank
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]}')
    r = httpx.post(server.url + "/v1/load_lora_adapter", headers=KEY, json={"lora_name": "wide", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "rank 64 is above --max-lora-rank 16" in r.json()["error"]["message"]


def test_an_adapter_in_use_is_not_unloaded(server):
    body = {"model": "attn8", "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with server.slowed(0.02), httpx.stream("POST", server.url + "/v1/completions", headers=KEY, json=body,
                                           timeout=30) as answer:
        lines = answer.iter_lines()  # kept: a dropped iterator closes the stream (the request is aborted)
        next(lines)  # it runs
        r = httpx.post(server.url + "/v1/unload_lora_adapter", headers=KEY, json={"lora_name": "attn8"})
        assert r.status_code == 400 and "adapter 'attn8' is in use by 1 request" in r.json()["error"]["message"]
    assert server.wait_idle()
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", headers=KEY).json()["data"]][:2] == ["base", "attn8"]


def test_an_adapter_named_as_the_served_model_is_refused(tiny, adapters):
    with pytest.raises(ValueError, match="an adapter is named 'base', as the served model"):
        ServerThread(engine_kwargs=dict(model=str(tiny[0]), lora_modules={"base": str(adapters["qv2"])}),
                     model_name="base")
