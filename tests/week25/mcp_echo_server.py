"""An MCP server for tests/week25/test_toolbox.py, run over stdio: `python mcp_echo_server.py`.

Tools: `echo` (answers its text), `add` (two integers), `fail` (raises), `sleep` (sleeps `seconds`,
past a test's timeout), `crash` (the process exits at once, as a crashed server would) and
`picture` (an image part beside a text one)."""

import asyncio
import os

from mcp.server.mcpserver import MCPServer
from mcp.types import ImageContent, TextContent

server = MCPServer("echo", log_level="CRITICAL")


@server.tool(description="Answer with the text it is given.")
def echo(text: str) -> str:
    return f"echo: {text}"


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Always fails.")
def fail(reason: str = "on purpose") -> str:
    raise RuntimeError(f"this tool failed {reason}")


@server.tool(description="Sleep, then answer.")
async def sleep(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "awake"


@server.tool(description="Exit the server process at once.")
def crash() -> str:
    os._exit(3)


@server.tool(description="A text part and an image part.")
def picture() -> list:
    return [TextContent(type="text", text="a red dot:"), ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png")]


if __name__ == "__main__":
    server.run("stdio")
