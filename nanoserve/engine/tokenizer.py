"""Week 3: text in, text out.

`Tokenizer` is a thin wrapper over the checkpoint's own HuggingFace tokenizer (we do not
re-implement BPE: the checkpoint's tokenizer *is* the specification). `IncrementalDetokenizer`
turns a growing list of token ids into text deltas for streaming, without ever emitting half of
a multi-byte UTF-8 character.
"""

from __future__ import annotations

import functools
import os

from nanoserve.engine.tool_templates import with_tool_template
from nanoserve.model.loader import check_model_dir, resolve_model_dir

REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for bytes that are not (yet) a character


class Tokenizer:
    def __init__(self, model: str | os.PathLike, tool_template: str | None = None):
        """`tool_template` (issue 38): "hermes" puts a tools slot in front of the model's own chat
        template (nanoserve/engine/tool_templates.py), for a model whose template has none."""
        from transformers import AutoTokenizer

        model_dir = resolve_model_dir(model)
        check_model_dir(model_dir, needs=("tokenizer",))  # else transformers blames a missing package
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.tool_template_name = tool_template
        if tool_template is not None:
            if not self.hf.chat_template:
                raise ValueError(f"--tool-template {tool_template} goes in front of the model's chat template, "
                                 "and this model has none")
            self.hf.chat_template = with_tool_template(tool_template, self.hf.get_chat_template())
        # Decoding runs twice per token per running sequence (IncrementalDetokenizer): a server
        # with 256 streams calls it 512 times a step. The HF wrapper's decode is the Rust
        # tokenizer's decode plus Python around it (about 2.6 µs a call against 0.9 on a 2-core
        # CPU); when the wrapper adds nothing to its result (no clean-up of spaces), call the Rust
        # one directly (docs/benchmarks.md, "Host time of a streaming decode step").
        self._rust_decode = _direct_decoder(self.hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (with the BOS token the tokenizer adds by itself, if any)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Chat messages -> prompt token ids, formatted by the tokenizer's own chat template.

        `tools` (tool calling, week 10): OpenAI's list of `{"type": "function", "function": {...}}`, handed to
        the template, which writes them into the prompt its own way (`takes_tools` says whether
        it does). Messages may carry `tool_calls` (arguments as dicts) and role `tool`, in
        HuggingFace's convention."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template: use plain completions")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        # The template already wrote the BOS token; do not let encode add a second one.
        return self.encode(text, add_special_tokens=False)

    @property
    def tool_template(self) -> str | None:
        """The chat template's text as used with tools (a tokenizer may keep a separate
        "tool_use" template beside its default one), or None without a template."""
        if not self.hf.chat_template:
            return None
        return self.hf.get_chat_template(tools=[])

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable. Parsed, not searched: a template
        that merely mentions the word in its text does not count."""
        source = self.tool_template
        if source is None:
            return False
        from jinja2 import meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        # HF's own environment: templates may use its extensions ({% generation %}, loop controls).
        environment = _compile_jinja_template(source).environment
        return "tools" in meta.find_undeclared_variables(environment.parse(source))


def _direct_decoder(hf):
    """The Rust tokenizer's `decode`, where HF's wrapper would return its result unchanged; else
    None (a slow tokenizer, or one whose wrapper cleans up spaces after decoding)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Feed it one token at a time; it returns the new text each token completes.

    Decoding token by token and joining the pieces is wrong for byte-level BPE: one emoji is
    four bytes, often split over two or three tokens, and each piece alone decodes to U+FFFD.
    Decoding the whole sequence every step is right but costs O(n) per token. Instead we keep
    two offsets into the token list:

        ids:   ... [prefix_offset ........ read_offset) [new tokens ...]
                    already-emitted tokens,             not yet emitted
                    kept as left context

    and decode only the short window from `prefix_offset`. The new text is the window's text
    minus the text of its already-emitted part. If the window ends in U+FFFD the last
    character is incomplete: emit nothing and wait for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" if a character is still open)."""
        # >>> week03: detokenize
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) <= len(prefix_text):
            return ""  # an unfinished UTF-8 character (or a token with no text, like EOS)
        delta = window_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta
        # <<< week03: detokenize

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (a truly broken character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window_text[len(prefix_text) :]
