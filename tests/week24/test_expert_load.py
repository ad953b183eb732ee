"""Week 24: how many tokens each expert received, where an operator looks: `/metrics` (a counter per
MoE layer and expert, read at scrape time) and `bench throughput` (a histogram of the timed run)."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.bench.throughput import print_expert_load
from nanoserve.testing import ServerThread

NAME = "nanoserve:moe_expert_tokens_total"


def scrape(url: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            samples[s.name, s.labels.get("layer"), s.labels.get("expert")] = s.value
    return samples


def test_metrics_count_each_experts_tokens(moe_checkpoints):
    path, _ = moe_checkpoints["qwen2_moe"]  # layers 0 and 2 are MoE, layer 1 dense
    with ServerThread(engine_kwargs=dict(model=str(path), max_model_len=256, num_blocks=64)) as server:
        before = scrape(server.url)
        assert {key[1:] for key in before if key[0] == NAME} == {(str(layer), str(e)) for layer in (0, 2) for e in range(16)}
        assert sum(v for key, v in before.items() if key[0] == NAME) == 0  # nothing routed yet
        r = httpx.post(server.url + "/v1/completions", json=dict(model="tiny", prompt="route these tokens", max_tokens=5,
                                                                  temperature=0, ignore_eos=True), timeout=60)
        assert r.status_code == 200
        ran = r.json()["usage"]["prompt_tokens"] + 4  # the last token is sampled, never run
        after = scrape(server.url)
    for layer in ("0", "2"):
        assert sum(after[NAME, layer, str(e)] for e in range(16)) == 4 * ran  # top-4: four experts a token
    assert ("nanoserve:kv_blocks_total", None, None) in after


def test_no_experts_no_expert_metrics():
    with ServerThread(engine_kwargs=dict(max_model_len=64, num_blocks=16)) as server:
        assert not [key for key in scrape(server.url) if key[0] == NAME]


def test_bench_prints_the_histogram(capsys):
    class Engine:
        def expert_load(self):
            return {0: [30, 10, 0, 0], 2: [10, 10, 10, 10]}

    figures = print_expert_load(Engine())
    out = capsys.readouterr().out
    assert figures["per_expert"] == [40, 20, 10, 10] and figures["busiest_over_even"] == {0: 3.0, 2: 1.0}
    assert "expert   0 " + "#" * 40 in out and "expert   1 " + "#" * 20 + " " in out and "worst 3.00 (layer 0)" in out
    assert print_expert_load(type("Dense", (), {"expert_load": lambda self: None})()) is None
