"""Issue 30: the data-parallel front's own answers, like the single server's: its 404, 405, 500 and
503 in OpenAI's error shape, and the same Host, Content-Type, CORS and key checks (the `Guard`),
applied by the front itself before anything reaches a replica. None of these needs a live replica:
the fronts below route to addresses where nothing listens."""

import contextlib
import socket
import threading
import time

import httpx
import pytest

from nanoserve.server import data_parallel
from nanoserve.server.data_parallel import create_front
from nanoserve.testing import dead_url

BODY = {"model": "tiny", "prompt": "The list", "max_tokens": 2}


@contextlib.contextmanager
def serving(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def front():
    with serving(create_front([dead_url()])) as url:
        yield url


def assert_openai_error(resp, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert code is None or error["code"] == code, error
    assert "x-nanoserve-replica" not in resp.headers  # the front's own answer
    return error


def test_routing_errors(front):
    error = assert_openai_error(httpx.get(front + "/v1/engines"), 404, "not_found")
    assert "/v1/engines" in error["message"]
    wrong = httpx.get(front + "/v1/completions")
    assert_openai_error(wrong, 405, "method_not_allowed")
    assert wrong.headers["Allow"] == "POST"


def test_a_bug_in_the_front_is_a_500_and_the_connection_lives(front, monkeypatch):
    async def broken(client, router):
        raise RuntimeError("a bug")

    monkeypatch.setattr(data_parallel, "health_report", broken)
    with httpx.Client(base_url=front, limits=httpx.Limits(max_connections=1)) as client:
        error = assert_openai_error(client.get("/health"), 500)
        assert error == {"message": "internal error: RuntimeError: a bug", "type": "server_error", "param": None,
                         "code": None}
        monkeypatch.undo()
        assert client.get("/health").status_code == 503  # the same connection; the replica is down


def test_no_healthy_replica_is_a_503(front):
    error = assert_openai_error(httpx.post(front + "/v1/completions", json=BODY), 503, "no_healthy_replica")
    assert error["type"] == "server_error"
    assert_openai_error(httpx.get(front + "/v1/models"), 503, "no_healthy_replica")


def test_the_front_checks_content_type_and_host(front):
    error = assert_openai_error(httpx.post(front + "/v1/completions", content=b"{}",
                                           headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type")
    assert "application/json" in error["message"]
    assert_openai_error(httpx.get(front + "/health", headers={"Host": "evil.example"}), 421, "host_not_allowed")
    preflight = httpx.options(front + "/v1/completions", headers={"Origin": "https://app.example",
                                                                  "Access-Control-Request-Method": "POST"})
    assert_openai_error(preflight, 405)  # no CORS unless configured
    assert not any(k.lower().startswith("access-control-") for k in preflight.headers)


def test_the_front_with_cors_a_key_and_its_docs():
    app = create_front([dead_url()], api_key="sesame", allowed_origins=["https://app.example"],
                       allowed_hosts=["llm.internal"])
    with serving(app) as url:
        preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type", "Host": "llm.internal"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        headers = {"Host": "llm.internal"}
        assert_openai_error(httpx.get(url + "/openapi.json", headers=headers), 401, "invalid_api_key")
        keyed = httpx.get(url + "/openapi.json", headers={**headers, "Authorization": "Bearer sesame"})
        assert keyed.status_code == 200 and "/v1/completions" in keyed.json()["paths"]
        assert httpx.get(url + "/health", headers=headers).status_code == 503  # open; no replica is up
        assert_openai_error(httpx.get(url + "/health"), 421)  # 127.0.0.1 is not in this front's list
