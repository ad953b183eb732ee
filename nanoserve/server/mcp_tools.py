"""Issue 38: the tools of MCP servers, each server a subprocess spoken to over stdio with the `mcp` SDK.

`--mcp-config FILE` names them in the shape MCP clients commonly read:

    {"mcpServers": {"files": {"command": "uvx", "args": ["mcp-server-fs", "/srv"], "env": {"K": "V"}}}}

`MCPServers.start()` launches each one, initializes its session and lists its tools; `call()` runs
one tool; `close()` ends every session, and the SDK's stdio client ends each process (stdin closed,
then SIGTERM and SIGKILL to its process group, each wait bounded).

One task owns every session. The SDK's stdio client and `ClientSession` are async context managers
whose anyio task groups and cancel scopes must be entered and left by the same task; the app's
lifespan starts the toolbox in one task and requests call tools from others. So `start()` creates
an owner task that opens the sessions in an `AsyncExitStack`, then takes calls from a queue, running
each in its own child task (a slow tool holds up no other call), until `close()` sends it `None`;
it then closes the stack, in that same task. `mcp` is imported here only, and this module only when
a config names servers (`pip install 'nanoserve[agents]'`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("nanoserve.tools")

START_TIMEOUT = 30.0  # seconds for an MCP server to start, initialize and list its tools
GONE = " (the MCP server exited or crashed; it is not restarted)"
SERVER_NAME = re.compile(r"^[a-zA-Z0-9-]+(?:_[a-zA-Z0-9-]+)*$")  # no "__": it separates server and tool


class ToolBoxError(ValueError):
    """A toolbox that cannot be built or started: a one-line reason."""


@dataclass
class MCPServerConfig:
    name: str
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class MCPTool:
    server: str
    name: str  # the server's own name for it
    description: str
    parameters: dict  # its inputSchema


def leaf(exc: BaseException) -> BaseException:
    """An exception group's first leaf (anyio's task groups wrap what crosses them), or `exc`."""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def one_line(exc: BaseException) -> str:
    """An exception as one line (an exception group as its first leaf)."""
    exc = leaf(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def read_mcp_config(path: str | os.PathLike) -> list[MCPServerConfig]:
    """The servers of an `--mcp-config` file, checked; each problem a one-line `ToolBoxError`."""
    where = f"--mcp-config {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolBoxError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ToolBoxError(f"{where}: cannot read it ({one_line(e)})") from None
    except json.JSONDecodeError as e:
        raise ToolBoxError(f"{where}: not JSON ({e})") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise ToolBoxError(f'{where}: expected {{"mcpServers": {{"NAME": {{"command": ..., "args": [...]}}}}}} '
                           "with at least one server")
    return [server_config(where, name, entry) for name, entry in servers.items()]


def server_config(where: str, name: str, entry) -> MCPServerConfig:
    if not SERVER_NAME.match(name) or len(name) > 30:
        raise ToolBoxError(f"{where}: server name {name!r} must be letters, digits, '-' and single '_' "
                           "(at most 30 characters): it prefixes its tools' names as NAME__TOOL")
    if not isinstance(entry, dict) or not isinstance(entry.get("command"), str) or not entry["command"]:
        raise ToolBoxError(f"{where}: server {name!r} has no \"command\" (a string)")
    args, env = entry.get("args", []), entry.get("env", {})
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ToolBoxError(f"{where}: server {name!r}: \"args\" must be a list of strings")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ToolBoxError(f"{where}: server {name!r}: \"env\" must map names to strings")
    unknown = sorted(set(entry) - {"command", "args", "env"})
    if unknown:  # "url", "cwd", "type": what this client does not do must not pass unnoticed
        raise ToolBoxError(f"{where}: server {name!r}: unsupported field(s) {', '.join(unknown)} (only stdio "
                           "servers: command, args, env)")
    if shutil.which(entry["command"]) is None:
        raise ToolBoxError(f"{where}: server {name!r}: command {entry['command']!r} not found")
    return MCPServerConfig(name, entry["command"], list(args), dict(env))


def import_mcp():
    """The `mcp` SDK, or a one-line error saying how to install it."""
    try:
        import mcp
    except ImportError:
        raise ToolBoxError("--mcp-config needs the mcp SDK: pip install 'nanoserve[agents]'") from None
    return mcp


@dataclass
class Call:
    server: str
    tool: str
    arguments: dict
    timeout: float
    done: asyncio.Future


class MCPServers:
    """The sessions of `servers`, owned by one task (see the module's docstring)."""

    def __init__(self, servers: list[MCPServerConfig], start_timeout: float = START_TIMEOUT):
        self.servers, self.start_timeout = servers, start_timeout
        self.mcp = import_mcp()
        self.queue: asyncio.Queue | None = None
        self.owner: asyncio.Task | None = None
        self.tools: list[MCPTool] = []
        self.gone: set[str] = set()  # servers whose connection closed: crashed, or exited on their own

    async def start(self) -> list[MCPTool]:
        """Launch and initialize every server and list its tools; `ToolBoxError` if one fails (those
        already started are stopped)."""
        if self.owner is not None:
            return self.tools
        self.queue = asyncio.Queue()
        ready = asyncio.get_running_loop().create_future()
        self.owner = asyncio.create_task(self.own(ready), name="nanoserve-mcp")
        try:
            self.tools = await ready
        except BaseException:
            self.owner = None  # nothing runs (the owner closed what it had opened); start() may try again
            raise
        return self.tools

    async def call(self, server: str, tool: str, arguments: dict, timeout: float):
        """Run `tool` of `server` within `timeout` seconds; a `(content, is_error)` pair, never raises
        for the tool's or the server's failure."""
        if self.owner is None or self.owner.done():
            return f"MCP server {server!r} is not running", True
        done = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(Call(server, tool, arguments, timeout, done))
        try:  # the owner answers within `timeout`; the margin only guards against a bug there
            return await asyncio.wait_for(done, timeout + 5.0)
        except asyncio.TimeoutError:
            return f"tool {tool!r} of MCP server {server!r} got no answer", True

    async def close(self) -> None:
        """End every session and process; idempotent."""
        owner, self.owner = self.owner, None
        if owner is None or owner.done():
            return
        self.queue.put_nowait(None)
        await owner

    async def own(self, ready: asyncio.Future) -> None:
        """The owner task: open the sessions, serve the queue, close the sessions."""
        import anyio

        try:
            async with AsyncExitStack() as stack:
                sessions, tools = {}, []
                for server in self.servers:
                    sessions[server.name] = await self.open(stack, server)
                    tools += await self.list_tools(server.name, sessions[server.name])
                ready.set_result(tools)
                async with anyio.create_task_group() as group:
                    while (call := await self.queue.get()) is not None:
                        group.start_soon(self.run, sessions[call.server], call)
                    group.cancel_scope.cancel()  # calls still running end now
        except Exception as e:
            if not ready.done():
                e = leaf(e)
                ready.set_exception(e if isinstance(e, ToolBoxError) else ToolBoxError(f"MCP servers: {one_line(e)}"))
            else:
                logger.error("the MCP servers' task failed: %s", one_line(e))

    async def open(self, stack: AsyncExitStack, server: MCPServerConfig):
        """One server's process and session, initialized; entered on `stack` (no timeout scope around
        the entering: a cancel scope must not enclose a context it does not also close)."""
        import anyio
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=server.command, args=server.args, env=server.env or None)
        try:
            read, write = await stack.enter_async_context(stdio_client(params, errlog=sys.stderr))
            session = await stack.enter_async_context(self.mcp.ClientSession(read, write))
            with anyio.fail_after(self.start_timeout):
                await session.initialize()
        except TimeoutError:
            raise ToolBoxError(f"MCP server {server.name!r} did not initialize within {self.start_timeout:g} s") from None
        except Exception as e:
            raise ToolBoxError(f"MCP server {server.name!r} ({server.command}) failed to start: {one_line(e)}") from None
        return session

    async def list_tools(self, name: str, session) -> list[MCPTool]:
        import anyio

        tools, cursor = [], None
        try:
            with anyio.fail_after(self.start_timeout):
                while True:
                    params = self.mcp.types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    page = await session.list_tools(params=params)
                    tools += [MCPTool(name, t.name, t.description or "", t.input_schema) for t in page.tools]
                    if not (cursor := page.next_cursor):
                        return tools
        except Exception as e:
            raise ToolBoxError(f"MCP server {name!r}: listing its tools failed: {one_line(e)}") from None

    async def run(self, session, call: Call) -> None:
        """One call, in a child task of the owner; its outcome goes to `call.done`."""
        import anyio

        what = f"tool {call.tool!r} of MCP server {call.server!r}"
        outcome = f"{what} was stopped: the MCP servers are shutting down", True  # if cancelled by close()
        try:
            if call.server in self.gone:
                raise ConnectionError("not called")
            with anyio.fail_after(call.timeout):
                result = await session.call_tool(call.tool, call.arguments)
            outcome = describe_result(result), bool(result.is_error)
        except TimeoutError:
            outcome = f"{what} timed out after {call.timeout:g} s", True
        except Exception as e:  # the server crashed (connection closed), refused the call, ...
            if getattr(e, "code", None) == self.mcp.types.CONNECTION_CLOSED:
                self.gone.add(call.server)
            outcome = f"{what} failed: {one_line(e)}" + (GONE if call.server in self.gone else ""), True
        finally:
            if not call.done.done():  # the caller may have gone (its request cancelled)
                call.done.set_result(outcome)


def describe_result(result) -> str:
    """A CallToolResult's content as the text the model reads: text parts as they are, others named."""
    parts = []
    for block in result.content:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} content, {block.mime_type}, not shown]")
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if text is not None else f"[resource {resource.uri}, binary, not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}]")
        else:
            parts.append(f"[{kind} content, not shown]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)
