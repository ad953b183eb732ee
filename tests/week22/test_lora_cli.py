"""Week 22 on the command line: `generate` and `chat` take `--lora PATH`; `--lora-modules` is
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


def test_chat_with_an_adapter(tiny, adapters, capsys):
    args = ["chat", "Hello", "--model", str(tiny[0]), "--device", "cpu", "--temperature", "0", "--max-tokens", "5"]
    if not (tiny[0] / "tokenizer_config.json").is_file() or "chat_template" not in (tiny[0] / "tokenizer_config.json").read_text():
        pytest.skip("the tiny model's tokenizer has no chat template")
    assert main(args + ["--lora", str(adapters["mlp4"])]) == 0
    with_adapter = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out != with_adapter


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
