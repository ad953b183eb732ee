"""Attention backends: the PyTorch reference ("torch") and the Triton kernels ("triton").

Both sit behind the same attention-context interface, so the model never knows which one runs.
The default is Triton on CUDA and the PyTorch reference elsewhere; set the environment variable
NANOSERVE_ATTENTION_BACKEND=torch|triton (or pass `attention_backend=` to the engine) to choose.
In a learner's workspace the default is Triton only once week 6's kernel is written.
"""

from __future__ import annotations

import os

from nanoserve.course.stubs import stubbed_weeks

BACKENDS = ("torch", "triton")
ENV_VAR = "NANOSERVE_ATTENTION_BACKEND"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: str, requested: str | None = None) -> str:
    """The attention backend to use on `device`: the request, the env var, or the default."""
    triton_default = device.startswith("cuda") and 6 not in stubbed_weeks()  # week 6's kernel, once written
    choice = requested or os.environ.get(ENV_VAR) or ("triton" if triton_default else "torch")
    if choice not in BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}: choose one of {', '.join(BACKENDS)}")
    if choice == "triton":
        if not triton_available():
            raise ValueError("the triton backend needs the `triton` package (pip install triton)")
        if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return choice
