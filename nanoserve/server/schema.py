"""The request bodies as Pydantic models: the schema every request is checked against first, and
what `/openapi.json` publishes (so a generated client, a fuzzer or the /docs page sees every
field, its type and its range).

Two layers check a request. This one checks its *shape*: the fields that exist, their JSON
types, their ranges, the structure of messages, tools and response formats. The handlers then
check what a schema cannot say: what depends on the model (token ids and `logit_bias` keys below
the vocabulary size, the context length, whether the chat template takes tools), rules between
fields (`top_logprobs` needs `logprobs`), and whether a grammar compiles.

The models are strict (a string is not a number, `true` is not 1) with one allowance: a
whole-number float such as `16.0` counts as an integer, because JSON encoders write them.
`null` counts as absent everywhere, as OpenAI reads it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.json_schema import models_json_schema

from nanoserve.sampling.params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SEED_MAX,
    SEED_MIN,
)

MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_STOP = 16  # stop strings per request (OpenAI takes 4; evaluation harnesses send more)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _whole_number(value: Any) -> Any:
    """16.0 -> 16 (16.5 stays a float, and is refused where an integer is expected)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def Int(ge: int | None = None, le: int | None = None, description: str | None = None) -> Any:  # noqa: N802
    """An integer field (a whole-number float accepted) in [ge, le]."""
    return Annotated[int, Field(ge=ge, le=le, description=description), BeforeValidator(_whole_number)]


def Number(ge: float, le: float, description: str | None = None) -> Any:  # noqa: N802
    """A number field (integer or float) in [ge, le]."""
    return Annotated[float, Field(ge=ge, le=le, description=description)]


def _false_only(value: bool) -> bool:
    if value:
        raise ValueError("should be false")
    return value


# `false` and nothing else. Not Literal[False]: Pydantic's literal check compares with ==, and
# 0 == 0.0 == False in Python, so it would take a number the published schema (const false) refuses.
FalseOnly = Annotated[bool, AfterValidator(_false_only), WithJsonSchema({"type": "boolean", "const": False})]
TokenId = Annotated[int, Field(ge=0, description="a token id, below the model's vocabulary size")]
NonEmptyText = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    """Unknown keys refused; no conversions between JSON types."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------- shared fields


class StreamOptions(Strict):
    include_usage: bool | None = Field(None, description="end the stream with a chunk holding the usage")
    include_obfuscation: bool | None = Field(None, description="accepted with no effect: nothing is padded")


class JSONSchemaFormat(Strict):
    name: NonEmptyText
    description: str | None = None
    strict: bool | None = Field(None, description="accepted; the output always follows the schema")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema (absent: any JSON)")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, description="with type 'json_schema' only")


TOKEN_ID_TEXT = r"^[0-9]{1,20}$"  # ASCII digits: str.isdigit() takes "²" (int() refuses it) and "١٢" (read as 12)
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule
PATTERNS = {TOKEN_ID_TEXT: "should be a token id written in ASCII digits",
            FUNCTION_NAME: "should be 1 to 64 letters, digits, '_' or '-'"}  # the rules in words, for errors
LogitBiasKey = Annotated[str, Field(pattern=TOKEN_ID_TEXT)]


class SamplingFields(Strict):
    """The fields both endpoints take."""

    model: str = Field(description="the served model's name (404 for another)")
    max_tokens: Int(ge=1, description="tokens to generate at most (default: the server's --max-tokens)") | None = None
    max_completion_tokens: Int(ge=1, description="the newer name of max_tokens; both given: equal") | None = None
    temperature: Number(0, 2, f"0 (greedy) or in [{MIN_TEMPERATURE:g}, 2]") | None = None
    top_p: Number(MIN_TOP_P, 1) | None = None
    top_k: Int(ge=0, le=MAX_TOP_K, description="0 = off (nanoserve)") | None = None
    repetition_penalty: Number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, "HF's rule (nanoserve)") | None = None
    presence_penalty: Number(-2, 2) | None = None
    frequency_penalty: Number(-2, 2) | None = None
    logit_bias: dict[LogitBiasKey, Number(-100, 100)] | None = Field(
        None, description="token id (ASCII digits) -> bias added to its logit")
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"a string or up to {MAX_STOP} (OpenAI takes 4)")
    seed: Int(ge=SEED_MIN, le=SEED_MAX) | None = None
    n: Int(ge=1, le=MAX_N, description="choices per prompt") | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="with stream: true only")
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, description="no effect")
    ignore_eos: bool | None = Field(None, description="go on past EOS (nanoserve)")
    priority: Int(ge=INT64_MIN, le=INT64_MAX, description="lower runs first; needs --scheduling-policy "
                                                           "priority (nanoserve)") | None = None
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="disaggregated serving, between the proxy and a --role prefill or decode instance (nanoserve)")
    session_id: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="a conversation whose KV the server keeps between turns (or the X-Session-Id header; "
                          "nanoserve, docs/agents.md)")


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: (NonEmptyText | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmptyText], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]) = Field(
        description="a string, a list of token ids, or a non-empty list of either (one choice each)")
    logprobs: Int(ge=0, le=MAX_LOGPROBS, description="alternatives per position") | None = None
    echo: bool | None = Field(None, description="the prompt in front of the text")
    best_of: Int(ge=1, le=MAX_N, description="equal to n only") | None = None


# ------------------------------------------------------------------------------------ chat


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="a JSON object, written as a string")


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class SystemMessage(Strict):
    role: Literal["system"]
    content: Content


class UserMessage(Strict):
    role: Literal["user"]
    content: Content


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="null only beside tool_calls")
    tool_calls: list[ToolCall] | None = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class Function(Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = Field(None, description="logprobs of the chosen tokens")
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS, description="with logprobs: true only") | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(None, description="no effect")
    safety_identifier: str | None = Field(None, description="no effect")
    prompt_cache_key: str | None = Field(None, description="no effect: the prefix cache keys by content")
    store: FalseOnly | None = Field(None, description="false only: nothing is stored")
    service_tier: Literal["auto", "default"] | None = Field(None, description="one tier (see priority)")
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = Field(
        None, description='["text"] only')
    server_tools: bool | None = Field(None, description="false: keep the server's own tools (GET /v1/tools) out of "
                                                        "this request (nanoserve, docs/agents.md)")


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


# ---------------------------------------------------------------------------- errors


def first_error(error: ValidationError, body: Any) -> tuple[str, str]:
    """A ValidationError -> (param, message) in the server's words: `'temperature' should be less
    than or equal to 2, got 3`. The param is the field's path in the body (`messages[0].content`),
    without the names Pydantic gives the branches of a union. A union reports one error per
    branch; the deepest one is the most telling (`prompt[1][0]` rather than "`prompt` is not a
    string")."""
    errors = [(e, _path(body, e["loc"])) for e in error.errors(include_url=False)]
    first, param = max(errors, key=lambda ep: ep[1].count(".") + ep[1].count("["))
    rules = []
    for e, path in errors:
        rule = PATTERNS.get((e.get("ctx") or {}).get("pattern"), e["msg"])
        if path == param and rule not in rules:
            rules.append(rule)
    where = f"'{param}'" if param else "the request body"
    if first["type"] == "missing":
        return param, f"{where} is required"
    rule = " or ".join(r[0].lower() + r[1:] for r in rules).replace("input should", "should")
    got = repr(first["input"])
    return param, f"{where} {rule}, got {got if len(got) <= 80 else got[:77] + '...'}"


def _path(body: Any, loc: tuple) -> str:
    """A Pydantic location -> the field's path in the body; items that are not keys of the body
    (the labels of union branches) are left out."""
    path, value = "", body
    for item in loc:
        if isinstance(value, list) and isinstance(item, int) and item < len(value):
            path, value = f"{path}[{item}]", value[item]
        elif isinstance(value, dict) and item in value:
            path, value = f"{path}.{item}" if path else str(item), value[item]
        elif isinstance(value, dict) and isinstance(item, str) and not _branch_label(item):
            path, value = f"{path}.{item}" if path else item, None  # a missing key
    return path


def _branch_label(item: str) -> bool:
    """Pydantic names a union's branches after their types or tags: 'str', 'list[int]',
    'function-after[...]', 'NamedToolChoice', 'user' (a message role). No field of a request is
    named so; keys of the body that are (in `metadata`) were matched before this is asked."""
    return (item in ("str", "int", "float", "bool", "dict", "system", "user", "assistant", "tool")
            or item[:1].isupper() or any(c in item for c in "[]-"))


# ---------------------------------------------------------------------------- the published schema


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its body is `model`. The handlers read the body themselves
    (within the limits of `protocol.load_json`, which FastAPI's own parsing does not have), so
    FastAPI cannot see the model from the handler's signature: this says it instead."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_request_models(openapi: dict) -> dict:
    """The OpenAPI document FastAPI generated, with the request models under components/schemas."""
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return openapi
