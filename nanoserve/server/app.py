"""Weeks 10-11: an OpenAI-compatible HTTP server.

    nanoserve serve --model tiny --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "The list", "max_tokens": 20}'

The server speaks HTTP and the OpenAI wire format; it knows nothing of tensors. It validates a
request, turns it into prompt token ids and `SamplingParams`, and awaits the outputs the
`AsyncEngine` (on its own thread) sends back: all at once for a plain response, chunk by chunk
as server-sent events when `stream` is true.

This module is the app's front door: the `Guard` middleware and the routes. What each route does
is a plain function in nanoserve/server/handlers.py, of a `ServerState` (the engine and the
server's settings) and the request.

Every error a client can cause comes back as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status, and the server
goes on serving. Nothing is silently ignored: a field the server does not honour is refused with
a 400 naming it (`check_fields`; docs/openai_api.md lists every field and its status).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException

from nanoserve.course.stubs import stubbed_weeks
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.server import handlers
from nanoserve.server.handlers import MAX_BODY_BYTES, ServerState
from nanoserve.server.metrics import RequestLog, ServerMetrics
from nanoserve.server.protocol import APIError
from nanoserve.server.schema import ChatCompletionRequest, CompletionRequest, add_request_models, request_body

logger = logging.getLogger("nanoserve.server")

BODY_TIMEOUT = 30.0  # seconds the server waits for each piece of a request body


class Guard:
    """Authentication and the body size limit, checked before any handler reads the body; the
    body's arrival timed (`body_timeout` seconds); and (week 16) every response's status handed to
    `on_response(path, status)`."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_response=None,
                 body_timeout: float = BODY_TIMEOUT):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.on_response, self.body_timeout = on_response, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.on_response is not None:
            inner_send = send

            async def send(message):
                if message["type"] == "http.response.start":
                    self.on_response(scope["path"], message["status"])
                await inner_send(message)

        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.api_key is not None and scope["path"].startswith("/v1/"):
                if not self.authorized(headers.get(b"authorization", b"")):
                    error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     code="invalid_api_key", type_="authentication_error")
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > self.max_body_bytes:
                error = APIError(413, f"request body larger than {self.max_body_bytes} bytes", code="body_too_large")
            if error is not None:
                await error.response()(scope, receive, send)
                return
            await self.answer_errors(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, authorization: bytes) -> bool:
        """`Authorization: Bearer <key>`, the scheme in any case (HTTP's schemes are case-insensitive),
        the key compared in constant time (`==` stops at the first wrong byte, which a patient
        attacker can time)."""
        scheme, _, key = authorization.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key.encode())

    async def answer_errors(self, scope, receive, send):
        """Run the app; an exception no handler took (a bug, not the client's fault) becomes a 500
        in OpenAI's shape here. Left to Starlette's outer error middleware, it would be re-raised to
        uvicorn after the 500, and uvicorn closes the connection: the client's next keep-alive
        request would fail too."""
        started, body_done = False, scope.get("method") in ("GET", "HEAD")

        async def timed_receive():
            # A client that sends less than its Content-Length would hold the connection forever.
            # Once the body is complete, receive() only waits for a disconnect: no limit then.
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                               code="body_timeout") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracked_send)
        except Exception as exc:
            if started:
                raise  # the response is under way: too late for an error body
            logger.exception("internal error on %s %s", scope.get("method"), scope["path"])
            message = f"internal error: {type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode()
            await APIError(500, message, type_="server_error").response()(scope, receive, send)


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = 16,
               metrics: bool | None = None, log_requests: bool = False, body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The app: routes only, each handing the request to its handler in nanoserve/server/handlers.py
    with the server's `ServerState` (also at `app.state.server`). `metrics`: serve `GET /metrics`
    (week 16; by default on, but in a learner's workspace only once week 16 is written, so that an
    earlier week's server never calls its stub: nanoserve/course/stubs.py); `log_requests`: one JSON
    line per finished request on the `nanoserve.requests` logger."""
    if metrics is None:
        metrics = 16 not in stubbed_weeks()
    app = FastAPI(title="nanoserve", version="0.1.0")
    state = ServerState(engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                        default_max_tokens=default_max_tokens, metrics=ServerMetrics(engine) if metrics else None)
    app.state.server, app.state.metrics = state, state.metrics
    if state.metrics is not None:
        engine.listeners.append(state.metrics.observe_request)
    if log_requests:
        engine.listeners.append(RequestLog())

    # A plain ASGI middleware, not @app.middleware("http"): that wrapper hides client
    # disconnects from the handlers, and we need them to abort abandoned requests.
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                       on_response=state.metrics.observe_http if state.metrics else None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException):  # 404 no such route, 405 wrong method
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response()

    @app.get("/health")
    async def health():
        return handlers.health(state)

    if state.metrics is not None:
        @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus's text format
        async def metrics_endpoint():
            return handlers.metrics_page(state)

    @app.get("/v1/models")
    async def models():
        return handlers.list_models(state)

    @app.get("/v1/models/{model_id:path}")  # :path, as a model id may hold a slash (org/name)
    async def model(model_id: str):
        return handlers.retrieve_model(state, model_id)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        return await handlers.completions(state, request)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await handlers.chat_completions(state, request)

    def openapi() -> dict:  # FastAPI's document, with the request models the routes refer to
        if app.openapi_schema is None:
            app.openapi_schema = add_request_models(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi
    return app
