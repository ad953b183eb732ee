"""Week 23: LoRA adapters loaded and unloaded while the server runs (vLLM's routes and fields).

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": FOLDER}  -> NAME serves as a `model`
    POST /v1/unload_lora_adapter  {"lora_name": NAME}

Behind the API key like every path but /health and /metrics: the load route reads a folder of the
server's own disk. An adapter is checked as at start-up (`nanoserve.model.lora.read_adapter`), and
every reason to refuse is a 400 with one line saying why; unloading an adapter that requests still
use is refused too (they would lose it mid-answer). The change runs on the engine thread, between
two steps.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import Field
from pydantic.json_schema import models_json_schema

from nanoserve.server.handlers import ServerState, read_json
from nanoserve.server.protocol import APIError
from nanoserve.server.schema import Strict, request_body
from nanoserve.server.tokenizer_api import validated

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
DOCS = "docs/lora.md"  # where an unknown field's error points


class LoadLoRAAdapterRequest(Strict):
    """`POST /v1/load_lora_adapter`."""

    lora_name: str = Field(min_length=1, description="the name requests give as their 'model'")
    lora_path: str = Field(min_length=1, description="a PEFT adapter folder on the server (adapter_config.json, "
                                                     "adapter_model.safetensors)")


class UnloadLoRAAdapterRequest(Strict):
    """`POST /v1/unload_lora_adapter`."""

    lora_name: str = Field(min_length=1, description="the adapter to unload")


LORA_REQUEST_MODELS = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)


async def load_adapter(state: ServerState, request: Request) -> dict:
    body = await read_json(state, request, model_required=False)
    req = validated(LoadLoRAAdapterRequest, body, LOAD_PATH, DOCS)
    if req.lora_name in state.models.names:
        raise APIError(400, f"'{req.lora_name}' is the served model's name: pick another", param="lora_name")
    async with state.models.use(only_model(state)) as model:
        await change(model.engine.load_lora(req.lora_name, req.lora_path), req.lora_name)
    return {"object": "lora_adapter", "id": req.lora_name, "loaded": True}


async def unload_adapter(state: ServerState, request: Request) -> dict:
    body = await read_json(state, request, model_required=False)
    req = validated(UnloadLoRAAdapterRequest, body, UNLOAD_PATH, DOCS)
    async with state.models.use(only_model(state)) as model:
        if req.lora_name not in model.engine.lora_names:
            raise APIError(404, f"no adapter '{req.lora_name}' is loaded", param="lora_name", code="model_not_found")
        await change(model.engine.unload_lora(req.lora_name), req.lora_name)
    return {"object": "lora_adapter", "id": req.lora_name, "loaded": False}


def only_model(state: ServerState) -> str:
    """The model adapters are loaded into: the server's one model (issue 38: with several, not yet)."""
    if len(state.models.names) > 1:
        raise APIError(400, "this server serves several models: loading LoRA adapters at run time needs a server "
                            "of one model (not built yet for several)", param="lora_name")
    return state.models.default


async def change(done, name: str) -> None:
    """Await a load or unload on the engine thread; what it refuses is a 400."""
    try:
        await done
    except ValueError as e:
        raise APIError(400, str(e), param="lora_name" if name in str(e) else "lora_path") from None


def add_routes(app: FastAPI, state: ServerState) -> None:
    """The two routes, on the server's app (and no adapter named as a served model: it would be unreachable)."""
    taken = set(state.models.names) & set(state.models.adapter_names())
    if taken:
        raise ValueError(f"an adapter is named {sorted(taken)[0]!r}, as the served model: rename one of them")

    @app.post(LOAD_PATH, openapi_extra=request_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request):
        return await load_adapter(state, request)

    @app.post(UNLOAD_PATH, openapi_extra=request_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request):
        return await unload_adapter(state, request)


def add_lora_models(openapi: dict) -> dict:
    """The OpenAPI document with this module's request models under components/schemas."""
    _, defs = models_json_schema([(m, "validation") for m in LORA_REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    return openapi
