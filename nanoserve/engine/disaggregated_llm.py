"""Issue 35, offline: a prefill engine and a decode engine in one process, as one `LLM`.

    with DisaggregatedLLM("tiny", kv_address="127.0.0.1:29650") as llm:
        outs = llm.generate(["The list", "A dictionary"], SamplingParams(max_tokens=20))

Each prompt runs on the prefill engine with max_tokens 1; its KV then moves through the two
engines' KV connectors (over loopback, as between two processes) to the decode engine, which
generates the rest. The outputs are those of `LLM.generate`. It exists to show and test the
moving parts in one place; serving runs the two engines as two servers behind a proxy
(nanoserve/server/disaggregated.py).
"""

from __future__ import annotations

import dataclasses
import os

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.params import SamplingParams


class DisaggregatedLLM:
    """`LLM.generate` over a prefill engine and a decode engine (`prefill`, `decode`: options of each
    one's own, such as num_blocks, over the shared `engine_config`)."""

    def __init__(self, model: str | os.PathLike = "tiny", kv_address: str = "127.0.0.1:29650",
                 prefill: dict | None = None, decode: dict | None = None, **engine_config):
        base = EngineConfig(model=model, kv_address=kv_address, **engine_config)
        # The decode engine first: it hosts the connector's store, which the prefill engine joins.
        self.decode = Engine(dataclasses.replace(base, kv_role="decode", **(decode or {})))
        try:
            self.prefill = Engine(dataclasses.replace(base, kv_role="prefill", **(prefill or {})))
        except BaseException:
            self.decode.close()
            raise
        self.tokenizer = self.decode.tokenizer

    @classmethod
    def from_engines(cls, prefill: Engine, decode: Engine) -> "DisaggregatedLLM":
        """A pair of engines built already (roles "prefill" and "decode", connectors on one address)."""
        llm = cls.__new__(cls)
        llm.prefill, llm.decode, llm.tokenizer = prefill, decode, decode.tokenizer
        return llm

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> "DisaggregatedLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Every prompt's final output, in order (a failed transfer's has finish reason "error")."""
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        order = {}  # prefill request id -> prompt index, then decode request id -> prompt index
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if p.max_tokens == 1:  # nothing to decode: the prefill engine's answer is the output
                rid = self.prefill.add_request(prompt, p, stream=False)
            else:
                rid = self.prefill.add_request(prompt, dataclasses.replace(p, max_tokens=1), stream=False,
                                               kv_transfer={"send": True})
            order[("prefill", rid)] = i
        results: dict[int, RequestOutput] = {}
        while self.prefill.has_unfinished() or self.decode.has_unfinished():
            for out in self.prefill.step():
                i = order.pop(("prefill", out.request_id))
                if out.kv_transfer is None:  # ended at its first token (or asked for one)
                    results[i] = out
                else:
                    rid = self.decode.add_request(out.prompt_token_ids, params[i], stream=False,
                                                  kv_transfer=out.kv_transfer)
                    order[("decode", rid)] = i
            for out in self.decode.step():
                if out.finished:
                    results[order.pop(("decode", out.request_id))] = out
        return [results[i] for i in range(len(prompts))]
