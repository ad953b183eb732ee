"""`nanoserve serve` in one process: the model(s), each on its own engine thread, and the app under
uvicorn (issue 38: several models, `--model NAME=PATH` repeated; nanoserve/server/models.py). The
data-parallel front and the disaggregated pair start such processes (nanoserve/server/data_parallel.py,
nanoserve/server/disaggregated.py)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

import uvicorn

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.server.app import create_app, guard_options
from nanoserve.server.data_parallel import exit_on_signal
from nanoserve.server.http11 import OpenAIErrorH11Protocol
from nanoserve.server.models import ModelRegistry, parse_models
from nanoserve.server.rate_limits import RateLimiter
from nanoserve.server.toolbox import MAX_TOOL_ROUNDS, TOOL_TIMEOUT, ToolBox


def serve_models(args: argparse.Namespace) -> int:
    """One process, its model(s) (issue 38: several, `args.models`) each on its own engine thread."""
    toolbox = build_toolbox(args)  # before any model loads: a bad --mcp-config is a one-line error now
    limits = None
    if args.rate_limit_rpm is not None or args.rate_limit_tpm is not None:
        limits = RateLimiter(args.rate_limit_rpm, args.rate_limit_tpm)
    builders = {name: engine_builder(args, name, path) for name, path in args.models.items()}
    first = list(builders)[:args.max_loaded_models or len(builders)]  # loaded now; the others on demand
    preloaded = {}
    try:
        for k, name in enumerate(first):
            preloaded[name] = builders[name]((k + 1) / len(first))
        registry = ModelRegistry(builders, args.max_loaded_models, preloaded)
    except BaseException:
        for engine in preloaded.values():
            engine.shutdown()
        raise
    app = create_app(registry, metrics=args.metrics, log_requests=args.log_requests, rate_limits=limits,
                     toolbox=toolbox, max_tool_rounds=args.max_tool_rounds, session_ttl=args.session_ttl,
                     session_kv_fraction=args.session_kv_fraction, **guard_options(args))
    for name, engine in preloaded.items():
        described = describe(engine.engine) + (f", the {args.kv_role} instance of a pair (KV over "
                                               f"{args.kv_connector}, {args.kv_address})" if args.kv_role else "")
        served = args.model if len(builders) == 1 else f"{name} ({args.models[name]})"
        print(f"nanoserve: serving {served} on http://{args.host}:{args.port} ({described})", file=sys.stderr)
    for name in list(builders)[len(first):]:
        print(f"nanoserve: {name} ({args.models[name]}) loads on its first request", file=sys.stderr)
    previous = signal.signal(signal.SIGTERM, exit_on_signal)  # docker, systemd, kubernetes: as Ctrl-C
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=OpenAIErrorH11Protocol,
                    timeout_keep_alive=args.keep_alive_timeout)
    finally:
        registry.close()  # each engine thread, then each engine's other ranks
        signal.signal(signal.SIGTERM, previous)
    return 0


def build_toolbox(args: argparse.Namespace) -> ToolBox | None:
    """Issue 38: the server's own tools from --server-tools, --tools-dir, --mcp-config and --tool-timeout,
    or None when none is asked for (the app starts the MCP servers in its lifespan)."""
    if args.server_tools is None and args.mcp_config is None:
        return None
    return ToolBox.from_options(args.server_tools, args.tools_dir, args.mcp_config, args.tool_timeout)


def check_tool_flags(args: argparse.Namespace) -> None:
    """Issue 38: the server-side tools' flags, checked before anything starts. A flag that nothing
    would read is refused rather than ignored."""
    asked = args.server_tools is not None or args.mcp_config is not None
    if not asked:
        unread = [flag for flag, on in (("--tools-dir", args.tools_dir is not None),
                                        ("--tool-timeout", args.tool_timeout != TOOL_TIMEOUT),
                                        ("--max-tool-rounds", args.max_tool_rounds != MAX_TOOL_ROUNDS)) if on]
        if unread:
            raise ValueError(f"{', '.join(unread)} apply to server-side tools: give --server-tools or --mcp-config")
        return
    if args.tool_timeout <= 0 or args.max_tool_rounds < 1:
        raise ValueError("--tool-timeout must be more than 0 seconds and --max-tool-rounds at least 1")
    refused = [flag for flag, on in (
        ("--data-parallel-size", args.data_parallel_size > 1), ("--disaggregated", args.disaggregated),
        ("--role", args.kv_role), ("--prefill-url", args.prefill_url)) if on]
    if refused:
        raise ValueError(f"server-side tools (issue 38) do not work with {', '.join(refused)} yet")


def engine_builder(args: argparse.Namespace, name: str, path: str):
    """Issue 38: `build(share)` for one model of `nanoserve serve`: its engine, started, on a GPU within
    `share` of --gpu-memory-utilization (k / --max-loaded-models when it is the k-th resident model)."""
    config = dataclasses.replace(EngineConfig.from_args(args), model=path)

    def build(share: float) -> AsyncEngine:
        engine = AsyncEngine(Engine(dataclasses.replace(config, gpu_memory_utilization=config.gpu_memory_utilization
                                                        * share)), max_pending=args.max_pending)
        if len(args.models) > 1:  # which model's engine a thread dump shows
            engine.thread.name = f"nanoserve-engine {name}"
        return engine.start()

    return build


def split_models(args: argparse.Namespace) -> None:
    """`nanoserve serve --model ...` (issue 38): `args.models` as {name: model}; `args.model` the one
    model (or the first), as the other commands have it. Several models run one engine each, in this
    process: what spreads a model over processes or instances is refused with them (not yet)."""
    args.models = parse_models(args.model or ["tiny"], args.served_model_name)
    args.model = next(iter(args.models.values()))
    check_tool_flags(args)
    if args.max_loaded_models is not None and args.max_loaded_models < 1:  # before any model loads
        raise ValueError(f"--max-loaded-models must be at least 1, got {args.max_loaded_models}")
    if len(args.models) == 1:
        return
    refused = [flag for flag, on in (
        ("--data-parallel-size", args.data_parallel_size > 1), ("--disaggregated", args.disaggregated),
        ("--role", args.kv_role), ("--prefill-url", args.prefill_url), ("--parallel auto", args.parallel == "auto"),
        ("--tensor-parallel-size", args.tensor_parallel_size > 1), ("--pipeline-parallel-size", args.pipeline_parallel_size > 1),
        ("--expert-parallel-size", args.expert_parallel_size > 1), ("--lora-modules", args.lora_modules)) if on]
    if refused:
        raise ValueError(f"several models in one server (issue 38) do not take {', '.join(refused)} yet: serve one "
                         "model per process for those")


def describe(engine: Engine) -> str:
    """What the start-up line says of an engine: its KV pool and its attention."""
    cache = engine.runner.cache
    return f"{cache.num_blocks} KV blocks of {cache.block_size}, {engine.attention_backend} attention"
