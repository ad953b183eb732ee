"""Week 11 (issue 17): logprobs, echo and n > 1 in a stream. Each chunk carries the logprobs of
the tokens whose text it delivers (text held back for a possible stop string travels with the
chunk that finally delivers it), and the chunks add up to the plain response."""

import json
import re

import httpx
import pytest

pytestmark = pytest.mark.exercise("sse-events")




def stream_chunks(server, path: str, body: dict) -> list[dict]:
    """The parsed chunks of a stream (the usage chunk and [DONE] left out)."""
    with httpx.stream("POST", server.url + path, json={"model": "tiny", "stream": True, **body}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [c for c in map(json.loads, events[:-1]) if c["choices"]]


def joined(chunks: list[dict]) -> dict:
    """The completion logprobs of all chunks, concatenated."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        for key in out:
            out[key] += lp[key] if lp else []
    return out


BASE = {"prompt": "Return the", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 2}


SPECIAL = re.compile(r"<\|[a-z_]+\|>")  # special tokens: shown in `tokens`, absent from the text


def test_held_back_text_and_its_tokens_travel_together(server):
    full = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **BASE}, timeout=60).json()
    text = full["choices"][0]["text"]
    tokens = full["choices"][0]["logprobs"]["tokens"]
    # A stop string that never matches but whose beginning does: text that could start it is held
    # back, then released with the next token.
    stop = text[6:10] + "\u0007"
    chunks = stream_chunks(server, "/v1/completions", {**BASE, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert joined(chunks) == full["choices"][0]["logprobs"]
    # A chunk carries the tokens whose text it completes: after each chunk, the tokens sent spell a
    # prefix of the text sent, short of it by less than the next token's text.
    sent_text, sent = "", 0
    for c in chunks:
        choice = c["choices"][0]
        sent_text += choice["text"]
        sent += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
        spelled = SPECIAL.sub("", "".join(tokens[:sent]))
        rest = sent_text[len(spelled):]  # text sent ahead of its token: the start of the next one
        upcoming = next((t for t in (SPECIAL.sub("", t) for t in tokens[sent:]) if t), "")
        assert sent_text.startswith(spelled) and upcoming.startswith(rest) and len(rest) < max(len(upcoming), 1)
    held = [c for c in chunks if c["choices"][0]["text"] and c["choices"][0]["logprobs"] is None]
    assert held  # some chunk delivered the start of a token whose end was held back


def test_tokens_past_a_stop_string_come_with_the_last_chunk(server):
    full_text = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **BASE}, timeout=60).json()
    text = full_text["choices"][0]["text"]
    stop = text[6:9]
    plain = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **BASE, "stop": stop}, timeout=60).json()
    chunks = stream_chunks(server, "/v1/completions", {**BASE, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"] == text[: text.find(stop)]
    lp = plain["choices"][0]["logprobs"]
    assert joined(chunks) == lp and len(lp["tokens"]) == plain["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]).startswith(plain["choices"][0]["text"] + stop)  # the cut tokens are listed
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_chat_logprobs_equal_the_plain_ones(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "What is a list?"}], max_tokens=10, temperature=0,
              logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    # The same tokens and alternatives; the logprobs to float32 rounding (the second request finds
    # the prompt in the prefix cache, so its prefill runs other shapes: the last bits may differ).
    assert [(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, c.bytes, [t.token for t in c.top_logprobs]) for c in plain]
    values = lambda items: [v for c in items for v in [c.logprob] + [t.logprob for t in c.top_logprobs]]
    assert values(streamed) == pytest.approx(values(plain), abs=1e-4)


def test_streamed_echo_starts_with_the_prompt(server):
    body = {"prompt": ["The list", "A"], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    plain = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60).json()
    chunks = stream_chunks(server, "/v1/completions", body)
    for index, prompt in enumerate(["The list", "A"]):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["choices"][0]["text"].startswith(prompt)
        assert "".join(c["choices"][0]["text"] for c in mine) == plain["choices"][index]["text"]
        assert joined(mine) == plain["choices"][index]["logprobs"]
        assert joined(mine)["token_logprobs"][0] is None


def test_n_choices_stream_with_a_role_chunk_each(server, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=8, temperature=1.0, seed=9)
    plain = client.chat.completions.create(**kw)
    body = {k: v for k, v in kw.items() if k != "model"}
    chunks = stream_chunks(server, "/v1/chat/completions", body)
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum("role" in c["delta"] for c in mine) == 1 and mine[-1]["finish_reason"] is not None
        assert "".join(c["delta"].get("content", "") for c in mine) == plain.choices[index].message.content
    completions = client.completions.create(model="tiny", prompt="The list", n=2, max_tokens=6, seed=4, stream=True)
    texts = ["", ""]
    for chunk in completions:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    same = client.completions.create(model="tiny", prompt="The list", n=2, max_tokens=6, seed=4)
    assert texts == [c.text for c in same.choices]
