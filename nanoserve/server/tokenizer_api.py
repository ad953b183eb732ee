"""Issue 30: the served model's tokenizer over HTTP, so that a client needs no copy of it.

    POST /tokenize        text (or chat messages, through the chat template) -> token ids
    POST /detokenize      token ids -> text
    GET  /tokenizer_info  the special tokens, the chat template, the context length

An evaluation harness scoring log-likelihoods must count tokens exactly as the server does: where
the context ends and the continuation starts. lm-evaluation-harness (0.4.10 and later) asks the
server, when these routes exist, instead of loading a HuggingFace tokenizer by the model's name
(`tokenizer_backend="remote"`, chosen on its own by `local-completions`: docs/openai_api.md,
"Tokenizer endpoints"). The paths and field names are vLLM's, which lm-eval targets: it derives
the paths from the completions URL by cutting off `/v1/completions`, so they sit at the root,
not under `/v1/`; and it sends no `model` (vLLM's `model` is optional here).

The bodies are checked as the other endpoints' are: read within the size limit and the limits of
`protocol.load_json`, then validated against the models below (published in /openapi.json), then
what a schema cannot say (token ids below the vocabulary size).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema

from nanoserve.server.handlers import ServerState, read_json
from nanoserve.server.models import ServedModel
from nanoserve.server.protocol import (
    APIError,
    template_messages,
)
from nanoserve.server.schema import FalseOnly, Message, Strict, TokenId, first_error, request_body

# The routes' paths, at the root (lm-eval derives them from the completions URL). Behind the API
# key like every path but /health and /metrics (a client with the key sends it: lm-eval's `auth_token`).
TOKENIZE_PATH, DETOKENIZE_PATH, TOKENIZER_INFO_PATH = "/tokenize", "/detokenize", "/tokenizer_info"

MODEL_FIELD = Field(None, description="a served model's name (404 for another); optional, as in vLLM (the first "
                                      "model served when left out)")
RETURN_TOKEN_STRS = Field(None, description="also return each token as the tokenizer spells it ('token_strs')")


class TokenizeCompletionRequest(Strict):
    """`POST /tokenize` with text."""

    model: str | None = MODEL_FIELD
    prompt: str = Field(description="the text to tokenize (may be empty)")
    add_special_tokens: bool | None = Field(
        None, description="add the tokens the tokenizer adds by itself, such as BOS (default true, as "
                          "/v1/completions does for a text prompt)")
    return_token_strs: bool | None = RETURN_TOKEN_STRS


class TokenizeChatRequest(Strict):
    """`POST /tokenize` with chat messages: the prompt /v1/chat/completions would build of them."""

    model: str | None = MODEL_FIELD
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: bool | None = Field(
        None, description="end with the assistant's header, as a chat request does (default true)")
    # The chat template writes the special tokens itself: adding the tokenizer's own on top would
    # double the BOS. vLLM's default is false too; true is refused rather than ignored.
    add_special_tokens: FalseOnly | None = Field(None, description="false only: the template writes them")
    return_token_strs: bool | None = RETURN_TOKEN_STRS


class DetokenizeRequest(Strict):
    """`POST /detokenize`."""

    model: str | None = MODEL_FIELD
    tokens: list[TokenId] = Field(description="token ids, each below the model's vocabulary size")


TOKENIZER_REQUEST_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)


# ---------------------------------------------------------------------------- the handlers


async def tokenize(state: ServerState, request: Request) -> JSONResponse:
    """`POST /tokenize`: `{"tokens", "count", "max_model_len", "token_strs"}`, vLLM's response.
    Nothing is refused for length: `count` and `max_model_len` let the client judge. The work runs
    on a tokenizer thread (issue 38), not on the event loop."""
    body = await read_json(state, request, model_required=False)
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise APIError(400, "send 'prompt' (text) or 'messages' (a chat), not both", param="messages")
    if chat:
        if body.get("add_special_tokens") is True:
            raise APIError(400, "'add_special_tokens' must be false with 'messages': the chat template writes the "
                                "special tokens itself", param="add_special_tokens")
        req = validated(TokenizeChatRequest, body, TOKENIZE_PATH)
    else:
        if body.get("prompt") is None:
            raise APIError(400, "'prompt' (text) or 'messages' (a chat) is required", param="prompt")
        req = validated(TokenizeCompletionRequest, body, TOKENIZE_PATH)
    async with state.models.use(req.model or state.models.default) as model:
        ids, strs = await state.off_loop(token_ids, model.engine.tokenizer, req, body.get("messages"))
        # A JSONResponse, not a dict: FastAPI would walk a dict's 100,000 ids one by one in Python
        # (jsonable_encoder, 80 ms for 60,000 on 2 cores), on the event loop; json.dumps takes 15 ms.
        return JSONResponse({"count": len(ids), "max_model_len": model.engine.max_model_len, "tokens": ids,
                             "token_strs": strs})


def token_ids(tokenizer, req: TokenizeCompletionRequest | TokenizeChatRequest,
              messages: list | None) -> tuple[list[int], list[str] | None]:
    """/tokenize's work: (the token ids of the text or of the chat `messages` as the body has them,
    their strings when asked for)."""
    if isinstance(req, TokenizeChatRequest):
        messages = template_messages(messages, tokenizer.takes_tools)  # content parts joined, as chat does
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False)
        except ValueError as e:  # no chat template
            raise APIError(400, str(e), param="messages") from None
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return ids, tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None


async def detokenize(state: ServerState, request: Request) -> dict:
    """`POST /detokenize`: `{"prompt": text}`. Special tokens are kept (`<|begin_of_text|>`
    spelled out), so that the text tokenizes back to the same ids: lm-eval decodes a
    log-likelihood request's ids to text when it sends text."""
    body = await read_json(state, request, model_required=False)
    req = validated(DetokenizeRequest, body, DETOKENIZE_PATH)
    async with state.models.use(req.model or state.models.default) as model:
        vocab_size = model.engine.vocab_size
        for i, token in enumerate(req.tokens):
            if token >= vocab_size:
                raise APIError(400, f"'tokens[{i}]' must be a token id in [0, {vocab_size}), got {token}",
                               param=f"tokens[{i}]")
        text = await state.off_loop(model.engine.tokenizer.decode, req.tokens, False)
        return {"prompt": text}


async def tokenizer_info(state: ServerState) -> dict:
    """`GET /tokenizer_info`: what a client needs to tokenize as the server does (the first model's
    tokenizer, with several). vLLM answers with the tokenizer's whole configuration (its
    tokenizer_config.json, every added token included); this is the part clients read, under the
    same names, plus the ids."""
    async with state.models.use(state.models.default) as model:
        return tokenizer_facts(model)


def tokenizer_facts(model: ServedModel) -> dict:
    tokenizer = model.engine.tokenizer
    hf = tokenizer.hf
    info = {"tokenizer_class": type(hf).__name__}
    for name in ("bos", "eos", "pad", "unk"):  # text (what lm-eval reads) and id of each special token
        info[f"{name}_token"] = getattr(hf, f"{name}_token")
        info[f"{name}_token_id"] = getattr(hf, f"{name}_token_id")
    bos = tokenizer.bos_token_id
    info["add_bos_token"] = bos is not None and tokenizer.encode("")[:1] == [bos]  # what /tokenize adds by default
    # The server's context length, under both names: tokenizer_config.json's `model_max_length`
    # is often a placeholder (1e30); this one is what the server holds requests to.
    info["model_max_length"] = info["max_model_len"] = model.engine.max_model_len
    info["vocab_size"] = model.engine.vocab_size
    info["chat_template"] = hf.get_chat_template() if hf.chat_template else None
    return info


# ---------------------------------------------------------------------------- reading a body


def validated(model: type[BaseModel], body: dict, path: str,
              docs: str = 'docs/openai_api.md, "Tokenizer endpoints"') -> BaseModel:
    """The body as `model`, or a 400 naming the first field at fault (`schema.first_error`).
    `null` counts as absent, as everywhere in this API, but an unknown field is refused even
    when it is null (the published schema has no such field: found by the fuzz)."""
    for name in body:  # said plainly, as `protocol.check_fields` says it for /v1/*
        if name not in model.model_fields:
            raise APIError(400, f"unknown field '{name}': {path} does not take it, and this server refuses what "
                                f"it would otherwise ignore ({docs})", param=name)
    body = {name: value for name, value in body.items() if value is not None}
    try:
        return model.model_validate(body)
    except ValidationError as e:
        param, message = first_error(e, body)
        raise APIError(400, message, param=param or None) from None


# ---------------------------------------------------------------------------- the published schema


def request_body_one_of(*models: type[BaseModel]) -> dict:
    """A route's `openapi_extra` whose body is one of `models` (`schema.request_body` for one)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_tokenizer_models(openapi: dict) -> dict:
    """The OpenAPI document with this module's request models under components/schemas (next to
    those `schema.add_request_models` adds; the message models they share come out the same)."""
    _, defs = models_json_schema([(m, "validation") for m in TOKENIZER_REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return openapi


def add_routes(app, state) -> None:
    """The tokenizer, for clients that must count tokens as the server does (lm-eval's remote
    tokenizer): at the root, where vLLM serves them and lm-eval looks."""
    @app.post(TOKENIZE_PATH, openapi_extra=request_body_one_of(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize_endpoint(request: Request):
        return await tokenize(state, request)

    @app.post(DETOKENIZE_PATH, openapi_extra=request_body(DetokenizeRequest))
    async def detokenize_endpoint(request: Request):
        return await detokenize(state, request)

    @app.get(TOKENIZER_INFO_PATH)
    async def tokenizer_info_endpoint():
        return await tokenizer_info(state)
