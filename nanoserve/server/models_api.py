"""Issue 38: operators load and unload the server's models while it runs.

    POST /v1/models/{name}/load     the model made resident (the least recently used one unloaded
                                    first when --max-loaded-models are); at once if it already is
    POST /v1/models/{name}/unload   its engine shut down, its KV pool and weights freed; 409 while
                                    requests use it (retry once they have finished)

Both answer `{"object": "model", "id": name, "loaded": true | false}`. Only the models given at
start-up can be loaded (not a new path; not an adapter: those have their own routes, week 23's).
Behind the API key, like every path but /health and /metrics, and, like every POST, sent as JSON
(an empty body will do, with `Content-Type: application/json`): a web page cannot send that
without the server's consent (CORS), so a page a user visits cannot unload the user's models.
"""

from __future__ import annotations

from fastapi import FastAPI

from nanoserve.server.handlers import ServerState
from nanoserve.server.protocol import check_model

LOAD_PATH, UNLOAD_PATH = "/v1/models/{model_id:path}/load", "/v1/models/{model_id:path}/unload"


async def load(state: ServerState, model_id: str) -> dict:
    check_model({"model": model_id}, state.models.names)
    await state.models.load(model_id)
    return {"object": "model", "id": model_id, "loaded": True}


async def unload(state: ServerState, model_id: str) -> dict:
    check_model({"model": model_id}, state.models.names)
    await state.models.unload(model_id)
    return {"object": "model", "id": model_id, "loaded": False}


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(LOAD_PATH)
    async def load_model(model_id: str):
        return await load(state, model_id)

    @app.post(UNLOAD_PATH)
    async def unload_model(model_id: str):
        return await unload(state, model_id)
