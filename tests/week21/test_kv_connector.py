"""Issue 35: the KV connector on its own, two pools in one process over loopback gloo (as CI runs it).

Blocks arrive bit for bit in the blocks the decode side allocated; an id the prefill side never
staged fails; a transfer that comes late (no prefill side yet, or a stuck one) times out and its
bytes are dropped when they come, and the pair goes on; a prefill instance that dies fails every
transfer after it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from nanoserve.attention.paged import PagedKVCache
from nanoserve.runner.kv_connector import TransferFailed, TransferTimedOut, make_connector
from nanoserve.testing import free_ports


def pools(seed: int = 0) -> tuple[PagedKVCache, PagedKVCache]:
    torch.manual_seed(seed)
    a, b = PagedKVCache(3, 10, 4, 2, 8), PagedKVCache(3, 10, 4, 2, 8)  # layers, blocks, block size, heads, dim
    a.k.normal_()
    a.v.normal_()
    return a, b


def wait_landed(connector, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        landed = connector.landed()
        if landed:
            return landed
        time.sleep(0.01)
    raise AssertionError("nothing landed")


@pytest.fixture
def pair():
    prefill_pool, decode_pool = pools()
    address = f"127.0.0.1:{free_ports(1)}"
    decode = make_connector("gloo", decode_pool, "decode", address, timeout=1.0)
    prefill = make_connector("gloo", prefill_pool, "prefill", address, timeout=1.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_close_ends_the_group_and_can_be_called_twice(pair):
    """`close` ends the two-rank group there and then (`release`), not at process exit."""
    prefill, decode = pair
    deadline = time.monotonic() + 10.0
    while not (prefill.stats()["connected"] and decode.stats()["connected"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.stats()["connected"] and decode.stats()["connected"]
    for side in (prefill, decode, prefill):
        side.close()
        assert not side.stats()["connected"] and not side.thread.is_alive()


def test_read_and_write_blocks_are_inverse():
    a, b = pools()
    data = a.read_blocks([4, 1, 7])
    assert data.shape == (3, 3, 2, 4, 2, 8)  # [n, layers, K/V, block size, heads, dim]
    b.write_blocks([0, 2, 9], data)
    assert torch.equal(b.k[:, [0, 2, 9]], a.k[:, [4, 1, 7]]) and torch.equal(b.v[:, [0, 2, 9]], a.v[:, [4, 1, 7]])


def test_blocks_land_bit_for_bit_in_the_blocks_the_decode_side_chose(pair):
    prefill, decode = pair
    prefill.send("a", [3, 1, 8])
    prefill.send("b", [5])
    decode.receive("b", [0])  # in another order than sent: the decode side pulls what it is ready for
    decode.receive("a", [9, 6, 2])
    landed = wait_landed(decode)
    if len(landed) < 2:
        landed += wait_landed(decode)
    assert sorted(x.transfer_id for x in landed) == ["a", "b"] and all(x.error is None for x in landed)
    assert {x.transfer_id: x.num_bytes for x in landed} == {"a": 3 * 3 * 2 * 4 * 2 * 8 * 4, "b": 3 * 2 * 4 * 2 * 8 * 4}
    assert all(x.seconds > 0 for x in landed)
    src, dst = prefill.cache, decode.cache
    assert torch.equal(dst.k[:, [9, 6, 2]], src.k[:, [3, 1, 8]]) and torch.equal(dst.v[:, [0]], src.v[:, [5]])
    # The prefill side counts a send once its own send call returns, which can be a moment after the
    # decode side has the bytes: wait for it rather than race it.
    deadline = time.monotonic() + 10.0
    while prefill.stats()["sent"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.stats()["sent"] == 2 and decode.stats()["received"] == 2
    assert prefill.num_waiting() == decode.num_waiting() == 0


def test_a_transfer_to_a_prefill_side_not_there_yet_times_out_and_is_dropped_once_it_comes():
    prefill_pool, decode_pool = pools()
    address = f"127.0.0.1:{free_ports(1)}"
    decode = make_connector("gloo", decode_pool, "decode", address, timeout=0.5)
    prefill = None
    try:
        decode.receive("early", [0, 1])
        [landed] = wait_landed(decode)
        assert isinstance(landed.error, TransferTimedOut) and "no prefill instance has connected" in str(landed.error)
        before = decode_pool.k.clone()
        prefill = make_connector("gloo", prefill_pool, "prefill", address, timeout=0.5)
        prefill.send("next", [4])
        decode.receive("next", [5])
        [landed] = wait_landed(decode)
        assert landed.transfer_id == "next" and landed.error is None
        assert torch.equal(decode_pool.k[:, :5], before[:, :5])  # "early" wrote nothing
        assert torch.equal(decode_pool.k[:, 5], prefill_pool.k[:, 4])
    finally:
        decode.close()
        if prefill is not None:
            prefill.close()


def test_an_id_the_prefill_side_never_staged_fails_and_a_cancelled_one_lands_nowhere(pair):
    prefill, decode = pair
    decode.receive("unknown", [0])
    [landed] = wait_landed(decode)
    assert type(landed.error) is TransferFailed and "holds no KV" in str(landed.error)
    before = decode.cache.v.clone()
    prefill.send("gone", [1])
    decode.receive("gone", [2])
    decode.cancel("gone")  # its request was aborted: the caller frees block 2
    prefill.send("never-received", [1])
    decode.cancel("never-received")  # aborted before it was received: pulled and dropped
    prefill.send("kept", [3])
    decode.receive("kept", [4])
    [landed] = wait_landed(decode)
    assert landed.transfer_id == "kept"
    assert torch.equal(decode.cache.v[:, 2], before[:, 2])
    assert prefill.num_waiting() == decode.num_waiting() == 0


PREFILL_PROCESS = """
import sys, time
from nanoserve.attention.paged import PagedKVCache
from nanoserve.runner.kv_connector import make_connector
pool = PagedKVCache(3, 10, 4, 2, 8)
connector = make_connector("gloo", pool, "prefill", sys.argv[1], timeout=1.0)
for name in ("a", "late", "b"):
    connector.send(name, [0])
print("staged", flush=True)
time.sleep(120)
"""


def test_a_stuck_prefill_instance_times_out_one_that_dies_fails_what_follows_and_a_new_one_takes_over():
    _, decode_pool = pools()
    address = f"127.0.0.1:{free_ports(1)}"
    decode = make_connector("gloo", decode_pool, "decode", address, timeout=1.0)
    proc = subprocess.Popen([sys.executable, "-c", PREFILL_PROCESS, address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "staged"
        decode.receive("a", [0])
        assert wait_landed(decode, timeout=30)[0].error is None
        proc.send_signal(signal.SIGSTOP)  # stuck: alive, answering nothing
        decode.receive("late", [1])
        [landed] = wait_landed(decode)
        assert isinstance(landed.error, TransferTimedOut) and "is the prefill instance stuck?" in str(landed.error)
        proc.send_signal(signal.SIGCONT)  # back: "late" arrives and is dropped, the pair goes on
        decode.receive("b", [2])
        [landed] = wait_landed(decode)
        assert landed.transfer_id == "b" and landed.error is None
        proc.kill()
        proc.wait(timeout=10)
        decode.receive("c", [3])
        [landed] = wait_landed(decode)
        assert type(landed.error) is TransferFailed and "the prefill instance is gone" in str(landed.error)
        assert decode.stats()["broken"].startswith("the prefill instance is gone")
        decode.receive("d", [4])  # and every one after it, at once
        [landed] = wait_landed(decode, timeout=1)
        assert "the prefill instance is gone" in str(landed.error)
        # A new prefill instance takes its place: the decode side joins it, no restart needed.
        proc = subprocess.Popen([sys.executable, "-c", PREFILL_PROCESS, address], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "staged"
        deadline = time.monotonic() + 30
        while decode.stats()["broken"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        decode.receive("b", [5])
        [landed] = wait_landed(decode, timeout=30)
        assert landed.transfer_id == "b" and landed.error is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
        decode.close()


def test_instances_whose_blocks_differ_refuse_every_transfer_and_say_why():
    address = f"127.0.0.1:{free_ports(1)}"
    decode = make_connector("gloo", PagedKVCache(3, 10, 4, 2, 8), "decode", address, timeout=5.0)
    prefill = make_connector("gloo", PagedKVCache(3, 10, 16, 2, 8), "prefill", address, timeout=5.0)
    try:
        decode.receive("a", [0])
        [landed] = wait_landed(decode)
        assert type(landed.error) is TransferFailed
        assert "the prefill instance's KV blocks are 3 layers x 16 tokens x 2 KV heads x 8 dims of torch.float32, " \
               "this one's 3 layers x 4 tokens" in str(landed.error) and "--block-size" in str(landed.error)
    finally:
        prefill.close()
        decode.close()


def test_bad_settings_are_refused_in_one_line():
    a, _ = pools()
    with pytest.raises(ValueError, match="unknown KV connector 'tcp'"):
        make_connector("tcp", a, "decode", "127.0.0.1:1", 1.0)
    with pytest.raises(ValueError, match="runs on the CPU: use --kv-connector gloo"):
        make_connector("nccl", a, "decode", "127.0.0.1:1", 1.0)
    with pytest.raises(ValueError, match="not host:port"):
        make_connector("gloo", a, "decode", "localhost", 1.0)
    with pytest.raises(ValueError, match="'prefill' or 'decode'"):
        make_connector("gloo", a, "both", "127.0.0.1:1", 1.0)


@pytest.mark.gpu
def test_the_nccl_connector_moves_blocks_between_two_gpus():
    """The NCCL transport, GPU to GPU in one process (each connector's thread on its own GPU):
    bit for bit, an unknown id, then a transfer after it; `close` ends both NCCL groups."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.manual_seed(0)
    src = PagedKVCache(3, 10, 16, 2, 64, dtype=torch.bfloat16, device="cuda:0")
    dst = PagedKVCache(3, 10, 16, 2, 64, dtype=torch.bfloat16, device="cuda:1")
    src.k.normal_()
    src.v.normal_()
    address = f"127.0.0.1:{free_ports(1)}"
    decode = make_connector("nccl", dst, "decode", address, timeout=30.0)
    prefill = make_connector("nccl", src, "prefill", address, timeout=30.0)
    try:
        prefill.send("a", [7, 2, 5])
        decode.receive("a", [0, 1, 9])
        [landed] = wait_landed(decode, timeout=60)
        assert landed.error is None and landed.num_bytes == 3 * 3 * 2 * 16 * 2 * 64 * 2
        assert torch.equal(dst.k[:, [0, 1, 9]].cpu(), src.k[:, [7, 2, 5]].cpu())
        assert torch.equal(dst.v[:, [0, 1, 9]].cpu(), src.v[:, [7, 2, 5]].cpu())
        decode.receive("unknown", [3])
        assert "holds no KV" in str(wait_landed(decode)[0].error)
        prefill.send("b", [1])
        decode.receive("b", [4])
        assert wait_landed(decode)[0].error is None and torch.equal(dst.k[:, 4].cpu(), src.k[:, 1].cpu())
    finally:
        prefill.close()
        decode.close()
    assert not prefill.stats()["connected"] and not decode.stats()["connected"]
