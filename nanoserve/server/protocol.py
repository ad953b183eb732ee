"""The OpenAI request fields: reading, checking and turning them into sampling parameters."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from nanoserve.sampling.grammar import GrammarError, check_grammar, grammar_for
from nanoserve.sampling.params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from nanoserve.server.schema import MAX_N, MAX_STOP, ChatCompletionRequest, CompletionRequest, first_error

NOT_SUPPORTED = {  # OpenAI's fields this server refuses, and why
    "suffix": "this server does not insert text before a suffix",
    "functions": "it is the deprecated name of 'tools': send the functions as 'tools' "
                 "([{\"type\": \"function\", \"function\": {...}}])",
    "function_call": "it is the deprecated name of 'tool_choice': send 'tool_choice' instead",
    "audio": "this server generates text only", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this server runs no reasoning model", "verbosity": "this server runs no reasoning model",
    "web_search_options": "this server cannot search the web", "moderation": "this server runs no moderation",
    "prompt_cache_options": "the prefix cache is automatic and has no options",
    "prompt_cache_retention": "the prefix cache is automatic and has no options",
}

MESSAGE_FIELDS = {  # the keys a message of each role may have (tool calls and their results)
    "system": {"role", "content"}, "user": {"role", "content"},
    "assistant": {"role", "content", "tool_calls"}, "tool": {"role", "content", "tool_call_id"},
}

MAX_JSON_DEPTH = 64  # arrays and objects inside each other, in a body or a tool call's `arguments`
MAX_INT_DIGITS = 20  # digits of a JSON integer: enough for any 64-bit seed

_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')  # a string literal, whose brackets are text
_JSON_BRACKET = re.compile(r"[\[\]{}]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a UTF-16 pair

# Every request field of the two endpoints that the server accepts is a field of its model in
# nanoserve/server/schema.py (docs/openai_api.md says what each one does). Anything else is refused
# with a 400 naming it: a field silently ignored is a question answered as if it had not been asked.
COMPLETION_FIELDS = frozenset(CompletionRequest.model_fields)
CHAT_FIELDS = frozenset(ChatCompletionRequest.model_fields)


class APIError(Exception):
    """An error to report to the client, OpenAI-style."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _get(body: dict, name: str, kinds: tuple, default: Any = None, check=None, rule: str = "") -> Any:
    """body[name] if present, checked for type (and `check`), else `default`."""
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if isinstance(value, float) and int in kinds and float not in kinds and value.is_integer():
        value = int(value)  # 16.0: what JSON encoders write for a whole float (16.5 is still refused)
    if isinstance(value, bool) and bool not in kinds:  # True is an int in Python; not in JSON
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got a boolean", param=name)
    if not isinstance(value, kinds):
        got = repr(value) if isinstance(value, float) else type(value).__name__
        raise APIError(400, f"'{name}' must be {_kind_names(kinds)}, got {got}", param=name)
    if check is not None and not check(value):
        raise APIError(400, f"'{name}' {rule}, got {value!r}", param=name)
    return value


def _kind_names(kinds: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


# ------------------------------------------------------------------------- JSON, within limits


def load_json(text: str | bytes, param: str | None = None) -> Any:
    """JSON text (a request body, or a JSON string inside one: `param` names it) -> its value; a
    400 for text that is not JSON, nested deeper than MAX_JSON_DEPTH, with an integer longer than
    MAX_INT_DIGITS, or with a string that is not valid Unicode. Past these limits Python's own
    parser and the tokenizer fail (RecursionError, a 4,300-digit ValueError, a TypeError)."""
    where = f"'{param}'" if param else "the request body"
    try:
        if isinstance(text, bytes):
            text = text.decode(json.detect_encoding(text))
        # the deepest nesting, counted over the brackets outside string literals
        steps = (1 if c in "[{" else -1 for c in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)))
        if max(itertools.accumulate(steps), default=0) > MAX_JSON_DEPTH:
            raise APIError(400, f"{where} nests arrays and objects more than {MAX_JSON_DEPTH} deep", param=param)
        value = json.loads(text, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"{where} is not valid JSON: {e}", param=param) from None
    except _IntegerTooLong as e:
        raise APIError(400, f"{where} holds an integer of {e.args[0]} digits; JSON integers here have at most "
                            f"{MAX_INT_DIGITS}", param=param) from None
    if _SURROGATE_ESCAPE.search(text):  # rare: only then look for the string it left unpaired
        path = _unpaired_surrogate(value, param or "")
        if path is not None:
            raise APIError(400, f"{f'{path!r}' if path else where} is not valid Unicode: it holds half of a UTF-16 surrogate pair (an escape "
                                "from \\ud800 to \\udfff without its other half)", param=path or None)
    return value


class _IntegerTooLong(ValueError):
    pass


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:  # before int(), whose time grows with the square
        raise _IntegerTooLong(len(digits.lstrip("-")))
    return int(digits)


def _unpaired_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) in `value` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")  # printable, even if the key is bad
        found = _unpaired_surrogate(key, name) or _unpaired_surrogate(item, name)
        if found is not None:
            return found
    return None


def sampling_params_from(body: dict, default_max_tokens: int) -> SamplingParams:
    """The sampling fields of a completion or chat request -> SamplingParams (400 on bad input)."""
    # >>> week10: parse-params
    max_tokens = _get(body, "max_tokens", (int,), None, lambda v: v >= 1, "must be at least 1")
    # the chat API's newer name for the same thing
    newer = _get(body, "max_completion_tokens", (int,), None, lambda v: v >= 1, "must be at least 1")
    if max_tokens is not None and newer is not None and newer != max_tokens:
        raise APIError(400, f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({newer}) disagree; "
                            "send one of them", param="max_completion_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens if newer is None else newer
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP:  # OpenAI takes 4; evaluation harnesses send more (each `until` string, and EOS)
        raise APIError(400, f"'stop' has {len(stop)} strings; this server takes at most {MAX_STOP}", param="stop")
    return SamplingParams(
        # ranges where float32 sampling is sound (nanoserve/sampling/params.py says why)
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: v == 0 or MIN_TEMPERATURE <= v <= 2,
                               f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: MIN_TOP_P <= v <= 1,
                         f"must be in [{MIN_TOP_P:g}, 1]")),
        top_k=_get(body, "top_k", (int,), 0, lambda v: 0 <= v <= MAX_TOP_K, f"must be in [0, {MAX_TOP_K}] (0 = off)"),
        repetition_penalty=float(_get(body, "repetition_penalty", (int, float), 1.0,
                                      lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
                                      f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")),
        max_tokens=max_tokens,
        stop=stop,
        seed=_get(body, "seed", (int,), None, lambda v: SEED_MIN <= v <= SEED_MAX,
                  f"must be in [{SEED_MIN}, {SEED_MAX}]"),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
    )
    # <<< week10: parse-params


def openai_fields(body: dict, params: SamplingParams, chat: bool, vocab_size: int) -> tuple[SamplingParams, int, bool]:
    """The wider OpenAI surface, on top of `sampling_params_from`: presence and frequency
    penalties, `logit_bias`, logprobs and `response_format` (as a grammar:
    nanoserve/sampling/grammar.py) go into the params; returns
    (params, n: choices per prompt, echo: completions repeat the prompt in front of the text)."""
    penalties = {name: float(_get(body, name, (int, float), 0.0, lambda v: -2 <= v <= 2, "must be in [-2, 2]"))
                 for name in ("presence_penalty", "frequency_penalty")}
    bias = _get(body, "logit_bias", (dict,), {})
    logit_bias = {}
    for key, value in bias.items():  # JSON keys are strings: token ids written as text
        param = f"logit_bias.{key}"
        # plain ASCII digits: str.isdigit() also takes "²" (which int() refuses) and "١٢" (which it reads as 12)
        if not (key.isascii() and key.isdigit() and len(key) <= len(str(vocab_size)) and int(key) < vocab_size):
            raise APIError(400, f"'logit_bias' keys are token ids written in ASCII digits, in [0, {vocab_size}), "
                                f"got {key!r}", param=param)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(400, f"'{param}' must be a number in [-100, 100], got {value!r}", param=param)
        logit_bias[int(key)] = float(value)
    rule = f"must be in [0, {MAX_LOGPROBS}]"
    if chat:  # a boolean, and how many alternatives apart
        top = _get(body, "top_logprobs", (int,), None, lambda v: 0 <= v <= MAX_LOGPROBS, rule)
        wanted = _get(body, "logprobs", (bool,), False)
        if top is not None and not wanted:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs, echo = (top or 0) if wanted else None, False
    else:  # completions: how many alternatives, or null for none
        logprobs = _get(body, "logprobs", (int,), None, lambda v: 0 <= v <= MAX_LOGPROBS, rule)
        echo = _get(body, "echo", (bool,), False)
    n = _get(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]")
    if _get(body, "best_of", (int,), n) != n:
        raise APIError(400, "'best_of' (keep the best of several samples) is not supported: leave it out or make it "
                            "equal to 'n'", param="best_of")
    try:  # structured output: a grammar the engine constrains the sampling with
        grammar = grammar_for(_get(body, "response_format", (dict,)))
        if grammar is not None:
            check_grammar(grammar)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
    params = dataclasses.replace(params, **penalties, logit_bias=logit_bias, logprobs=logprobs,
                                 prompt_logprobs=logprobs if echo else None, grammar=grammar)
    return params, n, echo


def check_fields(body: dict, chat: bool) -> None:
    """400 for every field of the body the server would not honour (null counts as absent)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if value is None:
            continue
        if name in NOT_SUPPORTED:
            raise APIError(400, f"'{name}' is not supported: {NOT_SUPPORTED[name]}", param=name)
        if name not in known:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise APIError(400, f"unknown field '{name}': {endpoint} does not take it, and this server refuses "
                                "what it would otherwise ignore (docs/openai_api.md lists every field)", param=name)
    # Fields accepted only where they change nothing (their default, or information for OpenAI's own use).
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        _get(body, name, (str,))
    metadata = _get(body, "metadata", (dict,), {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise APIError(400, "'metadata' maps strings to strings", param="metadata")
    defaults = [("store", (bool,), [False], "this server stores nothing"),
                ("service_tier", (str,), ["auto", "default"], "this server has one tier (see 'priority')"),
                ("modalities", (list,), [["text"]], "this server generates text only")]
    for name, kinds, allowed, reason in defaults:
        value = _get(body, name, kinds)
        if value is not None and value not in allowed:
            raise APIError(400, f"'{name}' {json.dumps(value)} is not supported: {reason}", param=name)
    options = _get(body, "stream_options", (dict,))
    if options is not None:
        if not _get(body, "stream", (bool,), False):
            raise APIError(400, "'stream_options' needs 'stream': true", param="stream_options")
        for key in options:  # include_obfuscation: this server pads nothing, true or false
            if key not in ("include_usage", "include_obfuscation") or not isinstance(options[key], bool):
                raise APIError(400, f"'stream_options.{key}' is not supported (include_usage and include_obfuscation, "
                                    "booleans, are)", param=f"stream_options.{key}")


def check_schema(body: dict, chat: bool) -> None:
    """The last check before the engine: the body conforms to its request model
    (nanoserve/server/schema.py), the contract /openapi.json publishes. The checks above come
    first because they say more (which part of a message is an image, why a field is refused);
    this one refuses whatever they let through that the published schema does not allow."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        model.model_validate(body)
    except ValidationError as e:
        param, message = first_error(e, body)
        raise APIError(400, message, param=param or None) from None


def check_model(body: dict, model_names: str | Sequence[str], adapters: Sequence[str] = ()) -> None:
    """400 without a string `model`; 404 for a model other than the ones this server serves
    (issue 38: one or several) or their LoRA adapters (week 23: a request names an adapter as its
    model, as with vLLM)."""
    model = _get(body, "model", (str,))
    if model is None:
        raise APIError(400, "'model' is required", param="model")
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
    if model not in names and model not in adapters:
        raise model_not_found(model, names, adapters)


def model_not_found(model: str, model_names: Sequence[str], adapters: Sequence[str] = ()) -> APIError:
    """The 404 for a `model` this server does not serve, naming the ones it does."""
    served = ", ".join(f"'{name}'" for name in model_names)
    also = f" and the adapters {', '.join(adapters)}" if adapters else ""
    return APIError(404, f"the model '{model}' does not exist; this server serves {served}{also}",
                    param="model", code="model_not_found")


def stream_fields(body: dict) -> tuple[bool, bool]:
    """(stream: whether the answer comes as server-sent events, include_usage: whether the stream
    ends with a usage chunk)."""
    stream = _get(body, "stream", (bool,), False)
    include_usage = bool((_get(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    return stream, include_usage


def request_priority(body: dict, scheduling_policy: str) -> int:
    """The request's `priority` (week 16; lower runs first), which only a server that schedules
    by priority takes."""
    priority = _get(body, "priority", (int,), 0)
    if priority != 0 and scheduling_policy != "priority":
        raise APIError(400, "'priority' needs a server started with --scheduling-policy priority "
                            f"(this one schedules by {scheduling_policy})", param="priority")
    return priority


def message_text(content: str | list, index: int) -> str:
    """A message's `content`: a string, or a list of text parts joined in order by newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        param = f"messages[{index}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise APIError(400, f"'{param}' is a '{kind}' part; this server takes text only "
                                "(parts of type 'text')", param=param)
        if not (kind == "text" and isinstance(part.get("text"), str) and set(part) == {"type", "text"}):
            raise APIError(400, f"'{param}' must be a text part: {{\"type\": \"text\", \"text\": \"...\"}}",
                           param=param)
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins them


def template_messages(messages: Any, takes_tools: bool) -> list[dict]:
    """The request's `messages`, checked, as the chat template gets them: each `content` one
    string; an assistant's `tool_calls` and a tool message's `tool_call_id` (tool calling) in
    HuggingFace's convention. `takes_tools`: whether the template can write tool messages."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
    return [template_message(m, i, takes_tools) for i, m in enumerate(messages)]


def template_message(m: Any, i: int, takes_tools: bool) -> dict:
    """One message (the i-th) as the chat template gets it."""
    role = m.get("role") if isinstance(m, dict) else None
    calls = m.get("tool_calls") if role == "assistant" else None
    content = m.get("content") if role else None
    if role not in MESSAGE_FIELDS or not (isinstance(content, (str, list)) or (content is None and calls)):
        raise APIError(400, "each message needs a 'role' (system, user, assistant or tool) and a 'content' (a string "
                            "or a list of text parts; null only beside an assistant's 'tool_calls')", param="messages")
    for key in m:
        if key not in MESSAGE_FIELDS[role] and m[key] is not None:
            raise APIError(400, f"'messages[{i}].{key}' is not supported: the chat template gets a {role} message's "
                                f"{', '.join(sorted(MESSAGE_FIELDS[role]))} only", param=f"messages[{i}].{key}")
    out = {"role": role, "content": None if content is None else message_text(content, i)}
    if (calls or role == "tool") and not takes_tools:
        param = f"messages[{i}].tool_calls" if calls else f"messages[{i}].role"
        raise APIError(400, "this model's chat template does not take tools, so it cannot write tool calls or "
                            "their results into the prompt (a server started with --tool-template hermes gives it a "
                            "tools slot: docs/agents.md)", param=param)
    if calls is not None:
        if not isinstance(calls, list):
            raise APIError(400, f"'messages[{i}].tool_calls' must be a list", param=f"messages[{i}].tool_calls")
        out["tool_calls"] = [template_tool_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
    if role == "tool":
        tool_call_id = m.get("tool_call_id")
        if not isinstance(tool_call_id, str):
            raise APIError(400, f"'messages[{i}].tool_call_id' is required: the id of the call this message "
                                "answers", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = tool_call_id
    return out


def template_tool_call(call: Any, param: str) -> dict:
    """One of an assistant message's `tool_calls`, OpenAI's shape, as HuggingFace templates read
    it: the same, but `arguments` decoded from its JSON string into an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and call.get("type", "function") == "function"
            and isinstance(call.get("id", ""), str) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str) and set(call) <= {"id", "type", "function"}
            and set(function) == {"name", "arguments"}):
        raise APIError(400, f"'{param}' must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"arguments\": \"<a JSON object, as a string>\"}}}}", param=param)
    arguments = load_json(function["arguments"], f"{param}.function.arguments")
    if not isinstance(arguments, dict):
        raise APIError(400, f"'{param}.function.arguments' must be a JSON object written as a string, got "
                            f"{function['arguments']!r}", param=f"{param}.function.arguments")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {"id": call["id"], **out} if "id" in call else out


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The params of a prompt's j-th choice (n > 1): its own seed, seed + j (so the n samples
    differ, and each is reproducible), and no prompt logprobs after the first choice (they
    would be the same, and computing them means prefilling the prompt again: see
    `Scheduler._reuse_cached_prefix`)."""
    if j == 0:
        return params
    seed = params.seed
    if seed is not None:
        seed = seed + j if seed + j <= SEED_MAX else seed + j - 2**64  # the same seed, modulo 2**64
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)

