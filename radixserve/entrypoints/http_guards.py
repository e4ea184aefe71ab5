"""What stands between a client's socket and the routes: a header-read
timeout on every connection, a cap on body size, the API key, and a last
catch for errors no route handled. Each answers in OpenAI's error shape.

The middlewares are plain ASGI (no ``BaseHTTPMiddleware``), so that they
neither buffer streams nor hide client disconnects from the routes."""

from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("radixserve.server")

DEFAULT_MAX_CONNECTIONS = 4096
RESERVED_FDS = 128  # open files kept for the process itself (model files, sockets to the children)


class BodyTooLarge(HTTPException):
    """Raised while reading a body past the limit; FastAPI lets HTTPExceptions through as they are."""

    def __init__(self, limit: int):
        super().__init__(413, f"body: the request body is larger than {limit} bytes (--max-request-body-bytes)")


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    err_type = err_type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


async def send_error(send, status: int, message: str, param: str | None = None) -> None:
    body = json.dumps(error_body(message, status, param=param)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class LimitBody:
    """413 for a body over ``limit`` bytes: at once when its Content-Length says
    so, else as soon as the bytes read pass it (chunked uploads)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await send_error(send, 413, BodyTooLarge(self.limit).detail, param="body")
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)


class RequireApiKey:
    """401 unless ``Authorization: Bearer <key>``; ``open_paths`` need no key."""

    def __init__(self, app, key: str, open_paths: set[str]):
        self.app, self.expected, self.open_paths = app, f"Bearer {key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                return await send_error(send, 401, "invalid or missing API key")
        await self.app(scope, receive, send)


class CatchErrors:
    """The last word on an exception no handler took: a JSON 500 (when the
    response has not started) and one log line; the traceback goes to the
    debug log, not to the client."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error("%s %s failed: %s: %s", scope.get("method"), scope.get("path"), type(exc).__name__, exc)
            logger.debug("traceback", exc_info=True)
            if not started:
                await send_error(send, 500, f"internal server error ({type(exc).__name__})")


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for each request's headers.

    uvicorn times out idle keep-alive connections, but not a connection that
    sends nothing (or half a request line) after it opens: enough of those
    exhaust the file descriptors. Here every connection must deliver a
    request's headers within ``header_timeout`` seconds of opening, or of its
    first byte after a previous response, or it is closed."""

    header_timeout: float = 30.0  # set by ``protocol_with_header_timeout``

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        waiting = cycle is None or cycle.response_complete
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        super().data_received(data)
        if self.cycle is not cycle and self._header_timer is not None:  # a new request's headers arrived
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderTimeoutH11]:
    """The protocol class to give uvicorn (``Config(http=...)``)."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout": seconds})


def resolved_max_connections(requested: int | None, open_file_limit: int) -> int:
    """``--max-connections``, or the default where the open-file limit allows it."""
    if requested is not None:
        return requested
    return max(min(DEFAULT_MAX_CONNECTIONS, open_file_limit - RESERVED_FDS), 1)
