"""Weeks 10-11: an OpenAI-compatible HTTP server.

    nanoserve serve --model tiny --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "The list", "max_tokens": 20}'

The server speaks HTTP and the OpenAI wire format; it knows nothing of tensors. It validates a
request, turns it into prompt token ids and `SamplingParams`, and awaits the outputs the
`AsyncEngine` (on its own thread) sends back: all at once for a plain response, chunk by chunk
as server-sent events when `stream` is true.

This module is the app's front door: the `Guard` middleware and the routes. What each route does
is a plain function in nanoserve/server/handlers.py, of a `ServerState` (the models, each with its
engine, and the server's settings) and the request. Issue 38: one server may serve several models
(nanoserve/server/models.py), each request routed to the one it names.

Every error a client can cause comes back as OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status, and the server
goes on serving. Nothing is silently ignored: a field the server does not honour is refused with
a 400 naming it (`check_fields`; docs/openai_api.md lists every field and its status).

Safe to run on a machine where a browser runs, by default: a body must be declared JSON (no web
page can send that without the server's consent), a server on loopback answers only to its own
names (no DNS rebinding), and no page of another origin may read an answer unless
`--allowed-origins` lists it (docs/openai_api.md, "Browser safety").
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import ipaddress
import logging
import re
import socket
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from nanoserve.course.stubs import stubbed_weeks
from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.server import handlers, lora_api, messages_api, models_api, tokenizer_api
from nanoserve.server.handlers import MAX_BODY_BYTES, ServerState
from nanoserve.server.messages_schema import add_messages_models
from nanoserve.server.metrics import RequestLog, ServerMetrics
from nanoserve.server.models import ModelRegistry
from nanoserve.server.protocol import APIError
from nanoserve.server.rate_limits import RateLimiter
from nanoserve.server.sessions import DEFAULT_KV_FRACTION, DEFAULT_TTL, SessionStore
from nanoserve.server.schema import ChatCompletionRequest, CompletionRequest, add_request_models, request_body
from nanoserve.server.toolbox import MAX_TOOL_ROUNDS, ToolBox, add_tools_route

logger = logging.getLogger("nanoserve.server")

BODY_TIMEOUT = 30.0  # seconds the server waits for each piece of a request body
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the Host names a loopback server answers to
OPEN_PATHS = ("/health", "/metrics")  # never behind the API key: probes and scrapers carry no secret
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")  # FastAPI's own pages
BODY_METHODS = ("POST", "PUT", "PATCH")  # methods whose body the server reads: it must be JSON
HOST_HEADER = re.compile(r"(?P<name>\[[0-9a-f:.]*\]|[^\[\]:]*)(?::[0-9]*)?")  # name[:port], name maybe [IPv6]


def host_name(value: str) -> str | None:
    """The name in a Host header, lower case and without port or brackets (`[::1]:8000` -> `::1`);
    None if the value is not a host name and port."""
    m = HOST_HEADER.fullmatch(value.strip().lower())
    return m["name"].strip("[]") if m else None


def host_names(allowed: Sequence[str] | None) -> set[str] | None:
    """`allowed` as `host_name` reads them; None (any host) for None or `*`."""
    if allowed is None or "*" in allowed:
        return None
    bad = [h for h in allowed if host_name(h) is None]
    if bad:
        raise ValueError(f"not a host name (--allowed-hosts): {', '.join(bad)}")
    return {host_name(h) for h in allowed}


def is_loopback(host: str) -> bool:
    """Whether a bind address (`--host`) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost, or 0.0.0.0 / :: (every interface)


def allowed_hosts_for(bind_host: str, extra: Sequence[str] = ()) -> list[str] | None:
    """The Host names a server bound to `bind_host` answers to (any port), None for any: the
    loopback names and `extra` for a loopback server or when `extra` is given, else any; `*` in
    `extra` switches the check off."""
    if "*" in extra:
        return None
    host_names(extra)  # a bad name fails here, at start-up, with the flag's name
    return [*LOOPBACK_HOSTS, *extra] if extra or is_loopback(bind_host) else None


def split_names(values: Sequence[str] | None) -> list[str]:
    """`--allowed-hosts a,b --allowed-hosts c` (comma-separated, repeatable) -> ["a", "b", "c"]."""
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


def guard_options(args) -> dict:
    """`Guard`'s settings from `nanoserve serve`'s flags (`args`, the parsed command line): the
    keyword arguments `create_app` and the data-parallel front's `create_front` share."""
    return dict(api_key=args.api_key, max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                allowed_hosts=allowed_hosts_for(args.host, split_names(args.allowed_hosts)),
                allowed_origins=split_names(args.allowed_origins), public_docs=args.public_docs)


def port_number(text: str) -> int:
    """argparse type of --port: a TCP port a server can listen on, refused in one line otherwise (port 0,
    which asks the system for any free port, included: the server would announce a port it is not on)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1 to 65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port a server can listen on: 1 to 65535")
    return port


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on, at once: before the model loads (seconds to minutes)
    and before "serving on ..." is printed. It binds the socket the way uvicorn will (the address family
    from the host, SO_REUSEADDR) and lets it go; a process that takes the port in between still makes
    uvicorn fail, with its own message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OverflowError:  # --port 65535 with --data-parallel-size: the replicas' ports run past the last
        raise ValueError(f"port {port} is past the last port, 65535: choose a lower --port") from None
    except OSError as e:
        what = "already in use" if e.errno == errno.EADDRINUSE else f"not available ({e.strerror})"
        raise ValueError(f"port {port} on {host} is {what}: stop what listens there, or choose another --port") from None


class CORS(CORSMiddleware):
    """Starlette's CORS middleware, its refusal of a preflight in OpenAI's error shape (its own is
    plain text). A refused preflight has no `Access-Control-Allow-Origin`: the browser stops there."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        return APIError(400, f"CORS preflight refused (not allowed: {refused}; see --allowed-origins)",
                        code="cors_not_allowed", headers={"Vary": response.headers.get("vary", "Origin")}).response()


class Guard:
    """What is checked before any handler reads the body, in this order: the `Host` header (421, a
    defence against DNS rebinding), CORS preflights (answered here when `allowed_origins` is set),
    the API key (401; on every path but `OPEN_PATHS`), the body's `Content-Type` (415) and size
    (413). Then the body's arrival is timed (`body_timeout` seconds), an exception no handler took
    becomes a 500, and (week 16) every response's status is handed to `on_response(path, status)`.

    `api_key`: a key, or several (issue 38: each client its own, and its own rate limits), or None.
    `allowed_hosts`: the Host names served (any port); None or `*` for any. `allowed_origins`: the
    web origins whose pages may call the server (CORS); none by default. `public_docs`: serve
    FastAPI's /docs, /redoc and /openapi.json without the key. `x_api_key`: take the key from an
    `x-api-key` header too, as Anthropic's clients send it (issue 38: the app's; not the fronts', which
    forward the Authorization header only)."""

    def __init__(self, app, api_key: str | Sequence[str] | None, max_body_bytes: int, on_response=None,
                 body_timeout: float = BODY_TIMEOUT, allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
                 allowed_origins: Sequence[str] = (), public_docs: bool = False, x_api_key: bool = False):
        self.app, self.max_body_bytes, self.x_api_key = app, max_body_bytes, x_api_key
        self.api_keys = [api_key.encode()] if isinstance(api_key, str) else [key.encode() for key in api_key or ()]
        self.on_response, self.body_timeout = on_response, body_timeout
        self.hosts = host_names(allowed_hosts)
        self.open_paths = OPEN_PATHS + (DOCS_PATHS if public_docs else ())
        # CORS goes after the Host check and before the key: a browser sends its preflight (OPTIONS)
        # without credentials, and the answers it may read, errors included, need CORS's headers.
        self.checked = self.check_and_run
        if allowed_origins:
            self.checked = CORS(self.check_and_run, allow_origins=list(allowed_origins),
                                allow_methods=["GET", "POST", "OPTIONS"],
                                allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version",
                                               "Anthropic-Beta"])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.on_response is not None:
            inner_send = send

            async def send(message):
                if message["type"] == "http.response.start":
                    self.on_response(scope["path"], message["status"])
                await inner_send(message)

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.host_error(dict(scope["headers"]))
        if error is not None:
            await error_response(scope, error)(scope, receive, send)
            return
        await self.checked(scope, receive, send)

    async def check_and_run(self, scope, receive, send):
        """The key, the body's type and size (each refused before a byte of the body is read); then the app."""
        headers = dict(scope["headers"])
        error = self.key_error(scope["path"], headers) or self.body_error(scope["method"], headers)
        if error is not None:
            await error_response(scope, error)(scope, receive, send)
            return
        await self.answer_errors(scope, receive, send)

    def host_error(self, headers: dict) -> APIError | None:
        """DNS rebinding: a page of evil.example, its name re-pointed at 127.0.0.1 after loading,
        reaches a loopback server as the same origin, so the browser lets it read the answers. Its
        requests still say `Host: evil.example`; a server that answers only to its own names stops it.
        421 Misdirected Request: the request may be well formed, but it was meant for another server."""
        if self.hosts is None:
            return None
        value = headers.get(b"host", b"").decode("latin-1")
        if host_name(value) in self.hosts:
            return None
        return APIError(421, f"this server does not answer to the host {value!r} (allowed: "
                             f"{', '.join(sorted(self.hosts))}; see --allowed-hosts)", code="host_not_allowed")

    def key_error(self, path: str, headers: dict) -> APIError | None:
        """With a key set, every path needs it but /health, /metrics (and the docs with `public_docs`)."""
        if not self.api_keys or path in self.open_paths or self.authorized(headers.get(b"authorization", b""),
                                                                           headers.get(b"x-api-key") if self.x_api_key else None):
            return None
        also = " or 'x-api-key: <key>'" if self.x_api_key else ""
        return APIError(401, f"invalid or missing API key (send 'Authorization: Bearer <key>'{also})",
                        code="invalid_api_key", type_="authentication_error")

    def body_error(self, method: str, headers: dict) -> APIError | None:
        """A body must say it is JSON. Why refuse one that does not, even if it parses: a web page
        may POST `text/plain` (or a form) to any address without the browser asking the server
        first (a CORS "simple request"), so a server that reads such a body runs generations for
        any site its user visits. `application/json` makes the browser ask (a preflight), and
        without --allowed-origins the answer is no. The size comes from Content-Length, before the
        body is read; a chunked body is counted as it arrives (`read_json` in handlers.py)."""
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if method in BODY_METHODS and content_type.partition(";")[0].strip().lower() != "application/json":
            got = f"got {content_type!r}" if content_type else "got none"
            return APIError(415, f"send the body as JSON with the header 'Content-Type: application/json' ({got})",
                            code="unsupported_media_type")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"request body larger than {self.max_body_bytes} bytes", code="body_too_large")
        return None

    def authorized(self, authorization: bytes, x_api_key: bytes | None = None) -> bool:
        """`Authorization: Bearer <key>`, the scheme in any case (HTTP's schemes are case-insensitive),
        or (issue 38) `x-api-key: <key>`, as Anthropic's clients send it; the key compared in constant
        time (`==` stops at the first wrong byte, which a patient attacker can time) with every key
        the server takes."""
        scheme, _, key = authorization.partition(b" ")
        if x_api_key is not None and not authorization:
            scheme, key = b"bearer", x_api_key
        matches = [hmac.compare_digest(key.strip(), known) for known in self.api_keys]  # all compared, always
        return scheme.lower() == b"bearer" and any(matches)

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
            await error_response(scope, APIError(500, message, type_="server_error"))(scope, receive, send)


def error_response(scope, error: APIError):
    """An error's response in the shape of the path's API: Anthropic's on /v1/messages (issue 38),
    OpenAI's elsewhere."""
    return messages_api.error_response(error) if messages_api.is_messages_path(scope["path"]) else error.response()


async def api_error(request: Request, exc: APIError):
    """An `APIError` raised in a route: its OpenAI-shaped response."""
    return exc.response()


async def routing_error(request: Request, exc: HTTPException):
    """Starlette's own errors (404 no such route, 405 wrong method) in OpenAI's shape (Anthropic's
    under /v1/messages)."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(request.scope, APIError(exc.status_code, message, code=code, headers=exc.headers))


def add_error_handlers(app: FastAPI) -> None:
    """Every error an app's routes raise in OpenAI's shape (the data-parallel front uses this too)."""
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, routing_error)


def server_state(engine: AsyncEngine | ModelRegistry, model_name: str | None, metrics: bool | None,
                 log_requests: bool, rate_limits: RateLimiter | None, session_ttl: float = DEFAULT_TTL,
                 session_kv_fraction: float = DEFAULT_KV_FRACTION, **settings) -> ServerState:
    """`create_app`'s `ServerState`: the models, their metrics and request log, the sessions (issue 38),
    the other `settings`."""
    if metrics is None:
        metrics = 16 not in stubbed_weeks()
    models = engine if isinstance(engine, ModelRegistry) else ModelRegistry.serving(engine, model_name)
    sessions = SessionStore(models, session_ttl, session_kv_fraction)
    state = ServerState(models, metrics=ServerMetrics(models, rate_limits, sessions) if metrics else None,
                        rate_limits=rate_limits, sessions=sessions, **settings)
    if state.metrics is not None:
        models.add_listener(state.metrics.observe_request)
    if log_requests:
        models.add_listener(RequestLog())
    return state


def create_app(engine: AsyncEngine | ModelRegistry, model_name: str | None = None, api_key: str | Sequence[str] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = 16,
               metrics: bool | None = None, log_requests: bool = False, body_timeout: float = BODY_TIMEOUT,
               allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS, allowed_origins: Sequence[str] = (),
               public_docs: bool = False, rate_limits: RateLimiter | None = None, toolbox: ToolBox | None = None,
               max_tool_rounds: int = MAX_TOOL_ROUNDS, session_ttl: float = DEFAULT_TTL,
               session_kv_fraction: float = DEFAULT_KV_FRACTION) -> FastAPI:
    """The app: routes only, each handing the request to its handler in nanoserve/server/handlers.py
    with the server's `ServerState` (also at `app.state.server`). `engine`: the engine of the one
    model served, as `model_name`; or (issue 38) a `ModelRegistry` of several. `metrics`: serve `GET
    /metrics` (week 16; by default on, but in a learner's workspace only once week 16 is written, so
    that an earlier week's server never calls its stub: nanoserve/course/stubs.py); `log_requests`: one
    JSON line per finished request on the `nanoserve.requests` logger. `allowed_hosts`,
    `allowed_origins`, `public_docs`: see `Guard` (the default hosts are right for a server on
    loopback; `allowed_hosts_for` gives them for another address). `rate_limits`: issue 38's buckets
    per API key (nanoserve/server/rate_limits.py). `toolbox`, `max_tool_rounds`: issue 38's server tools.
    `session_ttl`, `session_kv_fraction`: issue 38's sessions (nanoserve/server/sessions.py), always on:
    a request without a session id has none."""
    state = server_state(engine, model_name, metrics, log_requests, rate_limits, session_ttl, session_kv_fraction,
                         api_key=api_key, max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens,
                         toolbox=toolbox, max_tool_rounds=max_tool_rounds)
    app = FastAPI(title="nanoserve", version="0.1.0", lifespan=state.lifespan)
    app.state.server, app.state.metrics = state, state.metrics

    # A plain ASGI middleware, not @app.middleware("http"): that wrapper hides client
    # disconnects from the handlers, and we need them to abort abandoned requests.
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                       on_response=state.metrics.observe_http if state.metrics else None,
                       allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, public_docs=public_docs,
                       x_api_key=True)
    add_error_handlers(app)

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

    tokenizer_api.add_routes(app, state)  # /tokenize, /detokenize, /tokenizer_info
    add_tools_route(app, state.toolbox)  # issue 38: GET /v1/tools
    lora_api.add_routes(app, state)  # week 23: load and unload adapters
    models_api.add_routes(app, state)  # issue 38: load and unload models
    messages_api.add_routes(app, state)  # issue 38: Anthropic's Messages API

    def openapi() -> dict:  # FastAPI's document, with the request models the routes refer to
        if app.openapi_schema is None:
            app.openapi_schema = add_messages_models(lora_api.add_lora_models(
                tokenizer_api.add_tokenizer_models(add_request_models(FastAPI.openapi(app)))))
        return app.openapi_schema

    app.openapi = openapi
    return app
