"""The defaults a newcomer expects from the command line (issue 31).

- `chat` and `generate` sample the way the model's own generation config says (HuggingFace's
  generation_config.json, or a GGUF file's general.sampling.* keys), flags win, and a model that
  says nothing gets each command's fallback;
- a folder that is not a model, a port in use, a port that is no port: one line that says what is
  wrong, before anything slow happens;
- `--version`; every option's help states its default; `bench`'s results stay out of git.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
from pathlib import Path

import pytest

from nanoserve.cli import FALLBACK_SAMPLING, build_parser, describe_sampling, main, sampling_params
from nanoserve.model.loader import generation_defaults, resolve_model_dir
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import command_parsers, make_checkpoint, make_hf_model, tiny_config, write_gguf

ROOT = Path(__file__).resolve().parents[1]
MODEL_SAMPLING = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint whose generation_config.json names all four settings (as Llama-3.2's names two)."""
    path, _ = make_checkpoint(tmp_path_factory.mktemp("sampled-model"))
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(config | MODEL_SAMPLING | {"do_sample": True}))
    return path


def params_for(argv: list[str], model: Path):
    return sampling_params(build_parser().parse_args(argv), model)


# ------------------------------------------------------------------------------ sampling defaults


@pytest.mark.parametrize("command", [["chat"], ["generate", "a prompt"]])
def test_the_models_generation_config_is_the_default(model_dir, command):
    params, source = params_for([*command, "--model", str(model_dir)], model_dir)
    assert {k: getattr(params, k) for k in MODEL_SAMPLING} == MODEL_SAMPLING
    assert source == "the model's generation_config.json"


def test_flags_win_over_the_model(model_dir):
    params, source = params_for(["generate", "x", "--model", str(model_dir), "--temperature", "0.3", "--top-k", "5",
                                 "--repetition-penalty", "1.0"], model_dir)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.3, 5, 1.0)
    assert params.top_p == MODEL_SAMPLING["top_p"]  # not given: still the model's
    assert source.startswith("the command line, then the model's")


def test_a_model_that_names_some_settings_leaves_the_others_neutral(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "do_sample": True}))
    params, _ = params_for(["chat", "--model", str(tmp_path)], tmp_path)
    # its authors chose temperature 0.6 alone: chat's fallback top-p and penalty do not join in
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 1.0, 0, 1.0)


def test_a_model_that_names_none_gets_the_commands_fallback():
    tiny = resolve_model_dir("tiny")  # its generation_config.json has token ids only, like SmolLM2's GGUF
    assert generation_defaults(tiny) == {}
    chat, source = params_for(["chat"], tiny)
    assert {k: getattr(chat, k) for k in FALLBACK_SAMPLING["chat"]} == FALLBACK_SAMPLING["chat"]
    assert chat.repetition_penalty > 1 and "the model names no sampling settings" in source  # against loops
    generate, _ = params_for(["generate", "x"], tiny)
    assert describe_sampling(generate) == "greedy"


def test_a_bad_value_in_the_models_file_names_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\].*generation_config.json"):
        params_for(["chat"], tmp_path)


def test_chat_says_how_it_samples_and_generate_too(model_dir, capsys):
    common = ["--model", str(model_dir), "--device", "cpu", "--num-blocks", "32", "--max-tokens", "2"]
    assert main(["chat", "Hello", *common]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("nanoserve chat: sampling: temperature 0.6, top-p 0.8, top-k 20, "
                            "repetition penalty 1.2 (the model's generation_config.json; --temperature")
    assert main(["generate", "The list", *common, "--temperature", "0"]) == 0
    assert capsys.readouterr().err.strip().endswith("KV cache on, greedy, repetition penalty 1.2]")


def test_a_gguf_files_sampling_keys_become_its_generation_config(tmp_path):
    from nanoserve.model.gguf import convert_gguf

    model = make_hf_model(tiny_config(rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
    path = write_gguf(tmp_path / "sampled.gguf", model, "F32",
                      sampling={"temp": 0.7, "top_p": 0.95, "top_k": 40, "penalty_repeat": 1.1})
    out = convert_gguf(path, tmp_path / "converted")
    # stored as float32 (0.7 is 0.699999988 there), read back as the number that was meant
    assert generation_defaults(out) == {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "repetition_penalty": 1.1}


def test_the_help_says_where_sampling_comes_from():
    text = " ".join(_subparser(build_parser(), "chat").format_help().split())
    assert "--repetition-penalty" in text
    assert "the model's own (its generation_config.json, or a GGUF file's general.sampling.* keys)" in text
    assert f"when the model names none: {describe_sampling(SamplingParams(**FALLBACK_SAMPLING['chat']))}." in text


# ------------------------------------------------------------------------------ error messages


def test_a_folder_that_is_no_model_says_what_it_lacks(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert "is not a model folder: no config.json, no weights (model.safetensors), no tokenizer files" in err
    assert "--model takes a model folder: config.json, the weights" in err
    assert "sentencepiece" not in err and len(err.strip().splitlines()) == 1


def test_a_folder_without_a_tokenizer_names_it_and_a_gguf_inside(tmp_path, capsys):
    from nanoserve.engine.tokenizer import Tokenizer

    path, _ = make_checkpoint(tmp_path / "weights-only", with_tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"not a model folder: no tokenizer files\. --model takes"):
        Tokenizer(path)  # `nanoserve compare` starts here
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model.Q4_0.gguf").write_bytes(b"GGUF")
    assert main(["chat", "hi", "--model", str(tmp_path / "empty")]) == 2
    assert "It holds model.Q4_0.gguf: pass that file as --model." in capsys.readouterr().err


def test_a_file_that_is_not_a_gguf_file_is_named_so(tmp_path, capsys):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x00" * 64)
    assert main(["generate", "--model", str(path), "hi"]) == 2
    assert "is a file, but not a GGUF file" in capsys.readouterr().err


@pytest.fixture
def busy_port():
    """A port another program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_reported_before_the_model_loads(busy_port, monkeypatch, capsys):
    def no_engine(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr("nanoserve.engine.engine.Engine", no_engine)
    assert main(["serve", "--model", "tiny", "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert err == f"nanoserve: error: port {busy_port} on 127.0.0.1 is already in use: stop what listens there, " \
                  "or choose another --port\n"
    # --data-parallel-size: the replicas' ports (--port+1, ...) are checked too, before any replica starts
    assert main(["serve", "--model", "tiny", "--port", str(busy_port - 1), "-dp", "2"]) == 2
    assert f"port {busy_port} on 127.0.0.1 is already in use" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "bench serving"])
@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_that_is_no_port_is_an_argparse_error(command, port, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command.split(), f"--port={port}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --port:" in err and "1 to 65535" in err and "Traceback" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    assert capsys.readouterr().out == f"nanoserve {version}\n"  # the package's version is the project's


# ------------------------------------------------------------------------------ --help and bench


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return dict(command_parsers(parser))[f"nanoserve {name}"]


FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
         argparse._VersionAction, argparse._HelpAction)


def options_without_their_default(parser: argparse.ArgumentParser) -> list[str]:
    """The options of every (sub)command that have a default but whose help does not state it: a
    flag (--quick, --no-metrics) has no value to state, and None means "not set", said where it matters."""
    missing = []
    for name, sub in command_parsers(parser):
        for action in sub._actions:
            if not action.option_strings or isinstance(action, FLAGS) or action.default in (None, argparse.SUPPRESS):
                continue
            text = action.help % dict(vars(action), prog=name) if action.help else ""  # %(default)s filled in
            if isinstance(action.default, tuple):  # LOW,HIGH pairs state it as typed, not as %(default)s would
                stated = f"default: {','.join(map(str, action.default))}" in text
            else:
                stated = re.search(r"\bdefault\b", text, re.IGNORECASE)
            if not stated:
                missing.append(f"{name} {action.option_strings[0]} (default {action.default!r}): {text!r}")
    return missing


def test_every_option_states_its_default():
    missing = options_without_their_default(build_parser())
    assert not missing, "these options' --help does not say their default:\n" + "\n".join(missing)


def test_an_option_without_its_default_is_caught():
    parser = argparse.ArgumentParser(prog="nanoserve")
    sub = parser.add_subparsers().add_parser("planted")
    sub.add_argument("--block-size", type=int, default=16, help="tokens per KV block")  # planted: no default
    sub.add_argument("--seats", type=int, default=8, help="seats (default: %(default)s)")
    sub.add_argument("--quick", action="store_true", help="a flag")
    sub.add_argument("--lengths", default=(100, 1024), help="LOW,HIGH (default: 100,512)")  # planted: stale
    sub.add_argument("--output-len", default=(100, 512), help="LOW,HIGH (default: 100,512)")
    assert [m.split(" (")[0] for m in options_without_their_default(parser)] == [
        "nanoserve planted --block-size", "nanoserve planted --lengths"]


def test_bench_results_stay_out_of_git():
    out = _subparser(build_parser(), "bench").get_default("out")
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert not Path(out).is_absolute() and f"{out}/" in ignored
