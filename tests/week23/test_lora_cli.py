"""Week 23 on the command line: `generate` and `chat` take `--lora PATH`; `--lora-modules` is
checked (NAME=PATH), and its errors are one line."""

import pytest

from nanoserve.cli import main
from nanoserve.engine.config import parse_lora_modules
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams


def test_generate_with_an_adapter(tiny, adapters, capsys):
    args = ["generate", "The list", "--model", str(tiny[0]), "--device", "cpu", "--temperature", "0",
            "--max-tokens", "6"]
    assert main(args + ["--lora", str(adapters["attn8"])]) == 0
    with_adapter = capsys.readouterr().out
    llm = LLM(str(tiny[0]), device="cpu", lora_modules={"attn8": str(adapters["attn8"])})
    expected = llm.generate("The list", SamplingParams(temperature=0, max_tokens=6), lora="attn8")[0].text
    assert with_adapter == "The list" + expected + "\n"
    assert main(args) == 0
    assert capsys.readouterr().out != with_adapter  # the adapter changes the answer


def test_chat_with_an_adapter(tiny, adapters):
    """`chat --lora PATH` loads the adapter under its folder's name and every answer runs under it.
    (The session itself, not a terminal: `run_chat` binds its streams when first imported.)"""
    from nanoserve.cli import build_parser, with_lora_adapter
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from nanoserve.server.chat import ChatSession

    args = build_parser().parse_args(["chat", "--model", str(tiny[0]), "--device", "cpu",
                                      "--lora", str(adapters["mlp4"])])
    assert with_lora_adapter(args) == "mlp4" and args.lora_modules == [f"mlp4={adapters['mlp4']}"]
    engine = Engine(EngineConfig.from_args(args))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with_adapter, _ = ChatSession(engine, params, lora="mlp4").ask("Hello")
    without, _ = ChatSession(engine, params).ask("Hello")
    llm = LLM(str(tiny[0]), device="cpu", lora_modules={"mlp4": str(adapters["mlp4"])})
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert with_adapter == llm.generate(prompt, params, lora="mlp4")[0].text != without


def test_lora_modules_errors_are_one_line(tiny, adapters, capsys):
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad, message in ((["a"], "takes NAME=PATH"), (["a=/x", "a=/y"], "names 'a' twice"), (["=x"], "NAME=PATH")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
    args = ["generate", "x", "--model", str(tiny[0]), "--device", "cpu", "--max-tokens", "2"]
    assert main(args + ["--lora-modules", "big=" + str(adapters["all16"]), "--max-lora-rank", "8"]) == 2
    err = capsys.readouterr().err
    assert "rank 16 is above --max-lora-rank 8" in err and err.count("\n") == 1
    assert main(args + ["--lora", str(adapters["qv2"]), "--no-cache"]) == 2
    assert "drop --no-cache" in capsys.readouterr().err
