"""Issue 39: what the one-launch fusions share, their switches and the counters they keep.

Two of week 12's later fusions finish a reduction in the same launch that computed its parts: the
argmax's slices (`argmax.py`) and the attention's context splits (`paged_attention.py`). Each
program stores its part, then bumps a counter in global memory; the program that finds the counter
one short of the number of parts is the last one, so every other part is already stored, and it
does the finishing work (pick the slice, merge the splits) that a second kernel used to do. It also
sets the counter back to its start value, so the next launch, or the next replay of a CUDA graph
that captured this one, finds it ready.

The counters live in device buffers kept for the life of the process: a CUDA graph records their
address, so they are never freed, even when a larger batch needs a larger buffer.

Two more need no counter: at batch 1 each add + RMSNorm of a layer goes into the prologue of the
product after it (`normed_gemv.py`), every program computing the row's norm on its own: the one
before the qkv product (`qkv-norm`) and the one before gate_up·SiLU (`mlp-norm`).

Which are on by default is decided by measurement, not by launch counts. On an H100 (docs/benchmarks.md,
issue 39, 2026-11-27) two of them made the step slower than the kernels they replace: the merge in
the attention's launch (9.7 µs a layer against 3.9 + 2.0) and the one-launch argmax (3.7 µs against
two launches of about 3). Both norm fusions pay, the qkv one only once its blocks were tuned (7.2 µs
a layer in the step against about 6 for cuBLAS's plus a 1.8 µs norm; untuned it took 12.5). `DEFAULT_OFF`
switches the two losers off; they stay in the tree, tested, to measure again. Two more were measured
in a second lease and are on: `qkv-rope` (RoPE and the K/V write in the epilogue of the normed qkv
product, 16 launches fewer a step: 777.8 tok/s against 757.2) and `row-gemv` (o_proj and down_proj
through the same Triton GEMV instead of cuBLAS's: 858.7 against 813.3).

To measure each fusion alone (A/B on one GPU), name the ones to switch off in an environment
variable read when the first step runs, or by `switch_fusions` in the same process:

    (unset)                            DEFAULT_OFF: argmax and merge off, the other four on
    NANOSERVE_FUSE_OFF=                (set, empty) every fusion on
    NANOSERVE_FUSE_OFF=argmax          the argmax takes its two kernels (slices, then pick)
    NANOSERVE_FUSE_OFF=merge           the split attention launches its merge kernel
    NANOSERVE_FUSE_OFF=qkv-norm        the qkv product is cuBLAS's, after an add_rmsnorm launch
    NANOSERVE_FUSE_OFF=mlp-norm        gate_up·SiLU reads a row an add_rmsnorm launch wrote
    NANOSERVE_FUSE_OFF=qkv-rope        the normed qkv product leaves RoPE and the K/V write to their kernel
    NANOSERVE_FUSE_OFF=row-gemv        o_proj and down_proj through cuBLAS (the module's own forward)
    NANOSERVE_FUSE_OFF=norm            both norms; `all` switches every one off; lists: argmax,merge

`--no-fused-kernels` switches them all off too (with week 12's other fused kernels).
"""

from __future__ import annotations

import os

import torch

FUSIONS = ("argmax", "merge", "qkv-norm", "mlp-norm", "qkv-rope", "row-gemv")
GROUPS = {"all": FUSIONS, "norm": ("qkv-norm", "mlp-norm")}  # names that stand for several
DEFAULT_OFF = "argmax,merge"  # slower on an H100 than the launches they replace (the docstring's figures)
ENV_VAR = "NANOSERVE_FUSE_OFF"
_off: set[str] | None = None  # None: not read from the environment yet


def _parse(value: str) -> set[str]:
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = names - set(FUSIONS) - set(GROUPS)
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown fusion(s) {sorted(unknown)}; known: {', '.join(FUSIONS)}, "
                         f"or {' or '.join(GROUPS)}")
    return {f for n in names for f in GROUPS.get(n, (n,))}


def fusion_on(name: str) -> bool:
    """Is the fusion `name` (one of FUSIONS) on? On unless NANOSERVE_FUSE_OFF names it (DEFAULT_OFF when
    the variable is not set)."""
    global _off
    if _off is None:
        _off = _parse(os.environ.get(ENV_VAR, DEFAULT_OFF))
    return name not in _off


def switch_fusions(off: str | None) -> None:
    """Switch fusions off for this process, as NANOSERVE_FUSE_OFF would ("argmax,merge", "norm", "all"; ""
    switches all on); None reads the environment again (DEFAULT_OFF where it is not set). Takes effect at the next launch, so a
    CUDA graph captured before keeps what it captured: capture again to compare graphs."""
    global _off
    _off = None if off is None else _parse(off)


_buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers: a captured graph may still use them


def persistent_buffer(name: str, device: torch.device, size: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
    """A buffer of at least `size` entries of `dtype` on `device`, filled with `fill` when made, and
    the same one every call (per name) until a larger one is needed. The kernels that use it leave
    every entry at `fill` when they finish."""
    key = (name, torch.device(device), dtype)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < size:
        if buf is not None:
            _retired.append(buf)
        buf = _buffers[key] = torch.full((max(size, 1024),), fill, dtype=dtype, device=device)
    return buf
