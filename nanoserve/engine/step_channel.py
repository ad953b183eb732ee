"""Week 20: how a step's description reaches the other ranks.

Every step the driver (rank 0) tells every worker what to run: a `StepInput` of a few hundred
integers. Week 18 sent it with `broadcast_object_list` over gloo: pickle, a size broadcast, a
payload broadcast, each a round trip through the kernel's network stack, while the workers wait
and their GPUs idle.

When every rank lives on one host, the description can go through memory they all map instead:

    driver                                        worker r (waiting on `sequence`)
    ──────                                        ────────────────────────────────
    wait until every ack == sequence              ...
    payload ← pickle(step); length ← len          ...
    sequence ← sequence + 1          ───────▶     sees sequence > the last it read
                                                  step ← unpickle(payload[:length])
                                                  ack[r] ← sequence, then runs the step

One writer, one slot, one acknowledgement per reader: the writer never overwrites a message a
reader has not copied, and a reader never reads a half-written one, because the payload and its
length are stored before the sequence number that announces them (one thread's stores become
visible in order on x86). A reader spins for a little while, then sleeps in short steps, and in
1 ms steps once idle, so an idle server's workers do not burn a core each. A message larger than
the slot goes over gloo instead (the header says so): nothing has a size limit.

Ranks on several hosts (Ray across nodes, torchrun) and CPU ranks keep gloo: CPU ranks share the
cores that compute, and a spinning reader would slow the very step it waits for.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
from multiprocessing import shared_memory

import torch.distributed as dist

from nanoserve.course.stubs import stubbed_weeks

HEADER = 64  # bytes: sequence (8), length (8), then unused up to a cache line
ACK = 64  # each reader's acknowledgement on its own cache line
SLOT_BYTES = 8 << 20  # a message up to 8 MiB goes through memory; a larger one over gloo
OVER_GLOO = -1  # the length that says "this message went over gloo"


class GlooChannel:
    """Week 18's way: the pickled message broadcast over the gloo group."""

    def __init__(self, group):
        self.cpu_group = group.cpu_group

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.cpu_group)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        pass


class SharedMemoryChannel:
    """One host: a shared-memory slot the driver writes and every worker reads (see the top of
    this file). `send` on rank 0, `recv` on the others."""

    def __init__(self, group, name: str | None = None, driver_pid: int | None = None, poll=None,
                 timeout: float | None = None):
        """On rank 0: create the slot (`name` None); `poll` is called about every second while it
        waits for acknowledgements (it raises if a worker died), and `timeout` bounds that wait.
        On a worker: attach to `name`, and check now and then that `driver_pid` still lives."""
        self.rank, self.readers = group.rank, group.size - 1
        self.gloo = GlooChannel(group)
        self.poll = poll if name is None else (lambda: check_alive(driver_pid))
        self.timeout = timeout
        size = HEADER + ACK * self.readers + SLOT_BYTES
        self.memory = attach(name) if name is not None else shared_memory.SharedMemory(create=True, size=size)
        self.buf = self.memory.buf
        self.payload = HEADER + ACK * self.readers
        self.sequence = 0  # the last message sent (driver) or read (worker)

    def _ack(self, reader: int) -> int:
        """Where reader `reader` (0 for rank 1) acknowledges."""
        return HEADER + ACK * reader

    def send(self, message) -> None:
        """Driver: put `message` in the slot once every reader has taken the last one."""
        # >>> week20: channel-send
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._wait(lambda: all(struct.unpack_from("q", self.buf, self._ack(r))[0] == self.sequence
                               for r in range(self.readers)), self.timeout)
        fits = len(data) <= SLOT_BYTES
        if fits:
            self.buf[self.payload : self.payload + len(data)] = data
        struct.pack_into("q", self.buf, 8, len(data) if fits else OVER_GLOO)
        self.sequence += 1
        struct.pack_into("q", self.buf, 0, self.sequence)  # last: it announces the message
        if not fits:
            self.gloo.send(message)
        # <<< week20: channel-send

    def recv(self):
        """Worker: wait for the next message, take a copy, acknowledge it, return it."""
        # >>> week20: channel-recv
        wanted = self.sequence + 1
        self._wait(lambda: struct.unpack_from("q", self.buf, 0)[0] >= wanted)
        length = struct.unpack_from("q", self.buf, 8)[0]
        data = None if length == OVER_GLOO else bytes(self.buf[self.payload : self.payload + length])
        self.sequence = wanted
        struct.pack_into("q", self.buf, self._ack(self.rank - 1), wanted)
        return self.gloo.recv() if data is None else pickle.loads(data)
        # <<< week20: channel-recv

    def _wait(self, ready, timeout: float | None = None) -> None:
        """Wait for `ready()`: spin for 200 µs (the next decode step is usually that close), then
        sleep ~20 µs at a time for a tenth of a second, then 1 ms at a time (an idle server); call
        `poll` about every second so a dead peer is noticed; give up after `timeout` seconds."""
        start = last_poll = time.perf_counter()
        while not ready():
            now = time.perf_counter()
            waited = now - start
            if timeout is not None and waited > timeout:
                raise TimeoutError(f"a tensor-parallel rank has not taken a step for {timeout:.0f} s")
            if waited > 200e-6:
                time.sleep(20e-6 if waited < 0.1 else 1e-3)
            if self.poll is not None and now - last_poll > 1.0:
                self.poll()
                last_poll = now

    def close(self) -> None:
        self.buf = None
        try:
            self.memory.close()
            if self.rank == 0:
                self.memory.unlink()
        except (BufferError, FileNotFoundError):
            pass


def attach(name: str) -> shared_memory.SharedMemory:
    """Open the driver's slot. Python before 3.13 registers an opened segment with this process's
    resource tracker, which would delete it when this worker exits (the driver owns it): undo
    that registration."""
    memory = shared_memory.SharedMemory(name=name)
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + name, "shared_memory")
    except (ImportError, KeyError, ValueError):
        pass
    return memory


def check_alive(pid: int | None) -> None:
    """Raise if the driver process `pid` is gone: a worker must not wait for its steps forever."""
    if pid is None:
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise RuntimeError(f"the driver (process {pid}) is gone; this worker stops") from None
    except PermissionError:  # it exists, under another user
        pass


def one_host(group) -> bool:
    """Whether every rank of `group` runs on this host (asked once, over gloo)."""
    names = [None] * group.size
    dist.all_gather_object(names, socket.gethostname(), group=group.cpu_group)
    return len(set(names)) == 1


def open_channel(group, cuda: bool, poll=None, timeout: float | None = None):
    """The channel this group's steps travel by: shared memory when every rank is a GPU process on
    this host (its name travels once, over gloo), gloo otherwise. Every rank calls this once, at
    the same point. `NANOSERVE_STEP_CHANNEL=gloo` forces week 18's way, `shm` shared memory even
    for CPU ranks (to compare the two, or to test this one)."""
    wanted = os.environ.get("NANOSERVE_STEP_CHANNEL", "auto")
    if wanted not in ("auto", "gloo", "shm"):
        raise ValueError(f"NANOSERVE_STEP_CHANNEL={wanted!r}: 'auto', 'gloo' or 'shm'")
    # (In a learner's workspace, gloo until week 20's exercises are written.)
    auto_gloo = not cuda or 20 in stubbed_weeks()
    if wanted == "gloo" or (wanted == "auto" and auto_gloo) or not one_host(group):
        return GlooChannel(group)
    if group.rank == 0:
        channel = SharedMemoryChannel(group, poll=poll, timeout=timeout)
        dist.broadcast_object_list([(channel.memory.name, os.getpid())], src=0, group=group.cpu_group)
        return channel
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group.cpu_group)
    name, driver_pid = box[0]
    return SharedMemoryChannel(group, name=name, driver_pid=driver_pid)
