"""Issue 30: a server on a machine where a browser runs. A web page may send a `text/plain` POST
anywhere without asking (a CORS "simple request"), re-point its own name at 127.0.0.1 (DNS
rebinding) and read what a page of another origin may read; so a body must be declared JSON
(415), a loopback server answers only to its own names (421), and CORS is off unless configured.
Also: the API key covers FastAPI's docs pages, and a request that is not HTTP at all gets a 400 in
OpenAI's error shape."""

import socket
import subprocess
import sys
import time

import httpx
import pytest

from nanoserve.cli import build_parser
from nanoserve.server.app import LOOPBACK_HOSTS, allowed_hosts_for, guard_options
from nanoserve.testing import ServerThread

GOOD = {"model": "tiny", "prompt": "The list", "max_tokens": 2}
RAW = b'{"model": "tiny", "prompt": "The list", "max_tokens": 2}'
APP = "https://app.example"  # the one origin the CORS server below allows
KEY = {"Authorization": "Bearer sesame"}
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
DOCS = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")


def assert_openai_error(resp, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert code is None or error["code"] == code, error
    return error


def access_control(resp) -> dict:
    return {k: v for k, v in resp.headers.items() if k.lower().startswith("access-control-")}


@pytest.fixture(scope="module")
def guarded():
    """A server with a key, one allowed web origin and one extra host name."""
    options = dict(allowed_origins=[APP], allowed_hosts=allowed_hosts_for("127.0.0.1", ["llm.internal"]))
    with ServerThread(api_key="sesame", app_kwargs=options) as s:
        yield s


# ------------------------------------------------------------------------------- Content-Type


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "text/json", "application/jsonl", ""])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_not_declared_json_is_a_415(server, path, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    resp = httpx.post(server.url + path, content=RAW, headers=headers)  # the body itself is valid JSON
    error = assert_openai_error(resp, 415, "unsupported_media_type")
    assert "Content-Type: application/json" in error["message"], error


def test_the_media_type_is_read_in_any_case_with_parameters(server):
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/json ;charset=UTF-8"):
        resp = httpx.post(server.url + "/v1/completions", content=RAW, headers={"Content-Type": content_type})
        assert resp.status_code == 200, (content_type, resp.text)
    for content_type in ("text/plain; application/json", "application/json-patch+json"):
        resp = httpx.post(server.url + "/v1/completions", content=RAW, headers={"Content-Type": content_type})
        assert_openai_error(resp, 415)


def test_the_content_type_is_refused_before_the_body_is_read(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # 1,000 bytes promised, none sent
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 415"), answer


def test_clients_that_send_json_are_served(server, client):
    assert client.completions.create(model="tiny", prompt="The list", max_tokens=2).choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None
    assert httpx.post(server.url + "/v1/completions", json=GOOD).status_code == 200
    assert_openai_error(httpx.post(server.url + "/v1/completions", content=RAW), 415)  # content= sends no type


# ------------------------------------------------------------------------------------- Host


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil",
                                  "[::2]", "127.0.0.2", "a:b:c"])
def test_a_loopback_server_answers_only_to_its_own_names(server, host):
    for path in ("/v1/models", "/health"):  # every path: a rebinding page could read any of them
        error = assert_openai_error(httpx.get(server.url + path, headers={"Host": host}), 421, "host_not_allowed")
        assert "--allowed-hosts" in error["message"]
    body = assert_openai_error(httpx.post(server.url + "/v1/completions", json=GOOD, headers={"Host": host}), 421)
    assert body["type"] == "invalid_request_error"


def test_the_loopback_names_on_any_port_are_served(server):
    port = server.url.rsplit(":", 1)[1]
    for host in ("localhost", "LOCALHOST", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", "[::1]",
                 "[::1]:1234"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    assert_openai_error(httpx.get(server.url + "/v1/models", headers={"Host": f"evil.example:{port}"}), 421)


def test_allowed_hosts_adds_names(guarded):
    for host in ("llm.internal", "LLM.internal:80", "127.0.0.1"):
        assert httpx.get(guarded.url + "/health", headers={"Host": host}).status_code == 200, host
    assert_openai_error(httpx.get(guarded.url + "/health", headers={"Host": "evil.example"}), 421)


def test_which_servers_check_the_host():
    assert allowed_hosts_for("127.0.0.1") == list(LOOPBACK_HOSTS)
    assert allowed_hosts_for("::1") == allowed_hosts_for("localhost") == list(LOOPBACK_HOSTS)
    assert allowed_hosts_for("0.0.0.0") is None and allowed_hosts_for("192.168.1.5") is None  # no check
    assert allowed_hosts_for("0.0.0.0", ["llm.example"]) == [*LOOPBACK_HOSTS, "llm.example"]  # the flag asks for one
    assert allowed_hosts_for("127.0.0.1", ["a", "*"]) is None  # '*': off
    with pytest.raises(ValueError, match="--allowed-hosts"):
        allowed_hosts_for("127.0.0.1", ["a:b:c"])


def test_the_flags_reach_the_guard():
    def options(*flags):
        return guard_options(build_parser().parse_args(["serve", *flags]))

    default = options()
    assert default["allowed_hosts"] == list(LOOPBACK_HOSTS) and default["allowed_origins"] == []
    assert not default["public_docs"] and default["api_key"] is None
    many = options("--allowed-hosts", "a.example, b.example", "--allowed-hosts=c.example",
                   "--allowed-origins", f"{APP},http://localhost:3000", "--public-docs", "--api-key", "k")
    assert many["allowed_hosts"] == [*LOOPBACK_HOSTS, "a.example", "b.example", "c.example"]
    assert many["allowed_origins"] == [APP, "http://localhost:3000"] and many["public_docs"]
    assert options("--host", "0.0.0.0")["allowed_hosts"] is None
    assert options("--allowed-hosts", "*")["allowed_hosts"] is None


# ------------------------------------------------------------------------------------- CORS


def test_cors_only_where_configured(server, guarded):
    preflight = httpx.options(server.url + "/v1/completions", headers=PREFLIGHT)
    assert_openai_error(preflight, 405, "method_not_allowed")
    assert access_control(preflight) == {}
    answer = httpx.post(server.url + "/v1/completions", json=GOOD, headers={"Origin": APP})
    assert answer.status_code == 200 and access_control(answer) == {}
    # configured: a preflight from an allowed origin passes, without the key (browsers send none)
    resp = httpx.options(guarded.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status_code == 200, resp.text
    allowed = access_control(resp)
    assert allowed["access-control-allow-origin"] == APP
    assert {"GET", "POST", "OPTIONS"} <= {m.strip() for m in allowed["access-control-allow-methods"].split(",")}
    headers = {h.strip().lower() for h in allowed["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= headers


def test_a_preflight_from_another_origin_is_refused(guarded):
    resp = httpx.options(guarded.url + "/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert_openai_error(resp, 400, "cors_not_allowed")
    assert "access-control-allow-origin" not in resp.headers


def test_the_request_after_the_preflight_still_needs_the_key(guarded):
    refused = httpx.post(guarded.url + "/v1/completions", json=GOOD, headers={"Origin": APP})
    assert_openai_error(refused, 401, "invalid_api_key")
    assert refused.headers["access-control-allow-origin"] == APP  # the page may read why
    served = httpx.post(guarded.url + "/v1/completions", json=GOOD, headers={"Origin": APP, **KEY})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == APP
    other = httpx.post(guarded.url + "/v1/completions", json=GOOD, headers={"Origin": "https://evil.example", **KEY})
    assert "access-control-allow-origin" not in other.headers  # served (no browser sent it), unreadable to a page


# ------------------------------------------------------------------------- the key and the docs


@pytest.mark.parametrize("path", DOCS)
def test_the_docs_need_the_key(guarded, path):
    assert_openai_error(httpx.get(guarded.url + path), 401, "invalid_api_key")
    assert httpx.get(guarded.url + path, headers=KEY).status_code == 200


def test_health_and_metrics_stay_open(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200
    # Open means no key asked for. (What /metrics answers is week 16's: in a learner's workspace
    # before that week it is not served, or a stub.)
    assert httpx.get(guarded.url + "/metrics").status_code != 401
    assert_openai_error(httpx.get(guarded.url + "/v1/models"), 401)


def test_public_docs():
    with ServerThread(api_key="sesame", app_kwargs={"public_docs": True}) as s:
        for path in DOCS:
            assert httpx.get(s.url + path).status_code == 200, path
        assert "/v1/completions" in httpx.get(s.url + "/openapi.json").json()["paths"]
        assert_openai_error(httpx.get(s.url + "/v1/models"), 401)  # the API itself still needs the key


# ---------------------------------------------------------------------------- malformed HTTP


def send_raw(url: str, raw: bytes) -> bytes:
    """Send `raw` on a fresh connection; everything the server answers until it closes."""
    host, port = url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        while chunk := sock.recv(4096):  # a timeout here would mean the server kept the connection
            answer += chunk
    return answer


MALFORMED = [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
             b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n"]


@pytest.mark.parametrize("raw", MALFORMED, ids=["request line", "space in a header name", "header without colon"])
def test_malformed_http_is_a_json_400_and_the_server_goes_on(server, raw):
    answer = send_raw(server.url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    assert lines[0].startswith("http/1.1 400"), answer
    assert "content-type: application/json" in lines and "connection: close" in lines, answer
    error = assert_openai_error(httpx.Response(400, content=body), 400, "malformed_http")
    assert error["type"] == "invalid_request_error" and "HTTP" in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


# ---------------------------------------------------------------------------- from the command line


@pytest.mark.slow
def test_nanoserve_serve_applies_it_all():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
           "--log-level", "warning", "--api-key", "sesame", "--allowed-origins", APP, "--allowed-hosts", "llm.internal"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "nanoserve serve did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert b'"code":"malformed_http"' in send_raw(url, MALFORMED[0])  # uvicorn runs nanoserve's protocol
        assert_openai_error(httpx.get(url + "/health", headers={"Host": "evil.example"}), 421)
        assert httpx.get(url + "/health", headers={"Host": "llm.internal"}).status_code == 200
        assert httpx.options(url + "/v1/completions", headers=PREFLIGHT).headers["access-control-allow-origin"] == APP
        assert_openai_error(httpx.get(url + "/openapi.json"), 401)
        assert_openai_error(httpx.post(url + "/v1/completions", content=RAW, headers=KEY), 415)
        assert httpx.post(url + "/v1/completions", json=GOOD, headers=KEY).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
