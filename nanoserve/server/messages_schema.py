"""Issue 38: the bodies of Anthropic's Messages API as Pydantic models, published in /openapi.json
(so a generated client, a fuzzer or the /docs page sees every field /v1/messages takes).

They say exactly what nanoserve/server/messages_request.py accepts, in shape: its hand-written
checks run first (their messages say more: why `thinking` or an image block is refused), then the
body is validated against these models (`check_schema`), so that nothing the published schema
refuses is taken. What a schema cannot say is checked later, by the chat endpoint's functions:
the context length, a `tool_choice` naming a tool that is not in `tools`, two tools of one name,
whether the chat template takes tools, whether a tool's schema can constrain a call.

As on the OpenAI side the models are strict (a string is not a number, `true` is not 1, but a
whole-number float such as `16.0` counts as an integer: JSON Schema says so, and JSON encoders
write them), a top-level `null` counts as absent, and an unknown field is refused, `null` or not.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError
from pydantic.json_schema import models_json_schema

from nanoserve.sampling.params import MAX_TOP_K, MIN_TEMPERATURE, MIN_TOP_P
from nanoserve.server.protocol import APIError
from nanoserve.server.schema import FUNCTION_NAME, MAX_STOP, Int, NonEmptyText, Number, Strict, first_error

CacheControl = Annotated[dict[str, Any] | None, Field(description="a hint for Anthropic's cache: no effect here "
                                                                  "(the prefix cache is automatic)")]


def tagged(*models: type[BaseModel]) -> Any:
    """A union of `models` chosen by the value's `type` (each model's `type` is a Literal): a body
    with no such type fails as one error, not one per branch. The branches are tagged with the
    models' names, which `schema.first_error` leaves out of a field's path (the `type` values,
    such as "text", could be mistaken for keys)."""
    by_type = {m.model_fields["type"].annotation.__args__[0]: m.__name__ for m in models}

    def which(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return by_type.get(kind) if isinstance(kind, str) else None

    branches = [Annotated[m, Tag(m.__name__)] for m in models]
    rule = "should be an object whose 'type' is " + " or ".join(repr(t) for t in by_type)
    return Annotated[Union[tuple(branches)], Discriminator(which, custom_error_type="tagged_union",  # noqa: UP007
                                                           custom_error_message=rule)]


# ------------------------------------------------------------------------- content blocks


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = Field(None, description="accepted; not read")


class ToolUseBlock(Strict):
    """A call the assistant made, in the conversation's history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(description="the call's arguments")
    cache_control: CacheControl = None


class ToolResultBlock(Strict):
    """The answer to a tool_use block (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(description="the id of the tool_use block this answers")
    content: str | list[TextBlock] = Field("", description="a string or text blocks (no images)")
    is_error: bool = Field(False, description="true: the text reaches the model after 'Error: '")
    cache_control: CacheControl = None


class AnthropicUserMessage(Strict):
    role: Literal["user"]
    content: str | list[tagged(TextBlock, ToolResultBlock)]


class AnthropicAssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | list[tagged(TextBlock, ToolUseBlock)]


Message = Annotated[AnthropicUserMessage | AnthropicAssistantMessage, Field(discriminator="role")]


# ------------------------------------------------------------------------- tools


class ToolDefinition(Strict):
    """A client tool: the model asks for a call, the client runs it (no server tools)."""

    type: Literal["custom"] = "custom"
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the tool's input")
    cache_control: CacheControl = None


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = Field(False, description="true: one call at most")


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = Field(False, description="true: one call at most")


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str = Field(description="the tool to call, one of 'tools'")
    disable_parallel_tool_use: bool = Field(False, description="true: one call at most")


class ToolChoiceNone(Strict):
    type: Literal["none"]


class MessagesMetadata(Strict):
    user_id: str | None = Field(None, description="no effect")


# ------------------------------------------------------------------------- the requests


class CountTokensRequest(Strict):
    """`POST /v1/messages/count_tokens`: the body of a /v1/messages request, `max_tokens` optional
    (and not read)."""

    model: str = Field(description="the served model's name (404 for another)")
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Int(ge=1, description="not read here") | None = None
    system: str | list[TextBlock] | None = Field(None, description="the system prompt")
    stop_sequences: Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = None
    temperature: (Annotated[float, Field(ge=0, le=0)] | Number(MIN_TEMPERATURE, 1)) | None = Field(
        None, description=f"0 (greedy) or in [{MIN_TEMPERATURE:g}, 1]; default 1")
    top_p: Number(MIN_TOP_P, 1) | None = None
    top_k: Int(ge=0, le=MAX_TOP_K, description="0 = off") | None = None
    stream: bool | None = None
    metadata: MessagesMetadata | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: tagged(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone) | None = Field(
        None, description="without 'tools': absent, auto or none only")
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="one tier")
    speed: Literal["standard"] | None = Field(None, description="one speed")
    cache_control: CacheControl = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: Int(ge=1, description="tokens to generate at most (required)")


MESSAGES_REQUEST_MODELS = (MessagesRequest, CountTokensRequest)


def check_schema(body: dict, model: type[BaseModel]) -> None:
    """The last check of a body's shape: it fits its published model, or a 400 naming the field."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        param, message = first_error(e, body)
        raise APIError(400, message, param=param or None) from None


def add_messages_models(openapi: dict) -> dict:
    """The OpenAPI document with this module's request models under components/schemas."""
    _, defs = models_json_schema([(m, "validation") for m in MESSAGES_REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return openapi
