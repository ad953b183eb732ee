"""The engine on its own thread (week 10): requests in from the event loop, outputs back to it."""

from __future__ import annotations

import itertools

from nanoserve.engine.distributed import WorkerFailed
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.tokenizer import Tokenizer
from nanoserve.sampling.params import SamplingParams


class QueueFull(RuntimeError):
    """Too many requests in flight: the server answers 429 instead of queueing without bound."""


class AsyncEngine:
    """Runs an `Engine` loop on its own thread and hands each request's outputs to asyncio.

    Why a thread: a forward pass holds the CPU (or waits on the GPU) for milliseconds at a time;
    run on the event loop, it would freeze every connection while it computes. So the engine
    owns a thread, and the asyncio side only ever talks to it through queues:

        asyncio task --(inbox: add / abort, a thread-safe queue.Queue)--> engine thread
        engine thread --(loop.call_soon_threadsafe -> an asyncio.Queue per request)--> task

    The Engine object itself is touched by the engine thread alone, so it needs no locks.
    (Week 16's `stats()` reads a few of its counters from the event loop: plain integers and
    lengths, each read atomic under the GIL, so a scrape costs the engine thread nothing.)

    `listeners` (week 16) are called on the request's event loop with every finished request's
    last `RequestOutput` (aborted ones too, finish reason "abort") and the options it was
    submitted with: metrics and request logs hang there, off the engine thread.
    """

    def __init__(self, engine: Engine, max_pending: int = 256):
        import queue
        import threading

        self.engine = engine
        self.max_pending = max_pending  # requests admitted and not finished, at most
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[int, tuple] = {}  # our key -> (event loop, asyncio.Queue)
        self.request_ids: dict[int, int] = {}  # our key -> the engine's request id
        self.options: dict[int, dict] = {}  # our key -> the options it was submitted with
        self.listeners: list = []  # callables (final RequestOutput, options), run on the event loop
        self.num_pending = 0  # read and written on the event loop only
        self._keys = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        # Week 23: the adapters' names as of the last load or unload (a tuple: read from the event loop at any time)
        self.lora_names: tuple[str, ...] = tuple(engine.adapters.ids)

    def start(self) -> "AsyncEngine":
        self.thread.start()
        return self

    # What the server may know about the engine: no model, no tensors, only these facts.
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts (may exceed the tokenizer's own vocabulary)."""
        return self.engine.model.config.vocab_size

    @property
    def scheduling_policy(self) -> str:
        return self.engine.config.scheduling_policy

    @property
    def prefix_caching(self) -> bool:
        """Whether requests with a common prefix share its KV blocks (week 14)."""
        return self.engine.scheduler.prefix_caching

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks, for health checks."""
        alloc = self.engine.scheduler.allocator
        return alloc.num_free, alloc.num_blocks

    def stats(self) -> dict:
        """The engine's state right now, for `/metrics` (read from the event loop: see above)."""
        scheduler = self.engine.scheduler
        free, total = self.kv_blocks()
        stats = dict(running=len(scheduler.running), waiting=len(scheduler.waiting), kv_blocks_used=total - free,
                     kv_blocks_total=total, preemptions=scheduler.num_preemptions, steps=self.engine.num_steps,
                     scheduled_tokens=scheduler.num_scheduled_tokens)
        prefix = self.engine.prefix_cache_stats()
        if prefix is not None:
            stats["prefix_cache"] = prefix
        spec = self.engine.spec_stats()
        if spec is not None:
            stats["speculative"] = spec
        kv = self.engine.kv_transfer_stats()
        if kv is not None:
            stats["kv_transfer"] = kv
        stats["held_kv"] = self.engine.held_kv()  # issue 38
        load = self.engine.expert_load()
        if load is not None:  # week 24: a mixture of experts
            stats["expert_load"] = load
        return stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout)
        self.engine.close()

    @property
    def failed(self) -> str | None:
        """Why the engine can serve no more (a tensor-parallel rank died, or, issue 35, the other
        instance of its disaggregated pair is gone or not yet joined), or None."""
        workers = self.engine.workers
        if workers is not None and workers.failed is not None:
            return workers.failed
        kv = self.engine.kv_transfer_stats()
        if kv is None:
            return None
        if kv["broken"] is not None:
            return f"KV connector: {kv['broken']}"
        # Not yet joined (starting, or a replaced peer's new session forming): /health says 503 until
        # the pair can move KV, so a proxy never routes a request into that moment.
        return None if kv["connected"] else "KV connector: no session with the other instance of the pair yet"

    # -- the asyncio side --------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, **options):
        """Submit a request and yield its `RequestOutput`s as they come (the last is finished).

        If the consumer stops early (the client went away, the task was cancelled), the request
        is aborted on the engine thread and its KV blocks are freed. `options` travel with the
        request: `priority` goes to `Engine.add_request`, and the listeners get all of them
        (the server's request id, for the request log). Issue 38: `hold_kv=True` and
        `resume_from=<request id>` (an int, the `request_id` of an earlier output) go to
        `Engine.add_request` too: see there.
        """
        import asyncio

        # >>> week10: async-generate
        if self.num_pending >= self.max_pending:
            raise QueueFull(f"{self.num_pending} requests in flight, the limit is {self.max_pending}")
        key = next(self._keys)
        stream: asyncio.Queue = asyncio.Queue()
        self.num_pending += 1
        self.inbox.put(("add", key, prompt, params, options, asyncio.get_running_loop(), stream))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):  # a bad request, found by the engine thread
                    raise item
                finished = item.finished
                yield item
        finally:
            self.num_pending -= 1
            if not finished:
                self.inbox.put(("abort", key))
                self._wake.set()
        # <<< week10: async-generate

    async def load_lora(self, name: str, path: str) -> None:
        """Week 23: the adapter read and checked on a worker thread (the steps go on), then
        `Engine.adapters.add` on the engine thread. Their ValueErrors are raised here."""
        import asyncio

        adapter = await asyncio.to_thread(self.engine.adapters.read, name, path)
        await self._on_engine_thread(lambda engine: engine.adapters.add(name, adapter))

    async def unload_lora(self, name: str) -> None:
        """Week 23: `Engine.adapters.remove` on the engine thread (its ValueError raised here)."""
        await self._on_engine_thread(lambda engine: engine.adapters.remove(name))

    async def release_held(self, request_id: int) -> bool:
        """Issue 38: `Engine.release_held` on the engine thread; False if nothing was held under the id."""
        return await self._on_engine_thread(lambda engine: engine.release_held(request_id))

    def held_kv(self) -> dict:
        """Issue 38: `Engine.held_kv()` (plain counters: read from the event loop, as `stats` does)."""
        return self.engine.held_kv()

    async def _on_engine_thread(self, change):
        """Run `change(engine)` between two steps, on the thread that owns the engine, and wait for
        it; returns what it returned."""
        import asyncio

        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.inbox.put(("call", change, loop, done))
        self._wake.set()
        return await done

    # -- the engine thread -------------------------------------------------------------------

    def _send(self, key: int, item) -> None:
        if isinstance(item, RequestOutput) and item.error is not None:  # issue 35: a KV transfer failed
            item = item.error
        loop, stream = self.streams[key]
        loop.call_soon_threadsafe(stream.put_nowait, item)
        if isinstance(item, RequestOutput) and item.finished:
            self._finished(loop, item, self.options.pop(key, {}))
        elif isinstance(item, Exception):  # the request failed: nothing more will come
            self.options.pop(key, None)

    def _finished(self, loop, output: RequestOutput, options: dict) -> None:
        for listener in self.listeners:
            loop.call_soon_threadsafe(listener, output, options)

    def _handle_inbox(self) -> None:
        import queue

        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, key, prompt, params, options, loop, stream = command
                self.streams[key] = (loop, stream)
                try:
                    self.request_ids[key] = self.engine.add_request(prompt, params,
                                                                    priority=options.get("priority", 0),
                                                                    kv_transfer=options.get("kv_transfer"),
                                                                    lora=options.get("lora"),
                                                                    arrival_time=options.get("arrival_time"),
                                                                    hold_kv=options.get("hold_kv", False),
                                                                    resume_from=options.get("resume_from"))
                    self.options[key] = options
                except (ValueError, WorkerFailed) as e:  # e.g. a prompt that can never fit: tell that request only
                    self._send(key, e)
                    del self.streams[key]
            elif command[0] == "call":  # week 23: load or unload an adapter
                _, change, loop, done = command
                try:
                    result = change(self.engine)
                    self.lora_names = tuple(self.engine.adapters.ids)
                    loop.call_soon_threadsafe(done.set_result, result)
                except Exception as e:  # noqa: BLE001 (the caller gets it; the engine thread goes on)
                    loop.call_soon_threadsafe(done.set_exception, e)
            else:
                _, key = command
                rid = self.request_ids.pop(key, None)
                loop, _ = self.streams.pop(key, (None, None))
                options = self.options.pop(key, {})
                output = self.engine.abort(rid) if rid is not None else None
                if output is not None and loop is not None:
                    self._finished(loop, output, options)

    def _run(self) -> None:
        # >>> week10: engine-thread
        while not self._stop.is_set():
            self._handle_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)  # sleep until a request arrives
                self._wake.clear()
                continue
            by_request = {rid: key for key, rid in self.request_ids.items()}
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not kill the server: fail the requests in flight
                for key, rid in list(self.request_ids.items()):
                    self.engine.abort(rid)
                    self._send(key, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                self.request_ids.clear()
                self.streams.clear()
                continue
            for out in outputs:
                key = by_request.get(out.request_id)
                if key is None or key not in self.streams:
                    continue  # aborted meanwhile
                self._send(key, out)
                if out.finished:
                    del self.streams[key], self.request_ids[key]
        # <<< week10: engine-thread

