"""Week 16: `nanoserve run-batch INPUT OUTPUT`, offline inference from a batch file.

    nanoserve run-batch requests.jsonl results.jsonl --model tiny --max-concurrency 64

INPUT is a file in the OpenAI Batch API format, one request a line:

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "The list", "max_tokens": 20}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

or plain prompts: JSONL lines `{"prompt": ...}` or `{"messages": [...]}` (with an optional "id" or
"custom_id" and sampling fields), a CSV file with a `prompt` column (and optionally `id`), or the
same as a Parquet file (needs pyarrow); --max-tokens, --temperature (0), --top-p and --seed fill
the fields a plain prompt leaves out. OUTPUT gets one line per input line, in the OpenAI batch
output format:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "cmpl-...",
     "body": {... exactly what `nanoserve serve` answers ...}}, "error": null}

The answers come from the server's own code: each body goes to the FastAPI app of `nanoserve.server`,
in-process (httpx's ASGI transport, no socket), so validation, response shapes and sampling are
those of `nanoserve serve`, and a body the server refuses gets the server's own error (status 400).
A line that cannot be sent at all (not JSON, no custom_id, a duplicate custom_id...) gets a record
with `"response": null` and an `"error"`; the other lines still run.

Each record is written and flushed as soon as its request finishes, in the order they finish.
Ctrl-C (or SIGTERM) cancels the requests in flight and exits with code 130. Run the same command
again after that or a crash: the records already in OUTPUT are kept (a last line cut short by a
kill is dropped) and only the missing lines run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class Item:
    """One line of the input: a request to send, or, when `error` is set, a line that cannot run."""

    line: int  # 1-based line (or CSV / Parquet row) number
    custom_id: str
    url: str | None = None
    body: dict | None = None
    error: tuple[str, str] | None = None  # (code, message) of its error record

    @property
    def key(self) -> tuple[str, bool]:
        """What identifies its record in OUTPUT (see `_record_key`)."""
        return self.custom_id, self.error is not None and self.error[0] == "duplicate_custom_id"


# ------------------------------------------------------------------------------ reading INPUT


def read_input(path: str | Path, defaults: dict | None = None) -> list[Item]:
    """The lines of a JSONL, CSV or Parquet file as `Item`s. `defaults` (e.g. temperature) fill the
    fields a plain prompt does not set; the bodies of batch-format lines are sent as written."""
    path, defaults = Path(path), defaults or {}
    if path.suffix == ".csv":
        items = [_plain_item(row, n, defaults) for n, row in enumerate(_csv_rows(path), 1)]
    elif path.suffix == ".parquet":
        items = [_plain_item(row, n, defaults) for n, row in enumerate(_parquet_rows(path), 1)]
    else:
        items = list(_jsonl_items(path, defaults))
    # The first line with a custom_id owns it; later ones get an error record. So each custom_id
    # has one record that is not a duplicate error, which is what a resumed run looks for.
    first_line: dict[str, int] = {}
    for item in items:
        first = first_line.setdefault(item.custom_id, item.line)
        if first != item.line:
            item.error = ("duplicate_custom_id",
                          f"line {item.line}: custom_id {item.custom_id!r} is already used on line {first}")
    return items


def _jsonl_items(path: Path, defaults: dict):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue  # blank lines (a trailing newline, say) are not requests
            try:
                obj = json.loads(raw)
            except ValueError as e:  # not JSON, or not UTF-8
                yield _invalid(n, f"line {n}: not valid JSON ({e})")
                continue
            if not isinstance(obj, dict):
                yield _invalid(n, f"line {n}: a line must be a JSON object, got {type(obj).__name__}")
            elif "url" not in obj and "body" not in obj and ("prompt" in obj or "messages" in obj):
                yield _plain_item(obj, n, defaults)
            else:
                yield _batch_item(obj, n)


def _invalid(n: int, message: str, custom_id: str | None = None) -> Item:
    return Item(n, custom_id or f"line-{n}", error=("invalid_request", message))


def _batch_item(obj: dict, n: int) -> Item:
    """A line in the OpenAI Batch API format: custom_id, method, url, body."""
    custom_id = obj.get("custom_id")
    if not (isinstance(custom_id, str) and custom_id):
        return _invalid(n, f"line {n}: 'custom_id' is required: a non-empty string (or, for a plain prompt, "
                           "give 'prompt' or 'messages')")
    problem = None
    if obj.get("method", "POST") != "POST":
        problem = f"'method' must be \"POST\", got {obj['method']!r}"
    elif obj.get("url") not in (COMPLETIONS, CHAT):
        problem = f"'url' must be {COMPLETIONS!r} or {CHAT!r}, got {obj.get('url')!r}"
    elif not isinstance(obj.get("body"), dict):
        problem = "'body' is required: a JSON object, the request's body"
    if problem:
        return _invalid(n, f"line {n}: {problem}", custom_id)
    return _checked(Item(n, custom_id, obj["url"], obj["body"]))


def _plain_item(obj: dict, n: int, defaults: dict) -> Item:
    """A plain prompt: {"prompt": ...} or {"messages": [...]}, optional "custom_id" or "id", and
    any other fields (max_tokens, temperature...) passed into the body."""
    ident = obj.get("custom_id", obj.get("id"))
    custom_id = f"line-{n}" if ident is None or ident == "" else str(ident)
    if "prompt" in obj and "messages" in obj:
        return _invalid(n, f"line {n}: give 'prompt' (a completion) or 'messages' (a chat), not both", custom_id)
    body = {k: v for k, v in obj.items() if k not in ("custom_id", "id")}
    for name, value in defaults.items():
        body.setdefault(name, value)
    return _checked(Item(n, custom_id, CHAT if "messages" in body else COMPLETIONS, body))


def _checked(item: Item) -> Item:
    if item.body.get("stream") is True:
        item.error = ("invalid_request", f"line {item.line}: 'stream' cannot be true in a batch file: "
                                         "the whole answer is written to OUTPUT")
    return item


def _csv_rows(path: Path) -> list[dict]:
    import csv

    with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: the byte-order mark spreadsheets write
        reader = csv.DictReader(f)
        _check_columns(path, reader.fieldnames or [])
        return [{"prompt": row["prompt"], "id": row.get("id")} for row in reader]


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet files needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path)
    _check_columns(path, table.column_names)
    return [{"prompt": row["prompt"], "id": row.get("id")} for row in table.to_pylist()]


def _check_columns(path: Path, columns: list[str]) -> None:
    if "prompt" not in columns:
        raise ValueError(f"{path}: needs a 'prompt' column (and optionally an 'id' column); "
                         f"its columns are {list(columns)}")


# ----------------------------------------------------------------------------- OUTPUT records


def _record(custom_id: str, response: dict | None = None, error: dict | None = None) -> dict:
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": response, "error": error}


def _record_key(record: dict) -> tuple[str, bool]:
    """A record's custom_id, and whether it reports a duplicate: a duplicate line's record must not
    make a resumed run skip the first line with that custom_id."""
    error = record.get("error") or {}
    return record["custom_id"], error.get("code") == "duplicate_custom_id"


def read_done(path: str | Path) -> Counter:
    """The records already in OUTPUT, counted by `_record_key`. A last line without its newline
    was cut short by a kill during a write: the file is truncated to its last complete line."""
    # >>> week16: resume
    path = Path(path)
    if not path.exists():
        return Counter()
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        with open(path, "r+b") as f:
            f.truncate(complete)
    done: Counter = Counter()
    for n, raw in enumerate(data[:complete].splitlines(), 1):
        try:
            done[_record_key(json.loads(raw))] += 1
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{path} line {n} is not a batch output record: is OUTPUT the right file? "
                             "Move it away to start afresh") from None
    return done
    # <<< week16: resume


# ------------------------------------------------------------------------------------ running


def run_batch(engine, input_path: str | Path, output_path: str | Path, model_name: str | None = None,
              max_concurrency: int = 256, defaults: dict | None = None, progress: bool = True) -> dict:
    """Answer every line of INPUT not already answered in OUTPUT, appending the records to OUTPUT.

    `engine` is an `Engine`; it runs on an `AsyncEngine` thread for the duration of the call.
    `defaults` are sampling fields (max_tokens, temperature, top_p, seed) for plain prompts that do
    not set them; `defaults["max_tokens"]` is also the server's default for batch-format bodies.
    Returns a summary: total, done, errors, skipped, seconds, output_tokens, interrupted.
    """
    defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
    items = read_input(input_path, defaults)
    done = read_done(output_path)
    todo = []
    for item in items:  # skip the lines OUTPUT already answers, each record counting once
        if done[item.key] > 0:
            done[item.key] -= 1
        else:
            todo.append(item)
    summary = asyncio.run(_serve(engine, todo, Path(output_path), model_name or engine.model_name,
                                 defaults.get("max_tokens"), max_concurrency, progress))
    return dict(total=len(items), skipped=len(items) - len(todo), **summary)


async def _serve(engine, todo: list[Item], output_path: Path, model_name: str, default_max_tokens: int | None,
                 max_concurrency: int, progress: bool) -> dict:
    """The server's app on an AsyncEngine, and an in-process client for it (no socket)."""
    import httpx

    from nanoserve.engine.async_engine import AsyncEngine
    from nanoserve.server.app import create_app

    # The workers bound what is in flight. A body may hold a list of prompts, each its own engine
    # request, so the AsyncEngine's limit must never be the one that bites (no 429s).
    async_engine = AsyncEngine(engine, max_pending=sys.maxsize).start()
    try:
        options = {} if default_max_tokens is None else {"default_max_tokens": default_max_tokens}
        # allowed_hosts=None: no socket, so no browser (and no DNS rebinding) can reach this app
        app = create_app(async_engine, model_name, metrics=False, allowed_hosts=None, **options)
        # raise_app_exceptions=False: a bug in a handler is that line's 500 record, not the end of the run
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            return await _send_all(client, todo, model_name, output_path, max_concurrency, progress)
    finally:
        # Stop the engine thread while this event loop still runs: a request cut short by Ctrl-C may
        # still be on it, and its next output must not go to a closed loop.
        async_engine.shutdown()
        if not async_engine.thread.is_alive():  # the engine is the caller's again: leave it clean
            for request_id in list(engine.requests):  # (cut short by Ctrl-C, their abort still queued)
                engine.abort(request_id)


async def _send_all(client, todo: list[Item], model_name: str, output_path: Path, max_concurrency: int,
                    progress: bool) -> dict:
    """Send `todo`, `max_concurrency` requests at a time, appending each record to OUTPUT as soon
    as it is ready. SIGINT or SIGTERM cancels the requests in flight and ends the run."""
    from tqdm.auto import tqdm

    counts = dict(done=0, errors=0, output_tokens=0)
    start, interrupted = time.perf_counter(), False
    with open(output_path, "a", encoding="utf-8") as out, \
            tqdm(total=len(todo), desc="run-batch", unit="req", disable=not progress, file=sys.stderr) as bar:

        def write(record: dict) -> None:
            # One write and a flush, with no `await` between the answer and here: a cancelled run
            # never leaves half a record, and a killed process loses none that was written.
            # (ASCII JSON: any text, even a lone surrogate from a prompt, can be written.)
            out.write(json.dumps(record) + "\n")
            out.flush()
            response = record["response"]
            ok = response is not None and response["status_code"] == 200
            counts["done" if ok else "errors"] += 1
            if ok:
                counts["output_tokens"] += response["body"]["usage"]["completion_tokens"]
            bar.update(1)

        lines = iter(todo)  # shared by the workers: each line is taken by one of them

        async def worker() -> None:
            for item in lines:
                record = await _answer(client, item, model_name)
                if interrupted:  # a request cancelled by Ctrl-C may still come back, as an error
                    return  # (the server answers 500 when it is cancelled): drop it, the next run redoes it
                write(record)

        workers = [asyncio.ensure_future(worker()) for _ in range(max(1, min(max_concurrency, len(todo))))]

        def interrupt() -> None:
            nonlocal interrupted
            interrupted = True
            for task in workers:  # cancel the requests in flight: their engine requests are aborted
                task.cancel()

        with _on_signals(interrupt):
            await asyncio.wait(workers)
        for task in workers:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
    return dict(counts, seconds=time.perf_counter() - start, interrupted=interrupted)


async def _answer(client, item: Item, model_name: str) -> dict:
    """The record of one line: the server's answer to its body, or the line's own error."""
    if item.error is not None:
        code, message = item.error
        return _record(item.custom_id, error={"code": code, "message": message})
    body = item.body if item.body.get("model") is not None else {**item.body, "model": model_name}
    # ASCII JSON, as `write` above: a lone surrogate in a prompt is then the server's to refuse.
    response = await client.post(item.url, content=json.dumps(body), headers={"content-type": "application/json"})
    try:
        answer = response.json()
    except ValueError:  # only a crash deep inside the server answers anything but JSON
        answer = {"error": {"message": response.text, "type": "server_error", "param": None, "code": None}}
    # Our server gives an id to answers, not to errors (OpenAI's request_id is a header there).
    request_id = answer.get("id")
    return _record(item.custom_id, response={"status_code": response.status_code, "request_id": request_id,
                                              "body": answer})


@contextmanager
def _on_signals(handler):
    """Call `handler` on SIGINT and SIGTERM while inside (main thread only: elsewhere, and on
    Windows, the signals keep their usual meaning)."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handler)
            installed.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


# -------------------------------------------------------------------------- the command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    from nanoserve.engine.config import EngineConfig

    p.add_argument("input", help="JSONL (OpenAI batch format, or plain prompts), CSV or Parquet with a 'prompt' column")
    p.add_argument("output", help="JSONL of OpenAI batch output records; if it exists, its records are kept and "
                                  "only the missing lines run")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at once (default: 256)")
    p.add_argument("--served-model-name", default=None, help="the model name of the answers (default: --model)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens of the requests that set none (default: the server's, 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="plain prompts that set none (default: 0, greedy)")
    p.add_argument("--top-p", type=float, default=None, help="plain prompts that set none (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="plain prompts that set none")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    EngineConfig.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine

    if args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if Path(args.input).resolve() == Path(args.output).resolve():
        raise ValueError("INPUT and OUTPUT are the same file")
    if not Path(args.input).is_file():
        raise FileNotFoundError(f"no such input file: {args.input}")
    engine = Engine(EngineConfig.from_args(args))
    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    s = run_batch(engine, args.input, args.output, model_name=args.served_model_name,
                  max_concurrency=args.max_concurrency, defaults=defaults, progress=args.progress)
    answered = s["skipped"] + s["done"] + s["errors"]
    if s["interrupted"]:
        print(f"interrupted: {answered} of {s['total']} done; run the same command again to resume", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C
    print(f"run-batch: {s['done']} done, {s['errors']} errors, {s['skipped']} skipped as already in {args.output}, "
          f"{s['seconds']:.1f} s, {s['output_tokens'] / max(s['seconds'], 1e-9):.1f} output tok/s", file=sys.stderr)
    return 0
