"""Issue 35: the proxy of disaggregated serving, and the command that starts a pair behind it.

    client ──▶ proxy (this module, --port) ──▶ prefill instance (--role prefill): prompt, max_tokens 1
                                           ◀── first token + kv_transfer_params (transfer id, prompt ids)
                                           ──▶ decode instance (--role decode): the request + kv_transfer_params
                                           ◀── the whole answer, streamed or not, relayed as it comes

The decode instance pulls the prompt's KV from the prefill instance through their KV connector
(nanoserve/runner/kv_connector.py) before it decodes; the proxy only carries the transfer's id. A
request the pair cannot split (several choices or prompts, echo, logprobs, max_tokens 1) runs whole
on the decode instance, which is a complete engine. Failures keep their place: an unreachable
prefill instance is a 502 from the proxy; a transfer that fails or times out is the decode
instance's 502 or 504, relayed; both instances free the request's blocks; the proxy goes on serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.server.app import BODY_TIMEOUT, LOOPBACK_HOSTS, guard_options
from nanoserve.server.data_parallel import (
    cuda_available,
    end_with_parent,
    exit_on_signal,
    forwarding_app,
    replica_argv,
    stop_processes,
    visible_devices,
    visible_gpus,
    wait_healthy,
)
from nanoserve.server.handlers import MAX_BODY_BYTES
from nanoserve.server.protocol import APIError

PASSED_HEADERS = ("content-type", "cache-control", "retry-after", "x-accel-buffering")


def create_proxy(prefill_url: str, decode_url: str, timeout: float = 600.0, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT,
                 allowed_hosts=LOOPBACK_HOSTS, allowed_origins=(), public_docs: bool = False) -> FastAPI:
    """The proxy's app: the two generation routes split over the pair, /v1/models from the decode
    instance, /health from both. Clients see the proxy's address, so it applies the server's
    checks itself (`Guard`; the keyword arguments are `create_app`'s)."""
    app, client = forwarding_app("nanoserve disaggregated prefill/decode proxy", timeout, api_key=api_key,
                                 max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                                 allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                                 public_docs=public_docs)
    app.state.counts = counts = {"split": 0, "whole": 0, "prefill_unreachable": 0}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(client, prefill_url, decode_url, request, "/v1/completions", counts)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(client, prefill_url, decode_url, request, "/v1/chat/completions", counts)

    @app.get("/v1/models")
    async def models(request: Request):
        r = await get(client, decode_url + "/v1/models", request)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return await health_report(client, prefill_url, decode_url, counts)

    return app


def splittable(body: object) -> bool:
    """Whether a request can run as prefill there, decode here: one prompt, one choice, more than
    one token, nothing that needs the prompt's logits or the first token's logprob (which stay on the
    prefill instance). Anything else runs whole on the decode instance."""
    if not isinstance(body, dict) or body.get("kv_transfer_params") is not None:
        return False
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    logprobs = body.get("logprobs")  # completions: a count (0 included); chat: true or false
    return not batch and body.get("n") in (None, 1) and not body.get("echo") and max_tokens != 1 \
        and (logprobs is None or logprobs is False) and body.get("top_logprobs") is None


async def route(client: httpx.AsyncClient, prefill_url: str, decode_url: str, request: Request, path: str,
                counts: dict):
    """One request: its prompt on the prefill instance, then the rest from the decode instance,
    relayed as it comes (see the module docstring)."""
    # >>> week21: proxy-route
    raw = await request.body()
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None  # the decode instance answers the 400
    if not splittable(body):
        counts["whole"] += 1
        return await relay(client, decode_url + path, raw, headers)
    first = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    first.update(max_tokens=1, stream=False, kv_transfer_params={"send": True})
    try:
        answer = await client.post(prefill_url + path, json=first, headers=headers)
    except httpx.TransportError as e:
        counts["prefill_unreachable"] += 1
        raise APIError(502, f"the prefill instance at {prefill_url} did not answer ({type(e).__name__}); the "
                            "request did not run", code="prefill_unavailable", type_="server_error") from None
    if answer.status_code != 200:  # a bad request, a busy server: its own answer
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")
    transfer = answer.json().get("kv_transfer_params")
    counts["split" if transfer is not None else "whole"] += 1
    if transfer is None:  # it ended at its first token (a stop token): nothing to move; run it whole
        return await relay(client, decode_url + path, raw, headers)
    return await relay(client, decode_url + path, json.dumps(body | {"kv_transfer_params": transfer}).encode(),
                       headers)
    # <<< week21: proxy-route


async def relay(client: httpx.AsyncClient, url: str, content: bytes, headers: dict):
    """POST `content` to `url` and stream the answer back as it comes (SSE events included). When
    the client goes away, the upstream connection is closed, and the instance aborts the request."""
    upstream = client.build_request("POST", url, content=content, headers=headers)
    try:
        response = await client.send(upstream, stream=True)
    except httpx.TransportError as e:
        raise APIError(502, f"the decode instance at {url} did not answer ({type(e).__name__})",
                       code="decode_unavailable", type_="server_error") from None

    async def chunks():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    passed = {k: v for k, v in response.headers.items() if k.lower() in PASSED_HEADERS}
    return StreamingResponse(chunks(), status_code=response.status_code, headers=passed)


async def get(client: httpx.AsyncClient, url: str, request: Request) -> httpx.Response:
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    try:
        return await client.get(url, headers=headers, timeout=5.0)
    except httpx.TransportError as e:
        raise APIError(502, f"{url} did not answer ({type(e).__name__})", type_="server_error") from None


async def health_report(client: httpx.AsyncClient, prefill_url: str, decode_url: str, counts: dict) -> JSONResponse:
    """Both instances' own /health, and the proxy's counts. 200 only while both are up: a pair
    without its prefill instance refuses every request it would split."""
    body, up = {"requests": dict(counts)}, True
    for role, url in (("prefill", prefill_url), ("decode", decode_url)):
        try:
            r = await client.get(url + "/health", timeout=5.0)
            body[role] = dict(url=url, healthy=r.status_code == 200, **r.json())
        except (httpx.TransportError, ValueError) as e:
            body[role] = dict(url=url, healthy=False, error=f"{type(e).__name__}: {e}")
        up = up and body[role]["healthy"]
    body["status"] = "ok" if up else "degraded"
    return JSONResponse(body, status_code=200 if up else 503)


# ------------------------------------------------------------------------------ the processes


def serve_disaggregated(args, argv: list[str]) -> int:
    """`nanoserve serve --disaggregated`: a prefill instance (GPU 0) on --port + 1, a decode
    instance (GPU 1) on --port + 2, their KV connector on --kv-address, and the proxy on
    --host:--port, until interrupted; then the instances are stopped."""
    import uvicorn

    from nanoserve.server.http11 import OpenAIErrorH11Protocol

    cuda = (args.device or ("cuda" if cuda_available() else "cpu")).startswith("cuda")
    if cuda and len(visible_gpus()) < 2:
        raise SystemExit(f"nanoserve serve --disaggregated: one GPU per instance, and {len(visible_gpus())} is "
                         "visible; run the instances yourself (--role) or on the CPU (--device cpu)")
    procs, urls = [], []
    previous = signal.signal(signal.SIGTERM, exit_on_signal)  # as the data-parallel front: unwind, stop them
    try:
        for i, role in enumerate(("decode", "prefill")):  # the decode instance hosts the connector's store
            port = args.port + 2 - i
            env = dict(os.environ)
            if cuda:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(1 - i, 1)
            cmd = [sys.executable, "-m", "nanoserve.cli", *replica_argv(argv, also=("--disaggregated",)),
                   "--role", role, "--host", "127.0.0.1", "--port", str(port)]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=end_with_parent))
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(urls, procs, timeout=args.replica_start_timeout)
        decode_url, prefill_url = urls
        app = create_proxy(prefill_url, decode_url, **guard_options(args))
        print(f"nanoserve: prefill {prefill_url} + decode {decode_url} (KV over {args.kv_connector}, "
              f"{args.kv_address}) behind http://{args.host}:{args.port}", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=OpenAIErrorH11Protocol,
                    timeout_keep_alive=args.keep_alive_timeout)
    finally:
        stop_processes(procs)
        signal.signal(signal.SIGTERM, previous)
    return 0


