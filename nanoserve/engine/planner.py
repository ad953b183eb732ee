"""The parallelism planner: how many GPUs split the model (TP, PP) and how many copies serve (DP).

`nanoserve plan --model M --gpus N` answers before anything is loaded, from the model's config
alone and a cost model small enough to check by hand:

- **Memory.** Each GPU holds its share of the weights, weights / (TP x PP); a reserve for one
  step's activations and the CUDA graphs; and the KV cache of its layers and heads. A plan fits
  when those fit in `gpu_memory_utilization` of the GPU's memory with KV room left for at least
  `MIN_SEQUENCES` sequences of `max_model_len` tokens.
- **Where each kind may go.** TP all-reduces twice a layer on every step, so it stays inside a
  node (on NVLink) and only where the model splits evenly (`check_shardable`); PP hands one
  activation from stage to stage, so it may cross nodes.
- **Preference.** The smallest model-parallel degree TP x PP that fits: every GPU left over is
  one more replica (DP) serving its own requests, which is where throughput comes from. Among
  splits of one degree, more TP and less PP: TP makes each token faster, PP does not.
- **Speed.** A roofline estimate of one batch-1 decode step: the bytes each GPU reads over its
  memory bandwidth, plus the latency of every collective on the token's path; and PP's bubble.

The constants below say where their figures come from. The planner imports no torch and loads no
weights; `detect_machine` (for `serve --parallel auto`) is the one function that asks CUDA.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from nanoserve.engine.config import EngineConfig
from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import TINY_MODEL, gguf_source, resolve_model_dir
from nanoserve.model.tensor_parallel import check_shardable

GB = 1e9  # the planner speaks in decimal gigabytes, as GPU data sheets do
# H100 SXM's data sheet: 80 GB of HBM3 at 3.35 TB/s. (torch reports 79.2 GiB = 85.0 GB on it, so
# 80 GB leaves a little slack.) The H200 has 141 GB at 4.8 TB/s: pass --gpu-memory and --gpu-bandwidth.
H100_MEMORY = 80 * GB
H100_BANDWIDTH = 3.35e12  # bytes/s
# One all-reduce of a batch-1 hidden state (8 KiB in bf16 at hidden 4096), measured on two H100s
# joined by NVLink (NV18) with scripts/bench_all_reduce.py (docs/benchmarks.md, week 20): NCCL
# captured in a CUDA graph, 11.5 us; the one-shot all-reduce over peer-to-peer memory that
# `--all-reduce auto` uses for small messages on one host, 8.9 us. In the engine's batch-1 step the
# two came out level (docs/benchmarks.md), so the estimate uses NCCL's and prints the other beside it.
# Links differ: docs/parallelism.md says how to measure yours.
NCCL_ALLREDUCE_S = 11.5e-6
ONE_SHOT_ALLREDUCE_S = 8.9e-6
# A pipeline stage's hand-off (one [tokens, hidden] send to the next stage): not measured. The NCCL
# all-reduce latency above stands in for it, a lower bound once the hand-off crosses nodes.
STAGE_SEND_S = NCCL_ALLREDUCE_S
# One step's activations and the CUDA graphs, per GPU. The engine measures this on the real GPU
# before it sizes the KV pool (`kv_pool_blocks`); the Llama-3.2-1B shape at the defaults needed
# 1.53 GiB on an H100 (docs/benchmarks.md, "The KV pool sized from a measured step"). Rounded up.
ACTIVATION_RESERVE = 2 * 2**30
MIN_SEQUENCES = 4  # a plan must leave KV room for this many sequences of max_model_len tokens
# Micro-batches in flight through a pipeline: the batch of a step split in 8. GPipe (Huang et al.,
# 2019) found the bubble negligible once micro-batches number at least 4 x the stages.
PP_MICROBATCHES = 8
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "bfloat16": 2, "float16": 2, "float32": 4}
NORMS_PER_LAYER = {"Gemma3ForCausalLM": 4}  # Gemma 3 norms before and after attention and MLP; others 2


# ---------------------------------------------------------------------------- the model, counted


def read_model_config(model: str | os.PathLike) -> ModelConfig:
    """The config of what `--model` names, weights untouched: a checkpoint folder, a config.json
    file, 'tiny', a GGUF name or file (through `resolve_model_dir`, as `serve` resolves it: a GGUF
    file is converted once into the cache), or a hub id, of which only config.json is fetched."""
    text = str(model)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".json":
        return ModelConfig.from_json(path)
    hub_id = (text != TINY_MODEL and gguf_source(text) is None and not path.exists()
              and text.count("/") == 1 and not text.startswith((".", "/", "~")))
    if hub_id:  # serve would download the weights; the plan needs only the shapes
        return ModelConfig.from_json(hub_config(text))
    return ModelConfig.from_json(resolve_model_dir(model))


def hub_config(repo_id: str) -> Path:
    """config.json of a hub repository: from the local cache when it is there, else downloaded."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except Exception:
        pass
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as e:  # gated, offline, a typo: one line
        raise FileNotFoundError(f"could not get config.json of {repo_id!r} from the HuggingFace hub "
                                f"({type(e).__name__}); save it and pass --model path/to/config.json") from None


def count_parameters(cfg: ModelConfig) -> int:
    """Every parameter of the model, from its shapes: what `num_parameters()` of the HuggingFace
    model says (a tied head shares the embedding's matrix, so it counts once)."""
    embedding = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    qkv = cfg.q_size + 2 * cfg.kv_size  # q, k and v projections' outputs (GQA: fewer k/v heads)
    attention = cfg.hidden_size * qkv + cfg.q_size * cfg.hidden_size  # q/k/v, then o
    if cfg.attention_bias:  # Qwen2: biases on q, k and v
        attention += qkv
    if cfg.qk_norm:  # Qwen3, Gemma 3: one RMSNorm weight over a head of q, one over a head of k
        attention += 2 * cfg.head_dim
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up and down
    norms = NORMS_PER_LAYER.get(cfg.architecture, 2) * cfg.hidden_size
    final_norm = cfg.hidden_size
    mlps = sum(moe_parameters(cfg) if cfg.is_moe_layer(i) else mlp for i in range(cfg.num_layers))
    return embedding + head + cfg.num_layers * (attention + norms) + mlps + final_norm


def moe_parameters(cfg: ModelConfig) -> int:
    """Week 24: one MoE layer's router, experts and (Qwen2-MoE) gated shared expert."""
    experts = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    shared = 3 * cfg.hidden_size * cfg.shared_expert_intermediate_size
    return cfg.num_experts * cfg.hidden_size + experts + shared + (cfg.hidden_size if shared else 0)


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
    """KV cache bytes one token takes on one GPU: a K and a V vector per KV head per layer, for
    the layers of its stage and the KV heads of its rank. With more ranks than KV heads each rank
    keeps one KV head (replicated: `kv_head_range`), so past that point TP stops shrinking it."""
    layers = -(-cfg.num_layers // pp)  # the largest stage's
    kv_heads = max(cfg.num_kv_heads // tp, 1)
    return 2 * layers * kv_heads * cfg.head_dim * dtype_bytes


# ---------------------------------------------------------------------------- the machine and a split


@dataclass(frozen=True)
class Machine:
    """The GPUs a plan is for: how many, how they group into nodes, and each one's size and speed."""

    gpus: int
    gpus_per_node: int
    gpu_memory: float = H100_MEMORY  # bytes
    bandwidth: float = H100_BANDWIDTH  # bytes/s
    utilization: float = EngineConfig.gpu_memory_utilization  # the engine's default share of the memory

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus and --gpus-per-node must be at least 1 (got {self.gpus} and {self.gpus_per_node})")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not make whole nodes of {self.gpus_per_node}: --gpus must be a "
                             "multiple of --gpus-per-node")
        if self.gpu_memory <= 0 or self.bandwidth <= 0 or not 0 < self.utilization <= 1:
            raise ValueError("--gpu-memory and --gpu-bandwidth must be positive, and the memory utilization in (0, 1]")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def budget(self) -> float:
        """Bytes of one GPU the engine may use."""
        return self.gpu_memory * self.utilization


@dataclass(frozen=True)
class Split:
    """One way to split the model: its memory per GPU, in bytes."""

    tp: int
    pp: int
    weights: float
    kv_minimum: float  # MIN_SEQUENCES sequences of max_model_len tokens
    reserve: float
    kv_per_token: int

    @property
    def degree(self) -> int:
        return self.tp * self.pp

    @property
    def need(self) -> float:
        return self.weights + self.kv_minimum + self.reserve

    def describe(self) -> str:
        return (f"{bytes_text(self.need)} a GPU (weights {bytes_text(self.weights)} + KV {bytes_text(self.kv_minimum)}"
                f" + reserve {bytes_text(self.reserve)})")


def split_memory(cfg: ModelConfig, tp: int, pp: int, dtype_bytes: int, max_model_len: int) -> Split:
    """What each GPU of a TP x PP split holds. The weights divide evenly: a real split also gives
    the first stage the embedding and the last the head, and balances them with fewer layers."""
    kv = kv_bytes_per_token(cfg, dtype_bytes, tp, pp)
    return Split(tp, pp, weights=count_parameters(cfg) * dtype_bytes / (tp * pp),
                 kv_minimum=MIN_SEQUENCES * max_model_len * kv, reserve=ACTIVATION_RESERVE, kv_per_token=kv)


def tp_refusal(cfg: ModelConfig, tp: int) -> str | None:
    """Why the model cannot be split over `tp` ranks (week 18's `check_shardable`), or None."""
    if tp == 1:
        return None
    try:
        check_shardable(cfg, tp)
    except ValueError as e:
        return str(e)
    return None


def candidate_splits(cfg: ModelConfig, machine: Machine) -> list[tuple[int, int]]:
    """Every (TP, PP) the machine allows, in the order of preference: the smallest degree first,
    and at one degree the most TP. TP divides a node's GPUs (it stays on NVLink); PP has at least a
    layer a stage; the split tiles the machine, so that DP = gpus / (TP x PP) copies use every GPU."""
    tps = [t for t in range(machine.gpus_per_node, 0, -1) if machine.gpus_per_node % t == 0]
    splits = [(tp, degree // tp) for degree in range(1, machine.gpus + 1) if machine.gpus % degree == 0
              for tp in tps if degree % tp == 0 and degree // tp <= cfg.num_layers]
    return splits


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """The chosen sizes, the figures behind them, and one line of why per decision."""

    model: str
    config: ModelConfig
    machine: Machine
    dtype: str
    max_model_len: int
    params: int
    split: Split
    dp: int
    reasons: tuple[str, ...]

    @property
    def tp(self) -> int:
        return self.split.tp

    @property
    def pp(self) -> int:
        return self.split.pp

    @property
    def kv_room_tokens(self) -> int:
        """Tokens of KV one replica holds: what its GPUs have left after weights and reserve."""
        left = self.machine.budget - self.split.weights - self.split.reserve
        return int(left // self.split.kv_per_token)


def make_plan(cfg: ModelConfig, machine: Machine, dtype: str = "bf16", max_model_len: int | None = None,
              model: str = "model") -> Plan:
    """Pick TP, PP and DP for `cfg` on `machine` (see the module's docstring); a model that fits
    no split raises ValueError, in one line, with what it would need."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"--max-model-len must be at least 1 (got {max_model_len})")
    # >>> week20: make-plan
    length = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)  # as the engine clamps
    reasons = [f"memory: weights / (TP x PP) + {ACTIVATION_RESERVE / GB:.2f} GB reserve + KV for {MIN_SEQUENCES} "
               f"x {length} tokens must fit in {machine.utilization:g} x {machine.gpu_memory / GB:g} GB "
               f"= {machine.budget / GB:.2f} GB a GPU"]
    if length < (max_model_len or 0):
        reasons.append(f"max-model-len: {max_model_len} is past the model's {cfg.max_position_embeddings}; "
                       f"planned at {length}, as the engine would run it")
    refused_tps = set()
    for tp, pp in candidate_splits(cfg, machine):
        refused = tp_refusal(cfg, tp)
        if refused:  # said once for each TP size: the reason does not depend on PP
            if tp not in refused_tps:
                reasons.append(f"TP {tp}: refused: {refused}")
            refused_tps.add(tp)
            continue
        split = split_memory(cfg, tp, pp, DTYPE_BYTES[dtype], length)
        if split.need > machine.budget:
            reasons.append(f"TP {tp} x PP {pp}: does not fit: needs {split.describe()} > {machine.budget / GB:.2f} GB")
            continue
        reasons += chosen_reasons(split, machine)
        return Plan(model, cfg, machine, dtype, length, count_parameters(cfg), split,
                    machine.gpus // split.degree, tuple(reasons))
    raise ValueError(no_fit_message(cfg, machine, dtype, length))
    # <<< week20: make-plan


def chosen_reasons(split: Split, machine: Machine) -> list[str]:
    """The lines that say why the chosen split won, and what DP it leaves."""
    if split.degree == 1:
        fit = "the whole model fits one GPU: no split, no communication"
    elif split.pp == 1:
        fit = "the smallest split that fits; all TP, inside a node, where it also cuts each token's latency"
    elif split.tp < machine.gpus_per_node:
        fit = f"the smallest split that fits; PP {split.pp} because TP cannot go past {split.tp} for this model"
    else:
        fit = f"the smallest split that fits; TP fills a node ({split.tp} GPUs), PP {split.pp} spans nodes"
    dp = machine.gpus // split.degree
    return [f"TP {split.tp} x PP {split.pp}: fits: {split.describe()}: {fit}",
            f"DP {dp}: {plural(machine.gpus, 'GPU')} / (TP {split.tp} x PP {split.pp}) = " + (
                "1 copy of the model" if dp == 1 else f"{dp} copies of the model, each serving its own requests")]


def no_fit_message(cfg: ModelConfig, machine: Machine, dtype: str, length: int) -> str:
    """One line: the model fits nowhere here, what its best split would need, and what to change."""
    allowed = [(tp, pp) for tp, pp in candidate_splits(cfg, machine) if tp_refusal(cfg, tp) is None]
    tp, pp = max(allowed, key=lambda s: s[0] * s[1])  # the most GPUs; TP 1 x PP 1 is always allowed
    best = split_memory(cfg, tp, pp, DTYPE_BYTES[dtype], length)
    total = count_parameters(cfg) * DTYPE_BYTES[dtype] + MIN_SEQUENCES * length * kv_bytes_per_token(
        cfg, DTYPE_BYTES[dtype])
    return (f"the model does not fit on {plural(machine.gpus, 'GPU')} of {machine.gpu_memory / GB:g} GB: split the most "
            f"this machine allows (TP {tp} x PP {pp}) it needs {best.describe()}, over the "
            f"{machine.budget / GB:.2f} GB usable; {total / GB:.1f} GB of weights and KV in all ({dtype}, "
            f"{MIN_SEQUENCES} x {length} tokens): add GPUs, lower --max-model-len, or use a smaller dtype")


# ---------------------------------------------------------------------------- speed: a roofline


def collectives_per_step(cfg: ModelConfig, tp: int) -> int:
    """Collectives on one token's path through the model: two all-reduces a layer (after attention's
    o_proj and the MLP's down_proj), the embedding's all-reduce and the logits' all-gather."""
    return 0 if tp == 1 else 2 * cfg.num_layers + 2


def decode_step_seconds(plan: Plan, allreduce_s: float = NCCL_ALLREDUCE_S) -> tuple[float, float, float]:
    """A batch-1 decode step's time, as (reading weights, collectives, stage hand-offs), seconds.
    At batch 1 the stages of a pipeline run one after the other, so PP adds hand-offs and saves
    nothing: each of the PP stages reads its GPU's share in turn. The KV a sequence reads is left
    out: at batch 1 it is small next to the weights."""
    read = plan.pp * plan.split.weights / plan.machine.bandwidth
    return read, collectives_per_step(plan.config, plan.tp) * allreduce_s, (plan.pp - 1) * STAGE_SEND_S


def pipeline_bubble(pp: int, microbatches: int = PP_MICROBATCHES) -> float:
    """The share of a pipeline's time its stages sit idle, filling and draining: (P - 1) / (M + P - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


# ---------------------------------------------------------------------------- the plan, in words


def format_plan(plan: Plan) -> str:
    """The plan as `nanoserve plan` prints it: a small table of the sizes, the figures, and why."""
    m, s, cfg = plan.machine, plan.split, plan.config
    dtype_bytes = DTYPE_BYTES[plan.dtype]
    read, talk, send = decode_step_seconds(plan)
    lines = [
        f"nanoserve plan: {plan.model} ({cfg.architecture}), {plan.dtype}, max-model-len {plan.max_model_len}",
        f"machine: {plural(m.gpus, 'GPU')} ({plural(m.nodes, 'node')} of {m.gpus_per_node}), "
        f"{m.gpu_memory / GB:g} GB and {m.bandwidth / 1e12:g} TB/s each",
        "",
        "    TP   PP   DP   GPUs",
        f"  {plan.tp:>4} {plan.pp:>4} {plan.dp:>4} {m.gpus:>6}",
        "",
        f"  model      {count_text(plan.params)} parameters = {bytes_text(plan.params * dtype_bytes)} of weights; "
        f"KV {bytes_text(kv_bytes_per_token(cfg, dtype_bytes))} a token",
        f"  per GPU    {s.describe()}, of {m.budget / GB:.2f} usable",
        f"  KV room    {plan.kv_room_tokens:,} tokens a copy ({plan.kv_room_tokens // plan.max_model_len:,} "
        f"sequences of {plan.max_model_len})",
        f"  decode     ~{seconds_text(read + talk + send)} a step at batch 1 (roofline): "
        f"{plan.pp} x {bytes_text(s.weights)} / {m.bandwidth / 1e12:g} TB/s = {seconds_text(read)}",
        f"             + {collectives_per_step(cfg, plan.tp)} collectives x {NCCL_ALLREDUCE_S * 1e6:g} us "
        f"= {seconds_text(talk)} + {plan.pp - 1} stage hand-offs = {seconds_text(send)}",
    ]
    if plan.tp > 1:
        one_shot = sum(decode_step_seconds(plan, ONE_SHOT_ALLREDUCE_S))
        lines.append(f"             (~{seconds_text(one_shot)} with a one-shot all-reduce of "
                     f"{ONE_SHOT_ALLREDUCE_S * 1e6:g} us)")
    lines += [f"  PP bubble  {pipeline_bubble(plan.pp):.0%} of a pipeline's time with {PP_MICROBATCHES} "
              "micro-batches: (P - 1) / (M + P - 1)", "", "why:"]
    return "\n".join(lines + [f"  - {reason}" for reason in plan.reasons])


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def count_text(n: float) -> str:
    """12.3 M, 70.55 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def bytes_text(n: float) -> str:
    """In GB, MB or KB (decimal), whichever reads best."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1e3:.1f} KB"


def seconds_text(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


# ---------------------------------------------------------------------------- from the command line


def machine_from_args(args: argparse.Namespace) -> Machine:
    """`nanoserve plan`'s machine: --gpus, --gpus-per-node (default: all in one node), --gpu-memory
    in GB, --gpu-bandwidth in TB/s."""
    per_node = args.gpus if args.gpus_per_node is None else args.gpus_per_node
    if per_node > args.gpus:
        raise ValueError(f"--gpus-per-node {per_node} is more than --gpus {args.gpus}")
    return Machine(args.gpus, per_node, args.gpu_memory * GB, args.gpu_bandwidth * 1e12)


def plan_command(args: argparse.Namespace) -> Plan:
    """`nanoserve plan`: the plan for --model on the machine the options describe."""
    machine = machine_from_args(args)  # bad numbers fail before a model is read
    return make_plan(read_model_config(args.model), machine, args.dtype, args.max_model_len, str(args.model))


def detect_machine(utilization: float = EngineConfig.gpu_memory_utilization) -> Machine:
    """The GPUs this process sees, as one node (`serve` starts its ranks and replicas on one host).
    torch does not tell a GPU's bandwidth: the H100's stands in for it, in the speed estimate only."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("--parallel auto plans over GPUs and torch sees none; leave it out on a machine without "
                         "CUDA, or see what a machine would get with `nanoserve plan --gpus N`")
    memory = torch.cuda.get_device_properties(0).total_memory
    return Machine(count, count, memory, H100_BANDWIDTH, utilization)


# The options a plan sets, by every name argparse knows them by (a unique prefix of a long one too).
PARALLEL_OPTIONS = ("--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--pipeline-parallel-size", "-pp")


def names_parallel_option(arg: str) -> bool:
    """Whether a command-line word sets one of PARALLEL_OPTIONS (`-tp 2`, `--data-parallel-size=2`, `--tensor-p 2`)."""
    name = arg.split("=", 1)[0]
    if name in PARALLEL_OPTIONS:
        return True
    return name.startswith("--") and len(name) > 2 and any(
        o.startswith(name) for o in PARALLEL_OPTIONS if o.startswith("--"))


def auto_parallel(args: argparse.Namespace, machine: Machine) -> Plan:
    """`--parallel auto` on serve and bench: plan for --model on `machine`, then set the sizes on
    `args` before any engine is built (`apply_plan`)."""
    given = [a.split("=", 1)[0] for a in getattr(args, "argv", []) if names_parallel_option(a)]
    if given:
        raise ValueError(f"--parallel auto chooses the parallel sizes itself; leave out {', '.join(given)} "
                         "(or leave out --parallel auto)")
    dtype = args.dtype or "bfloat16"  # the engine's default on CUDA, where a plan runs
    plan = make_plan(read_model_config(args.model), machine, dtype, args.max_model_len, str(args.model))
    apply_plan(args, plan)
    return plan


def apply_plan(args: argparse.Namespace, plan: Plan) -> None:
    """Set TP, PP and DP on `args`, and write them into `args.argv` in place of `--parallel auto`:
    a data-parallel front hands its argv on to its replicas, which must run the plan, not plan again.
    PP is set only where this nanoserve has the option; a plan that needs PP without it fails."""
    has_pp = hasattr(args, "pipeline_parallel_size")
    if plan.pp > 1 and not has_pp:
        raise ValueError(f"the plan needs pipeline parallelism (TP {plan.tp} x PP {plan.pp}), and this nanoserve has "
                         "no --pipeline-parallel-size yet: run on more or larger GPUs, or lower --max-model-len")
    args.tensor_parallel_size = plan.tp
    args.data_parallel_size = plan.dp
    sizes = ["--tensor-parallel-size", str(plan.tp), "--data-parallel-size", str(plan.dp)]
    if has_pp:
        args.pipeline_parallel_size = plan.pp
        sizes += ["--pipeline-parallel-size", str(plan.pp)]
    args.parallel = "manual"  # the sizes are explicit now
    args.argv = without_parallel_auto(getattr(args, "argv", [])) + sizes


def without_parallel_auto(argv: list[str]) -> list[str]:
    """argv less `--parallel auto` (`--parallel=auto`, or a prefix argparse takes: `--par auto`)."""
    out, skip = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        if skip:
            skip = False
        elif name.startswith("--pa") and "--parallel".startswith(name):
            skip = "=" not in a
        else:
            out.append(a)
    return out
