"""Issue 17: tool calling (`tools` and `tool_choice` on /v1/chat/completions).

A model does not call functions. It writes text; the server decides that the text is a call.
Three steps make that work, and none of them needs a new piece of engine:

1. **Tools become prompt.** The request's `tools` (OpenAI's list of `{"type": "function",
   "function": {"name", "description", "parameters"}}`, `parameters` being a JSON schema) go to
   the model's own chat template, which writes them into the prompt the way the model was trained
   to read them, and says how to answer with a call. A template that never reads a `tools`
   variable cannot do this (`Tokenizer.takes_tools`): such a request is refused.
2. **Text becomes calls.** After generation, `parse_tool_calls` reads the answer in the model's
   call format. Two are common, and the template tells which one a model uses:

       "json"   (Llama 3.x)    {"name": "get_weather", "parameters": {"city": "Paris"}}
                               the whole answer is one such object, or several joined by ";"
       "tagged" (Hermes, Qwen) Let me look.<tool_call>{"name": "get_weather",
                               "arguments": {"city": "Paris"}}</tool_call>
                               text before the first tag is ordinary content

   A call counts only if it names one of the request's tools and its arguments are a JSON
   object; anything else stays text, and the client gets it as `content`. Calls come back in
   OpenAI's shape, `{"id": "call_...", "type": "function", "function": {"name", "arguments"}}`,
   where `arguments` is a JSON *string*, and the finish reason is "tool_calls".
3. **When a call is required, the grammar makes it one.** With `tool_choice: "required"` or a
   named function, the answer must be a call, and a small model left to itself may not write
   one. So the server builds a grammar that accepts exactly one call whose arguments follow the
   function's `parameters` schema, and the engine masks every token that would leave it: the
   same machinery as `response_format` (nanoserve/sampling/grammar.py), given a different grammar.

`tool_choice`: "none" hands no tools to the template and parses nothing (the tools may as well
not have been sent); "auto" (the default with tools) hands them over and parses whatever comes
back; "required" and `{"type": "function", "function": {"name": ...}}` constrain the output.
`parallel_tool_calls: false` keeps at most the first call of an "auto" answer; the constrained
modes always produce exactly one.

In a stream (`ToolCallStream`), text that may still become a call is held back until the answer
is complete, then sent as one `tool_calls` delta, or, if it was not a call after all, as content.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass

from nanoserve.sampling.grammar import JSON_OPTIONS

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function name
# A function whose `parameters` are left out (or `{}`) takes no arguments, as OpenAI reads it:
# its call's arguments are `{}`, and a constrained call may not invent any.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"  # the "tagged" format's markers
# Issue 38: the 400 for tools sent to a model whose chat template has no tools slot.
NO_TOOLS_SLOT = ("this model's chat template does not take tools (it never reads a 'tools' variable), so the model "
                 "cannot be told about them. Models whose own template takes tools (Llama 3.x, Qwen 2.5, Hermes, "
                 "the bundled tiny model) need nothing more; for one without (SmolLM2, Gemma 3), start the server "
                 "with --tool-template hermes, which lists the tools in the system message (docs/agents.md); or "
                 "leave 'tools' out")


class ToolError(ValueError):
    """A request whose tools the server cannot use; `param` names the field at fault."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------- the request


@dataclass
class ToolUse:
    """What a chat request asks of its tools, once checked."""

    tools: list[dict]  # as `check_tools` returns them: what the template gets
    mode: str  # "auto", "required" or "function" (one named function)
    name: str | None  # the function, in mode "function"
    fmt: str  # the model's call format: "json" or "tagged"
    parallel: bool = True  # parallel_tool_calls: more than one call allowed ("auto" only)

    @property
    def constrained(self) -> bool:
        """Whether the output must be a call (generated under `grammar()`)."""
        return self.mode != "auto"

    def grammar(self) -> str | None:
        """The llguidance grammar of the answer, for the constrained modes (None for "auto")."""
        if not self.constrained:
            return None
        wanted = [t for t in self.tools if self.mode == "required" or t["function"]["name"] == self.name]
        return call_grammar(wanted, self.fmt)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """The answer -> (content, calls); at most one call without `parallel`."""
        content, calls = parse_tool_calls(text, self.fmt, self.tools)
        return content, calls if self.parallel else calls[:1]

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished answer, and its finish reason."""
        content, calls = self.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def tool_use(body: dict, template: str | None, takes_tools: bool) -> ToolUse | None:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls` -> a ToolUse, or None
    when the request uses no tools (none given, or `tool_choice` "none"). `template` is the chat
    template's text (the call format is read from it); `takes_tools`: whether it reads `tools`."""
    tools = check_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    mode, name = check_tool_choice(body.get("tool_choice"), tools)
    if mode == "none":
        return None
    if not takes_tools:
        raise ToolError(NO_TOOLS_SLOT)
    return ToolUse(tools, mode, name, call_format(template or ""), True if parallel is None else parallel)


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools` -> the same list, each function's `parameters` filled in (an empty object
    schema when left out). ToolError names the first field at fault (`tools[1].function.name`)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise ToolError(f"'{at}' must be {{\"type\": \"function\", \"function\": {{...}}}} (function tools "
                            "only)", at)
        function = check_function(tool["function"], f"{at}.function")
        if function["name"] in names:
            raise ToolError(f"'{at}.function.name': two tools are named {function['name']!r}", f"{at}.function.name")
        names.add(function["name"])
        checked.append({"type": "function", "function": function})
    return checked


def check_function(function, at: str) -> dict:
    """One tool's `function` object: name, and optional description, parameters and strict."""
    if not isinstance(function, dict):
        raise ToolError(f"'{at}' must be an object with a 'name'", at)
    for key in function:
        if key not in ("name", "description", "parameters", "strict"):
            raise ToolError(f"'{at}.{key}' is not a field of a function (name, description, parameters, strict)",
                            f"{at}.{key}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"'{at}.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r}", f"{at}.name")
    kinds = {"description": (str, "a string"), "parameters": (dict, "an object (a JSON schema)"),
             "strict": (bool, "a boolean")}
    for key, (kind, words) in kinds.items():
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise ToolError(f"'{at}.{key}' must be {words}", f"{at}.{key}")
    # `strict` changes nothing here: constrained calls always follow the schema, and "auto"
    # answers are the model's own. The template gets name, description and parameters.
    checked = {"name": name}
    if function.get("description") is not None:
        checked["description"] = function["description"]
    checked["parameters"] = function.get("parameters") or dict(NO_PARAMETERS)  # {} too: no arguments
    return checked


def check_tool_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    """OpenAI's `tool_choice` -> (mode, name): ("none" | "auto" | "required", None) or
    ("function", the name). The default is "auto" with tools and "none" without."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(f"'tool_choice' must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        mode, name = choice, None
    else:
        name = _named_function(choice)
        if name is None:
            raise ToolError("'tool_choice' as an object must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "tool_choice")
        mode = "function"
    if mode != "none" and not tools:
        raise ToolError(f"'tool_choice' {json.dumps(choice)} needs 'tools'", "tool_choice")
    if mode == "function" and name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
    return mode, name


def _named_function(choice) -> str | None:
    """The name in a `{"type": "function", "function": {"name": ...}}` tool_choice, else None."""
    if not (isinstance(choice, dict) and set(choice) == {"type", "function"} and choice["type"] == "function"):
        return None
    function = choice["function"]
    if not (isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str)):
        return None
    return function["name"]


def call_format(template: str) -> str:
    """The call format a chat template teaches its model: "tagged" when it writes `<tool_call>`
    tags (Hermes, Qwen), else "json" (Llama 3.x)."""
    return "tagged" if TAG_OPEN in template else "json"


# --------------------------------------------------------------------------- the grammar


def call_schema(tool: dict, fmt: str) -> dict:
    """The JSON schema of one call of `tool`: its name, then its arguments under the format's
    key ("parameters" for "json", "arguments" for "tagged"), nothing else."""
    key = "parameters" if fmt == "json" else "arguments"
    function = tool["function"]
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: function["parameters"]},
            "required": ["name", key], "additionalProperties": False}


def call_grammar(tools: list[dict], fmt: str) -> str:
    """An llguidance grammar accepting exactly one call of one of `tools` (compact JSON, as
    structured output writes it). For "tagged", the JSON sits between the two tags, in a lark
    grammar whose `%json{...}` rule embeds the schema. ToolError if a schema cannot be used."""
    from llguidance import LLMatcher

    schemas = [call_schema(t, fmt) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    for i, one in enumerate(schemas):  # find the function at fault before combining them
        check_tool_grammar(LLMatcher.grammar_from_json_schema(one, defaults=JSON_OPTIONS), tools[i])
    if fmt == "json":
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    else:
        call = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        grammar = LLMatcher.grammar_from_lark(f"start: {json.dumps(TAG_OPEN)} call {json.dumps(TAG_CLOSE)}\n"
                                              f"call: %json {call}\n")
    check_tool_grammar(grammar, None)
    return grammar


def check_tool_grammar(grammar: str, tool: dict | None) -> None:
    """ToolError if llguidance cannot compile the grammar (an unknown type, a bad `$ref`...)."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        which = f"the function {tool['function']['name']!r}'s parameters" if tool else "the tools' parameters"
        raise ToolError(f"{which} cannot constrain a call: {error}", "tools")


# --------------------------------------------------------------------------------- parsing


def parse_tool_calls(text: str, fmt: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """A finished answer -> (content, calls) in OpenAI's shape.

    All or nothing: if the answer holds a call that is not one (an unknown name, arguments that
    are not a JSON object, broken JSON), it is all content, `(text, [])`. With calls, content is
    the text before them ("tagged"), or None when there is none."""
    names = {t["function"]["name"] for t in tools}
    found = _json_calls(text) if fmt == "json" else _tagged_calls(text)
    if found is None:
        return text, []
    content, objects = found
    calls = [_openai_call(obj, names) for obj in objects]
    if not calls or None in calls:
        return text, []
    return content, calls


def _json_calls(text: str) -> tuple[None, list] | None:
    """The "json" format: JSON objects joined by ";", and nothing else (surrounding white space
    aside). None when the text is not that."""
    decoder, objects = json.JSONDecoder(), []
    rest = text.strip()
    while rest.startswith("{"):
        try:
            obj, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        objects.append(obj)
        rest = rest[end:].lstrip()
        if not rest:
            return None, objects
        if not rest.startswith(";"):
            return None
        rest = rest[1:].lstrip()
    return None


TAGGED = re.compile(re.escape(TAG_OPEN) + r"(.*?)" + re.escape(TAG_CLOSE), re.S)


def _tagged_calls(text: str) -> tuple[str | None, list] | None:
    """The "tagged" format: content, then `<tool_call>JSON</tool_call>` blocks separated only by
    white space. None when the text has no tag, or anything else after the first one."""
    start = text.find(TAG_OPEN)
    if start < 0 or TAGGED.sub("", text[start:]).strip():
        return None
    objects = []
    for block in TAGGED.findall(text, start):
        try:
            objects.append(json.loads(block))
        except json.JSONDecodeError:
            return None
    content = text[:start]
    return (content if content.strip() else None), objects


def _openai_call(obj, names: set[str]) -> dict | None:
    """One parsed call -> OpenAI's shape, or None unless it names a tool of the request and its
    arguments ("parameters" or "arguments") are an object."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("parameters", obj.get("arguments"))
    if not isinstance(arguments, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


# ------------------------------------------------------------------------------ streaming


def held_from(text: str, fmt: str, constrained: bool) -> int:
    """Where the part of an unfinished answer that may still become a call starts: the stream
    holds `text[held_from(...):]` back (len(text): nothing to hold).

    Constrained answers are calls: all of it. Blank text may still become anything. "json": a
    call is the whole answer, so an answer starting with `{` is held entirely. "tagged": from the
    first `<tool_call>`, or from an ending that could be the start of one (`<tool`)."""
    if constrained or not text.strip():
        return 0
    if fmt == "json":
        return 0 if text.lstrip().startswith("{") else len(text)
    at = text.find(TAG_OPEN)
    if at >= 0:
        return at
    for size in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TAG_OPEN[:size]):
            return len(text) - size
    return len(text)


class ToolCallStream:
    """Tool calls in a stream: wraps the `(index, output)` pairs that `sse_events` consumes, and
    is its `tool_calls(index, output)` hook.

    Each choice's text goes out as it comes until it may be a call (`held_from`); from there the
    wrapper holds it back, with the logprobs of its tokens. The finished output then carries
    either the calls (through the hook, finish reason "tool_calls") or the held text as content,
    with every held logprob: the chunks still add up to the plain response."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.texts: dict[int, str] = {}  # choice index -> its text so far
        self.sent: dict[int, int] = {}  # choice index -> how much of that went out as content
        self.held_logprobs: dict[int, list] = {}  # choice index -> logprobs of text not sent yet
        self.calls: dict[int, list[dict]] = {}  # choice index -> the calls its last output delivers

    async def wrap(self, outputs):
        try:
            async for index, out in outputs:
                yield index, self.step(index, out)
        finally:
            await outputs.aclose()

    def step(self, index: int, out):
        """One output -> the output to stream: its delta cut to what may go out now."""
        text = self.texts.get(index, "") + out.delta
        sent = self.sent.get(index, 0)
        self.texts[index] = text
        logprobs = self.held_logprobs.pop(index, []) + (out.delta_logprobs or [])
        if out.finished:
            content, calls = self.use.parse(text[sent:])
            if calls:
                self.calls[index] = [{"index": j, **call} for j, call in enumerate(calls)]
                return dataclasses.replace(out, delta=content or "", delta_logprobs=logprobs,
                                           finish_reason="tool_calls")
            return dataclasses.replace(out, delta=text[sent:], delta_logprobs=logprobs)
        end = max(sent, held_from(text, self.use.fmt, self.use.constrained))
        self.sent[index] = end
        if end == sent:  # nothing to send: keep the logprobs for the text that will carry them
            self.held_logprobs[index] = logprobs
            return dataclasses.replace(out, delta="", delta_logprobs=[])
        return dataclasses.replace(out, delta=text[sent:end], delta_logprobs=logprobs)

    def __call__(self, index: int, out) -> list[dict] | None:
        """`sse_events`' hook: the calls a choice's last output delivers, else None."""
        return self.calls.pop(index, None) if out.finished else None
