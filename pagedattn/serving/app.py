"""The OpenAI-compatible HTTP layer (FastAPI): it only translates.

    app = build_app(CoreClient.in_thread(LLM(model_dir)), model_name="tiny")
    Server(uvicorn_config(app, "127.0.0.1", 8000)).run()                     # pagedattn.serving.http_server

A request body becomes prompt token ids + SamplingParams (protocol.py), the engine's front (CoreClient)
runs it, and its increments become a JSON response or server-sent events (responses.py). Nothing here
knows about blocks or steps.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id} (these need
the API key when one is set: `Authorization: Bearer KEY`), GET /health, GET /metrics (Prometheus text);
/docs, /redoc and /openapi.json only with enable_docs. Every GET route answers HEAD too. No redirects: a
path with a trailing slash is a 404 (Starlette's redirect would name the host the client's Host header gave).

What a client can make the server do is bounded (ServerLimits; docs/serving.md lists the defaults and
their flags): RequestGuard (guard.py), in front of every route, checks the API key from the headers before a byte of
the body is read, refuses a body over max_body_bytes (413) and one that does not arrive within
body_timeout_s (408); the routes cap prompts per request, characters per prompt and stop strings; chat
templates and tokenization run on one worker thread, never on the event loop; and the HTTP protocol
(http_server.uvicorn_config) closes a connection whose request headers are not complete within head_timeout_s.

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}} (http_errors.py):
  400 invalid_request_error: malformed JSON, no body, a field of the wrong type (strict: "5" is not an
      int), a string that is not valid Unicode, a value out of range (the engine's own message, `param` =
      the field), a prompt that leaves no room to generate, a request the KV pool can never hold, an
      unsupported option;
  401 invalid_api_key; 404 model_not_found (param "model") or an unknown route; 405 a method the route does
  not take (with Allow); 408 the body came too slowly; 413 the body is over max_body_bytes;
  500 server_error (an engine step failed; code request_failed: this request alone failed in the engine),
  503 the engine has stopped (code engine_dead) or the server is stopping (server_shutting_down).
A stream that fails after it started sends one `data: {"error": ...}` event, then `data: [DONE]`.
A client that disconnects, streaming or not, has its requests aborted (their KV blocks freed).
"""
import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.errors import InvalidRequestError
from pagedattn.serving import protocol as P
from pagedattn.serving.config import ServerLimits
from pagedattn.serving.guard import RequestGuard
from pagedattn.serving.http_errors import APIError, bad_request, error_of
from pagedattn.serving.metrics import CONTENT_TYPE, ServingMetrics
from pagedattn.serving.responses import ChatJob, CompletionJob, OpenJobs, SSEResponse, until_disconnected
from pagedattn.serving.stream import EngineDeadError, EngineStepError, engine_dead
from pagedattn.serving.token_text import control_tokens


def build_app(client, model_name, api_key=None, limits=None, enable_docs=False):
    """The FastAPI app serving `client` (a CoreClient) as `model_name`. api_key: required on /v1/* when set.
    limits: ServerLimits (default ServerLimits()). enable_docs: serve /docs, /redoc and /openapi.json.

    If client.metrics is None, a ServingMetrics is created and attached to it (before any request)."""
    limits = ServerLimits() if limits is None else limits
    if client.metrics is None:
        client.metrics = ServingMetrics(model_name)
    metrics = client.metrics
    metrics.attach(lambda: {**client.engine_metrics(), "num_requests_in_flight": client.num_requests_in_flight},
                   alive=lambda: client.is_alive)
    tokenizer = client.tokenizer
    specials = control_tokens(tokenizer)
    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json") if enable_docs else dict(
        docs_url=None, redoc_url=None, openapi_url=None)
    # redirect_slashes off: Starlette's redirect from "/health/" to "/health" builds its Location from the
    # client's Host header, so any client could make the server send a redirect to a host of its choosing; an
    # unknown path is a 404 like any other.
    app = _App(title="pagedattn", description="OpenAI-compatible server on the pagedattn engine",
               redirect_slashes=False, **docs)
    app.add_middleware(RequestGuard, api_key=api_key, limits=limits)
    # Chat templates and tokenization: one worker thread (the front's tokenizer is used by one thread at a
    # time), so a long prompt costs its own request time, never the event loop's.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedattn-tokenize")
    app.state.client, app.state.metrics, app.state.model_name, app.state.limits = client, metrics, model_name, limits
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
        return error_of(exc).response()

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
        if not client.is_alive:
            return error_of(engine_dead(client.error)).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=model_name, max_model_len=client.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return P.ModelCard(id=model_name, max_model_len=client.max_model_len)

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
            ids = await off_loop(lambda: client.tokenize(render_chat(req)))
            max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
            if max_tokens is None:      # OpenAI's default: whatever room the context leaves (none: the
                max_tokens = max(1, client.max_request_tokens - len(ids))     # validation says so, naming the prompt)
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
        chat = req.chat(limits.max_prompt_chars, specials)
        try:
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        except Exception as e:          # noqa: BLE001 (the template's own complaint, e.g. a role it refuses)
            raise InvalidRequestError(f"messages: the chat template failed: {e}") from e

    def tokenize_all(prompts):
        """(on the worker thread) Each prompt's token ids; an error names the prompt when there are several."""
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(client.tokenize(prompt))
            except InvalidRequestError as e:
                if len(prompts) == 1:
                    raise
                raise _of_prompt(e, i) from e
        return ids

    def start(prompts, params, rid):
        """One engine request per prompt; if one is refused, those already queued are aborted."""
        streams = []
        for i, prompt in enumerate(prompts):
            try:
                streams.append(client.add_request(prompt, params, f"{rid}-{i}"))
            except InvalidRequestError as e:
                for s in streams:
                    s.abort()
                if len(prompts) == 1:
                    raise
                raise _of_prompt(e, i) from e
        return streams

    return app


class _App(FastAPI):
    """FastAPI, keeping the server's own ASGI `send` in the scope ("pagedattn.send"). A streamed response sends
    its start through the middlewares' wrappers of `send` (they note that a response started) and its body
    messages, which they pass on unchanged, straight to the server's (SSEResponse): two coroutine layers less
    per chunk."""

    async def __call__(self, scope, receive, send):
        scope["pagedattn.send"] = send
        await super().__call__(scope, receive, send)


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
