"""Issue 30: a request that is not HTTP at all answered in OpenAI's error shape.

A request line such as `GARBAGE`, or a header such as `Bad Header: x` (a space in its name), never
reaches the app: uvicorn's HTTP/1.1 parser (h11) refuses it, and uvicorn answers by itself, with a
plain-text `400 Bad Request` ("Invalid HTTP request received.") and a closed connection. No ASGI
middleware can change that answer: there is no request to hand it.

uvicorn lets a server choose its protocol class (`uvicorn.run(app, http=...)`, `uvicorn.Config(http=...)`),
so the server runs uvicorn's own h11 protocol with that one answer replaced: the same status, the same
`Connection: close` (after a parse error the stream cannot be trusted, so the connection ends), a
JSON body in OpenAI's shape. Everything else is uvicorn's.

The one thing borrowed from uvicorn's insides is the name of the method that answers,
`send_400_response(msg)`; `tests/week10/test_browser_safety.py` sends malformed requests to a
real server, so a uvicorn that renamed it would fail there, not quietly in production. Always h11:
uvicorn's other parser (httptools, used when installed) is not a nanoserve dependency.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve.server.protocol import APIError

MALFORMED = "malformed HTTP request: the request line or a header is not valid HTTP/1.1"


class OpenAIErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; its own 400 for a request h11 cannot parse is OpenAI-shaped JSON."""

    def send_400_response(self, msg: str) -> None:
        body = bytes(APIError(400, MALFORMED, code="malformed_http").response().body)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
