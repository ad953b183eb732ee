"""Issue 38's test helpers: a server of several models, built the way `nanoserve serve --model a=PATH
--model b=PATH` builds it, on a loopback port. (A module of its own, not conftest.py: another week's
conftest.py would shadow it when several weeks run in one session.)"""

import collections
import itertools
import threading
import time

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.server.app import create_app
from nanoserve.server.http11 import OpenAIErrorH11Protocol
from nanoserve.server.models import ModelRegistry
from nanoserve.testing import AppThread

ENGINE = dict(device="cpu", num_blocks=64, max_model_len=256)
_servers = itertools.count()


class ModelsServer(AppThread):
    """`ModelRegistry` + `create_app` on a loopback port. `models`: name -> checkpoint; the first
    `max_loaded` (all by default) are loaded at start, as `nanoserve serve` does. `builds` counts the
    loads of each model; `load_delay` seconds are added to each load after the first; `step_delay` to
    each engine step (requests stay in flight long enough to act on them)."""

    def __init__(self, models: dict[str, str], max_loaded: int | None = None, load_delay: float = 0.0,
                 step_delay: float = 0.0, **app_kwargs):
        self.builds: collections.Counter = collections.Counter()
        self.tag = f" #{next(_servers)}"  # in its engine threads' names: tell this server's from another's
        self.load_delay, self.step_delay = load_delay, step_delay
        builders = {name: self.builder(name, path) for name, path in models.items()}
        first = list(models)[:max_loaded or len(models)]
        self.registry = ModelRegistry(builders, max_loaded, {name: builders[name](1.0) for name in first})
        super().__init__(create_app(self.registry, **app_kwargs), http=OpenAIErrorH11Protocol)

    def builder(self, name: str, path: str):
        def build(share: float) -> AsyncEngine:
            if self.builds[name] and self.load_delay:
                time.sleep(self.load_delay)
            self.builds[name] += 1
            engine = Engine(EngineConfig(model=path, **ENGINE))
            if self.step_delay:
                step = engine.step
                engine.step = lambda: (time.sleep(self.step_delay), step())[1]
            async_engine = AsyncEngine(engine)
            async_engine.thread.name = f"nanoserve-engine {name}{self.tag}"
            return async_engine.start()

        return build

    def __exit__(self, *exc) -> None:
        super().__exit__()
        self.registry.close()

    def engine_threads(self) -> set[str]:
        """The names of this server's engine threads alive now, less the tag."""
        return {t.name.removesuffix(self.tag) for t in threading.enumerate() if t.name.endswith(self.tag)}
