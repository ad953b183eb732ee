"""Week 3: the tokenizer wrapper and the incremental (streaming) detokenizer."""

import pytest

from nanoserve.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello 世界! 🎉🚀 naïve café — 日本語のテキストです。",
    "👩‍👩‍👧 family, 🇫🇷 flag, emoji after emoji 😀😃😄",
    "Plain ASCII: def f(x):\n    return x * 2\n",
    "混合 text with 中文, 한국어 and Ελληνικά 🧪",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer("tiny")


def test_encode_decode_round_trip(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id  # the tokenizer adds BOS by itself
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_chat_template(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_matches_full_decode_at_every_step(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    streamed, held_back_steps = "", 0
    for i, token in enumerate(ids):
        delta = detok.add(token)
        assert REPLACEMENT_CHAR not in delta
        streamed += delta
        full = tok.decode(ids[: i + 1])
        # Everything decoded so far, except an unfinished character at the very end.
        assert streamed == full.rstrip(REPLACEMENT_CHAR)
        held_back_steps += delta == "" and full.endswith(REPLACEMENT_CHAR)
    streamed += detok.flush()
    assert streamed == text
    if any(ord(c) > 0x7FF for c in text):
        assert held_back_steps > 0, "no character was split across tokens: the test proved little"


def test_special_tokens_add_no_text(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("Hello") + [tok.eos_token_id]
    assert "".join(detok.add(t) for t in ids) + detok.flush() == "Hello"


def test_broken_bytes_at_the_end_are_flushed(tok):
    """A sequence that ends inside a character: flush returns what the decoder makes of it."""
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(t) for t in ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])
