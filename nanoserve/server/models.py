"""Issue 38: several models behind one server, each with its own engine on its own thread.

    nanoserve serve --model small=/models/a --model big=/models/b --max-loaded-models 1

A request names its model; the registry hands the handler that model's engine for the time the
handler runs (a *lease*), loading it first when it is not resident. At most `max_loaded` models
are resident at once: loading one more unloads the least recently used first. Unloading shuts
the engine's thread down and drops every reference to the engine, so its KV pool and weights are
freed (tests/week25 checks that nothing is left: no thread, no engine object).

A model goes through four states, and every change of state runs in one task, shared by all the
requests that wait for it (`ModelSlot.pending`):

    unloaded --load--> loaded --(evicted, or unloaded by an operator)--> draining --> unloaded

- **loading**: the first request for an unloaded model starts the load; the requests that come
  meanwhile await the same task (one load, however many wait). The wait is part of their TTFT: the
  server stamps a request's arrival before it asks for its model.
- **draining**: a model chosen for eviction takes no new request (they wait for it to be unloaded,
  then load it again); the ones in flight finish first. An operator's unload of a model with
  requests in flight is refused instead (409): an operator asking to free memory now should hear
  that it is not free, not wait for an unknown time.
- Loads, evictions and operator unloads run one at a time (`lock`): two loads never both count
  the same free place.

A model is *busy* while requests wait for its load, while a handler holds a lease on it (from the
moment its name is resolved to the moment its answer is under way), or while its engine has
requests in flight (`AsyncEngine.num_pending`, which covers a streamed answer until its last
chunk). A busy model is evicted only after the idle ones, and only once it is idle; the requests
that waited for its load are served by it first, even when the next load chose it for eviction at
once: without that, two models taking turns in one place would load and unload each other for
ever, and no request would get its turn. Everything here runs on the event loop; the
engine is built and shut down on a worker thread, so that the other models go on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.config import parse_named_paths
from nanoserve.engine.device import release_cached_memory
from nanoserve.server.protocol import APIError, check_model, model_not_found
from nanoserve.server.streaming import TokenStrings

UNLOADED, LOADED, DRAINING = "unloaded", "loaded", "draining"
DRAIN_POLL = 0.02  # seconds between two looks at a draining model's requests in flight

# build(share) -> a started AsyncEngine. `share`: the part of --gpu-memory-utilization this load may
# bring the GPU to, as a fraction (k / max_loaded when k models will then be resident).
Builder = Callable[[float], AsyncEngine]


@dataclass(frozen=True)
class ServedModel:
    """A loaded model, as a handler sees it: its name, its engine, and its token strings (logprobs)."""

    name: str
    engine: AsyncEngine
    token_strings: TokenStrings


@dataclass
class ModelSlot:
    """One model of the registry: how to build it and, while it is loaded, what serves it."""

    name: str
    build: Builder | None  # None: handed over built (`ModelRegistry.serving`), so it cannot come back once unloaded
    served: ServedModel | None = None
    state: str = UNLOADED
    pending: asyncio.Future | None = None  # the load or unload under way, awaited by every request that waits
    leases: int = 0  # handlers using the model right now
    waiting: int = 0  # requests waiting for its load: they hold it from eviction as a lease does
    last_used: float = 0.0
    max_model_len: int | None = None  # known once it has been loaded
    adapters: tuple[str, ...] = ()  # its LoRA adapters' names, as of its last load (week 23)
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=lambda: {"lru": 0, "operator": 0})

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.waiting > 0 or (self.served is not None and self.served.engine.num_pending > 0)


class ModelRegistry:
    """The models a server serves, by name (`slots`, in the order given: the first is the default
    of requests that name none, such as /tokenize's). `max_loaded`: how many may be resident at
    once (None: all of them); `preloaded`: engines already built and started, by name."""

    def __init__(self, builders: dict[str, Builder | None], max_loaded: int | None = None,
                 preloaded: dict[str, AsyncEngine] | None = None, clock: Callable[[], float] = time.monotonic):
        if not builders:
            raise ValueError("a server needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got {max_loaded}")
        self.slots = {name: ModelSlot(name, build) for name, build in builders.items()}
        self.max_loaded = max_loaded
        self.clock = clock
        self.listeners: list = []  # given to every engine this registry loads (`AsyncEngine.listeners`)
        self.lock = asyncio.Lock()
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-loader")
        for name, engine in (preloaded or {}).items():
            self.install(self.slots[name], engine)

    def add_listener(self, listener) -> None:
        """Hand `listener(final output, options)` every finished request of every model, loaded now or later."""
        self.listeners.append(listener)
        for served in self.loaded():
            served.engine.listeners.append(listener)

    @classmethod
    def serving(cls, engine: AsyncEngine, name: str) -> "ModelRegistry":
        """The registry of a server of one model, built by the caller (`create_app(engine, name)`)."""
        return cls({name: None}, preloaded={name: engine})

    # ------------------------------------------------------------------ what the handlers ask

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.slots)

    @property
    def default(self) -> str:
        return self.names[0]

    def adapter_names(self) -> tuple[str, ...]:
        return tuple(a for slot in self.slots.values() for a in self.adapters_of(slot))

    def adapters_of(self, slot: ModelSlot) -> tuple[str, ...]:
        return slot.served.engine.lora_names if slot.served is not None else slot.adapters

    def check(self, body: dict) -> None:
        """400 without a string `model`, 404 for a name that is neither a model nor an adapter."""
        check_model(body, self.names, self.adapter_names())

    def slot_of(self, name: str) -> ModelSlot:
        """The slot of a model, or of the model an adapter belongs to (404 for any other name)."""
        if name in self.slots:
            return self.slots[name]
        for slot in self.slots.values():
            if name in self.adapters_of(slot):
                return slot
        raise model_not_found(name, self.names, self.adapter_names())

    def loaded(self) -> list[ServedModel]:
        return [slot.served for slot in self.slots.values() if slot.served is not None]

    @property
    def capacity(self) -> int:
        """How many models may be resident at once."""
        return min(self.max_loaded or len(self.slots), len(self.slots))

    def resident(self) -> int:
        return sum(slot.served is not None for slot in self.slots.values())

    @contextlib.asynccontextmanager
    async def use(self, name: str):
        """`async with registry.use(name) as model:` the model (or the adapter's model) loaded, and
        kept from eviction until the block ends."""
        slot = self.slot_of(name)
        served = await self.acquire(slot)
        try:
            yield served
        finally:
            slot.leases -= 1

    async def acquire(self, slot: ModelSlot) -> ServedModel:
        """Take a lease on the model, loading it first if needed (the load shared with whoever
        else waits). A failed load is a 503 for every request that waited for it."""
        while slot.state != LOADED:
            if slot.pending is None:  # unloaded, and nobody loads it yet: this request starts the load
                slot.pending = asyncio.ensure_future(self.load_task(slot))
            # Waiting for a load, a request counts as busy, and once the load is done it takes its lease
            # even if another load has chosen the model for eviction meanwhile: else two models taking
            # turns in one place would evict each other before any request ran.
            for_load = slot.state != DRAINING
            slot.waiting += for_load
            try:
                loaded = await asyncio.shield(slot.pending)  # a cancelled request leaves the load running
            finally:
                slot.waiting -= for_load
            if for_load and loaded is not None:
                break
        slot.leases += 1
        slot.last_used = self.clock()
        return slot.served

    # ------------------------------------------------------------------ loading and unloading

    async def load(self, name: str) -> ModelSlot:
        """An operator's load (`POST /v1/models/{name}/load`); nothing to do for a resident model."""
        async with self.use(name):
            return self.slot_of(name)

    async def unload(self, name: str) -> bool:
        """An operator's unload (`POST /v1/models/{name}/unload`): False if it was not loaded; 409 while
        requests use it, 400 for a model that could not be loaded again."""
        slot = self.slot_of(name)
        async with self.lock:
            if slot.state != LOADED:
                return False
            if slot.build is None:
                raise APIError(400, f"the model '{slot.name}' was handed to this server already built: it could not be "
                                    "loaded again, so it is not unloaded", param="model")
            if slot.busy:
                in_flight = slot.served.engine.num_pending + slot.leases
                raise APIError(409, f"the model '{slot.name}' has {in_flight} request(s) in flight: retry once they "
                                    "have finished", code="model_busy")
            await self.start_unload(slot, "operator")
        return True

    async def load_task(self, slot: ModelSlot) -> ServedModel:
        """Load one model (the task every request for it awaits): room first, then the engine."""
        # >>> week25: load-model
        try:
            async with self.lock:
                if slot.state == LOADED:
                    return slot.served
                await self.make_room()
                if slot.build is None:
                    raise APIError(503, f"the model '{slot.name}' was unloaded and this server cannot build it again",
                                   code="model_unavailable", type_="server_error")
                share = (self.resident() + 1) / self.capacity
                try:
                    engine = await asyncio.get_running_loop().run_in_executor(self.loader, slot.build, share)
                except Exception as e:  # noqa: BLE001 (a load that fails is one model's problem, not the server's)
                    raise APIError(503, f"the model '{slot.name}' could not be loaded: {type(e).__name__}: {e}",
                                   code="model_load_failed", type_="server_error") from e
                self.install(slot, engine)
                return slot.served
        finally:
            slot.pending = None
        # <<< week25: load-model

    def install(self, slot: ModelSlot, engine: AsyncEngine) -> None:
        engine.listeners.extend(self.listeners)
        slot.served = ServedModel(slot.name, engine, TokenStrings(engine.tokenizer))
        slot.state, slot.last_used = LOADED, self.clock()
        slot.max_model_len, slot.adapters = engine.max_model_len, engine.lora_names
        slot.loads += 1

    async def make_room(self) -> None:
        """Unload models until one more fits: the idle ones first, each time the least recently used."""
        while self.max_loaded is not None and self.resident() >= self.max_loaded:
            loaded = [slot for slot in self.slots.values() if slot.state == LOADED]
            victim = min(loaded, key=lambda slot: (slot.busy, slot.last_used))
            await self.start_unload(victim, "lru")

    async def start_unload(self, slot: ModelSlot, reason: str) -> None:
        """Drain the model, then unload it; requests that ask for it meanwhile await the same task."""
        slot.state = DRAINING  # from now on no new lease: set before the first await
        slot.pending = asyncio.ensure_future(self.unload_task(slot, reason))
        await asyncio.shield(slot.pending)

    async def unload_task(self, slot: ModelSlot, reason: str) -> None:
        try:
            while slot.busy:  # the requests in flight finish first
                await asyncio.sleep(DRAIN_POLL)
            engine = slot.served.engine
            slot.served = None
            await asyncio.get_running_loop().run_in_executor(self.loader, engine.shutdown)  # its thread, its ranks
            del engine  # the last reference: its pool and weights are garbage now
            await asyncio.get_running_loop().run_in_executor(self.loader, release_cached_memory)
            slot.unloads[reason] += 1
        finally:
            slot.state, slot.pending = UNLOADED, None

    def close(self) -> None:
        """Shut every resident engine down (the server is stopping)."""
        for slot in self.slots.values():
            if slot.served is not None:
                slot.served.engine.shutdown()
                slot.served, slot.state = None, UNLOADED
        self.loader.shutdown(wait=False)


def parse_models(specs: Sequence[str], served_name: str | None = None) -> dict[str, str]:
    """`--model` values -> {name: model}. One plain value (`--model PATH`) serves under
    --served-model-name, else the value itself, as before issue 38; `NAME=PATH` names a model. A
    name given twice, or a mix of plain values and several models, is a one-line error."""
    if len(specs) == 1 and "=" not in specs[0]:
        return {served_name or specs[0]: specs[0]}
    if served_name is not None:
        raise ValueError("--served-model-name names the one model of --model PATH: with several, name each one "
                         "as --model NAME=PATH")
    return parse_named_paths(specs, "--model (with several models, each)")
