"""Week 20: the shared-memory step channel, in one process (the writer and a reader on two
threads, the reader attached by name as a worker would be). The processes' version is in
test_tp_step.py."""

import threading
from types import SimpleNamespace

import pytest

from nanoserve.engine import step_channel
from nanoserve.engine.step_channel import SharedMemoryChannel

pytestmark = pytest.mark.exercise("channel-send", "channel-recv")


class Mailbox:
    """Stands in for the gloo channel of oversized messages: a list both sides share."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        return self.sent.pop(0)


@pytest.fixture
def pair():
    """A driver's channel (rank 0 of 3) and the two workers' channels attached to it."""
    writer = SharedMemoryChannel(SimpleNamespace(rank=0, size=3, cpu_group=None), timeout=5)
    readers = [SharedMemoryChannel(SimpleNamespace(rank=r, size=3, cpu_group=None), name=writer.memory.name)
               for r in (1, 2)]
    box = Mailbox()
    for channel in [writer, *readers]:
        channel.gloo = box
    yield writer, readers
    for channel in [*readers, writer]:
        channel.close()


def read_all(reader, count, into):
    for _ in range(count):
        into.append(reader.recv())


def test_every_reader_gets_every_message_in_order(pair):
    writer, readers = pair
    messages = [("step", i, list(range(i))) for i in range(200)] + [None]
    got = [[], []]
    threads = [threading.Thread(target=read_all, args=(r, len(messages), g)) for r, g in zip(readers, got)]
    for t in threads:
        t.start()
    for m in messages:
        writer.send(m)
    for t in threads:
        t.join(10)
    assert got == [messages, messages]


def test_the_writer_waits_for_every_acknowledgement(pair):
    """One slot: a second message cannot be written until both readers have taken the first."""
    writer, readers = pair
    writer.send("first")
    assert readers[0].recv() == "first"
    writer.timeout = 0.2  # reader 2 has not read it: the next send must wait, then give up
    with pytest.raises(TimeoutError):
        writer.send("second")
    assert readers[1].recv() == "first"
    writer.send("second")  # now it goes
    assert [r.recv() for r in readers] == ["second", "second"]


def test_a_message_larger_than_the_slot_goes_the_other_way(pair, monkeypatch):
    writer, readers = pair
    monkeypatch.setattr(step_channel, "SLOT_BYTES", 100)
    big = list(range(1000))
    writer.send(big)
    assert writer.gloo.sent == [big]  # sent once, the other way; the slot only says so
    got = readers[0].recv()
    writer.gloo.sent.append(big)  # (the real gloo broadcast delivers to every reader)
    assert got == big and readers[1].recv() == big
    writer.send("small again")
    assert [r.recv() for r in readers] == ["small again", "small again"]


def test_a_reader_notices_that_the_driver_is_gone(pair):
    writer, readers = pair
    calls = []

    def poll():
        calls.append(1)
        raise RuntimeError("the driver is gone")

    readers[0].poll = poll
    with pytest.raises(RuntimeError, match="gone"):
        readers[0].recv()  # nothing is ever sent: only the poll ends the wait (after about a second)
    assert calls == [1]
