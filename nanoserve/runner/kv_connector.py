"""Issue 35: the KV connector, which moves a request's KV blocks from a prefill instance to a decode instance.

Disaggregated serving runs a request's prompt on one engine (the prefill instance) and its decode
steps on another (the decode instance). Between the two, the prompt's K/V must move: every layer's
K and V of every block of the prompt, `layers x 2 x kv_heads x head_dim x dtype bytes` per token.
This module moves them, and nothing else; which blocks, and when, is the engines' business
(nanoserve/engine/disaggregation.py). The interface is four calls:

    prefill side   send(transfer_id, blocks)      copy the blocks out now; the engine frees them right after
    decode side    receive(transfer_id, blocks)   bring that transfer into these blocks (already allocated)
                   landed() -> [Landed]           the transfers that finished since the last call: the
                                                  bytes are in the blocks, or it failed (timed out, peer gone)
                   cancel(transfer_id)            the request went away: whatever arrives for it is dropped

The two instances form a process group of two ranks (prefill 0, decode 1) over a TCP store the
decode instance hosts (`address`, host:port), one group per *session*: each prefill instance that
connects opens a new one, so a dead instance on either side can be replaced without restarting
the other (`connect`; until then every transfer fails at once). The decode side *pulls*: for its k-th transfer it
writes `pull/k = transfer_id` into the store, and the prefill side's thread answers the pulls in
order, with a header (found or not, how many elements) then the blocks, both tagged k. Pulling
keeps the two sides in step without a second channel: NCCL matches sends and receives in the
order they are issued, and only the decode side knows which request it is ready for, into
which blocks.

A transfer lands in a staging tensor first and is copied into its blocks by the decode engine's
own thread (`landed`). So a transfer that timed out, or whose request was aborted, can still
arrive later without touching blocks that were freed and handed to someone else meanwhile.

Two transports, one protocol:
  `HostConnector`   gloo, through host memory: the blocks go GPU -> host -> socket -> host -> GPU
                    (on the CPU, as in CI, there is no GPU leg); works between any two machines
  `NcclConnector`   NCCL send/recv, GPU to GPU (NVLink or the network), no host copy
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.attention.paged import PagedKVCache

PREFILL_RANK, DECODE_RANK = 0, 1
FOUND, MISSING = 1, 0  # the header's first element


class TransferFailed(RuntimeError):
    """A transfer will not land: the prefill instance is gone, or holds no KV for that id."""


class TransferTimedOut(TransferFailed):
    """A transfer did not land within the connector's timeout."""


class LayoutMismatch(ValueError):
    """The two instances' KV blocks are shaped differently: no transfer can work."""


@dataclass
class Landed:
    """One finished transfer, as `landed` reports it: `error` is None when its bytes are in its blocks."""

    transfer_id: str
    num_bytes: int = 0
    seconds: float = 0.0  # from `receive` to the bytes in the blocks, queueing included
    error: TransferFailed | None = None


@dataclass
class _Pull:
    """A transfer the decode side asked for (the pulling thread fills `staged` or `error`)."""

    transfer_id: str
    blocks: list[int] | None  # None: pulled only to be dropped (`cancel`)
    start: float
    staged: torch.Tensor | None = None
    error: str | None = None


class KVConnector:
    """The protocol of the module docstring over a two-rank process group; a transport (below)
    says which group, where the staging copies live, and how to wait for one."""

    def __init__(self, cache: PagedKVCache, role: str, address: str, timeout: float = 30.0):
        if role not in ("prefill", "decode"):
            raise ValueError(f"a KV connector's role is 'prefill' or 'decode', not {role!r}")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"the KV connector's address {address!r} is not host:port")
        self.cache, self.role, self.timeout = cache, role, timeout
        # A transfer late past `timeout` fails its request, but the group waits longer before it gives
        # up on the peer: a slow transfer must not break the pair for the ones after it.
        self.group_timeout = 4 * timeout + 30
        self.host, self.port = host, int(port)
        self.lock = threading.Lock()
        self.broken: str | None = None  # why no transfer can work any more
        self.num_sent = self.num_received = self.num_failed = 0
        self.bytes_sent = self.bytes_received = 0
        self.seconds_received = 0.0
        # prefill side: staged copies waiting for their pull, each with what says it is complete (see
        # `stage`) and the time it expires; `wakeup` ends the pull thread's idle wait when one comes
        self.held: dict[str, tuple[torch.Tensor, object, float]] = {}
        self.wakeup = threading.Event()
        # decode side: pulls to issue, pulls issued and not reported, pulls done and not reported
        self.to_pull: queue.Queue[_Pull] = queue.Queue()
        self.pending: dict[str, _Pull] = {}
        self.done: list[_Pull] = []
        self.finished = threading.Event()  # set when `done` gets a pull
        self.store = self.keys = self.group = None  # the TCP store, this session's keys in it, the group
        self.session = 0  # the newest prefill instance's number (see `connect`)
        self._stop = threading.Event()
        loop = self._answer_pulls if role == "prefill" else self._pull
        self.thread = threading.Thread(target=self._run, args=(loop,), name=f"nanoserve-kv-{role}", daemon=True)
        self.thread.start()

    # -- the transport (what `HostConnector` and `NcclConnector` say) ------------------------

    def staging_device(self) -> torch.device:
        """Where a transfer's bytes wait, on both sides."""
        raise NotImplementedError

    def make_group(self, store: dist.Store, rank: int):
        """The two-rank process group of this transport."""
        raise NotImplementedError

    def stage(self, blocks: list[int]) -> tuple[torch.Tensor, object]:
        """A copy of `blocks` on the staging device, and what tells the connector's thread it is
        complete (None: it is, when this returns). Called on the engine's thread."""
        raise NotImplementedError

    def before_send(self, ready) -> None:
        """On the connector's thread, before a staged copy is sent: wait for `ready` (from `stage`)."""

    def wait(self, work) -> None:
        """Wait for a send or receive to be done, as far as the host can tell."""
        work.wait()

    def connect(self) -> None:
        """Join the peer: the store (the decode side hosts it; the prefill side connects to it, anew
        each time) and a two-rank group under a fresh prefix. Each prefill instance that connects
        opens a new *session* (it increments `session` in the store); the decode side joins the
        newest. So a prefill instance that died can be replaced without restarting the decode one."""
        timeout = datetime.timedelta(seconds=max(self.timeout, 60.0))
        if self.role == "decode":
            if self.store is None:
                self.store = dist.TCPStore(self.host, self.port, 2, is_master=True, timeout=timeout,
                                           wait_for_workers=False)
            while self.store.add("session", 0) <= self.session:  # a new prefill instance
                if self._stop.wait(0.05):
                    raise ConnectionAbortedError("the connector was closed")
            self.session = self.store.add("session", 0)
        else:
            self.store = dist.TCPStore(self.host, self.port, 2, is_master=False, timeout=timeout,
                                       wait_for_workers=False)
            self.session = self.store.add("session", 1)
        self.keys = dist.PrefixStore(f"nanoserve-kv/{self.session}", self.store)
        group = self.make_group(self.keys, DECODE_RANK if self.role == "decode" else PREFILL_RANK)
        self.check_layout()
        self.group = group

    def layout(self) -> str:
        """What a block is here, in words: both instances' must be the same."""
        layers, _, block_size, heads, head_dim = self.cache.k.shape
        scales = "" if self.cache.k_scale is None else " with a float16 scale per token and head"  # issue 33
        return (f"{layers} layers x {block_size} tokens x {heads} KV heads x {head_dim} dims of {self.cache.k.dtype}"
                + scales)

    def check_layout(self) -> None:
        """Refuse a peer whose blocks are not shaped as ours (another model, --block-size or --dtype)."""
        peer = "decode" if self.role == "prefill" else "prefill"
        self.keys.set(f"layout/{self.role}", self.layout())
        theirs = self.keys.get(f"layout/{peer}").decode()
        if theirs != self.layout():
            raise LayoutMismatch(f"the {peer} instance's KV blocks are {theirs}, this one's {self.layout()}: "
                                 "start both with the same model, --block-size, --dtype and --kv-cache-dtype")

    # -- the prefill side -------------------------------------------------------------------

    def send(self, transfer_id: str, blocks: list[int]) -> None:
        """Copy `blocks` out of the pool now (the caller may free them as soon as this returns);
        the copy waits for the decode side's pull, at most `2 * timeout` seconds."""
        self._expire_held()  # (here too: the thread that also does it is gone when the decode instance is)
        staged, ready = self.stage(blocks)
        with self.lock:
            self.held[transfer_id] = (staged, ready, time.monotonic() + 2 * self.timeout)
        self.wakeup.set()

    def _answer_pulls(self) -> None:
        k = 0
        while not self._stop.is_set():
            key = f"pull/{k}"
            if not self._wait_key(key):
                self._expire_held()
                continue
            transfer_id = self.keys.get(key).decode()
            staged, ready = self._take_held(transfer_id)
            found = staged is not None
            header = torch.tensor([FOUND if found else MISSING, staged.numel() if found else 0], dtype=torch.long)
            self.wait(self.group.send([header.to(self.staging_device())], DECODE_RANK, k))
            if found:
                self.before_send(ready)
                self.wait(self.group.send([staged], DECODE_RANK, k))
                self.num_sent += 1
                self.bytes_sent += staged.numel() * staged.element_size()
            k += 1

    def _take_held(self, transfer_id: str) -> tuple[torch.Tensor | None, object]:
        """The staged copy of `transfer_id` and its `ready`, which leave the connector; (None, None) if
        there is none (it expired, or was never sent: the decode side pulls only what the proxy saw
        prefilled)."""
        with self.lock:
            found = self.held.pop(transfer_id, None)
        return (None, None) if found is None else found[:2]

    def _expire_held(self) -> None:
        """Forget the copies nobody pulled in time (their decode request was refused, or its client left)."""
        now = time.monotonic()
        with self.lock:
            for transfer_id in [t for t, (_, _, expiry) in self.held.items() if expiry < now]:
                del self.held[transfer_id]

    def _wait_key(self, key: str) -> bool:
        """Whether `key` is in the store, after waiting for it up to half a second (so that the
        thread sees `_stop`). Polled (a blocking wait that times out makes the store print a warning
        each time): every millisecond while copies are held, since their pulls are about to come;
        otherwise every 20 ms (a pull could only ask for what is not here), or at once when `send`
        holds a copy: a pull that follows a send closely does not wait out the idle interval."""
        deadline = time.monotonic() + 0.5
        while not self.keys.check([key]):
            if time.monotonic() > deadline:
                return False
            if self.held:
                time.sleep(0.001)
            else:
                self.wakeup.wait(0.02)
                self.wakeup.clear()
        return True

    # -- the decode side --------------------------------------------------------------------

    def receive(self, transfer_id: str, blocks: list[int]) -> None:
        """Start bringing `transfer_id` into `blocks` (allocated by the caller, as many as were sent)."""
        pull = _Pull(transfer_id, list(blocks), time.monotonic())
        with self.lock:
            self.pending[transfer_id] = pull
        self.to_pull.put(pull)

    def cancel(self, transfer_id: str) -> None:
        """Give up on a transfer (its request was aborted), received or not: the caller frees its
        blocks, whatever arrives for it is dropped, and the prefill side lets its copy go (a transfer
        never received is pulled and dropped, for that)."""
        with self.lock:
            asked = self.pending.pop(transfer_id, None) is not None  # (`receive` was called)
        if not asked:
            self.to_pull.put(_Pull(transfer_id, None, time.monotonic()))

    def wait_for_landing(self, timeout: float) -> None:
        """Sleep until a transfer finishes (landed or failed) or `timeout` seconds pass: for an engine
        with nothing to run but transfers to wait for, instead of polling `landed` in a busy loop."""
        self.finished.wait(timeout)

    def landed(self) -> list[Landed]:
        """The transfers finished since the last call: each one's bytes are in its blocks (copied
        here, on the caller's thread), or it failed: the peer is gone, it has nothing under that
        id, or it took longer than `timeout` seconds."""
        with self.lock:
            self.finished.clear()
            done, self.done = self.done, []
            out = [self._land(p) for p in done if self.pending.pop(p.transfer_id, None) is not None]
            now = time.monotonic()
            for p in list(self.pending.values()):
                if self.broken is not None or now - p.start > self.timeout:
                    del self.pending[p.transfer_id]
                    error = TransferFailed(f"KV transfer {p.transfer_id}: {self.broken}") if self.broken else \
                        TransferTimedOut(f"KV transfer {p.transfer_id} did not land within {self.timeout:g} s ("
                                         + ("is the prefill instance stuck?)" if self.group is not None else
                                            f"no prefill instance has connected to {self.host}:{self.port} yet)"))
                    out.append(Landed(p.transfer_id, error=error))
        self.num_failed += sum(landed.error is not None for landed in out)
        return out

    def _land(self, pull: _Pull) -> Landed:
        if pull.error is not None:
            return Landed(pull.transfer_id, error=TransferFailed(f"KV transfer {pull.transfer_id}: {pull.error}"))
        self.cache.write_blocks(pull.blocks, pull.staged)
        if pull.staged.is_cuda:  # received on the connector's stream, copied on this one: keep it until then
            pull.staged.record_stream(torch.cuda.current_stream(pull.staged.device))
        num_bytes = pull.staged.numel() * pull.staged.element_size()
        seconds = time.monotonic() - pull.start
        self.num_received += 1
        self.bytes_received += num_bytes
        self.seconds_received += seconds
        return Landed(pull.transfer_id, num_bytes, seconds)

    def _pull(self) -> None:
        k = 0
        while not self._stop.is_set():
            try:
                pull = self.to_pull.get(timeout=0.5)
            except queue.Empty:
                if self.store.add("session", 0) > self.session:  # the prefill instance was replaced
                    raise ConnectionResetError("a new prefill instance connected")
                continue
            self.keys.set(f"pull/{k}", pull.transfer_id)
            header = torch.empty(2, dtype=torch.long, device=self.staging_device())
            self.wait(self.group.recv([header], PREFILL_RANK, k))
            found, numel = header.tolist()
            if pull.blocks is None:  # cancelled before it was received: take it off the wire, drop it
                if found == FOUND:
                    self.wait(self.group.recv([torch.empty(numel, dtype=self.cache.block_dtype,
                                                           device=self.staging_device())], PREFILL_RANK, k))
                k += 1
                continue
            shape = (len(pull.blocks), *self.cache.block_shape)  # (issue 33: an FP8 pool's blocks are bytes)
            if found == MISSING:
                pull.error = "the prefill instance holds no KV under this id (expired, or never prefilled)"
            else:
                staged = torch.empty(numel, dtype=self.cache.block_dtype, device=self.staging_device())
                self.wait(self.group.recv([staged], PREFILL_RANK, k))
                if numel != torch.Size(shape).numel():
                    pull.error = (f"{numel} values arrived for {len(pull.blocks)} blocks: the two instances' "
                                  "models or block sizes differ")
                else:
                    pull.staged = staged.view(shape)
            with self.lock:
                self.done.append(pull)
                self.finished.set()
            k += 1

    # -- both -------------------------------------------------------------------------------

    def _run(self, loop) -> None:
        """Connect, then serve the transfers; when the peer goes away, say so (`broken`: every
        transfer fails until a peer is back) and connect again."""
        while not self._stop.is_set():
            try:
                self.connect()
                with self.lock:
                    self.broken = None
                loop()
            except LayoutMismatch as e:  # a wrong pair: the decode side waits for another prefill instance
                self._lost(str(e))
                if self.role == "prefill":
                    return
            except Exception as e:  # the peer died, or never came
                self._lost(f"the {'prefill' if self.role == 'decode' else 'decode'} instance is gone "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                self._stop.wait(0.5)  # (a prefill side retries the store until a decode instance is up)

    def _lost(self, why: str) -> None:
        """The peer is gone: every transfer under way fails, pulls not yet issued are dropped."""
        if self._stop.is_set():
            return
        with self.lock:
            self.broken, group, self.group = why, self.group, None
            self.held.clear()
            for pull in self.pending.values():  # reported by the next `landed`
                pull.error = why
                self.done.append(pull)
            self.finished.set()
        while not self.to_pull.empty():
            self.to_pull.get_nowait()
        release(group)

    def stats(self) -> dict:
        """Transfers so far: how many and how many bytes each way, the failed ones, the seconds the
        received ones took in all, why the pair is broken (None while it works), and whether this
        side has joined a session with a peer (`connected`: the group is formed and the layouts match)."""
        return dict(sent=self.num_sent, bytes_sent=self.bytes_sent, received=self.num_received,
                    bytes_received=self.bytes_received, failed=self.num_failed,
                    seconds_received=self.seconds_received, broken=self.broken, connected=self.group is not None)

    def num_waiting(self) -> int:
        """Copies held for a pull (prefill side) or transfers not yet reported (decode side)."""
        with self.lock:
            return len(self.held) + len(self.pending)

    def close(self) -> None:
        """Stop the thread (it notices within half a second), drop what is held, and end the group."""
        self._stop.set()
        with self.lock:
            self.held.clear()
        self.thread.join(timeout=2.0)
        with self.lock:
            group, self.group = self.group, None
        release(group)


def release(group) -> None:
    """End a connector's two-rank group now, not at process exit: its communicators and sockets go
    (an NCCL group left to its destructor warns that it was never destroyed). `abort`, not a shutdown
    that flushes: the peer may be gone, and nothing of this group's is wanted after it."""
    if group is not None:
        group.abort()


class HostConnector(KVConnector):
    """Through host memory, over gloo: the blocks are copied to the host (`send`), go over a socket,
    and are copied into the decode instance's pool (`landed`). On a GPU the host copies are pinned,
    so that each is one DMA transfer at full PCIe speed. This is the transport CI tests."""

    def staging_device(self) -> torch.device:
        return torch.device("cpu")

    def make_group(self, store: dist.Store, rank: int):
        return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=self.group_timeout))

    def stage(self, blocks: list[int]) -> tuple[torch.Tensor, None]:
        staged = self.cache.read_blocks(blocks)
        if not staged.is_cuda:
            return staged, None  # read_blocks made a copy already
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        host.copy_(staged)  # synchronous: complete before the caller frees the blocks
        return host, None


class NcclConnector(KVConnector):
    """GPU to GPU over NCCL send/recv: the staged copy stays on the prefill instance's GPU and lands
    in a staging tensor on the decode instance's GPU, over NVLink or the network, no host copy.

    The connector's thread works on a stream of its own. Waiting for a send or a receive makes the
    thread's current stream wait for NCCL's: on the default stream, which the engine's kernels also
    use, every decode step after a pull would wait for the whole transfer (measured on two H200s,
    issue 35: ITL p99 2.5x a colocated pair's). For the same reason `stage` does not stop the engine's
    thread: it records an event after the copy, and the thread's stream waits for that event."""

    stream = None  # the connector thread's CUDA stream (made by `make_group`, on that thread)

    def staging_device(self) -> torch.device:
        return self.cache.k.device

    def make_group(self, store: dist.Store, rank: int):
        device = self.cache.k.device
        torch.cuda.set_device(device)  # in the connector's thread, which issues the sends and receives
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        torch.cuda.set_stream(self.stream)  # (the current stream is per thread: the engine's stays as it is)
        return dist.ProcessGroupNCCL(store, rank, 2)

    def stage(self, blocks: list[int]) -> tuple[torch.Tensor, torch.cuda.Event]:
        staged = self.cache.read_blocks(blocks)  # queued on the engine's stream, before any later write
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(staged.device))
        return staged, ready

    def before_send(self, ready: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.cache.k.device).wait_event(ready)

    def wait(self, work) -> None:
        work.wait()  # makes the thread's current stream (its own) wait for NCCL's
        torch.cuda.current_stream(self.cache.k.device).synchronize()  # and the host for that stream


CONNECTORS = {"gloo": HostConnector, "nccl": NcclConnector}


def make_connector(kind: str, cache: PagedKVCache, role: str, address: str, timeout: float) -> KVConnector:
    """The connector `kind` ("gloo" or "nccl") for this engine's pool, as `role`, over the store at `address`."""
    if kind not in CONNECTORS:
        raise ValueError(f"unknown KV connector {kind!r}: choose gloo (through host memory) or nccl (GPU to GPU)")
    if kind == "nccl" and cache.k.device.type != "cuda":
        raise ValueError("the nccl KV connector moves blocks between GPUs, and this engine runs on the CPU: "
                         "use --kv-connector gloo")
    return CONNECTORS[kind](cache, role, address, timeout)
