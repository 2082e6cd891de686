"""RequestGuard: what an HTTP request may cost the server, bounded before any route sees it.

    app.add_middleware(RequestGuard, api_key="secret", limits=ServerLimits())

Checked in this order, so that a client's size never stalls the others: the API key (from the headers,
before a byte of the body is read), the body's declared and actual size (max_body_bytes), and the time the
body takes to arrive (body_timeout_s). HEAD is answered as GET without the body.
"""
import asyncio
import secrets

from pagedattn.serving.http_errors import APIError
from pagedattn.serving.responses import resume


class RequestGuard:
    """Pure ASGI middleware: what a request costs is bounded before the app sees it.

    For /v1/* with an API key set: the Authorization header is checked first (401 without reading the
    body). Then a body (POST) is read here, up to limits.max_body_bytes (413 beyond, from Content-Length
    at once or while reading a chunked body) and within limits.body_timeout_s (408), and handed to the app
    from memory; after it, `receive` passes the client's disconnect through as before.

    HEAD is GET without the body, as HTTP servers answer it (monitors and load balancers probe with it):
    the app sees a GET and its response goes out with GET's headers and no body. (FastAPI's routes take only
    the methods they name, and naming HEAD on every GET route makes two OpenAPI operations of one.)"""

    def __init__(self, app, api_key, limits):
        self.app, self.api_key, self.limits = app, api_key, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        path = scope.get("path", "")
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            error = self.check_key(headers.get(b"authorization", b""))
            if error is not None:
                return await error.response(close=True)(scope, receive, send)
        if scope.get("method") == "HEAD":
            return await self.app(dict(scope, method="GET"), receive, _without_body(send))
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _too_large(limit).response(close=True)(scope, receive, send)
        try:
            body = await _within(self.read_body(receive, limit), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            return await APIError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                                  code="request_timeout").response(close=True)(scope, receive, send)
        except _BodyTooLarge:
            return await _too_large(limit).response(close=True)(scope, receive, send)
        except _ClientGone:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def check_key(self, header):
        """None, or the 401 APIError for an Authorization header value (bytes)."""
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
        if not secrets.compare_digest(given.strip(), self.api_key.encode()):
            return APIError(401, "incorrect API key provided", code="invalid_api_key")
        return None

    @staticmethod
    async def read_body(receive, limit):
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _within(coro, timeout_s):
    """`await asyncio.wait_for(coro, timeout_s)`, without its task and timer when coro ends without waiting (a
    small body is all there when the app is called: the server read it with the headers)."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as done:
        return done.value

    async def rest():
        return await resume(coro, waiting_on)
    return await asyncio.wait_for(rest(), timeout_s)


def _without_body(send):
    """`send` with every response body left out (the answer to a HEAD; the headers, Content-Length
    included, stay GET's)."""
    async def send_head(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)
    return send_head


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _too_large(limit):
    return APIError(413, f"the request body is larger than {limit} bytes (max_body_bytes)", code="body_too_large")
