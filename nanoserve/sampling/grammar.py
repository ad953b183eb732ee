"""Structured output (week 10), by grammar-constrained decoding.

A request with `response_format` `{"type": "json_object"}` or `{"type": "json_schema", ...}` must
produce text that parses (and validates against the schema). No model guarantees that by
itself, so the engine constrains it: before each token is drawn, a *matcher* (llguidance) says
which tokens of the vocabulary may come next without leaving the grammar, and every other
token's logit becomes -inf. After the token is drawn, the matcher consumes it and moves on.

    response_format --(grammar_for, on the server)--> grammar (a string, in SamplingParams)
    grammar --(Engine.add_request)--> TokenConstraint: a matcher for this request
    each step:  mask = constraint.allowed()     # [vocab] bools, on the host (one row; the Sampler
                                                #  gets a batch at once, packed: token_bitmasks)
                logits[row][~mask] = -inf       # Sampler, constrained rows only
                token = draw(...)
                constraint.consume(token)       # the sequence's stop check: True once complete

The grammar ends the request: once the JSON value is complete, the matcher accepts nothing but
EOS, and the request finishes with reason "stop" at once (no step is spent drawing the EOS).

The mask costs CPU time: the matcher walks its lexer and parser over the tokenizer's whole
vocabulary (llguidance prunes most of it with a token trie), for every constrained row of every
step. weeks/week10/README.md says what that costs and how engines hide it behind the forward pass
(here: the batch's rows filled in parallel by llguidance while the GPU runs the launched forward
pass, packed 32 tokens to a word, unpacked on the device).
"""

from __future__ import annotations

import os

import numpy as np
import torch

# How nanoserve writes JSON: compact, no free whitespace (`{"a":1,"b":[true,false]}`). Free
# whitespace would let a model (a small one especially) pad its answer with newlines until it
# runs out of tokens; without it, a schema whose strings, numbers and arrays are bounded gives
# output of bounded length.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A response_format the server cannot turn into a grammar; `param` names the field at fault."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


def grammar_for(response_format: dict | None) -> str | None:
    """OpenAI's `response_format` -> an llguidance grammar (a string), or None for plain text.

    Checks the shape of the field; `check_grammar` checks that the grammar compiles.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("'response_format' must be an object such as {\"type\": \"json_object\"}")
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise GrammarError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                           "response_format.type")
    for key in response_format:
        if key not in allowed[kind]:
            raise GrammarError(f"'response_format.{key}' is not a field of a '{kind}' response format",
                               f"response_format.{key}")
    if kind == "text":
        return None
    from llguidance import LLMatcher

    if kind == "json_object":  # any JSON object
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("'response_format.json_schema' is required: {\"name\": ..., \"schema\": {...}}",
                           "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("'response_format.json_schema.name' must be a non-empty string",
                           "response_format.json_schema.name")
    for key, kinds in (("description", str), ("strict", (bool, type(None))), ("schema", dict)):
        if key in spec and not isinstance(spec[key], kinds):
            raise GrammarError(f"'response_format.json_schema.{key}' has the wrong type",
                               f"response_format.json_schema.{key}")
    for key in spec:
        if key not in ("name", "description", "strict", "schema"):
            raise GrammarError(f"'response_format.json_schema.{key}' is not a field of a JSON schema format",
                               f"response_format.json_schema.{key}")
    # No schema: any JSON value, as OpenAI reads it. `strict` changes nothing here: the output
    # always follows the schema (a schema llguidance cannot compile is refused, never loosened).
    schema = spec.get("schema", {})
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"'response_format.json_schema.schema' is not valid: {e}",
                           "response_format.json_schema.schema") from None


def check_grammar(grammar: str) -> None:
    """Raise GrammarError if the grammar does not compile (an unknown type, a bad `$ref`...)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"'response_format.json_schema.schema' cannot be used: {error}",
                           "response_format.json_schema.schema")


class TokenConstraint:
    """One request's grammar state: which tokens may come next, and the tokens so far.

    `vocab_size` is the model's: it may exceed the tokenizer's (padding rows of the embedding),
    and those extra ids are never allowed. `stop_ids`: the request's stop tokens; where the
    grammar allows its EOS, they are allowed too (a chat model ends its turn with its own).
    """

    def __init__(self, tokenizer, grammar: str, vocab_size: int, stop_ids: frozenset[int]):
        from llguidance import LLMatcher

        self.tokenizer = tokenizer  # an llguidance LLTokenizer (`make_tokenizer`)
        self.matcher = LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"the response format cannot be used: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.stop_ids = sorted(t for t in stop_ids if t < vocab_size)

    def allowed(self) -> torch.Tensor:
        """The tokens that may come next: bools [vocab_size], on the host."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # one bit per token, little-endian
        n = self.tokenizer.vocab_size
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[: min(n, self.vocab_size)] = np.unpackbits(bits, bitorder="little")[: min(n, self.vocab_size)]
        eos = self.tokenizer.eos_token
        if eos < self.vocab_size and mask[eos]:
            mask[self.stop_ids] = True
        if not mask.any():  # cannot happen unless the matcher failed; end the request rather than draw from nothing
            mask[self.stop_ids or [eos]] = True
        return torch.from_numpy(mask)

    def consume(self, token: int) -> bool:
        """The token was appended to the sequence. True once the grammar is complete (the request
        stops there)."""
        if token in self.stop_ids:  # the request ends on it anyway
            return True
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()


def make_tokenizer(hf_tokenizer):
    """The llguidance view of a HuggingFace tokenizer: each token's bytes, for the matcher.
    Built once per engine (it takes up to a second for a large vocabulary)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer)


_EXECUTOR = None  # llguidance's thread pool for a batch's masks: one per process, made on first use


def token_bitmasks(constraints: list[TokenConstraint], vocab_size: int) -> torch.Tensor:
    """The masks of a step's constrained rows, packed: int32 [len(constraints), ceil(vocab / 32)],
    bit b of word w of row j set when token 32·w + b may come next for constraints[j] (on the
    host, pinned when a GPU is present, ready for an asynchronous copy).

    `allowed` says the same thing one row at a time, as bools; this is what the sampler uses:
    llguidance fills all rows at once on its own threads, without holding Python's lock, and the
    packed rows are 32 times smaller to copy to the device (`apply_token_bitmasks` unpacks them
    there). The request's stop tokens join EOS here too, and a row with nothing allowed gets them.
    """
    global _EXECUTOR
    import llguidance
    import llguidance.torch

    if _EXECUTOR is None:  # its threads: the cores, less the engine's own thread
        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, min(16, (os.cpu_count() or 2) - 1)))
    n = constraints[0].tokenizer.vocab_size  # llguidance's words cover the tokenizer's ids
    packed = _host_buffer(len(constraints), -(-n // 32))
    llguidance.torch.fill_next_token_bitmask_par(_EXECUTOR, [(c.matcher, j) for j, c in enumerate(constraints)],
                                                 packed)
    highest = max(t for c in constraints for t in c.stop_ids or [c.tokenizer.eos_token])
    if highest >= 32 * packed.shape[1]:  # a stop token past the tokenizer's ids (the model's padding rows)
        packed = torch.cat([packed, packed.new_zeros(len(constraints), highest // 32 + 1 - packed.shape[1])], 1)
    bits = packed.numpy().view(np.uint32)
    for j, c in enumerate(constraints):
        row = bits[j]
        row[c.tokenizer.vocab_size // 32 + 1 :] = 0  # (tokens past the tokenizer's: never)
        if c.tokenizer.vocab_size % 32:
            row[c.tokenizer.vocab_size // 32] &= np.uint32((1 << (c.tokenizer.vocab_size % 32)) - 1)
        eos = c.tokenizer.eos_token
        if (eos < vocab_size and row[eos >> 5] >> np.uint32(eos & 31) & 1) or not row.any():
            for t in c.stop_ids or [eos]:
                row[t >> 5] |= np.uint32(1 << (t & 31))
    return packed


_BUFFERS: dict[int, torch.Tensor] = {}  # words per row -> a pinned buffer, grown as batches grow


def _host_buffer(rows: int, words: int) -> torch.Tensor:
    """[rows, words] int32 on the host, pinned with a GPU present, reused from step to step:
    allocating pinned memory each step cost up to 3 ms on an H100 machine (docs/benchmarks.md).
    (Reuse is safe: a step's copy of it to the GPU is over before the step's tokens reach the host.)"""
    buffer = _BUFFERS.get(words)
    if buffer is None or buffer.shape[0] < rows:
        buffer = torch.zeros(max(rows, 2 * (0 if buffer is None else buffer.shape[0])), words, dtype=torch.int32,
                             pin_memory=torch.cuda.is_available())
        _BUFFERS[words] = buffer
    return buffer[:rows]


def apply_token_bitmasks(logits: torch.Tensor, rows: list[int], packed: torch.Tensor) -> torch.Tensor:
    """`apply_token_masks` for packed masks (`token_bitmasks`): the words travel to the device
    (asynchronously from pinned memory) and are unpacked there into [len(rows), V] bools."""
    device = logits.device
    words = packed.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [len(rows), 32 * words]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # ids past the tokenizer's (padding rows of the embedding): never
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    index = torch.tensor(rows, device=device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def apply_token_masks(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """-inf wherever masks[j] is False, in row rows[j] of logits [N, V]; other rows unchanged.
    Returns a new tensor (the raw logits stay, for logprobs). Only the constrained rows' masks
    travel to the device: [len(rows), V] bools."""
    index = torch.tensor(rows, device=logits.device)
    allowed = torch.stack(masks).to(logits.device)  # [len(rows), V]
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked
