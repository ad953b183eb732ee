"""Week 13: `nanoserve chat` — the conversation goes through the chat template, /reset clears
it, and Ctrl-C stops the answer being written, not the program. On the bundled tiny model
(which has a chat template), so these run in seconds."""

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from nanoserve.server.chat import ChatSession, run_chat
from nanoserve.engine.engine import Engine
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig("tiny", device="cpu", num_blocks=64))


def assert_idle(engine):
    alloc = engine.scheduler.allocator
    assert not engine.has_unfinished() and alloc.num_free == alloc.num_blocks


def test_history_goes_through_the_template(engine):
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=8), system="Be brief.")
    first, reason = session.ask("Hello")
    assert reason == "length" and first
    session.ask("And then?")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    # The second turn's prompt is the whole conversation, formatted by the template.
    prompt = engine.tokenizer.decode(engine.tokenizer.apply_chat_template(session.messages[:4]),
                                     skip_special_tokens=False)
    assert "Be brief." in prompt and "Hello" in prompt and first.strip() in prompt and "And then?" in prompt
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]
    assert_idle(engine)


def test_stop_ends_the_answer_and_frees_its_blocks(engine):
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=500))
    seen = []

    def on_delta(delta):
        seen.append(delta)
        if len(seen) == 3:
            session.stop()  # what the Ctrl-C handler does

    answer, reason = session.ask("Tell me everything", on_delta)
    assert reason == "interrupted" and len(seen) <= 4 and answer == "".join(seen)
    assert_idle(engine)
    assert session.messages[-1] == {"role": "assistant", "content": answer}  # kept: the user saw it
    session.params = SamplingParams(temperature=0, max_tokens=4)
    _, reason = session.ask("Go on")  # the next turn works
    assert reason == "length"
    assert_idle(engine)


def test_a_conversation_over_the_context_is_refused_with_advice():
    small = Engine(EngineConfig("tiny", device="cpu", num_blocks=16, max_model_len=32))
    session = ChatSession(small, SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="over this model's context of 32: /reset"):
        session.ask("word " * 40)
    assert session.messages == []  # the refused message is not kept


def test_the_loop_reads_commands(engine):
    session = ChatSession(engine, SamplingParams(temperature=0, max_tokens=4))
    out = io.StringIO()
    assert run_chat(session, stdin=io.StringIO("Hi\n/reset\n/what\nHello again\n"), stdout=out) == 0
    text = out.getvalue()
    assert text.count("[max tokens reached]") == 2 and "[new conversation]" in text
    assert "unknown command /what" in text
    assert len(session.messages) == 2  # only what came after /reset


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_not_the_program():
    cmd = [sys.executable, "-m", "nanoserve.cli", "chat", "--model", "tiny", "--device", "cpu",
           "--max-tokens", "1500", "--temperature", "1", "--seed", "0"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = bytearray()
    reader = threading.Thread(target=lambda: [out.extend(c) for c in iter(lambda: proc.stdout.read1(256), b"")],
                              daemon=True)
    reader.start()

    def wait_for(predicate, timeout=60):
        deadline = time.time() + timeout
        while not predicate():
            assert time.time() < deadline, out.decode(errors="replace")
            time.sleep(0.02)

    try:
        wait_for(lambda: b"> " in out)
        proc.stdin.write(b"Tell me a very long story\n")
        proc.stdin.flush()
        start = len(out)
        wait_for(lambda: len(out) > start + 40)  # the answer is streaming
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: b"[stopped]" in out)
        proc.stdin.write(b"/exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    assert b"[max tokens reached]" not in out
