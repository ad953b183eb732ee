"""`nanoserve serve`'s own command-line options (the engine's come from `EngineConfig.add_arguments`).

The command line (nanoserve/cli.py) builds the parser; the options that belong to the server layer
are written here, beside the code that reads them.
"""

from __future__ import annotations

import argparse

from nanoserve.server.app import port_number


def add_serve_arguments(srv: argparse.ArgumentParser) -> None:
    """`nanoserve serve`'s own options (the engine's come from `EngineConfig.add_arguments`)."""
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    srv.add_argument("--port", type=port_number, default=8000, help="the port to listen on (default: %(default)s)")
    srv.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="run this many engine replicas (each with --tensor-parallel-size GPUs) on ports "
                          "--port+1.. behind a front on --port that routes each request to the replica with the "
                          "fewest outstanding tokens (week 18; default: %(default)s, no front)")
    srv.add_argument("--replica-start-timeout", type=float, default=600.0,
                     help="--data-parallel-size: seconds to wait for the replicas to be healthy (default: %(default)g)")
    srv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every path but /health and /metrics (the docs "
                          "pages /docs, /redoc and /openapi.json included, unless --public-docs); repeat it for "
                          "several keys, each with its own rate limits (default: none, no key needed)")
    srv.add_argument("--public-docs", action="store_true",
                     help="with --api-key: serve /docs, /redoc and /openapi.json without the key (default: off)")
    srv.add_argument("--allowed-hosts", action="append", default=None, metavar="NAMES",
                     help="Host header names the server answers to, besides localhost, 127.0.0.1 and [::1] "
                          "(any port; comma-separated or repeated; '*' for any). Default: those three on a "
                          "loopback --host (against DNS rebinding), any on another address")
    srv.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                     help="web origins (https://app.example:8443) whose pages may call the server: CORS "
                          "(comma-separated or repeated; '*' for any). Default: none")
    srv.add_argument("--served-model-name", default=None,
                     help="the 'model' clients send, with one --model PATH (default: --model)")
    srv.add_argument("--max-loaded-models", type=int, default=None, metavar="K",
                     help="with several --model NAME=PATH: keep at most K models loaded, unloading the least "
                          "recently used to load another on demand (issue 38; default: all of them)")
    srv.add_argument("--rate-limit-rpm", type=int, default=None,
                     help="requests a minute each API key (or, without --api-key, each client address) may send, "
                          "in bursts of up to a minute's worth; past it, 429 with Retry-After (issue 38; default: "
                          "no limit)")
    srv.add_argument("--rate-limit-tpm", type=int, default=None,
                     help="tokens a minute each API key (or client address) may use, a request counting its "
                          "prompt and max_tokens for each choice; past it, 429 with Retry-After (issue 38; "
                          "default: no limit)")
    srv.add_argument("--max-pending", type=int, default=512, help="requests in flight before 429 (default: %(default)s)")
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20,
                     help="the largest request body, in bytes, before a 413 (default: %(default)s, 1 MiB)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds for a request body to arrive before a 408 (a client that stalls mid-body; default: %(default)g)")
    srv.add_argument("--keep-alive-timeout", type=float, default=5.0,
                     help="seconds an idle keep-alive connection stays open between requests (default: %(default)g)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="for uvicorn's and nanoserve's own loggers (default: info)")
    srv.add_argument("--log-requests", action="store_true",
                     help="one JSON line per finished request on stderr (id, lengths, TTFT, end-to-end time, "
                          "finish reason; default: off)")
    srv.add_argument("--no-metrics", dest="metrics", action="store_const", const=False, default=None,
                     help="do not serve GET /metrics (Prometheus text format; default: served, in a learner's "
                          "workspace once week 16 is written)")
    ss = srv.add_argument_group("sessions (issue 38, docs/agents.md)")
    ss.add_argument("--session-ttl", type=float, default=600.0, metavar="SECONDS",
                    help="a session (a request's session_id, or its X-Session-Id header) idle this long gives its "
                         "KV back; its next turn prefills again (default: %(default)g)")
    ss.add_argument("--session-kv-fraction", type=float, default=0.5, metavar="SHARE",
                    help="the share of each model's KV blocks that sessions may hold between turns; past it, the "
                         "sessions idle longest give theirs back (default: %(default)g; 0: no KV kept)")
    pd = srv.add_argument_group("disaggregated prefill and decode (issue 35, docs/disaggregation.md)")
    pd.add_argument("--disaggregated", action="store_true",
                    help="start a prefill instance (GPU 0, --port+1) and a decode instance (GPU 1, --port+2) of "
                         "--model, and the proxy that splits each request between them on --port (default: off)")
    pd.add_argument("--role", dest="kv_role", choices=["prefill", "decode"], default=None,
                    help="serve as one instance of a pair: prefill (prompts, one token each; sends their KV) or "
                         "decode (receives the KV, generates the rest) (default: none, both phases)")
    pd.add_argument("--prefill-url", default=None,
                    help="with --decode-url: run only the proxy, in front of instances started with --role "
                         "(default: none)")
    pd.add_argument("--decode-url", default=None, help="see --prefill-url (default: none)")
    pd.add_argument("--kv-connector", choices=["gloo", "nccl"], default="gloo",
                    help="how KV moves from the prefill to the decode instance: gloo through host memory, or "
                         "nccl GPU to GPU (default: %(default)s)")
    pd.add_argument("--kv-address", default="127.0.0.1:29650",
                    help="host:port where the decode instance listens for the prefill instance's KV connector "
                         "(default: %(default)s)")
    pd.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                    help="seconds a request's KV may take to land before the request fails with a 504 "
                         "(default: %(default)g)")
    add_tool_arguments(srv)


def add_tool_arguments(srv: argparse.ArgumentParser) -> None:
    """Issue 38: the server's own tools (nanoserve/server/toolbox.py)."""
    tools = srv.add_argument_group("server-side tools (issue 38, docs/agents.md)")
    tools.add_argument("--server-tools", default=None, metavar="NAMES",
                       help="built-in tools the server owns and runs itself, comma-separated: calculator, "
                            "current_time, read_file, list_files (the last two need --tools-dir; default: none)")
    tools.add_argument("--tools-dir", default=None, metavar="DIR",
                       help="the folder read_file and list_files read; nothing outside it (default: none)")
    tools.add_argument("--mcp-config", default=None, metavar="FILE",
                       help='a JSON file {"mcpServers": {"NAME": {"command": ..., "args": [...], "env": {...}}}}: '
                            "MCP servers started over stdio with the server and stopped with it, their tools "
                            "served as NAME__TOOL (needs pip install 'nanoserve[agents]'; default: none)")
    tools.add_argument("--tool-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="seconds a server-side tool call may take before it becomes an error result for "
                            "the model (default: %(default)g)")
    tools.add_argument("--max-tool-rounds", type=int, default=4, metavar="N",
                       help="rounds of server-side tool calls the tool loop runs in one request; an answer that "
                            "still calls them after that goes back with its calls unrun (default: %(default)s)")
