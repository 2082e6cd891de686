"""The HTTP layer's errors, all in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

APIError is an error response; error_of maps what the engine's front raises (pagedattn.serving.stream) to
one. The routes (app.py), the guard in front of them (guard.py) and a streamed response's error event
(responses.py) all answer with these.
"""
import json

from fastapi.responses import JSONResponse

from pagedattn.errors import InvalidRequestError
from pagedattn.serving import protocol as P
from pagedattn.serving.stream import EngineDeadError, EngineStepError, RequestFailedError


class APIError(Exception):
    """An error response: HTTP status and OpenAI's error fields."""

    def __init__(self, status, message, type="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self):
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).model_dump()

    def response(self, close=False, headers=None):
        """The JSON response; close: end the connection after it (the request body was left unread).
        headers: more response headers (a 405's Allow)."""
        headers = {**(headers or {}), **({"Connection": "close"} if close else {})}
        return ErrorJSONResponse(self.body(), status_code=self.status, headers=headers or None)


class ErrorJSONResponse(JSONResponse):
    """JSON written as ASCII (\\u escapes): an error message may quote what the client sent, and that
    must never make the error itself unwritable."""

    def render(self, content):
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(exc, renames=None):
    """InvalidRequestError -> APIError 400 with `param` = the field its message names."""
    return APIError(400, str(exc), param=P.error_param(exc, renames))


class ServerStoppingError(EngineDeadError):
    """The server is stopping, and this request was still open when its grace period ended (Server)."""


def error_of(exc):
    """The APIError a front's exception answers with: 503 once the engine stopped (or the server is stopping),
    500 for a failed step or a request that failed alone, 400 for a request the engine refused."""
    if isinstance(exc, ServerStoppingError):
        return APIError(503, str(exc), type="server_error", code="server_shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type="server_error", code="request_failed")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="server_error", code="engine_step_failed")
    if isinstance(exc, InvalidRequestError):     # refused by the engine itself when added
        return bad_request(exc)
    return APIError(500, f"internal error: {exc!r}", type="server_error")

