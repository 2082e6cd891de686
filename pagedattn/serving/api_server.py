"""The OpenAI-compatible HTTP layer (FastAPI): it only translates.

    app = build_app(AsyncLLM(LLM(model_dir)), model_name="tiny")      # then: uvicorn.run(app, ...)

A request body becomes prompt token ids + SamplingParams (protocol.py), AsyncLLM runs it, and its
increments become a JSON response or server-sent events (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`).
Nothing here knows about blocks or steps.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id} (these need
the API key when one is set: `Authorization: Bearer KEY`), GET /health, GET /metrics (Prometheus text);
/docs, /redoc and /openapi.json only with enable_docs. Every GET route answers HEAD too. No redirects: a
path with a trailing slash is a 404 (Starlette's redirect would name the host the client's Host header gave).

What a client can make the server do is bounded (ServerLimits; docs/serving.md lists the defaults and
their flags): RequestGuard, in front of every route, checks the API key from the headers before a byte of
the body is read, refuses a body over max_body_bytes (413) and one that does not arrive within
body_timeout_s (408); the routes cap prompts per request, characters per prompt and stop strings; chat
templates and tokenization run on one worker thread, never on the event loop; and the HTTP protocol
(`uvicorn_config`) closes a connection whose request headers are not complete within head_timeout_s.

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
  400 invalid_request_error: malformed JSON, no body, a field of the wrong type (strict: "5" is not an
      int), a string that is not valid Unicode, a value out of range (the engine's own message, `param` =
      the field), a prompt that leaves no room to generate, a request the KV pool can never hold, an
      unsupported option;
  401 invalid_api_key; 404 model_not_found (param "model") or an unknown route; 405 a method the route does
  not take (with Allow); 408 the body came too slowly; 413 the body is over max_body_bytes;
  500 server_error (an engine step failed; code request_failed: this request alone failed in the engine),
  503 the engine has stopped.
A stream that fails after it started sends one `data: {"error": ...}` event, then `data: [DONE]`.
A client that disconnects, streaming or not, has its requests aborted (their KV blocks freed).
"""
import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.errors import InvalidRequestError
from pagedattn.serving import protocol as P
from pagedattn.serving.async_llm import EngineDeadError, EngineStepError, RequestFailedError, engine_dead
from pagedattn.serving.metrics import CONTENT_TYPE, ServingMetrics

logger = logging.getLogger("pagedattn.serving")


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


@dataclass
class ServerLimits:
    """What one client may ask of the server (docs/serving.md: defaults and `serve` flags).

    max_body_bytes: request body size (413 beyond). body_timeout_s: the whole body must arrive within it (408).
    head_timeout_s: a connection's request line and headers must be complete within it, or it is closed.
    timeout_keep_alive_s: an idle keep-alive connection is closed after it.
    max_prompts_per_request: prompts in one /v1/completions call.
    max_prompt_chars: characters of one completions prompt, or of a chat request's message content in all.
    max_stop_strings, max_stop_chars: stop strings per request, characters per stop string.
    """

    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 30.0
    head_timeout_s: float = 10.0
    timeout_keep_alive_s: float = 5.0
    max_prompts_per_request: int = 256
    max_prompt_chars: int = 1_000_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidRequestError(f"{f.name} must be a number > 0, got {v!r}")


def bad_request(exc, renames=None):
    """InvalidRequestError -> APIError 400 with `param` = the field its message names."""
    return APIError(400, str(exc), param=P.error_param(exc, renames))


class ServerStoppingError(EngineDeadError):
    """The server is stopping, and this request was still open when its grace period ended (Server)."""


def _engine_error(exc):
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


def build_app(llm, model_name, api_key=None, limits=None, enable_docs=False):
    """The FastAPI app serving `llm` (an AsyncLLM) as `model_name`. api_key: required on /v1/* when set.
    limits: ServerLimits (default ServerLimits()). enable_docs: serve /docs, /redoc and /openapi.json.

    If llm.metrics is None, a ServingMetrics is created and attached to it (before any request)."""
    limits = ServerLimits() if limits is None else limits
    if llm.metrics is None:
        llm.metrics = ServingMetrics(model_name)
    metrics = llm.metrics
    metrics.attach(lambda: {**llm.engine_metrics(), "num_requests_in_flight": llm.num_requests_in_flight},
                   alive=lambda: llm.is_alive)
    tokenizer = llm.tokenizer
    control_tokens = _control_tokens(tokenizer)
    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json") if enable_docs else dict(
        docs_url=None, redoc_url=None, openapi_url=None)
    # redirect_slashes off: Starlette's redirect from "/health/" to "/health" builds its Location from the
    # client's Host header, so any client could make the server send a redirect to a host of its choosing; an
    # unknown path is a 404 like any other.
    app = FastAPI(title="pagedattn", description="OpenAI-compatible server on the pagedattn engine",
                  redirect_slashes=False, **docs)
    app.add_middleware(RequestGuard, api_key=api_key, limits=limits)
    # Chat templates and tokenization: one worker thread (the front's tokenizer is used by one thread at a
    # time), so a long prompt costs its own request time, never the event loop's.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedattn-tokenize")
    app.state.llm, app.state.metrics, app.state.model_name, app.state.limits = llm, metrics, model_name, limits
    open_jobs = app.state.open_jobs = OpenJobs()       # what a stopping Server ends with an error

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # ---- errors ------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc):
        return exc.response()

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineStepError)
    async def _engine_failure(request, exc):
        return _engine_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg"))
            return APIError(400, f"malformed JSON body: {detail}").response()
        if err.get("type") == "missing" and not loc:       # no body at all
            required = _REQUIRED.get(request.url.path, ())
            what = f"a JSON object with {' and '.join(required)}" if required else "a JSON object"
            return APIError(400, f"the request body is empty: {what} is required",
                            param=required[0] if required else None).response()
        if err.get("type") == "missing":
            return APIError(400, f"{'.'.join(loc)} is required", param=loc[0]).response()
        where = ".".join(loc) if loc else "request body"
        return APIError(400, f"{where}: {err.get('msg')}", param=loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        message, headers = str(exc.detail), dict(exc.headers or {})
        allow = headers.get("Allow")
        if exc.status_code == 405 and allow:   # (the headers go out too: Allow, the methods the route takes)
            methods = [m.strip() for m in allow.split(",")]
            if "GET" in methods and "HEAD" not in methods:
                methods.append("HEAD")      # (RequestGuard answers it)
            headers["Allow"] = ", ".join(methods)
            message += f": {request.url.path} takes {headers['Allow']}"
        return APIError(exc.status_code, message, code=code).response(headers=headers)

    # ---- model -------------------------------------------------------------------------------------
    def check_model(name):
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{model_name}`).",
                           param="model", code="model_not_found")

    # ---- routes (every GET route answers HEAD too: RequestGuard) ---------------------------------------
    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return _engine_error(engine_dead(llm.error)).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=model_name, max_model_len=llm.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return P.ModelCard(id=model_name, max_model_len=llm.max_model_len)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        check_model(req.model)
        rid = P.random_id("cmpl")
        try:
            req.check_supported()
            req.check_limits(limits.max_stop_strings, limits.max_stop_chars)
            params = req.sampling_params(16 if req.max_tokens is None else req.max_tokens,
                                         logprobs=req.logprobs is not None)
            prompts = req.prompts()
            if len(prompts) > limits.max_prompts_per_request:
                P.unsupported("prompt", f"prompt holds {len(prompts)} prompts: at most "
                              f"{limits.max_prompts_per_request} are allowed per request")
            for i, p in enumerate(prompts):
                if isinstance(p, str) and len(p) > limits.max_prompt_chars:
                    where = f"prompt {i}" if len(prompts) > 1 else "prompt"
                    P.unsupported("prompt", f"{where} has {len(p)} characters: at most {limits.max_prompt_chars} "
                                  "are allowed")
            if any(isinstance(p, str) for p in prompts):
                prompts = await off_loop(tokenize_all, prompts)
            streams = start(prompts, params, rid)
        except InvalidRequestError as e:
            raise bad_request(e) from e
        job = CompletionJob(rid, model_name, req, streams, tokenizer)
        if req.stream:
            return SSEResponse(job, open_jobs)
        return await until_disconnected(raw, job, open_jobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request):
        check_model(req.model)
        rid = P.random_id("chatcmpl")
        max_tokens_field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        renames = {"prompt": "messages", "max_tokens": max_tokens_field}
        try:
            req.check_supported()
            req.check_limits(limits.max_stop_strings, limits.max_stop_chars)
            ids = await off_loop(lambda: llm.tokenize(render_chat(req)))
            max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
            if max_tokens is None:      # OpenAI's default: whatever room the context leaves (none: the
                max_tokens = max(1, llm.max_request_tokens - len(ids))     # validation says so, naming the prompt)
            params = req.sampling_params(max_tokens, logprobs=bool(req.logprobs))
            streams = start([ids], params, rid)
        except InvalidRequestError as e:
            if P.error_param(e) == "prompt":    # the prompt a chat user never wrote: say where it came from
                e2 = InvalidRequestError(f"messages after the chat template: {e}")
                e2.param = "messages"
                raise bad_request(e2, renames) from e
            raise bad_request(e, renames) from e
        job = ChatJob(rid, model_name, req, streams, tokenizer)
        if req.stream:
            return SSEResponse(job, open_jobs)
        return await until_disconnected(raw, job, open_jobs)

    def render_chat(req):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("messages: this model has no chat template: use /v1/completions")
        chat = req.chat(limits.max_prompt_chars, control_tokens)
        try:
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:          # noqa: BLE001 (the template's own complaint, e.g. a role it refuses)
            raise InvalidRequestError(f"messages: the chat template failed: {e}") from e

    def tokenize_all(prompts):
        """(on the worker thread) Each prompt's token ids; an error names the prompt when there are several."""
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(llm.tokenize(prompt))
            except InvalidRequestError as e:
                if len(prompts) == 1:
                    raise
                raise _of_prompt(e, i) from e
        return ids

    def start(prompts, params, rid):
        """One AsyncLLM request per prompt; if one is refused, those already queued are aborted."""
        streams = []
        for i, prompt in enumerate(prompts):
            try:
                streams.append(llm.add_request(prompt, params, f"{rid}-{i}"))
            except InvalidRequestError as e:
                for s in streams:
                    s.abort()
                if len(prompts) == 1:
                    raise
                raise _of_prompt(e, i) from e
        return streams

    return app


def _of_prompt(exc, i):
    """exc, an InvalidRequestError about prompt i of a request with several, saying which prompt."""
    e = InvalidRequestError(f"prompt {i}: {exc}")
    e.param = P.error_param(exc)
    return e


# The fields a route's body must have, named when the body is missing altogether.
_REQUIRED = {path: tuple(name for name, f in model.model_fields.items() if f.is_required())
             for path, model in [("/v1/completions", P.CompletionRequest),
                                 ("/v1/chat/completions", P.ChatCompletionRequest)]}
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*)$")


def _control_tokens(tokenizer):
    """The tokenizer's added tokens (<|im_start|>, <|im_end|>, ...): strings its encoder turns into one
    control token wherever they appear in text."""
    if tokenizer is None:
        return ()
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names = {getattr(t, "content", str(t)) for t in added.values()} | set(getattr(tokenizer, "all_special_tokens", ()))
    return tuple(sorted(n for n in names if n))


# ---- the guard in front of every route ---------------------------------------------------------------
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
            body = await asyncio.wait_for(self.read_body(receive, limit), self.limits.body_timeout_s)
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


# ---- the HTTP protocol: bounded time to send the request headers ----------------------------------------
def _head_timeout_protocol(base, timeout_s):
    """`base` (uvicorn's httptools or h11 protocol) that closes a connection whose request line and headers are not
    complete within timeout_s of the connection opening or of the first byte of a next request (uvicorn's
    keep-alive timer stops at the first byte, so a client dribbling a header would hold the socket)."""

    class HeadTimeoutProtocol(base):
        head_timeout_s = timeout_s

        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = None
            self._arm_head_timer()

        def _waiting_for_head(self):
            return self.cycle is None or self.cycle.response_complete

        def _arm_head_timer(self):
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data):
            super().data_received(data)
            if self._waiting_for_head():
                self._arm_head_timer()
            else:
                self._disarm_head_timer()

        def _head_timed_out(self):
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            self._disarm_head_timer()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


# Once told to stop, a server gives its open requests this long to finish (then they end with an error).
SHUTDOWN_TIMEOUT_S = 5.0


def http_protocol(impl="auto"):
    """uvicorn's HTTP/1.1 protocol class: "httptools" (the C parser; "auto" picks it when it is installed: it
    is most of the API process's CPU per streamed chunk) or "h11" (pure Python)."""
    if impl not in ("auto", "httptools", "h11"):
        raise ValueError(f"http_impl must be 'auto', 'httptools' or 'h11', got {impl!r}")
    if impl != "h11":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
            return HttpToolsProtocol
        except ImportError:
            if impl == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return H11Protocol


def uvicorn_config(app, host="127.0.0.1", port=8000, log_level="info", limits=None, http_impl="auto",
                   shutdown_timeout_s=SHUTDOWN_TIMEOUT_S, **kwargs):
    """The uvicorn.Config `python -m pagedattn serve` runs `app` with (run it with Server): the HTTP protocol of
    http_impl (see http_protocol) with the head timeout above, uvloop's event loop where it is installed
    (uvicorn's "auto"), limits.timeout_keep_alive_s for idle keep-alive connections (limits: the ServerLimits
    given to build_app, default ServerLimits()), and shutdown_timeout_s: how long open requests may take to
    finish once the server is told to stop (uvicorn's timeout_graceful_shutdown; Server)."""
    limits = ServerLimits() if limits is None else limits
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=_head_timeout_protocol(http_protocol(http_impl), limits.head_timeout_s),
                          timeout_keep_alive=limits.timeout_keep_alive_s, timeout_graceful_shutdown=shutdown_timeout_s,
                          **kwargs)


class Server(uvicorn.Server):
    """uvicorn's Server, whose stop ends the requests still open with an error rather than cutting them.

    On a stop (SIGTERM, Ctrl-C, should_exit): no new connection is accepted and idle keep-alive connections
    close; the open requests get config.timeout_graceful_shutdown seconds (uvicorn_config's shutdown_timeout_s)
    to finish; then every request of the app (build_app's) still open ends with ServerStoppingError, aborted in
    the engine: a stream sends `data: {"error": ...}` and `data: [DONE]`, a non-streamed request answers 503
    (code server_shutting_down). uvicorn's own shutdown follows, and its connections close as those last
    responses complete. (uvicorn alone waits out the same period and then cuts the streams still open: no
    error event, no [DONE].)"""

    async def startup(self, sockets=None):
        jobs = self._open_jobs()
        if jobs is not None:
            jobs.reopen()
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None):
        for server in self.servers:     # (uvicorn's own first steps; it repeats them, harmlessly)
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()       # idle: closed now; busy: closed once its response is complete
        grace = self.config.timeout_graceful_shutdown
        loop = asyncio.get_running_loop()
        deadline = None if grace is None else loop.time() + grace
        while (self.server_state.connections and not self.force_exit
               and (deadline is None or loop.time() < deadline)):
            await asyncio.sleep(0.05)
        jobs = self._open_jobs()
        if jobs is not None:
            jobs.fail_all(ServerStoppingError(
                "the server is shutting down: this request was still running when the shutdown grace period "
                f"({grace:g} s) ended" if grace is not None else "the server is shutting down"))
        await super().shutdown(sockets=sockets)

    def _open_jobs(self):
        return getattr(getattr(self.config.app, "state", None), "open_jobs", None)


# ---- running the requests ------------------------------------------------------------------------------
async def merge_streams(streams):
    """Yield (prompt index, RequestOutput) from several RequestStreams as their outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as e:          # noqa: BLE001 (handed to the consumer)
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class _Job:
    """One HTTP request's engine requests (one per prompt) and how their outputs become choices."""

    def __init__(self, rid, model_name, req, streams, tokenizer):
        self.rid, self.model_name, self.req, self.streams, self.tokenizer = rid, model_name, req, streams, tokenizer
        self.created = int(time.time())
        self.n = req.n or 1
        self.prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        self.completion_tokens = 0
        self.finished = set()           # choice indices whose finish_reason was sent
        self.final = {}                 # choice index -> latest CompletionOutput
        self._pieces = {}               # choice index -> TokenPieces (logprobs)

    def abort(self):
        for s in self.streams:
            s.abort()

    def fail(self, error):
        """End the job's requests with `error` (RequestStream.fail): a stream sends its error event and
        [DONE], a non-streamed request answers with the error."""
        for s in self.streams:
            s.fail(error)

    def usage(self):
        return P.UsageInfo.of(self.prompt_tokens, self.completion_tokens)

    def usage_dict(self):
        """usage() as the plain dict a streamed chunk carries (the same JSON)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def token_strings(self, index, token_ids):
        """The next tokens of choice `index` as text (TokenPieces: what each completes of the choice's text;
        call with the choice's tokens in order)."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in token_ids]
        pieces = self._pieces.get(index)
        if pieces is None:
            pieces = self._pieces[index] = TokenPieces(self.tokenizer)
        return [pieces.step(t) for t in token_ids]

    def updates(self, i, out):
        """(choice index, CompletionOutput, finish_reason sent now or None) for the completions of `out`
        that changed."""
        for c in out.outputs:
            index = i * self.n + c.index
            self.final[index] = c
            k = len(c.delta_token_ids)
            self.completion_tokens += k
            finish = c.finish_reason if c.finish_reason is not None and index not in self.finished else None
            if finish is not None:
                self.finished.add(index)
            if k or c.delta_text or finish is not None:
                yield index, c, finish

    async def run(self):
        """Consume every output (non-streaming) and return the response model."""
        async for i, out in merge_streams(self.streams):
            for _ in self.updates(i, out):
                pass
        return self.response()

    async def write(self, send):
        """Send the SSE events of a streamed response to the ASGI `send`, [DONE] included, each output's chunks
        (one per choice that changed, as OpenAI sends them) in one body message. One coroutine from the
        request's stream to uvicorn's send, where two async generators and Starlette's streaming response
        were: the API process's CPU per streamed token is what limits one API process (docs/serving.md)."""
        done = b"data: [DONE]\n\n"
        try:
            head = b"".join(_sse(chunk) for chunk in self.first_chunks())
            if head:
                await send({"type": "http.response.body", "body": head, "more_body": True})
            if len(self.streams) == 1:  # (no generator between the stream and the socket)
                async for out in self.streams[0]:
                    body = self.body(0, out)
                    if body:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
            else:
                async for i, out in merge_streams(self.streams):
                    body = self.body(i, out)
                    if body:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
            if self.req.include_usage:
                done = _sse(self.chunk([], usage=self.usage_dict())) + done
        except (EngineStepError, EngineDeadError, InvalidRequestError) as e:
            done = b"data: " + json.dumps(_engine_error(e).body()).encode() + b"\n\n" + done
        finally:
            self.abort()                # a no-op unless the client left early
        await send({"type": "http.response.body", "body": done, "more_body": False})

    def body(self, i, out):
        """The SSE events (bytes) of one output of prompt i: a chunk per choice that changed."""
        changed = list(self.updates(i, out))        # (first: the usage counts these tokens)
        usage = self.usage_dict() if self.req.continuous_usage else None
        return b"".join([_sse(self.chunk([self.stream_choice(index, c, finish)], usage)) for index, c, finish in changed])

    def first_chunks(self):
        return []


_JSON = msgspec.json.Encoder()


def _sse(chunk):
    """One server-sent event (bytes) of a chunk dict: compact JSON, UTF-8, as pydantic's model_dump_json
    writes the protocol models (the streamed chunks are plain dicts: a model per token costs more than
    the rest of the token's way through the server)."""
    return b"data: " + _JSON.encode(chunk) + b"\n\n"


class CompletionJob(_Job):
    def __init__(self, *args):
        super().__init__(*args)
        self.offsets = {}               # choice index -> text offset of its next token (logprobs)

    def logprobs(self, index, c, token_ids):
        if self.req.logprobs is None:
            return None
        tokens = self.token_strings(index, token_ids)
        values = (c.logprobs or [])[len(c.logprobs or []) - len(token_ids):]
        start = self.offsets.get(index, 0)
        offsets = []
        for t in tokens:
            offsets.append(start)
            start += len(t)
        self.offsets[index] = start
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets)

    def stream_choice(self, index, c, finish):
        """A streamed choice (P.CompletionChoice's fields, as a dict)."""
        logprobs = self.logprobs(index, c, c.delta_token_ids)
        return {"index": index, "text": c.delta_text, "logprobs": None if logprobs is None else logprobs.model_dump(),
                "finish_reason": finish}

    def chunk(self, choices, usage=None):
        """A streamed chunk (P.CompletionChunk's fields, as a dict)."""
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage}

    def response(self):
        choices = []
        for index, c in sorted(self.final.items()):
            logprobs = self.logprobs(index, c, c.token_ids)
            if logprobs is not None:    # tokens past a stop string start where the (cut) text ends
                logprobs.text_offset = [min(o, len(c.text)) for o in logprobs.text_offset]
            choices.append(P.CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason,
                                              logprobs=logprobs))
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model_name, choices=choices,
                                    usage=self.usage())


class ChatJob(_Job):
    def logprobs(self, index, c, token_ids):
        if not self.req.logprobs:
            return None
        values = (c.logprobs or [])[len(c.logprobs or []) - len(token_ids):]
        texts = self.token_strings(index, token_ids)
        return P.ChatChoiceLogprobs(content=[
            P.ChatLogprob(token=text, logprob=v, bytes=token_bytes(self.tokenizer, t, text))
            for t, text, v in zip(token_ids, texts, values)])

    def first_chunks(self):
        """The role comes first, once per choice, as OpenAI sends it."""
        choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for index in range(len(self.streams) * self.n)]
        return [self.chunk(choices)]

    def stream_choice(self, index, c, finish):
        """A streamed choice (P.ChatCompletionStreamChoice's fields, as a dict; the delta has content only)."""
        logprobs = self.logprobs(index, c, c.delta_token_ids)
        return {"index": index, "delta": {"content": c.delta_text},
                "logprobs": None if logprobs is None else logprobs.model_dump(), "finish_reason": finish}

    def chunk(self, choices, usage=None):
        """A streamed chunk (P.ChatCompletionChunk's fields, as a dict)."""
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage}

    def response(self):
        choices = [P.ChatCompletionChoice(index=index, message=P.ChatResponseMessage(content=c.text),
                                          finish_reason=c.finish_reason, logprobs=self.logprobs(index, c, c.token_ids))
                   for index, c in sorted(self.final.items())]
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model_name,
                                        choices=choices, usage=self.usage())


class TokenPieces:
    """Each token's share of a completion's text, token by token: the characters it completes. A character
    whose UTF-8 bytes span several tokens belongs to the token that completes it (the tokens before get ""),
    so no piece holds a replacement character '\ufffd' and the pieces join to the decoded text (special
    tokens skipped), which makes the completions API's text_offset an offset into that text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(skip_special_tokens=True)
        self.ids, self.text = [], ""

    def step(self, token_id):
        if self.backend is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)       # a slow tokenizer: decode the whole again
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        piece, self.text = full[len(self.text):], full
        return piece


def _byte_level_decoder():
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()


def token_bytes(tokenizer, token_id, text):
    """The UTF-8 bytes a token stands for: for a byte-level BPE token its own bytes (part of a character,
    maybe), otherwise the bytes of its text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteLevel" in repr(backend.decoder):
        token = tokenizer.convert_ids_to_tokens(token_id)
        special = token_id in getattr(tokenizer, "all_special_ids", ())
        if isinstance(token, str) and token and not special and all(ch in _BYTE_LEVEL for ch in token):
            return [_BYTE_LEVEL[ch] for ch in token]
    return list(text.encode("utf-8"))


class SSEResponse(Response):
    """A streamed response (text/event-stream) written by the job itself (_Job.write). While it writes, a task
    waits for the client's disconnect; if that comes first, the writer is cancelled and the job's requests are
    aborted (their blocks freed before the engine's next step). open_jobs: the app's OpenJobs, which hold the
    job while it writes."""
    media_type = "text/event-stream"

    def __init__(self, job, open_jobs):
        self.job, self.open_jobs, self.status_code, self.background = job, open_jobs, 200, None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        with self.open_jobs.holding(self.job):
            writer = await _unless_gone(self.job.write(send), receive, self.job)
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()
        if self.background is not None:
            await self.background()


class OpenJobs:
    """The app's requests being answered (their jobs), so that a stopping server can end them with an error
    (Server.shutdown) instead of cutting their connections. Event-loop code only."""

    def __init__(self):
        self.jobs = set()
        self.error = None               # set by fail_all: a job that starts after it fails at once

    @contextlib.contextmanager
    def holding(self, job):
        if self.error is not None:
            job.fail(self.error)
        self.jobs.add(job)
        try:
            yield
        finally:
            self.jobs.discard(job)

    def fail_all(self, error):
        """End every job held, and every job that starts from now on, with `error` (_Job.fail)."""
        self.error = error
        for job in list(self.jobs):
            job.fail(error)

    def reopen(self):
        """Take jobs normally again (a server starting on this app anew)."""
        self.error = None


async def _unless_gone(coro, receive, job):
    """Run coro as a task until it ends or the client disconnects, whichever comes first; on a disconnect
    the task is cancelled and the job's requests aborted (nobody is left to answer). Returns the task."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            job.abort()
    return work


async def until_disconnected(raw, job, open_jobs):
    """Run a non-streamed job (held in open_jobs meanwhile); if the client disconnects first, abort it (nobody is
    left to answer)."""
    with open_jobs.holding(job):
        work = await _unless_gone(job.run(), raw.receive, job)
    if not work.done() or work.cancelled():
        return Response(status_code=499)   # the client is gone; this is never read
    try:
        return work.result()
    except (EngineStepError, EngineDeadError, InvalidRequestError) as e:
        return _engine_error(e).response()


async def _wait_disconnect(receive):
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
