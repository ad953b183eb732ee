"""Issue 38: an Anthropic Messages request, checked and translated into the chat endpoint's terms.

`POST /v1/messages` (nanoserve/server/messages_api.py) runs on the same path as
`/v1/chat/completions`: the same chat template, sampling parameters, tools and grammar. This module
reads Anthropic's body and writes the OpenAI chat body that means the same thing, which the chat
endpoint's own functions then check and run:

    Anthropic                                   OpenAI chat
    system (a string, or text blocks)           a first message of role "system"
    messages[i] role user/assistant,            messages: text blocks joined by newlines; an
      content a string or blocks                assistant's tool_use blocks become its tool_calls;
                                                a user's tool_result blocks become "tool" messages
                                                (in front of the user's text)
    max_tokens (required), stop_sequences,      max_tokens, stop, temperature, top_p, top_k
      temperature (0 to 1), top_p, top_k
    tools [{name, description, input_schema}]   tools [{type: function, function: {name,
                                                description, parameters}}]
    tool_choice {type: auto|any|tool|none,      tool_choice "auto" | "required" | {type: function,
      name, disable_parallel_tool_use}          function: {name}} | "none"; parallel_tool_calls

As on the OpenAI side, a field the server would not honour is refused with a 400 that names it:
an unknown field, an image or document block, extended thinking. The checks here come first
because they say why; the body is then held to its published model
(nanoserve/server/messages_schema.py, in /openapi.json), so that nothing the schema refuses is taken.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.sampling.params import MIN_TEMPERATURE
from nanoserve.server.messages_schema import CountTokensRequest, MessagesRequest, check_schema
from nanoserve.server.protocol import APIError

# Every top-level field /v1/messages takes. `metadata` (user_id), `service_tier` "auto" or
# "standard_only", `speed` "standard" and `cache_control` (the prefix cache is automatic) change
# nothing here and are accepted as information. temperature, top_p and top_k are older fields of
# the API (the `anthropic` client 2.x sends them through `extra_body`); the default is Anthropic's,
# temperature 1.
FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "stream", "metadata", "tools", "tool_choice", "service_tier", "speed", "cache_control"})
NOT_SUPPORTED = {  # Anthropic's fields this server refuses, and why
    "thinking": "this server runs no reasoning model (extended thinking is not supported)",
    "container": "this server runs no code execution container",
    "mcp_servers": "this server connects to no MCP server: run the tools in the client",
    "context_management": "this server does not edit the context",
    "output_config": "structured output through 'output_config' is not supported yet: ask for a tool_use "
                     "block with tools and tool_choice {\"type\": \"tool\", \"name\": ...}, whose input follows "
                     "the tool's schema",
}
BLOCK_KEYS = {  # the keys each content block may have (cache_control: a hint for Anthropic's cache, no effect)
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}
ERROR_PREFIX = "Error: "  # in front of a tool result sent with is_error: true, for the model to read


def _param_error(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}' {message}", param=param)


def check_fields(body: dict, counting: bool = False) -> None:
    """400 for a field the server would not honour, or a required one missing (null counts as
    absent, but an unknown field is refused even when null: the published schema has no such
    field). `counting`: for count_tokens, where max_tokens may be left out."""
    for name in body:
        if name in NOT_SUPPORTED:
            raise APIError(400, f"'{name}' is not supported: {NOT_SUPPORTED[name]}", param=name)
        if name not in FIELDS:
            raise APIError(400, f"unknown field '{name}': /v1/messages does not take it, and this server refuses what "
                                "it would otherwise ignore (docs/agents.md lists the fields)", param=name)
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise _param_error("max_tokens", "is required: the most tokens to generate")
    whole = isinstance(max_tokens, int) or (isinstance(max_tokens, float) and max_tokens.is_integer())
    if max_tokens is not None and (isinstance(max_tokens, bool) or not whole or max_tokens < 1):  # 16.0 counts
        raise _param_error("max_tokens", f"must be an integer of at least 1, got {max_tokens!r}")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= 1)):
        raise _param_error("temperature", f"must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, 1], got "
                                          f"{temperature!r}")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and set(metadata) <= {"user_id"}
                                     and isinstance(metadata.get("user_id", ""), (str, type(None)))):
        raise _param_error("metadata", "takes 'user_id' (a string) only")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _param_error("service_tier", "must be 'auto' or 'standard_only': this server has one tier")
    if body.get("speed") not in (None, "standard"):
        raise _param_error("speed", "must be 'standard': this server has one speed")
    if body.get("cache_control") is not None and not isinstance(body["cache_control"], dict):
        raise _param_error("cache_control", "must be an object")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _param_error("stream", "must be a boolean")


def text_of(blocks: Any, param: str, what: str = "a string or a list of text blocks") -> str:
    """A string, or a list of text blocks joined by newlines."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _param_error(param, f"must be {what}")
    texts = []
    for j, block in enumerate(blocks):
        texts.append(check_block(block, f"{param}[{j}]", ("text",))["text"])
    return "\n".join(texts)


def check_block(block: Any, param: str, allowed: tuple[str, ...]) -> dict:
    """One content block, checked: one of the `allowed` types, with the keys of its type."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document", "search_result"):
        raise APIError(400, f"'{param}' is a '{kind}' block: this server takes text only ({kind} blocks are not "
                            "supported)", param=param)
    if kind not in allowed:
        raise APIError(400, f"'{param}' must be a content block of type {' or '.join(allowed)}, got "
                            f"{kind if isinstance(kind, str) else type(block).__name__!r}", param=param)
    extra = sorted(set(block) - BLOCK_KEYS[kind])
    if extra:
        raise APIError(400, f"'{param}.{extra[0]}' is not supported in a {kind} block", param=f"{param}.{extra[0]}")
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _param_error(f"{param}.text", "must be a string")
    if kind == "tool_use" and not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                                   and isinstance(block.get("input"), dict)):
        raise APIError(400, f"'{param}' must be {{\"type\": \"tool_use\", \"id\": ..., \"name\": ..., \"input\": "
                            "{...}}", param=param)
    if kind == "tool_result":
        if not isinstance(block.get("tool_use_id"), str):
            raise _param_error(f"{param}.tool_use_id", "is required: the id of the tool_use block this answers")
        if not isinstance(block.get("is_error", False), bool):
            raise _param_error(f"{param}.is_error", "must be a boolean")
    return block


def chat_messages(body: dict) -> list[dict]:
    """`system` and `messages` -> the chat endpoint's `messages` (OpenAI's shape)."""
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": text_of(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _param_error("messages", "is required: a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLE_BLOCKS:
            raise APIError(400, f"'messages[{i}].role' must be 'user' or 'assistant', got {role!r} (the system "
                                "prompt goes in the top-level 'system' field)", param=f"messages[{i}].role")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise _param_error(f"messages[{i}].{extra[0]}", "is not supported: a message has 'role' and 'content'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _param_error(f"messages[{i}].content", "must be a string or a list of content blocks")
        blocks = [check_block(b, f"messages[{i}].content[{j}]", ROLE_BLOCKS[role]) for j, b in enumerate(content)]
        out += user_turn(blocks, i) if role == "user" else [assistant_turn(blocks)]
    return out


def user_turn(blocks: list[dict], i: int) -> list[dict]:
    """A user message's blocks -> its tool results as "tool" messages, then its text (if any)."""
    out = [{"role": "tool", "tool_call_id": b["tool_use_id"],
            "content": (ERROR_PREFIX if b.get("is_error") else "")
            + text_of(b.get("content", ""), f"messages[{i}].content[{j}].content")}
           for j, b in enumerate(blocks) if b["type"] == "tool_result"]
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def assistant_turn(blocks: list[dict]) -> dict:
    """An assistant message's blocks -> one assistant message: its text, and its tool_use blocks as calls."""
    text = "\n".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [{"id": b["id"], "type": "function",
              "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
             for b in blocks if b["type"] == "tool_use"]
    message = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(body: dict) -> dict:
    """`tools` and `tool_choice` -> the chat endpoint's `tools`, `tool_choice` and `parallel_tool_calls`."""
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") not in (None, {"type": "none"}, {"type": "auto"}):
            raise _param_error("tool_choice", "needs 'tools'")
        return {}
    if not isinstance(tools, list):
        raise _param_error("tools", "must be a list of {name, description, input_schema}")
    out = []
    for j, tool in enumerate(tools):
        param = f"tools[{j}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"'{param}' must be a client tool {{name, description, input_schema}}"
                                + (f"; Anthropic's server tools ({kind!r}) are not supported" if kind else ""),
                           param=param)
        extra = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
        if extra:
            raise _param_error(f"{param}.{extra[0]}", "is not supported in a tool")
        if not isinstance(tool.get("input_schema"), dict):
            raise _param_error(f"{param}.input_schema", "is required: the JSON schema of the tool's input")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return {"tools": out, **chat_tool_choice(body.get("tool_choice"))}


def chat_tool_choice(choice: Any) -> dict:
    """Anthropic's `tool_choice` -> OpenAI's `tool_choice` (and `parallel_tool_calls`)."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    keys = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
            "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if kind not in keys or set(choice) - keys[kind]:
        raise _param_error("tool_choice", "must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", "
                                          "\"name\": ...} or {\"type\": \"none\"}")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise _param_error("tool_choice.name", "is required with type 'tool': the tool to call")
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise _param_error("tool_choice.disable_parallel_tool_use", "must be a boolean")
    out: dict = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)
                 or {"type": "function", "function": {"name": choice["name"]}}}
    if disable:
        out["parallel_tool_calls"] = False
    return out


def chat_body(body: dict, counting: bool = False) -> dict:
    """A /v1/messages body, checked, as the /v1/chat/completions body that asks for the same answer.
    `counting`: a count_tokens body (max_tokens optional; the chat body gets 1)."""
    check_fields(body, counting)
    out = {"model": body["model"], "messages": chat_messages(body),
           "max_tokens": 1 if counting else int(body["max_tokens"]), **chat_tools(body)}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _param_error("stop_sequences", "must be a list of non-empty strings")
        out["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    # The checks above say why; this one refuses whatever they let through that the published
    # schema (nanoserve/server/messages_schema.py) does not allow.
    check_schema(body, CountTokensRequest if counting else MessagesRequest)
    return out
