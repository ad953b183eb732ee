"""The `nanoserve` command line: `chat`, `generate`, `compare`, `serve`, `bench`, `plan`, `run-batch`, `cache` and `course`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from nanoserve.model.loader import MODEL_NAMES_HELP, resolve_model_dir
from nanoserve.sampling.params import SamplingParams
from nanoserve.server.arguments import add_serve_arguments


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# What `generate` and `chat` sample with when neither the command line nor the model names a setting
# (the model names its own in generation_config.json, or a GGUF file in its general.sampling.* keys;
# SmolLM2's file and the bundled tiny model name none):
# - generate: greedy, so that a completion comes out the same every time, as the lessons show them;
# - chat: greedy too, with a repetition penalty of 1.1 (CTRL, the paper that introduced it, used 1.2).
#   Measured on SmolLM2-135M (Q4_1; 2026-11-26), with answers of up to 200 tokens: greedy alone repeats
#   itself to the limit on open questions ("I'm a language model that's designed to be empathetic and
#   empathetic. I'm a ..."), and so does sampling at SmolLM2's model card's temperature 0.2 with top-p
#   0.9 (5 answers of 15: "a kettle, and more kettle, a kettle, ..."); with the penalty neither did, in
#   8 questions greedy and 15 answers sampled. But sampling, at 0.2 as at 0.7, starts many answers to
#   "What is the capital of France?" with "L'Étoile" and goes on in French (5 of 16 at 0.2, with and
#   without the penalty): "The" and "L" are nearly tied there, and greedy takes "The" every time.
FALLBACK_SAMPLING = {
    "generate": {"temperature": 0.0},
    "chat": {"temperature": 0.0, "repetition_penalty": 1.1},
}
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "repetition_penalty")


def sampling_params(args: argparse.Namespace, model_dir: os.PathLike) -> tuple[SamplingParams, str]:
    """The SamplingParams of `generate` and `chat`, and where they came from (in words). Each setting
    comes from the first that names it: the command line, the model's own generation config, the
    command's fallback above. When the model names any setting, the ones it leaves out are neutral
    (temperature 1, no top-k/top-p, no penalty), as in HuggingFace and vLLM: its authors
    chose that combination."""
    from nanoserve.model.loader import generation_defaults

    model = generation_defaults(model_dir)
    base = model or FALLBACK_SAMPLING[args.command]
    neutral = SamplingParams()
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else base.get(name, getattr(neutral, name))
              for name in SAMPLING_OPTIONS}
    source = ("the model's generation_config.json" if model else
              f"nanoserve {args.command}'s defaults: the model names no sampling settings")
    if any(getattr(args, name) is not None for name in SAMPLING_OPTIONS):
        source = f"the command line, then {source}"
    try:
        params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **chosen)
    except ValueError as e:  # a bad value in the model's file: say where it came from
        raise ValueError(f"{e} (from {source})") from None
    return params, source


def describe_sampling(params: SamplingParams) -> str:
    """'greedy', or the settings that shape the draw: 'temperature 0.7, top-p 0.9, repetition penalty 1.1'."""
    return describe_settings(params.temperature, params.top_p, params.top_k, params.repetition_penalty)


def describe_settings(temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      repetition_penalty: float = 1.0) -> str:
    """`describe_sampling` from the values themselves (the defaults are SamplingParams'): the help
    text uses it without building a SamplingParams, whose checks are a week-3 exercise."""
    greedy = temperature == 0
    if greedy and repetition_penalty == 1.0:
        return "greedy"
    parts = ["greedy" if greedy else f"temperature {temperature:g}"]
    if not greedy and top_p < 1.0:
        parts.append(f"top-p {top_p:g}")
    if not greedy and top_k:
        parts.append(f"top-k {top_k}")
    if repetition_penalty != 1.0:
        parts.append(f"repetition penalty {repetition_penalty:g}")
    return ", ".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.engine.config import DTYPES, EngineConfig
    from nanoserve.engine.engine import Engine

    if args.no_cache:  # week 2's loop: recompute the whole sequence for every token
        if args.lora is not None:
            raise ValueError("--lora runs on the engine (with its KV cache): drop --no-cache")
        return _generate_no_cache(args, args.device or _default_device(), DTYPES[args.dtype or "float32"])
    lora = with_lora_adapter(args)
    engine = Engine(EngineConfig.from_args(args))
    params, _ = sampling_params(args, resolve_model_dir(args.model))
    engine.add_request(args.prompt, params, lora=lora)
    print(args.prompt, end="", flush=True)
    start, n = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():  # stream the text as it comes
            print(out.delta, end="", flush=True)
            n = len(out.token_ids)
    elapsed = time.perf_counter() - start
    engine.close()
    print()
    print(f"[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tok/s, KV cache on, {describe_sampling(params)}]",
          file=sys.stderr)
    return 0


def _generate_no_cache(args: argparse.Namespace, device: str, dtype: torch.dtype) -> int:
    from nanoserve.engine.tokenizer import Tokenizer
    from nanoserve.model.loader import load_model
    from nanoserve.runner.generate import greedy_generate_no_cache

    tok = Tokenizer(args.model)
    model = load_model(args.model, dtype=dtype, device=device)
    ids = tok.encode(args.prompt)
    start = time.perf_counter()
    new = greedy_generate_no_cache(model, ids, args.max_tokens, stop_ids=model.config.eos_token_ids)
    elapsed = time.perf_counter() - start
    print(args.prompt + tok.decode(new))
    print(f"[{len(new)} tokens in {elapsed:.2f} s, {len(new) / elapsed:.1f} tok/s, no KV cache, greedy]",
          file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from nanoserve.server.chat import ChatSession, run_chat

    lora = with_lora_adapter(args)
    engine = Engine(EngineConfig.from_args(args))
    params, source = sampling_params(args, resolve_model_dir(args.model))
    # One line on stderr (stdout is the conversation): which sampling, why, and how to change it.
    print(f"nanoserve chat: sampling: {describe_sampling(params)} ({source}; --temperature, --top-p, "
          "--top-k and --repetition-penalty change it)", file=sys.stderr)
    return run_chat(ChatSession(engine, params, system=args.system, lora=lora), args.message)


def with_lora_adapter(args: argparse.Namespace) -> str | None:
    """Week 23: `--lora PATH` of generate and chat, added to the engine's --lora-modules under the
    folder's name; returns that name (None without --lora)."""
    if args.lora is None:
        return None
    name = Path(args.lora).expanduser().resolve().name
    args.lora_modules = (args.lora_modules or []) + [f"{name}={args.lora}"]
    return name


def cmd_cache(args: argparse.Namespace) -> int:
    import shutil

    from nanoserve.model.gguf import assembled_gguf_files, cache_dir

    root = cache_dir() / "gguf"
    entries = sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []
    for entry in entries:
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        print(f"{size / 2**20:10.1f} MiB  {entry}")
    for path in assembled_gguf_files():  # gemma3-270m's file, joined from its package's parts
        print(f"{path.stat().st_size / 2**20:10.1f} MiB  {path} (the GGUF file, assembled by its package; "
              "--clear keeps it)")
    if args.clear:
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {len(entries)} converted model(s) from {root}")
    elif not entries:
        print(f"no converted models in {root}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoserve.server.app import check_port_free

    _configure_logging(args.log_level)
    if (args.prefill_url is None) != (args.decode_url is None):
        raise SystemExit("nanoserve serve: --prefill-url and --decode-url go together (the proxy of a pair)")
    if args.disaggregated and (args.kv_role or args.data_parallel_size > 1 or args.prefill_url):
        raise SystemExit("nanoserve serve: --disaggregated starts a pair and its proxy: drop --role, "
                         "--data-parallel-size and --prefill-url/--decode-url")
    # Before the model loads: a port in use is a one-line error now, not a traceback minutes later.
    check_port_free(args.host, args.port)
    if args.kv_role == "decode" or args.disaggregated:  # issue 35: where the decode instance's KV connector listens
        kv_host, _, kv_port = args.kv_address.rpartition(":")
        if not kv_host or not kv_port.isdigit():
            raise ValueError(f"--kv-address {args.kv_address!r} is not host:port")
        check_port_free(kv_host, int(kv_port))
    if args.prefill_url:  # issue 35: only the proxy of a pair started elsewhere
        return serve_proxy(args)
    if args.disaggregated:  # issue 35: a pair and its proxy (nanoserve/server/disaggregated.py)
        from nanoserve.server.disaggregated import serve_disaggregated

        for port in (args.port + 1, args.port + 2):
            check_port_free("127.0.0.1", port)
        return serve_disaggregated(args, args.argv)
    for replica in range(args.data_parallel_size if args.data_parallel_size > 1 else 0):  # on their own ports
        check_port_free("127.0.0.1", args.port + 1 + replica)
    if args.data_parallel_size > 1:  # week 18: replicas behind a front (nanoserve/server/data_parallel.py)
        from nanoserve.server.data_parallel import serve_data_parallel

        return serve_data_parallel(args, args.argv)
    from nanoserve.server.serve import serve_models

    return serve_models(args)


def serve_proxy(args: argparse.Namespace) -> int:
    """`nanoserve serve --prefill-url URL --decode-url URL`: the proxy of a disaggregated pair (issue 35)."""
    import uvicorn

    from nanoserve.server.app import guard_options
    from nanoserve.server.disaggregated import create_proxy
    from nanoserve.server.http11 import OpenAIErrorH11Protocol

    app = create_proxy(args.prefill_url, args.decode_url, **guard_options(args))
    print(f"nanoserve: proxy for prefill {args.prefill_url} + decode {args.decode_url} on "
          f"http://{args.host}:{args.port}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=OpenAIErrorH11Protocol,
                timeout_keep_alive=args.keep_alive_timeout)
    return 0


def _configure_logging(level: str) -> None:
    """nanoserve's own loggers at `level` on stderr; the request log (`nanoserve.requests`) as
    bare JSON lines, so that `2> requests.jsonl`-style collection needs no parsing."""
    import logging

    root = logging.getLogger("nanoserve")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    requests = logging.getLogger("nanoserve.requests")
    if not requests.handlers:
        bare = logging.StreamHandler()
        bare.setFormatter(logging.Formatter("%(message)s"))
        requests.addHandler(bare)
        requests.propagate = False


def cmd_compare(args: argparse.Namespace) -> int:
    from nanoserve.bench.compare import compare_with_hf, first_divergence, format_report
    from nanoserve.engine.tokenizer import Tokenizer

    model_dir = resolve_model_dir(args.model)
    ids = Tokenizer(model_dir).encode(args.prompt)
    diffs = compare_with_hf(str(model_dir), ids)
    print(f"{len(ids)} tokens through {model_dir}")
    print(format_report(diffs, args.rtol))
    return 0 if first_divergence(diffs, args.rtol) is None else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from nanoserve.engine.planner import format_plan, plan_command

    print(format_plan(plan_command(args)))
    return 0


def _add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    """`nanoserve plan`'s options: the model, and the machine it is planned for."""
    from nanoserve.engine.planner import H100_BANDWIDTH, H100_MEMORY

    plan.add_argument("--model", default="tiny", help=f"{MODEL_NAMES_HELP}, or a config.json file; only its config "
                      "is read (default: %(default)s)")
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    plan.add_argument("--gpus-per-node", type=int, default=None,
                      help="GPUs of one host, joined by NVLink; tensor parallelism stays inside one (default: "
                           "--gpus, one node)")
    plan.add_argument("--gpu-memory", type=float, default=H100_MEMORY / 1e9,
                      help="GB of memory a GPU (default: %(default)g, an H100)")
    plan.add_argument("--gpu-bandwidth", type=float, default=H100_BANDWIDTH / 1e12,
                      help="TB/s of memory bandwidth a GPU, for the speed estimate (default: %(default)g, an H100)")
    plan.add_argument("--max-model-len", type=int, default=None,
                      help="the longest sequence to leave KV room for (default: the model's context length)")
    plan.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                      help="the weights' and the KV cache's type (default: %(default)s)")


def add_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """`--parallel auto` of serve and bench: the planner's sizes in place of -tp and -dp."""
    parser.add_argument("--parallel", choices=["manual", "auto"], default="manual",
                        help="auto: choose --tensor-parallel-size and --data-parallel-size (and pipeline "
                             "parallelism, where this nanoserve has it) for the GPUs this process sees, as "
                             "`nanoserve plan` does, and print the plan; manual: take them from those options "
                             "(default: %(default)s)")


def apply_parallel_auto(args: argparse.Namespace) -> None:
    """`--parallel auto`: plan for the GPUs here and set the sizes on args, before any engine is built."""
    from nanoserve.engine.planner import auto_parallel, detect_machine, format_plan

    plan = auto_parallel(args, detect_machine(args.gpu_memory_utilization))
    print(format_plan(plan), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    from nanoserve import __version__

    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from nanoserve.engine.config import EngineConfig

    def add_sampling(p: argparse.ArgumentParser, max_tokens: int, command: str) -> None:
        fallback = describe_settings(**FALLBACK_SAMPLING[command])
        g = p.add_argument_group("sampling", "Unset, --temperature, --top-p, --top-k and --repetition-penalty are "
                                 "the model's own (its generation_config.json, or a GGUF file's general.sampling.* "
                                 f"keys); when the model names none: {fallback}.")
        g.add_argument("--max-tokens", type=int, default=max_tokens, help="new tokens at most (default: %(default)s)")
        g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: see above)")
        g.add_argument("--top-p", type=float, default=None,
                       help="keep the most likely tokens whose probabilities add up to this (default: see above)")
        g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = all (default: see above)")
        g.add_argument("--repetition-penalty", type=float, default=None,
                       help="> 1 makes the tokens of the prompt and the answer so far less likely (default: see above)")
        g.add_argument("--seed", type=int, default=None, help="make the draws repeatable (default: none, fresh draws)")

    chat = sub.add_parser("chat", help="talk to a chat model in the terminal (default: smollm2)")
    chat.add_argument("message", nargs="?", default=None, help="answer this one message and exit")
    add_sampling(chat, max_tokens=512, command="chat")
    chat.add_argument("--system", default=None, help="a system message (default: the chat template's own)")
    chat.add_argument("--lora", default=None, metavar="PATH", help="answer with this LoRA adapter (a PEFT folder; week 23)")
    EngineConfig.add_arguments(chat, default_model="smollm2")
    chat.set_defaults(func=cmd_chat)

    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    add_sampling(gen, max_tokens=48, command="generate")
    gen.add_argument("--no-cache", action="store_true", help="week 2's loop: recompute everything per token")
    gen.add_argument("--lora", default=None, metavar="PATH", help="generate with this LoRA adapter (a PEFT folder; week 23)")
    EngineConfig.add_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    cmp = sub.add_parser("compare", help="per-layer differences between nanoserve and HuggingFace")
    cmp.add_argument("--model", default="tiny", help=f"{MODEL_NAMES_HELP} (default: %(default)s)")
    cmp.add_argument("prompt")
    cmp.add_argument("--rtol", type=float, default=1e-4,
                     help="a stage differs when its largest difference passes rtol x its scale (at least 1) "
                          "(default: %(default)g)")
    cmp.set_defaults(func=cmd_compare)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_serve_arguments(srv)
    add_parallel_argument(srv)
    EngineConfig.add_arguments(srv, several_models=True)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="latency, throughput and serving benchmarks, HuggingFace side by side")
    from nanoserve.bench.cli import add_arguments
    from nanoserve.bench.cli import run as run_bench

    add_arguments(bench)
    add_parallel_argument(bench)
    bench.set_defaults(func=run_bench)

    plan = sub.add_parser("plan", help="choose tensor-, pipeline- and data-parallel sizes for a model on a machine, "
                                       "from its config alone, and say why")
    _add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    batch = sub.add_parser("run-batch", help="offline inference from a batch file (OpenAI batch JSONL, prompts in "
                                             "JSONL, CSV or Parquet); resumable")
    import nanoserve.server.run_batch

    nanoserve.server.run_batch.add_arguments(batch)
    batch.set_defaults(func=nanoserve.server.run_batch.run)

    cache = sub.add_parser("cache", help="list the GGUF files converted so far; --clear removes them")
    cache.add_argument("--clear", action="store_true")
    cache.set_defaults(func=cmd_cache)

    sub.add_parser("course", help="the learner's workspace: start, check, peek, reset, notebook (see nanoserve/course/cli.py)")
    return parser


def worker_rank_under_torchrun(args: argparse.Namespace) -> bool:
    """Week 18: started by torchrun, ranks other than 0 do not run the command: they are the
    engine's workers (rank 0 runs it, and drives them). True once such a rank is done."""
    from nanoserve.engine.distributed import rank_device, torchrun_rank, worker_main

    found = torchrun_rank()
    if found is None or found[0] == 0 or not hasattr(args, "tensor_parallel_size"):
        return False
    from nanoserve.engine.config import EngineConfig, default_device

    rank, size = found
    config = EngineConfig.from_args(args)
    if config.world_size != size:  # (week 20: every stage of a pipeline is a tensor-parallel group)
        raise ValueError(f"torchrun started {size} ranks but --tensor-parallel-size x --pipeline-parallel-size "
                         f"x --expert-parallel-size is {config.world_size}")
    config.device = config.device or default_device()
    init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    worker_main(config, rank, size, init, config.distributed_timeout, rank_device(config.device, rank))
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["course"]:  # the learner's workspace commands live in nanoserve/course/cli.py
        from nanoserve.course.cli import main as course_main

        return course_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # what --data-parallel-size hands on to its replicas
    try:
        if args.command == "serve":  # issue 38: --model may name several models
            from nanoserve.server.serve import split_models

            split_models(args)
        if getattr(args, "parallel", "manual") == "auto":  # before torchrun's ranks read the sizes
            apply_parallel_auto(args)
        if worker_rank_under_torchrun(args):
            return 0
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:  # user errors: a message, not a traceback
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
