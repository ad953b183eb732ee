"""Issue 38: a tools slot for a model whose chat template has none (`--tool-template hermes`).

A model learns to call functions from its chat template: the template writes the tool list into
the prompt and shows what a call looks like. SmolLM2-135M-Instruct's template (ChatML) and the
turn format nanoserve gives Gemma 3 270M never read a `tools` variable, so a request with tools
is refused (`Tokenizer.takes_tools`). This module's template is put in front of the model's own:
it rewrites the conversation into messages that template can already write, and leaves the turn
format (`<|im_start|>`, `<start_of_turn>`) to it.

What it teaches the model, in the Hermes convention (NousResearch's Hermes 2 Pro, also Qwen 2.5's):

- the system message gets a paragraph that lists the functions, one JSON object each
  (`{"type": "function", "function": {"name", "description", "parameters"}}`) between `<tools>` and
  `</tools>`, and says to answer a call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (after the caller's own system text,
  or alone when the conversation has none);
- an assistant message's `tool_calls` become that same text, one tagged call after its content;
- a `tool` message (a call's result) becomes a user turn, the result between `<tool_response>` and
  `</tool_response>`; consecutive results share one turn (Gemma's turns alternate).

The server then parses calls in the "tagged" format (nanoserve/server/tools.py finds
`<tool_call>` in this text). A 135M model was never trained on this: with `tool_choice` "auto" it
seldom writes a call; with "required" or a named function the grammar makes it write one.
"""

from __future__ import annotations

TOOL_TEMPLATES = ("hermes",)  # the values of --tool-template

HERMES_PRELUDE = """\
{#- nanoserve's "hermes" tools slot (nanoserve/engine/tool_templates.py): the tools go into the system
    message, tool calls and their results become text; the model's own template follows. -#}
{%- set ns = namespace(messages=[], results='') -%}
{%- set tool_text = '' -%}
{%- if tools -%}
{%- set tool_text -%}
You can call functions. They are listed below, one JSON object each, between <tools> and </tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
</tools>
To call a function, answer with its name and a JSON object of its arguments between two tags, like this:
<tool_call>{"name": "function_name", "arguments": {"argument": "value"}}</tool_call>
The result comes back between <tool_response> and </tool_response>.
{%- endset -%}
{%- endif -%}
{%- if tool_text and (not messages or messages[0]['role'] != 'system') -%}
{%- set ns.messages = [{'role': 'system', 'content': tool_text}] -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'tool' -%}
{%- set ns.results = ns.results + '<tool_response>\\n' + message['content'] + '\\n</tool_response>' -%}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
{%- set ns.messages = ns.messages + [{'role': 'user', 'content': ns.results}] -%}
{%- set ns.results = '' -%}
{%- else -%}
{%- set ns.results = ns.results + '\\n' -%}
{%- endif -%}
{%- elif message['role'] == 'system' and loop.first and tool_text -%}
{%- set ns.messages = ns.messages + [{'role': 'system', 'content': message['content'] + '\\n\\n' + tool_text}] -%}
{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}
{%- set text = namespace(value=message['content'] or '') -%}
{%- for call in message['tool_calls'] -%}
{%- set function = call['function'] if call.get('function') else call -%}
{%- set text.value = text.value + ('\\n' if text.value else '') + '<tool_call>' + {'name': function['name'], 'arguments': function['arguments']} | tojson + '</tool_call>' -%}
{%- endfor -%}
{%- set ns.messages = ns.messages + [{'role': 'assistant', 'content': text.value}] -%}
{%- else -%}
{%- set ns.messages = ns.messages + [{'role': message['role'], 'content': message['content']}] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = ns.messages -%}
{%- set tools = none -%}
"""


def with_tool_template(name: str, template: str) -> str:
    """The chat template `template` (the model's own) with the tools slot `name` in front."""
    if name not in TOOL_TEMPLATES:
        raise ValueError(f"unknown tool template {name!r}: one of {', '.join(TOOL_TEMPLATES)}")
    return HERMES_PRELUDE + template
