"""The engine layer: requests in, outputs out.

This face re-exports what a user of the package needs (the README's examples use it):

    from nanoserve.engine import LLM
    from nanoserve.sampling import SamplingParams

Inside the package, modules import from the module that defines a name, never from here.
"""

from nanoserve.engine.async_engine import AsyncEngine, QueueFull
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import LLM, Engine
from nanoserve.engine.outputs import RequestMetrics, RequestOutput

__all__ = ["LLM", "AsyncEngine", "Engine", "EngineConfig", "QueueFull", "RequestMetrics", "RequestOutput"]
