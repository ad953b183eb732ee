"""What goes back out: logprob objects, the token strings behind them, usage."""

from __future__ import annotations

from nanoserve.engine.outputs import RequestOutput
from nanoserve.sampling.sampler import TokenLogprob


class TokenStrings:
    """What the logprobs fields show of a token id: its text (special tokens spelled out), its
    width in the output text (0 for a special token, which the text skips), and its bytes.
    Cached: the same alternatives come back at every position."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, int, list[int]]] = {}
        try:  # byte-level BPE (Llama 3): each character of a raw token stands for one byte
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_of = {c: b for b, c in bytes_to_unicode().items()}
        except ImportError:
            self.byte_of = {}

    def __call__(self, token: int) -> tuple[str, int, list[int]]:
        if token not in self.cache:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            width = len(self.tokenizer.decode([token], skip_special_tokens=True))
            raw = self.tokenizer.hf.convert_ids_to_tokens(token)
            if isinstance(raw, str) and raw and all(c in self.byte_of for c in raw):
                data = [self.byte_of[c] for c in raw]  # exact, even for half a character
            else:
                data = list(text.encode("utf-8"))
            self.cache[token] = (text, width, data)
        return self.cache[token]


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # OpenAI's floor ("very unlikely"), and never -inf in JSON


def completion_logprobs(entries: list[TokenLogprob], strings: TokenStrings, offset: int = 0) -> tuple[dict, int]:
    """Completions' (legacy) logprobs object for `entries`, whose first token's text starts at
    `offset` in the choice's text; also returns where the next token's text starts. Each
    `top_logprobs` dict holds the requested alternatives and the chosen token (OpenAI: up to
    logprobs + 1 entries); a position nothing predicts (the first prompt token) has None."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text, width, _ = strings(e.token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += width
        if e.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_logprob(e.logprob))
        top = {strings(t)[0]: _logprob(lp) for t, lp in e.top}
        top.setdefault(text, _logprob(e.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries: list[TokenLogprob], strings: TokenStrings) -> dict:
    """Chat's logprobs object: `content`, one item per token, with its text, logprob, UTF-8 bytes
    and its `top_logprobs` alternatives (as many as asked)."""
    def item(token: int, logprob: float) -> dict:
        text, _, data = strings(token)
        return {"token": text, "logprob": _logprob(logprob), "bytes": data}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


class StreamLogprobs:
    """`sse_events`' `logprobs(index, out)`: the logprobs object of the tokens an output
    delivers (`out.delta_logprobs`), or None when it delivers none. Keeps each choice's text
    offset (completions) from chunk to chunk."""

    def __init__(self, strings: TokenStrings, chat: bool):
        self.strings, self.chat = strings, chat
        self.offsets: dict[int, int] = {}

    def __call__(self, index: int, out: RequestOutput) -> dict | None:
        if not out.delta_logprobs:
            return None
        if self.chat:
            return chat_logprobs(out.delta_logprobs, self.strings)
        found, self.offsets[index] = completion_logprobs(out.delta_logprobs, self.strings, self.offsets.get(index, 0))
        return found


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

