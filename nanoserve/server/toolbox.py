"""Issue 38: the tools the server owns, behind one interface the tool loop calls.

Client tools (issue 17, nanoserve/server/tools.py) are the request's: the server parses a call and
hands it back to the client. Server tools are the server's: built-ins (nanoserve/server/builtin_tools.py)
and the tools of MCP servers (nanoserve/server/mcp_tools.py), enabled at start-up:

    nanoserve serve --server-tools calculator,current_time,read_file --tools-dir ./notes \\
                    --mcp-config mcp.json --tool-timeout 10 --max-tool-rounds 4

`ToolBox` is what the loop sees: `specs()` (OpenAI's tools format, for the chat template and for
`GET /v1/tools`), `owns(name)`, `call(name, arguments)` -> `ToolResult`, and `start()` / `close()`,
which the app's lifespan runs (MCP servers live exactly as long as the app).

`call` never raises for a tool's failure: a tool that fails, refuses its arguments, is unknown or
runs past `--tool-timeout` gives a `ToolResult` with `is_error` set and a one-line reason, which the
model reads as the tool's answer.

Names: built-ins keep their own (`calculator`); an MCP tool is always named `SERVER__TOOL` (the
server's name in the config, two underscores, the tool's name, every character outside
`[a-zA-Z0-9_-]` turned into `_`), so two servers, or a server and a built-in, never clash and a
tool's name does not change when another server is added. A name past 64 characters, or two tools
that come out with the same name, stop the start with a one-line error.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from nanoserve.server.builtin_tools import (
    BUILTIN_NAMES,
    FILE_TOOLS,
    Builtin,
    ToolFailure,
    check_arguments,
    make_builtin,
    utc_now,
)
from nanoserve.server.mcp_tools import MCPServers, MCPTool, ToolBoxError, one_line, read_mcp_config
from nanoserve.server.tools import NAME

TOOL_TIMEOUT = 10.0  # --tool-timeout's default, seconds
MAX_TOOL_ROUNDS = 4  # --max-tool-rounds' default
SEPARATOR = "__"  # between an MCP server's name and its tool's


@dataclass
class ToolResult:
    content: str  # what goes back to the model as the tool message
    is_error: bool  # the tool failed, was refused, or timed out (content says which, in one line)


def exposed_name(server: str, tool: str) -> str:
    """The name the model sees for `tool` of MCP server `server`: `server__tool`, made OpenAI-valid."""
    return server + SEPARATOR + re.sub(r"[^a-zA-Z0-9_-]", "_", tool)


class ToolBox:
    """The server's tools: `builtins`, and those of the MCP servers `mcp` starts; each call bounded
    by `timeout` seconds."""

    def __init__(self, builtins: Sequence[Builtin] = (), mcp: MCPServers | None = None,
                 timeout: float = TOOL_TIMEOUT):
        if timeout <= 0:
            raise ToolBoxError(f"--tool-timeout must be more than 0 seconds, got {timeout:g}")
        self.builtins = {tool.name: tool for tool in builtins}
        self.mcp, self.timeout = mcp, timeout
        self.mcp_tools: dict[str, MCPTool] = {}  # exposed name -> tool, once started

    @classmethod
    def from_options(cls, server_tools: str | Sequence[str] | None = None, tools_dir: str | None = None,
                     mcp_config: str | None = None, timeout: float = TOOL_TIMEOUT,
                     clock: Callable[[], datetime] = utc_now) -> ToolBox:
        """From serve's flags: `server_tools` the built-ins' names (comma-separated or a list),
        `tools_dir` the folder the file tools read, `mcp_config` the MCP servers' file. Every
        problem is a one-line `ToolBoxError` (a `ValueError`), before anything starts."""
        names = split_names(server_tools)
        unknown = [name for name in names if name not in BUILTIN_NAMES]
        if unknown:
            raise ToolBoxError(f"--server-tools: no built-in tool {', '.join(unknown)} (there are: "
                               f"{', '.join(BUILTIN_NAMES)})")
        if tools_dir is not None and not set(names) & set(FILE_TOOLS):
            raise ToolBoxError(f"--tools-dir is read by the built-ins {' and '.join(FILE_TOOLS)}: name one in "
                               "--server-tools")
        try:
            builtins = [make_builtin(name, tools_dir, clock) for name in dict.fromkeys(names)]
        except ValueError as e:
            raise ToolBoxError(str(e)) from None
        mcp = MCPServers(read_mcp_config(mcp_config)) if mcp_config is not None else None
        return cls(builtins, mcp, timeout)

    def specs(self) -> list[dict]:
        """Every tool, in OpenAI's tools format (the MCP servers' once `start()` has listed them)."""
        tools = [(t.name, t.description, t.parameters) for t in self.builtins.values()]
        tools += [(name, t.description, t.parameters) for name, t in self.mcp_tools.items()]
        return [{"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
                for name, description, parameters in tools]

    def owns(self, name: str) -> bool:
        return name in self.builtins or name in self.mcp_tools

    async def call(self, name: str, arguments: dict) -> ToolResult:
        """Run the tool `name`, within the timeout. Never raises for the tool's failure."""
        try:
            if name in self.builtins:
                return await self.call_builtin(self.builtins[name], arguments)
            if name in self.mcp_tools:
                tool = self.mcp_tools[name]
                if not isinstance(arguments, dict):
                    return ToolResult(f"{name}: arguments must be a JSON object", True)
                content, is_error = await self.mcp.call(tool.server, tool.name, arguments, self.timeout)
                return ToolResult(content, is_error)
            return ToolResult(f"no server tool named {name!r}", True)
        except Exception as e:  # a bug in a tool or here: still a tool message, never a 500
            return ToolResult(f"{name} failed: {type(e).__name__}: {one_line(e)}", True)

    async def call_builtin(self, tool: Builtin, arguments) -> ToolResult:
        """A built-in on a worker thread (a file read must not hold up the event loop), bounded."""
        wrong = check_arguments(tool.parameters, arguments)
        if wrong is not None:
            return ToolResult(f"{tool.name}: {wrong}", True)
        try:
            return ToolResult(await asyncio.wait_for(asyncio.to_thread(tool.run, arguments), self.timeout), False)
        except ToolFailure as e:
            return ToolResult(f"{tool.name}: {e}", True)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            return ToolResult(f"{tool.name} timed out after {self.timeout:g} s", True)

    async def start(self) -> None:
        """Start the MCP servers and list their tools; `ToolBoxError` if one fails (nothing left running)."""
        if self.mcp is None or self.mcp_tools:
            return
        tools = await self.mcp.start()
        exposed: dict[str, MCPTool] = {}
        for tool in tools:
            name = exposed_name(tool.server, tool.name)
            problem = ("is longer than 64 characters" if not NAME.match(name) else
                       f"clashes with {exposed[name].name!r}" if name in exposed else None)
            if problem:
                await self.mcp.close()
                raise ToolBoxError(f"MCP server {tool.server!r}: tool {tool.name!r} (as {name}) {problem}")
            exposed[name] = tool
        self.mcp_tools = exposed

    async def close(self) -> None:
        """Stop the MCP servers (every process ends); idempotent."""
        if self.mcp is not None:
            await self.mcp.close()
        self.mcp_tools = {}


def split_names(value: str | Sequence[str] | None) -> list[str]:
    """`"a,b"` or `["a,b", "c"]` -> `["a", "b", "c"]`."""
    values = [value] if isinstance(value, str) else list(value or ())
    return [name.strip() for v in values for name in v.split(",") if name.strip()]


def tools_page(toolbox: ToolBox | None) -> dict:
    """`GET /v1/tools`: the server's tools in OpenAI's format."""
    return {"object": "list", "data": toolbox.specs() if toolbox is not None else []}


def add_tools_route(app, toolbox: ToolBox | None) -> None:
    """`GET /v1/tools` on `app` (a FastAPI app; behind its API key like the other routes)."""

    @app.get("/v1/tools")
    async def tools():
        return tools_page(toolbox)
