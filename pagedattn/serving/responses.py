"""How a request's engine outputs become an OpenAI response: a JSON body, or server-sent events.

    job = CompletionJob(rid, model_name, req, streams, tokenizer)      # streams: one RequestStream per prompt
    return SSEResponse(job, open_jobs) if req.stream else await until_disconnected(raw, job, open_jobs)

A job holds one HTTP request's engine requests (one per prompt, each with n completions: choice index =
prompt x n + completion) and turns their increments into choices: a streamed chunk per choice that changed
(a plain dict encoded by msgspec, byte for byte what the pydantic protocol models write; the chunks of one
output go out in one write), `data: [DONE]` last. A stream that fails after it started sends one
`data: {"error": ...}` event, then `data: [DONE]`. A client that disconnects, streaming or not, has its
requests aborted (their KV blocks freed before the engine's next step). OpenJobs holds the requests being
answered, so a stopping server (http_server.Server) can end them with an error instead of cutting them.
"""
import asyncio
import contextlib
import functools
import json
import time
import types

import msgspec
from fastapi.responses import Response

from pagedattn.errors import InvalidRequestError
from pagedattn.serving import protocol as P
from pagedattn.serving.http_errors import error_of
from pagedattn.serving.stream import EngineDeadError, EngineStepError
from pagedattn.serving.token_text import TokenPieces, token_bytes


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
        self.continuous_usage = req.stream and req.continuous_usage
        self.frame = None               # a streamed choice's bytes around its values (event); None: the dicts
        for s in streams:               # a streamed chunk carries the new tokens and text alone; a body, the end
            s.deltas_only, s.final_only = req.stream, not req.stream

    def frame_of(self, obj, before_text, after_text):
        """(head, mid, tail) of a streamed chunk of one choice with no logprobs: head + index + mid + the
        text's JSON + tail + the finish reason's JSON + '}],"usage":' + the usage's JSON + '}', as event
        writes it: the bytes _sse writes of chunk([stream_choice(...)], usage), without building either."""
        head = b'data: {"id":%s,"object":%s,"created":%d,"model":%s,"choices":[{"index":' % (
            _JSON.encode(self.rid), _JSON.encode(obj), self.created, _JSON.encode(self.model_name))
        return head, before_text, after_text + b',"logprobs":null,"finish_reason":'

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
        """[(choice index, CompletionOutput, finish_reason sent now or None)] for the completions of `out`
        that changed."""
        changed = []
        for c in out.outputs:
            index = i * self.n + c.index
            self.final[index] = c
            k = len(c.delta_token_ids)
            self.completion_tokens += k
            finish = c.finish_reason if c.finish_reason is not None and index not in self.finished else None
            if finish is not None:
                self.finished.add(index)
            if k or c.delta_text or finish is not None:
                changed.append((index, c, finish))
        return changed

    async def run(self):
        """Consume every output (non-streaming) and return the response model."""
        async for i, out in merge_streams(self.streams):
            for _ in self.updates(i, out):
                pass
        return self.response()

    async def write(self, send):
        """Send the SSE events of a streamed response to the ASGI `send`, [DONE] included. The events are
        written as the front processes each step (RequestStream.push_to: on_output), each output's chunks
        (one per choice that changed, as OpenAI sends them) in one body message: no task wakes per step per
        stream, and none of the response's Python runs outside the step's processing (the API process's CPU
        per streamed token is what limits one API process, docs/serving.md). Returns once [DONE] went out."""
        self.sender = _Sender(send)
        self.ended = asyncio.get_running_loop().create_future()
        self.open = len(self.streams)
        try:
            head = b"".join(_sse(chunk) for chunk in self.first_chunks())
            if head:
                self.sender.write(head)
            for i, stream in enumerate(self.streams):
                if not self.ended.done():
                    stream.push_to(functools.partial(self.on_output, i))
            await self.ended
        finally:
            self.abort()                # a no-op unless the client left early or a stream failed

    def on_output(self, i, out, error):
        """(RequestStream's writer, on the loop) An output of prompt i's stream, or its error: the chunks it
        brings; after the last stream's final output (or the first error) the usage, [DONE], the end."""
        if self.ended.done():
            return
        try:
            if error is not None:
                if not isinstance(error, (EngineStepError, EngineDeadError, InvalidRequestError)):
                    raise error
                self.end(b"data: " + json.dumps(error_of(error).body()).encode() + b"\n\n")
                return
            body = self.body(i, out)
            if out.finished:
                self.open -= 1
                if not self.open:
                    if self.req.include_usage:
                        body += _sse(self.chunk([], usage=self.usage_dict()))
                    self.end(body)
                    return
            if body:
                self.sender.write(body)
        except Exception as e:          # noqa: BLE001 (this response fails; the step's other responses go on)
            self.ended.set_exception(e)
            self.abort()

    def end(self, body):
        """The last body message (body, then [DONE]); `ended` is set once it went out."""
        self.sender.write(body + b"data: [DONE]\n\n", more_body=False)
        self.sender.then(self.ended)

    def body(self, i, out):
        """The SSE events (bytes) of one output of prompt i: a chunk per choice that changed."""
        changed = self.updates(i, out)              # (first: the usage counts these tokens)
        usage = self.usage_dict() if self.continuous_usage else None
        if len(changed) == 1:
            return self.event(*changed[0], usage)
        return b"".join([self.event(index, c, finish, usage) for index, c, finish in changed])

    def event(self, index, c, finish, usage):
        """The SSE event (bytes) of streamed choice `index` (CompletionOutput c, finish reason sent now or
        None, usage dict or None): from the job's frame when it has one (no logprobs), else _sse(chunk(...))."""
        if self.frame is None:
            return _sse(self.chunk([self.stream_choice(index, c, finish)], usage))
        head, mid, tail = self.frame
        return b'%s%d%s%s%s%s}],"usage":%s}\n\n' % (
            head, index, mid, _JSON.encode(c.delta_text), tail, b"null" if finish is None else _JSON.encode(finish),
            b"null" if usage is None else _JSON.encode(usage))

    def first_chunks(self):
        return []


_JSON = msgspec.json.Encoder()


class _Sender:
    """An ASGI `send` called from code that is not a coroutine (a step's processing): each message is sent on
    the spot. An ASGI send returns without waiting unless the socket's buffer is full (uvicorn then awaits its
    drain): sent as `send(message).send(None)`, a send that returns at once costs no task; one that waits
    goes on as a task, and the messages written meanwhile follow it in one message, in order."""

    def __init__(self, send):
        self.send = send
        self.backlog = None             # messages written while a send waits for the socket (and then a task runs)
        self.task = None

    def write(self, body, more_body=True):
        message = {"type": "http.response.body", "body": body, "more_body": more_body}
        if self.backlog is not None:
            self.backlog.append(message)
            return
        send = self.send(message)
        try:
            waiting_on = send.send(None)
        except StopIteration:
            return
        self.backlog = []
        self.task = asyncio.ensure_future(self._drain(send, waiting_on))

    async def _drain(self, send, waiting_on):
        try:
            await resume(send, waiting_on)
            while self.backlog:
                messages, self.backlog = self.backlog, []
                await self.send({"type": "http.response.body", "body": b"".join(m["body"] for m in messages),
                                 "more_body": messages[-1]["more_body"]})
        finally:
            self.backlog = None

    def then(self, future):
        """Resolve `future` once every message written so far went out (or with the exception a send raised)."""
        if self.task is None or self.task.done():       # (a finished task left no backlog)
            error = None if self.task is None or self.task.cancelled() else self.task.exception()
        else:
            self.task.add_done_callback(lambda _: self.then(future))
            return
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


@types.coroutine
def resume(coro, waiting_on):
    """Run `coro` to its end from where it stopped: it was stepped once by hand (coro.send(None)) and
    yielded `waiting_on` (what it waits for), as `await coro` would have gone on from there."""
    while True:
        try:
            sent = yield waiting_on
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:      # (thrown into the task: a cancellation)
            try:
                waiting_on = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waiting_on = coro.send(sent)
            except StopIteration as stop:
                return stop.value


def _sse(chunk):
    """One server-sent event (bytes) of a chunk dict: compact JSON, UTF-8, as pydantic's model_dump_json
    writes the protocol models (the streamed chunks are plain dicts: a model per token costs more than
    the rest of the token's way through the server)."""
    return b"data: " + _JSON.encode(chunk) + b"\n\n"


class CompletionJob(_Job):
    def __init__(self, *args):
        super().__init__(*args)
        self.offsets = {}               # choice index -> text offset of its next token (logprobs)
        if self.req.stream and self.req.logprobs is None:
            self.frame = self.frame_of("text_completion", b',"text":', b"")

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
    def __init__(self, *args):
        super().__init__(*args)
        if self.req.stream and not self.req.logprobs:
            self.frame = self.frame_of("chat.completion.chunk", b',"delta":{"content":', b"}")

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


class SSEResponse(Response):
    """A streamed response (text/event-stream) written by the job itself (_Job.write; its body messages to the
    server's own send where the app kept it in the scope, build_app's _App). While it writes, a task
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
            writer = await _unless_gone(self.job.write(scope.get("pagedattn.send", send)), receive, self.job)
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
        return error_of(e).response()


async def _wait_disconnect(receive):
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
