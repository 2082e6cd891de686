"""The OpenAI-compatible HTTP layer (FastAPI): it only translates.

    app = build_app(AsyncLLM(LLM(model_dir)), model_name="tiny")      # then: uvicorn.run(app, ...)

A request body becomes prompt token ids + SamplingParams (protocol.py), AsyncLLM runs it, and its
increments become a JSON response or server-sent events (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`).
Nothing here knows about blocks or steps.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these need the API key when
one is set: `Authorization: Bearer KEY`), GET /health, GET /metrics (Prometheus text).

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
  400 invalid_request_error: malformed JSON, a field of the wrong type, a value out of range (the
      engine's own message, `param` = the field), a prompt too long, a request the KV pool can never
      hold, an unsupported option;
  401 invalid_api_key; 404 model_not_found (param "model") or an unknown route;
  500 server_error (an engine step failed), 503 the engine has stopped.
A stream that fails after it started sends one `data: {"error": ...}` event, then `data: [DONE]`.
A client that disconnects, streaming or not, has its requests aborted (their KV blocks freed).
"""
import asyncio
import json
import logging
import secrets
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.errors import InvalidRequestError
from pagedattn.serving import protocol as P
from pagedattn.serving.async_llm import EngineDeadError, EngineStepError
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

    def response(self):
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(exc, renames=None):
    """InvalidRequestError -> APIError 400 with `param` = the field its message names."""
    return APIError(400, str(exc), param=P.error_param(exc, renames))


def _engine_error(exc):
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="server_error", code="engine_step_failed")
    if isinstance(exc, InvalidRequestError):     # refused by the engine itself when added
        return bad_request(exc)
    return APIError(500, f"internal error: {exc!r}", type="server_error")


def build_app(llm, model_name, api_key=None):
    """The FastAPI app serving `llm` (an AsyncLLM) as `model_name`. api_key: required on /v1/* when set.

    If llm.metrics is None, a ServingMetrics is created and attached to it (before any request)."""
    if llm.metrics is None:
        llm.metrics = ServingMetrics(model_name)
    metrics = llm.metrics
    metrics.attach(lambda: {**llm.engine_metrics(), "num_requests_in_flight": llm.num_requests_in_flight})
    tokenizer = llm.tokenizer
    app = FastAPI(title="pagedattn", description="OpenAI-compatible server on the pagedattn engine")
    app.state.llm, app.state.metrics, app.state.model_name = llm, metrics, model_name

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
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err.get("msg"))
            return APIError(400, f"malformed JSON body: {detail}").response()
        if err.get("type") == "missing":
            return APIError(400, f"{'.'.join(loc)} is required", param=loc[0] if loc else None).response()
        where = ".".join(loc) if loc else "request body"
        return APIError(400, f"{where}: {err.get('msg')}", param=loc[0] if loc else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    # ---- auth, model -------------------------------------------------------------------------------
    async def check_api_key(request: Request):
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def check_model(name):
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{model_name}`).",
                           param="model", code="model_not_found")

    # ---- routes ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return _engine_error(EngineDeadError(f"the engine has stopped: {llm.error}")).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models():
        return P.ModelList(data=[P.ModelCard(id=model_name, max_model_len=llm.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(req: P.CompletionRequest, raw: Request):
        check_model(req.model)
        rid = P.random_id("cmpl")
        try:
            req.check_supported()
            params = req.sampling_params(16 if req.max_tokens is None else req.max_tokens,
                                         logprobs=req.logprobs is not None)
            streams = start(req.prompts(), params, rid)
        except InvalidRequestError as e:
            raise bad_request(e) from e
        job = CompletionJob(rid, model_name, req, streams, tokenizer)
        if req.stream:
            return sse_response(job)
        return await until_disconnected(raw, job)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request):
        check_model(req.model)
        rid = P.random_id("chatcmpl")
        max_tokens_field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        renames = {"prompt": "messages", "max_tokens": max_tokens_field}
        try:
            req.check_supported()
            ids = llm.tokenize(render_chat(req))
            max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
            if max_tokens is None:      # OpenAI's default: whatever room the context leaves
                max_tokens = llm.max_request_tokens - len(ids)
                if max_tokens < 1:
                    raise InvalidRequestError(
                        f"prompt has {len(ids)} tokens after the chat template, which leaves no room to generate: "
                        f"the prompt length must be < {llm.max_request_tokens}")
            params = req.sampling_params(max_tokens, logprobs=bool(req.logprobs))
            streams = start([ids], params, rid)
        except InvalidRequestError as e:
            raise bad_request(e, renames) from e
        job = ChatJob(rid, model_name, req, streams, tokenizer)
        if req.stream:
            return sse_response(job)
        return await until_disconnected(raw, job)

    def render_chat(req):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("messages: this model has no chat template: use /v1/completions")
        try:
            return tokenizer.apply_chat_template(req.chat(), tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt)
        except Exception as e:          # noqa: BLE001 (the template's own complaint, e.g. a role it refuses)
            raise InvalidRequestError(f"messages: the chat template failed: {e}") from e

    def start(prompts, params, rid):
        """One AsyncLLM request per prompt; if one is refused, those already queued are aborted."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(llm.add_request(prompt, params, f"{rid}-{i}"))
        except InvalidRequestError as e:
            for s in streams:
                s.abort()
            if len(prompts) > 1:
                e2 = InvalidRequestError(f"prompt {i}: {e}")
                e2.param = P.error_param(e)
                raise e2 from e
            raise
        return streams

    return app


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

    def abort(self):
        for s in self.streams:
            s.abort()

    def usage(self):
        return P.UsageInfo.of(self.prompt_tokens, self.completion_tokens)

    def token_strings(self, token_ids):
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in token_ids]
        return [self.tokenizer.decode([t]) for t in token_ids]

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

    async def events(self):
        """The SSE events (str) of a streamed response, [DONE] included."""
        try:
            for chunk in self.first_chunks():
                yield _sse(chunk)
            async for i, out in merge_streams(self.streams):
                for index, c, finish in list(self.updates(i, out)):     # one choice per chunk, as OpenAI
                    chunk = self.chunk([self.stream_choice(index, c, finish)])
                    if self.req.continuous_usage:
                        chunk.usage = self.usage()
                    yield _sse(chunk)
            if self.req.include_usage:
                yield _sse(self.chunk([], usage=self.usage()))
        except (EngineStepError, EngineDeadError, InvalidRequestError) as e:
            yield "data: " + json.dumps(_engine_error(e).body()) + "\n\n"
        finally:
            self.abort()                # a no-op unless the client left early
        yield "data: [DONE]\n\n"

    def first_chunks(self):
        return []


def _sse(model):
    return "data: " + model.model_dump_json() + "\n\n"


class CompletionJob(_Job):
    def __init__(self, *args):
        super().__init__(*args)
        self.offsets = {}               # choice index -> text offset of its next token (logprobs)

    def logprobs(self, index, c, token_ids):
        if self.req.logprobs is None:
            return None
        tokens = self.token_strings(token_ids)
        values = (c.logprobs or [])[len(c.logprobs or []) - len(token_ids):]
        start = self.offsets.get(index, 0)
        offsets = []
        for t in tokens:
            offsets.append(start)
            start += len(t)
        self.offsets[index] = start
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets)

    def stream_choice(self, index, c, finish):
        return P.CompletionChoice(index=index, text=c.delta_text, finish_reason=finish,
                                  logprobs=self.logprobs(index, c, c.delta_token_ids))

    def chunk(self, choices, usage=None):
        return P.CompletionChunk(id=self.rid, created=self.created, model=self.model_name, choices=choices,
                                 usage=usage)

    def response(self):
        choices = [P.CompletionChoice(index=index, text=c.text, finish_reason=c.finish_reason,
                                      logprobs=self.logprobs(index, c, c.token_ids))
                   for index, c in sorted(self.final.items())]
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model_name, choices=choices,
                                    usage=self.usage())


class ChatJob(_Job):
    def logprobs(self, c, token_ids):
        if not self.req.logprobs:
            return None
        values = (c.logprobs or [])[len(c.logprobs or []) - len(token_ids):]
        return P.ChatChoiceLogprobs(content=[
            P.ChatLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8")))
            for t, v in zip(self.token_strings(token_ids), values)])

    def first_chunks(self):
        """The role comes first, once per choice, as OpenAI sends it."""
        choices = [P.ChatCompletionStreamChoice(index=index, delta=P.DeltaMessage(role="assistant", content=""))
                   for index in range(len(self.streams) * self.n)]
        return [self.chunk(choices)]

    def stream_choice(self, index, c, finish):
        return P.ChatCompletionStreamChoice(index=index, delta=P.DeltaMessage(content=c.delta_text),
                                            finish_reason=finish, logprobs=self.logprobs(c, c.delta_token_ids))

    def chunk(self, choices, usage=None):
        return P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model_name, choices=choices,
                                     usage=usage)

    def response(self):
        choices = [P.ChatCompletionChoice(index=index, message=P.ChatResponseMessage(content=c.text),
                                          finish_reason=c.finish_reason, logprobs=self.logprobs(c, c.token_ids))
                   for index, c in sorted(self.final.items())]
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model_name,
                                        choices=choices, usage=self.usage())


def sse_response(job):
    """A streamed response; if the client disconnects, Starlette cancels the stream and the background
    task aborts the job's requests (the stream's own `finally` does too, once it is closed)."""
    return StreamingResponse(job.events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(_abort_job, job))


async def _abort_job(job):
    job.abort()


async def until_disconnected(raw, job):
    """Run a non-streamed job; if the client disconnects first, abort it (nobody is left to answer)."""
    work = asyncio.ensure_future(job.run())
    gone = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            job.abort()
    if not work.done() or work.cancelled():
        return Response(status_code=499)   # the client is gone; this is never read
    try:
        return work.result()
    except (EngineStepError, EngineDeadError, InvalidRequestError) as e:
        return _engine_error(e).response()


async def _wait_disconnect(raw):
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
