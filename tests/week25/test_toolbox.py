"""Issue 38: the server's own tools (nanoserve/server/toolbox.py), which the tool loop will call.

Built-ins: the calculator walks the expression's tree and refuses what is not arithmetic or would
burn the CPU; the time comes from an injectable clock; the file tools read nothing outside
--tools-dir. MCP servers (tests/week25/mcp_echo_server.py, written with the SDK) run over stdio:
their tools are listed as SERVER__TOOL, calls come back as content, a failing, slow or crashed tool
becomes an error result (never an exception), and no process outlives `close()` or the app.
Every problem of the flags or of the config file is a one-line error."""

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil
import pytest
from agents_helpers import ModelsServer

from nanoserve.cli import build_parser, main
from nanoserve.server.builtin_tools import MAX_EXPRESSION, READ_CAP
from nanoserve.server.mcp_tools import ToolBoxError
from nanoserve.server.serve import build_toolbox, split_models
from nanoserve.server.toolbox import ToolBox, ToolResult
from nanoserve.testing import free_ports

ECHO_SERVER = str(Path(__file__).with_name("mcp_echo_server.py"))
CLOCK = datetime(2026, 1, 2, 3, 4, 5, 678, tzinfo=timezone.utc)


def call(box: ToolBox, name: str, arguments) -> ToolResult:
    return asyncio.run(box.call(name, arguments))


_before: set[int] = set()  # this worker's child processes when the running test began


@pytest.fixture(autouse=True)
def _children_before():
    """Children that another test of this worker still holds (a module's server and its MCP server,
    under xdist) are not this test's: remember them."""
    _before.clear()
    _before.update(p.pid for p in psutil.Process().children(recursive=True))
    yield


def children() -> list[psutil.Process]:
    """The processes this test started that are still alive."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in _before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def mcp_config(tmp_path: Path, servers: dict) -> str:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return str(path)


def echo(name: str = "echo") -> dict:
    return {name: {"command": sys.executable, "args": [ECHO_SERVER]}}


@pytest.fixture(scope="module")
def builtins():
    return ToolBox.from_options("calculator,current_time", clock=lambda: CLOCK)


# ------------------------------------------------------------------------------ calculator


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-2 ** 2", "-4"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("2 ** -1", "0.5"), ("1 / 3", "0.333333333333333"), ("2 ** 100", str(2 ** 100)), ("sqrt(16)", "4"),
    ("round(pi * 100) / 100", "3.14"), ("+-+1.5e3", "-1500")])
def test_calculator_values(builtins, expression, value):
    assert call(builtins, "calculator", {"expression": expression}) == ToolResult(value, False)


@pytest.mark.parametrize("expression, says", [
    ("__import__('os').system('true')", "not allowed"), ("x + 1", "the name 'x'"), ("(1).__class__", "Attribute"),
    ("'a' * 3", "not allowed"), ("[1, 2]", "not allowed"), ("True + 1", "not allowed"), ("lambda: 1", "not allowed"),
    ("open('f')", "a call"), ("9 ** 9 ** 9", "past the limit"), ("10 ** 5000", "larger than"),
    ("2 ** 10000 * 2 ** 10000", "larger than"), ("1" * (MAX_EXPRESSION + 1), "longer than"), ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"), ("(-8) ** 0.5", "not a real number"), ("exp(1000)", "no result"),
    ("1e308 * 10", "not a finite number"), ("2 +", "not an arithmetic expression"), ("sqrt(-1)", "no result")])
def test_calculator_refusals_are_error_results(builtins, expression, says):
    start = time.perf_counter()
    result = call(builtins, "calculator", {"expression": expression})
    assert result.is_error and says in result.content and "\n" not in result.content, result
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------------ time


def test_current_time_from_the_clock_in_utc_or_a_zone(builtins):
    assert call(builtins, "current_time", {}) == ToolResult("2026-01-02T03:04:05+00:00", False)
    assert call(builtins, "current_time", {"timezone": "Asia/Tokyo"}) == ToolResult(
        "2026-01-02T12:04:05+09:00 (Asia/Tokyo)", False)
    for zone in ("Mars/Olympus_Mons", "../../etc/passwd", ""):
        result = call(builtins, "current_time", {"timezone": zone})
        assert result.is_error and "unknown time zone" in result.content


# ------------------------------------------------------------------------------ files


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "tools"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "a.txt").write_text("café au lait\n")
    (root / "big.txt").write_bytes(b"x" * (READ_CAP + 1))
    (root / "bin.dat").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "secret.txt").write_text("not for the model")
    (root / "link-out").symlink_to(tmp_path / "secret.txt")
    (root / "dir-out").symlink_to(tmp_path)
    (root / "link-in").symlink_to(root / "notes" / "a.txt")
    return ToolBox.from_options(["read_file", "list_files"], tools_dir=str(root)), tmp_path


def test_read_file_reads_inside_the_tools_dir_only(files):
    box, tmp_path = files
    assert call(box, "read_file", {"path": "notes/a.txt"}) == ToolResult("café au lait\n", False)
    assert call(box, "read_file", {"path": "link-in"}) == ToolResult("café au lait\n", False)  # a link inside: fine
    assert call(box, "read_file", {"path": "notes/../notes/a.txt"}).content == "café au lait\n"
    for path, says in [("../secret.txt", "outside the tools directory"), ("link-out", "outside the tools directory"),
                       ("dir-out/secret.txt", "outside the tools directory"), (str(tmp_path / "secret.txt"), "relative"),
                       ("~/x", "relative"), ("big.txt", f"{READ_CAP}-byte cap"), ("bin.dat", "not UTF-8"),
                       ("missing.txt", "no such file"), ("notes", "not a regular file"), ("", "relative")]:
        result = call(box, "read_file", {"path": path})
        assert result.is_error and says in result.content and "not for the model" not in result.content, (path, result)


def test_list_files_inside_the_tools_dir_only(files):
    box, _ = files
    listing = call(box, "list_files", {})
    assert listing == ToolResult("big.txt\nbin.dat\ndir-out/\nlink-in\nlink-out\nnotes/", False)
    assert call(box, "list_files", {"path": "notes"}).content == "a.txt"
    for path in ("..", "dir-out", "/"):
        assert call(box, "list_files", {"path": path}).is_error


def test_bad_arguments_and_unknown_tools_are_error_results(builtins):
    for name, arguments, says in [
        ("calculator", {}, "missing argument(s): expression"), ("calculator", {"expression": 3}, "not a string"),
        ("calculator", {"expression": "1", "x": "2"}, "unknown argument(s): x"), ("calculator", "1 + 1", "JSON object"),
        ("current_time", {"timezone": None}, "not a string"), ("shell", {"command": "ls"}, "no server tool")]:
        result = call(builtins, name, arguments)
        assert result.is_error and says in result.content, (name, arguments, result)
    assert builtins.owns("calculator") and not builtins.owns("shell") and not builtins.owns("read_file")


def test_specs_in_openai_format(builtins):
    specs = builtins.specs()
    assert [s["function"]["name"] for s in specs] == ["calculator", "current_time"]
    for spec in specs:
        assert spec["type"] == "function" and spec["function"]["description"]
        assert spec["function"]["parameters"]["type"] == "object"


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize("options, says", [
    (dict(server_tools="calculator,shell"), "no built-in tool shell"),
    (dict(server_tools="read_file"), "give --tools-dir"),
    (dict(server_tools="calculator", tools_dir="."), "--tools-dir is read by"),
    (dict(server_tools="list_files", tools_dir="/no/such/folder"), "not a folder"),
    (dict(server_tools="calculator", timeout=0), "--tool-timeout"),
    (dict(mcp_config="/no/such/mcp.json"), "no such file"),
])
def test_bad_options_are_one_line_errors(options, says):
    with pytest.raises(ToolBoxError, match=says) as e:
        ToolBox.from_options(**options)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, says", [
    ("{not json", "not JSON"), ('{"servers": {}}', "mcpServers"), ('{"mcpServers": {}}', "at least one server"),
    ('{"mcpServers": {"a": {"args": []}}}', 'has no "command"'),
    ('{"mcpServers": {"a": {"command": "no-such-command-here"}}}', "not found"),
    ('{"mcpServers": {"a__b": {"command": "python"}}}', "server name"),
    ('{"mcpServers": {"a": {"command": "python", "args": "x"}}}', '"args" must be'),
    ('{"mcpServers": {"a": {"url": "http://x", "command": "python"}}}', "unsupported field(s) url"),
])
def test_bad_mcp_config_files_are_one_line_errors(tmp_path, text, says):
    path = tmp_path / "mcp.json"
    path.write_text(text)
    with pytest.raises(ToolBoxError) as e:
        ToolBox.from_options(mcp_config=str(path))
    assert says in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------ MCP servers


def test_mcp_tools_listed_called_failing_slow_and_then_closed(tmp_path):
    box = ToolBox.from_options("calculator", mcp_config=mcp_config(tmp_path, echo()), timeout=1.5)

    async def scenario():
        assert box.specs()[0]["function"]["name"] == "calculator"  # MCP tools once started
        await box.start()
        names = [s["function"]["name"] for s in box.specs()]
        assert names == ["calculator", "echo__echo", "echo__add", "echo__fail", "echo__sleep", "echo__crash",
                         "echo__picture"]
        add = next(s for s in box.specs() if s["function"]["name"] == "echo__add")["function"]
        assert add["description"] == "Add two integers." and set(add["parameters"]["required"]) == {"a", "b"}
        assert len(children()) == 1 and box.owns("echo__echo") and not box.owns("echo")
        assert await box.call("echo__echo", {"text": "hi"}) == ToolResult("echo: hi", False)
        assert await box.call("echo__add", {"a": 2, "b": 40}) == ToolResult("42", False)
        assert (await box.call("echo__add", {"a": "x"})).is_error  # the server's own argument check
        failed = await box.call("echo__fail", {})
        assert failed.is_error and "fail" in failed.content
        picture = await box.call("echo__picture", {})
        assert picture == ToolResult("a red dot:\n[image content, image/png, not shown]", False)
        start = time.perf_counter()
        slow, quick = await asyncio.gather(box.call("echo__sleep", {"seconds": 30}),
                                           box.call("echo__echo", {"text": "meanwhile"}))
        assert slow == ToolResult("tool 'sleep' of MCP server 'echo' timed out after 1.5 s", True)
        assert quick == ToolResult("echo: meanwhile", False) and time.perf_counter() - start < 5
        assert await box.call("echo__echo", {"text": "after"}) == ToolResult("echo: after", False)
        await box.close()
        await box.close()  # idempotent
        assert children() == [] and box.specs()[0]["function"]["name"] == "calculator" and len(box.specs()) == 1

    asyncio.run(scenario())


def test_a_crashed_mcp_server_gives_error_results(tmp_path):
    box = ToolBox.from_options(mcp_config=mcp_config(tmp_path, echo()), timeout=5)

    async def scenario():
        await box.start()
        crashed = await box.call("echo__crash", {})
        assert crashed.is_error and "exited or crashed" in crashed.content, crashed
        after = await box.call("echo__echo", {"text": "anyone?"})
        assert after.is_error and "exited or crashed" in after.content
        await box.close()
        assert children() == []

    asyncio.run(scenario())


def test_an_mcp_server_that_fails_to_start_stops_the_start(tmp_path):
    servers = echo("good") | {"bad": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(1)"]}}
    box = ToolBox.from_options(mcp_config=mcp_config(tmp_path, servers))
    with pytest.raises(ToolBoxError, match="MCP server 'bad'") as e:
        asyncio.run(box.start())
    assert "\n" not in str(e.value)
    assert children() == []  # the good one, started first, is stopped too


# ------------------------------------------------------------------------------ the app


def test_app_serves_v1_tools_behind_the_key_and_stops_the_mcp_servers(tmp_path):
    servers = mcp_config(tmp_path, echo("one") | echo("two"))
    args = build_parser().parse_args(["serve", "--model", "tiny", "--api-key", "k", "--server-tools", "calculator",
                                      "--mcp-config", servers, "--tool-timeout", "3", "--max-tool-rounds", "2"])
    split_models(args)
    toolbox = build_toolbox(args)
    with ModelsServer({"tiny": "tiny"}, api_key="k", toolbox=toolbox, max_tool_rounds=args.max_tool_rounds) as server:
        assert httpx.get(server.url + "/v1/tools").status_code == 401
        page = httpx.get(server.url + "/v1/tools", headers={"Authorization": "Bearer k"}).json()
        names = [tool["function"]["name"] for tool in page["data"]]
        assert page["object"] == "list" and names[0] == "calculator" and "one__echo" in names and "two__echo" in names
        state = server.app.state.server
        assert state.toolbox is toolbox and state.max_tool_rounds == 2 and toolbox.timeout == 3
        assert len(children()) == 2
    assert toolbox.mcp_tools == {} and toolbox.mcp.owner is None  # the app's lifespan closed the toolbox
    assert children() == []


def test_serve_refuses_tool_flags_before_anything_loads(tmp_path, capsys):
    port = str(free_ports(1))
    for argv, says in [
        (["--tools-dir", str(tmp_path)], "give --server-tools or --mcp-config"),
        (["--max-tool-rounds", "8"], "apply to server-side tools"),
        (["--server-tools", "calculator", "--max-tool-rounds", "0"], "at least 1"),
        (["--server-tools", "calculator", "--data-parallel-size", "2"], "--data-parallel-size"),
        (["--mcp-config", str(tmp_path / "none.json")], "no such file"),
        (["--server-tools", "calculator,rm"], "no built-in tool rm"),
    ]:
        assert main(["serve", "--model", "tiny", "--port", port, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, err


@pytest.mark.slow
def test_sigterm_of_nanoserve_serve_ends_its_mcp_servers(tmp_path):
    """The real command: its MCP server runs while it serves, and SIGTERM (docker, systemd) ends both."""
    port = free_ports(1)
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
           "--mcp-config", mcp_config(tmp_path, echo()), "--log-level", "warning"]
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a leaked child would hold it open
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                tools = httpx.get(f"http://127.0.0.1:{port}/v1/tools", timeout=2).json()["data"]
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "nanoserve serve did not start"
                time.sleep(0.2)
        assert "echo__echo" in [tool["function"]["name"] for tool in tools]
        mcp_servers = psutil.Process(proc.pid).children(recursive=True)
        assert len(mcp_servers) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(mcp_servers, timeout=10)
        assert not alive, "the MCP server outlived nanoserve serve"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_mcp_is_imported_only_for_mcp_config(tmp_path, monkeypatch):
    code = "import sys; from nanoserve.server.toolbox import ToolBox; ToolBox.from_options('calculator'); print('mcp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "mcp", None)  # as if the SDK were not installed
    with pytest.raises(ToolBoxError, match=r"pip install 'nanoserve\[agents\]'"):
        ToolBox.from_options(mcp_config=mcp_config(tmp_path, echo()))
