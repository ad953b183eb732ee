"""Week 18: data parallelism, whole replicas of the engine behind one address.

Tensor parallelism makes one engine faster (and able to hold a bigger model); data parallelism
makes more engines. Each replica is a complete `nanoserve serve` process with its own GPU(s)
(`--tensor-parallel-size` of them), its own scheduler and its own KV cache; replicas share
nothing and never talk to each other, so N replicas serve N times the traffic, as long as the
traffic is spread well. That is the front's one job:

    client ──▶ front (this module, --port) ──▶ replica 0 (127.0.0.1:port+1, GPUs 0..tp-1)
                                           └─▶ replica 1 (127.0.0.1:port+2, GPUs tp..2tp-1)   ...

The front sends each request to the replica with the fewest *outstanding tokens*: the prompt
tokens and max_tokens of every request it has sent there and not yet seen finish. Counting
requests instead would treat a 4-token question like a 4,000-token document; counting tokens
approximates the work each replica has queued. (The prompt is measured with the model's own
tokenizer; chat messages by their text, without the template: an estimate is all routing needs.)

In production the same shape is usually built from standard parts: several `nanoserve serve`
processes behind a load balancer such as nginx (docs/data_parallel.md has a configuration).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.server.app import (
    BODY_TIMEOUT,
    LOOPBACK_HOSTS,
    Guard,
    add_error_handlers,
    guard_options,
)
from nanoserve.server.handlers import MAX_BODY_BYTES
from nanoserve.server.protocol import APIError

ROUTED = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Replica:
    url: str
    outstanding: int = 0  # tokens of the requests sent and not yet finished
    in_flight: int = 0
    healthy: bool = True
    sent: int = 0  # requests sent, in all
    error: str | None = None


@dataclass
class Router:
    """Picks a replica for each request and keeps the counts."""

    replicas: list[Replica]
    _ties: itertools.count = field(default_factory=itertools.count)

    def pick(self, tokens: int) -> Replica:
        """The healthy replica with the fewest outstanding tokens (ties taken in turn); its count
        grows by `tokens` until `done` is called."""
        # >>> week18: route
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise LookupError("no replica is healthy")
        fewest = min(r.outstanding for r in healthy)
        tied = [r for r in healthy if r.outstanding == fewest]
        chosen = tied[next(self._ties) % len(tied)]
        chosen.outstanding += tokens
        chosen.in_flight += 1
        chosen.sent += 1
        return chosen
        # <<< week18: route

    def done(self, replica: Replica, tokens: int) -> None:
        replica.outstanding -= tokens
        replica.in_flight -= 1


def estimate_tokens(body: dict, count) -> int:
    """What a request will cost a replica, in tokens: its prompt(s) and max_tokens, times n.
    `count(text)` measures a text in tokens."""
    if "messages" in body:
        texts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [p.get("text", "") for p in content if isinstance(p, dict)]
        prompts = [sum(count(t) for t in texts)]
    else:
        prompt = body.get("prompt", "")
        items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        prompts = [len(p) if isinstance(p, list) else count(p) if isinstance(p, str) else 0 for p in items]
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
    max_tokens = max_tokens if isinstance(max_tokens, int) else 16  # (a bad value: the replica answers 400)
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    return sum(p + max_tokens for p in prompts) * n


def forwarding_app(title: str, timeout: float, **guard) -> tuple[FastAPI, httpx.AsyncClient]:
    """An app that forwards to other servers (the data-parallel front, the disaggregated proxy):
    the single server's checks (`Guard`, with `create_app`'s keyword arguments), its error shapes
    (404, 405, and the Guard's 408 raised while a body is read), and one HTTP client, closed with
    the app."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title=title, lifespan=lifespan)
    app.add_middleware(Guard, **guard)
    add_error_handlers(app)
    return app, client


def create_front(replica_urls: list[str], count=None, timeout: float = 600.0, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT,
                 allowed_hosts=LOOPBACK_HOSTS, allowed_origins=(), public_docs: bool = False) -> FastAPI:
    """The front's app: /v1/completions and /v1/chat/completions routed (streamed through as
    they come), /v1/models and /v1/models/{id} from the first healthy replica, /health summing
    them all up. The address clients see is the front's, so it applies the single server's
    checks itself (the same `Guard`: Host, CORS, key, Content-Type, body size; the keyword
    arguments are `create_app`'s), and its own errors come in the same OpenAI shape."""
    app, client = forwarding_app("nanoserve data-parallel front", timeout, api_key=api_key,
                                 max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                                 allowed_hosts=allowed_hosts, allowed_origins=allowed_origins,
                                 public_docs=public_docs)
    router = Router([Replica(u) for u in replica_urls])
    app.state.router = router
    count = count or (lambda text: max(1, len(text) // 4))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(client, router, count, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(client, router, count, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        return await first_healthy_models(client, router, request)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return await first_healthy_models(client, router, request, "/v1/models/" + urllib.parse.quote(model_id))

    @app.get("/health")
    async def health():
        return await health_report(client, router)

    return app


def no_replica() -> JSONResponse:
    return APIError(503, "no replica is healthy (see /health)", code="no_healthy_replica",
                    type_="server_error").response()


async def forward(client: httpx.AsyncClient, router: Router, count, request: Request, path: str):
    """Send the request to the replica `router` picks (its cost in tokens measured by
    `count(text)`), and stream the answer back as it comes. A replica that cannot be reached is
    marked unhealthy, and the next one is tried."""
    # >>> week18: front
    raw = await request.body()
    try:
        body = json.loads(raw)
        tokens = estimate_tokens(body, count) if isinstance(body, dict) else 1
    except (ValueError, RecursionError, TypeError):  # not JSON, too deep, a 5,000-digit number, bad Unicode
        tokens = 1  # the replica answers the 400
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
    while True:
        try:
            replica = router.pick(tokens)
        except LookupError:
            return no_replica()
        upstream = client.build_request("POST", replica.url + path, content=raw, headers=headers)
        try:
            response = await client.send(upstream, stream=True)
            break
        except httpx.TransportError as e:  # the replica is gone: take it out, try another
            router.done(replica, tokens)
            replica.healthy, replica.error = False, f"{type(e).__name__}: {e}"

    async def relay():
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()
            router.done(replica, tokens)

    passed = {k: v for k, v in response.headers.items()
              if k.lower() in ("content-type", "cache-control", "retry-after", "x-accel-buffering")}
    passed["x-nanoserve-replica"] = str(router.replicas.index(replica))
    return StreamingResponse(relay(), status_code=response.status_code, headers=passed)
    # <<< week18: front


async def first_healthy_models(client: httpx.AsyncClient, router: Router, request: Request,
                               path: str = "/v1/models"):
    """`GET /v1/models` (or `path`, one model of it), as the first healthy replica answers it."""
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    for replica in router.replicas:
        if replica.healthy:
            try:
                r = await client.get(replica.url + path, headers=headers)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            except httpx.TransportError:
                continue
    return no_replica()


async def health_report(client: httpx.AsyncClient, router: Router) -> JSONResponse:
    """Every replica's own /health, and the front's counts. 200 while one replica is up."""
    states = []
    for i, replica in enumerate(router.replicas):
        try:
            r = await client.get(replica.url + "/health", timeout=5.0)
            replica.healthy, replica.error = r.status_code == 200, None if r.status_code == 200 else r.text
        except httpx.TransportError as e:
            replica.healthy, replica.error = False, f"{type(e).__name__}: {e}"
        states.append(dict(replica=i, url=replica.url, healthy=replica.healthy, error=replica.error,
                           outstanding_tokens=replica.outstanding, in_flight=replica.in_flight,
                           requests_sent=replica.sent))
    up = sum(s["healthy"] for s in states)
    body = {"status": "ok" if up == len(states) else "degraded" if up else "failed", "replicas": states}
    return JSONResponse(body, status_code=200 if up else 503)


# ------------------------------------------------------------------------------ the processes


def replica_argv(argv: list[str], also: tuple[str, ...] = ()) -> list[str]:
    """`nanoserve serve` options for a replica: the front's, less --data-parallel-size, --host
    and --port (each replica gets its own loopback port), and less the flags (without a value)
    named in `also`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--data-parallel-size", "-dp", "--host", "--port"):
            skip = "=" not in a
            continue
        if name in also:
            continue
        out.append(a)
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES, else 0, 1, 2, ...)."""
    import torch

    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return seen.split(",") if seen else [str(i) for i in range(torch.cuda.device_count())]


def visible_devices(index: int, per_replica: int) -> str:
    """The GPUs replica `index` may see: the index-th group of `per_replica` of those this
    process sees (CUDA_VISIBLE_DEVICES, else 0, 1, 2, ...)."""
    ids = visible_gpus()
    mine = ids[index * per_replica : (index + 1) * per_replica]
    if len(mine) < per_replica:
        raise ValueError(f"replica {index} needs {per_replica} GPU(s) but only {len(ids)} are visible for "
                         f"--data-parallel-size x --tensor-parallel-size")
    return ",".join(mine)


def serve_data_parallel(args, argv: list[str]) -> int:
    """`nanoserve serve --data-parallel-size N`: start N replicas, wait until all are healthy,
    run the front on --host:--port until interrupted, then stop them."""
    import uvicorn

    from nanoserve.engine.tokenizer import Tokenizer
    from nanoserve.server.http11 import OpenAIErrorH11Protocol

    n = args.data_parallel_size
    tp = args.tensor_parallel_size * args.pipeline_parallel_size * args.expert_parallel_size  # GPUs per replica
    cuda = (args.device or ("cuda" if cuda_available() else "cpu")).startswith("cuda")
    procs, urls = [], []
    # SIGTERM (docker stop, systemd, kubernetes) must end the replicas too. Its default action kills
    # this process on the spot, skipping `finally`; and uvicorn, which handles it while it serves,
    # raises it again once it has shut down. Raised as SystemExit instead, it unwinds to `finally`.
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        for i in range(n):
            port = args.port + 1 + i
            env = dict(os.environ)
            if cuda:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(i, tp)
            cmd = [sys.executable, "-m", "nanoserve.cli", *replica_argv(argv), "--host", "127.0.0.1", "--port", str(port)]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=end_with_parent))
            urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(urls, procs, timeout=args.replica_start_timeout)
        tokenizer = Tokenizer(args.model)
        app = create_front(urls, count=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                           **guard_options(args))
        print(f"nanoserve: {n} replicas ({', '.join(urls)}) behind http://{args.host}:{args.port}", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=OpenAIErrorH11Protocol,
                    timeout_keep_alive=args.keep_alive_timeout)
    finally:
        stop_processes(procs)
        signal.signal(signal.SIGTERM, previous)
    return 0


REPLICA_STOP_TIMEOUT = 8.0  # seconds a replica gets to finish after SIGTERM before it is killed


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """End the replicas (or a disaggregated pair): SIGTERM to all, then each gets
    `REPLICA_STOP_TIMEOUT` seconds to finish before it is killed."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=REPLICA_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def exit_on_signal(signum, frame) -> None:
    """A SIGTERM handler for a server: unwind through every `finally` (engines closed, ranks and
    replicas stopped) and exit 0, as Ctrl-C does. Without it, the default action ends the process on
    the spot, and uvicorn, which catches SIGTERM while it serves, raises it again once it has shut
    down: `finally` blocks, finalizers and atexit never run, and the other ranks learn it from a
    broken connection."""
    raise SystemExit(0)


def end_with_parent() -> None:
    """Run in a replica's process before it starts (Linux): ask the kernel to send it SIGTERM when
    the front dies, even by SIGKILL or a crash, when no `finally` of the front runs. Elsewhere a
    killed front still leaves its replicas, and says nothing: there is no portable way."""
    if sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_healthy(urls: list[str], procs: list, timeout: float) -> None:
    """Wait until every replica answers /health with 200; fail if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(urls)))
    while pending:
        for i in sorted(pending):
            if procs[i].poll() is not None:
                raise RuntimeError(f"replica {i} exited with code {procs[i].returncode} while starting")
            try:
                if httpx.get(urls[i] + "/health", timeout=2.0).status_code == 200:
                    pending.discard(i)
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {sorted(pending)} were not healthy after {timeout:.0f} s")
        if pending:
            time.sleep(0.5)



# ------------------------------------------------------------------- offline: LLM.generate × N


def generate_data_parallel(config, prompts: list, params: list, size: int) -> tuple[list, float]:
    """Offline generation over `size` replicas: replica i, a process of its own on its own GPU(s),
    generates prompts i, i + size, i + 2·size, ... Returns (the outputs, in prompt order; the
    seconds from the moment every replica was loaded and warm to the moment the last finished),
    so that loading is not counted, as in `nanoserve bench throughput`."""
    procs = []
    cuda = config.device.startswith("cuda")
    for i in range(size):
        env = dict(os.environ)
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(i, config.world_size)
        p = subprocess.Popen([sys.executable, "-m", "nanoserve.server.data_parallel"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
        pickle.dump((config, prompts[i::size], params[i::size]), p.stdin)
        p.stdin.flush()
        procs.append(p)
    try:
        for i, p in enumerate(procs):  # each says when it is loaded and warm
            if p.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"replica {i} failed while loading (exit code {p.wait()})")
        start = time.perf_counter()
        for p in procs:  # go
            p.stdin.write(b"go\n")
            p.stdin.flush()
        results = [pickle.load(p.stdout) for p in procs]
        elapsed = time.perf_counter() - start
    finally:
        for p in procs:
            p.wait(timeout=60)
    outputs = [None] * len(prompts)
    for i, outs in enumerate(results):
        outputs[i::size] = outs
    return outputs, elapsed


def _replica_main() -> None:
    """One offline replica (`generate_data_parallel`): load, warm up, say "ready", wait for "go",
    generate, send the outputs back pickled."""
    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    config, prompts, params = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed from here on must not mix with the pickles
    if config.device.startswith("cuda"):
        config = dataclasses.replace(config, device="cuda")  # this process sees its own GPUs only
    with LLM(config) as llm:
        llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8)] * len(prompts[:4]), use_tqdm=False)
        out.write(b"ready\n")
        out.flush()
        sys.stdin.buffer.readline()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for o in outputs:
            o.metrics = None  # times of another process's clock: not comparable
        pickle.dump(outputs, out)
        out.flush()


if __name__ == "__main__":
    _replica_main()
