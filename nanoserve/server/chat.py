"""`nanoserve chat`: talk to a chat model in the terminal.

The conversation is a list of messages; every turn sends all of it through the model's chat
template (the model has no memory of its own: the history *is* the prompt), streams the answer
token by token, and appends it to the list. Ctrl-C stops the answer being written, not the
program: a signal handler sets a flag that the loop checks between engine steps, and the request
is aborted so its KV blocks go back to the pool.
"""

from __future__ import annotations

import signal
import sys
from typing import Callable, TextIO

from nanoserve.engine.engine import Engine
from nanoserve.sampling.params import SamplingParams

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


class ChatSession:
    """A conversation with one engine: `ask` a message, get the streamed answer back."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None, lora: str | None = None):
        self.engine = engine
        self.lora = lora  # week 23: the adapter (a name the engine loaded) every answer runs under
        self.params = params
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._stop_requested = False
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def stop(self) -> None:
        """Ask the answer being written to stop after the current step (safe from a signal handler)."""
        self._stop_requested = True

    def ask(self, text: str, on_delta: Callable[[str], None] = lambda s: None) -> tuple[str, str]:
        """Send one user message; returns (the answer, why it ended: "stop", "length" or "interrupted")."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.engine.tokenizer.apply_chat_template(self.messages)
        if len(prompt) >= self.engine.max_model_len:
            self.messages.pop()
            raise ValueError(f"the conversation is {len(prompt)} tokens, over this model's context of "
                             f"{self.engine.max_model_len}: /reset to start a new one")
        self._stop_requested = False
        request = self.engine.add_request(prompt, self.params, lora=self.lora)
        answer, reason = "", None
        while reason is None:
            if self._stop_requested:
                self.engine.abort(request)
                reason = "interrupted"
                break
            for out in self.engine.step():
                answer += out.delta
                on_delta(out.delta)
                if out.finished:
                    reason = out.finish_reason
        # Even a stopped answer stays in the history: it is what the user saw.
        self.messages.append({"role": "assistant", "content": answer})
        return answer, reason


def run_chat(session: ChatSession, message: str | None = None, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    """With `message`: answer it once and return. Otherwise a read-answer loop until /exit or EOF.
    `stdin`, `stdout`: the process's own, read when called (not when this module was imported: a
    test's capture may have replaced and closed them since)."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    def answer(text: str) -> None:
        previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, lambda *_: session.stop())
        try:
            _, reason = session.ask(text, write)
        except ValueError as e:
            write(f"[{e}]\n")
            return
        finally:
            signal.signal(signal.SIGINT, previous)
        write({"interrupted": " [stopped]\n", "length": " [max tokens reached]\n"}.get(reason, "\n"))

    if message is not None:
        answer(message)
        return 0
    write(f"nanoserve chat with {session.engine.model_name}: {HELP}\n")
    while True:
        write("> ")
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: nothing to stop
            write(f"\n[{HELP}]\n")
            continue
        if not line:  # EOF (Ctrl-D)
            write("\n")
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            write("[new conversation]\n")
        elif text.startswith("/"):
            write(f"[unknown command {text.split()[0]}: {HELP}]\n")
        elif text:
            answer(text)
