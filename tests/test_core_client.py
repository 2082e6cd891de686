"""AsyncLLM's threading contract on a scripted fake engine (no model: fast, and every failure is on cue).

The fake has the engine's request interface (validate_request, add_request(stream=True), step, abort_request,
has_unfinished_requests, metrics). Request "r" with max_tokens=k emits the tokens 0..k-1, one per step, with
the text "<t0>", "<t1>", ...; `fail_steps` makes chosen steps raise. The real engine behind the real server is
tests/test_serving.py's business.
"""
import asyncio
import threading
import time

import pytest
from serving_helpers import signal_handlers_kept  # noqa: F401 (autouse: SIGTERM/SIGINT handlers kept)

from pagedattn.engine.outputs import CompletionOutput, RequestOutput
from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import SamplingParams
from pagedattn.serving.async_llm import (AsyncLLM, EngineDeadError, EngineStepError, RequestFailedError, engine_dead,
                                         merge_outputs)
from pagedattn.serving.metrics import ServingMetrics


class FakeConfig:
    block_size = 16
    max_num_seqs = 8


class FakeEngine:
    def __init__(self, fail_steps=(), step_delay=0.0, refuse_ids=(), fail_ids=()):
        self.config = FakeConfig()
        self.tokenizer = None
        self.model_path = "fake"
        self.max_model_len = 64
        self.vocab_size = 512
        self.num_blocks = 16
        self.requests = {}              # id -> [params, generated count, stream]
        self.aborted = []
        self.num_steps = 0
        self.fail_steps = set(fail_steps)
        self.step_delay = step_delay
        self.refuse_ids = set(refuse_ids)
        self.fail_ids = set(fail_ids)   # requests that fail alone at their second step (as fail_request does)
        self.thread_ids = set()         # threads that called add_request / step / abort_request

    def validate_request(self, prompt, params):
        if params.max_tokens > 32:
            raise InvalidRequestError(f"max_tokens must be in [1, 32], got {params.max_tokens}")
        return list(prompt)

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, stream=False):
        self.thread_ids.add(threading.get_ident())
        if request_id in self.refuse_ids:
            raise InvalidRequestError(f"request_id {request_id!r} refused")
        assert request_id not in self.requests
        self.requests[request_id] = [params, 0, stream]

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.num_steps in self.fail_steps:
            raise RuntimeError(f"step {self.num_steps} failed")
        outs = []
        for rid, state in list(self.requests.items()):
            params, k, _ = state
            if rid in self.fail_ids and k == 1:
                del self.requests[rid]
                c = CompletionOutput(0, "", [0], "error")
                outs.append(RequestOutput(rid, None, [1, 2], [c], finished=True, error="its row broke"))
                continue
            state[1] = k + 1
            done = k + 1 == params.max_tokens
            ids = list(range(k + 1))
            c = CompletionOutput(0, "".join(f"<t{i}>" for i in ids), ids, "length" if done else None,
                                 delta_text=f"<t{k}>", delta_token_ids=[k])
            outs.append(RequestOutput(rid, None, [1, 2], [c], finished=done))
            if done:
                del self.requests[rid]
        return outs

    def metrics(self):
        return {"num_running": len(self.requests), "num_waiting": 0, "num_free_blocks": self.num_blocks,
                "num_blocks": self.num_blocks}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def params(k):
    return SamplingParams(temperature=0, max_tokens=k)


@pytest.fixture
def make_llm():
    made = []

    def make(**kwargs):
        llm = AsyncLLM(FakeEngine(**kwargs))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


async def collect(llm, k, rid=None):
    outs = [out async for out in llm.generate([1, 2], params(k), rid)]
    return outs


def test_deltas_concatenate_to_the_final_output(make_llm):
    llm = make_llm()

    async def main():
        return await asyncio.gather(collect(llm, 5, "a"), collect(llm, 2, "b"), collect(llm, 7, "c"))

    for outs, k in zip(run(main()), [5, 2, 7]):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        c = outs[-1].outputs[0]
        assert "".join(o.outputs[0].delta_text for o in outs) == c.text == "".join(f"<t{i}>" for i in range(k))
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == c.token_ids == list(range(k))
    assert llm.engine.thread_ids == {llm._thread.ident}       # only the engine thread touched the engine
    assert llm.num_requests_in_flight == 0


def test_a_slow_consumer_gets_merged_outputs(make_llm):
    llm = make_llm()

    async def main():
        stream = llm.add_request([1, 2], params(6), "slow")
        while llm.engine.has_unfinished_requests() or llm.engine.num_steps == 0:
            await asyncio.sleep(0.01)   # the engine runs all 6 steps before we read anything
        return [out async for out in stream]

    outs = run(main())
    assert len(outs) == 1 and outs[0].finished
    c = outs[0].outputs[0]
    assert c.delta_token_ids == c.token_ids == list(range(6)) and c.delta_text == c.text


def test_stream_interval_batches_increments(make_llm):
    llm = make_llm(step_delay=0.005)
    llm.stream_interval = 3

    async def main():
        return [out async for out in llm.generate([1, 2], params(7))]

    counts = [len(o.outputs[0].delta_token_ids) for o in run(main())]
    # the first token at once, then >= 3 tokens per increment, the last one whatever is left
    assert sum(counts) == 7 and len(counts) <= 3 and all(k >= 3 for k in counts[1:-1]), counts


def test_leaving_early_aborts(make_llm):
    llm = make_llm(step_delay=0.002)

    async def main():
        got = []
        async for out in llm.generate([1, 2], params(30), "early"):
            got.append(out)
            if len(got) == 2:
                break                   # closes the generator: the request must be aborted
        return got

    run(main())
    llm.wait_until_idle(10)
    assert llm.engine.aborted == ["early"] and not llm.engine.has_unfinished_requests()


def test_cancelling_the_consumer_task_aborts(make_llm):
    llm = make_llm(step_delay=0.002)

    async def main():
        task = asyncio.ensure_future(collect(llm, 30, "cancelled"))
        while llm.engine.num_steps < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    llm.wait_until_idle(10)
    assert llm.engine.aborted == ["cancelled"] and not llm.engine.has_unfinished_requests()


def test_invalid_and_duplicate_requests_raise_at_once(make_llm):
    llm = make_llm(step_delay=0.002)

    async def main():
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            llm.add_request([1], params(33), "too-long")
        first = llm.add_request([1], params(5), "dup")
        with pytest.raises(InvalidRequestError, match="already running"):
            llm.add_request([1], params(5), "dup")
        return [out async for out in first]

    outs = run(main())
    assert outs[-1].outputs[0].token_ids == list(range(5))
    assert "too-long" not in llm.engine.aborted


def test_an_add_error_reaches_only_its_own_stream(make_llm):
    llm = make_llm(refuse_ids={"bad"})

    async def main():
        return await asyncio.gather(collect(llm, 4, "good"), collect(llm, 4, "bad"), return_exceptions=True)

    good, bad = run(main())
    assert good[-1].outputs[0].token_ids == list(range(4))
    assert isinstance(bad, InvalidRequestError) and "refused" in str(bad)


def test_a_failed_step_fails_the_requests_in_flight_and_the_loop_goes_on(make_llm):
    llm = make_llm(fail_steps={3})

    async def main():
        failed = await asyncio.gather(collect(llm, 10, "x"), collect(llm, 10, "y"), return_exceptions=True)
        after = await collect(llm, 3, "z")
        return failed, after

    failed, after = run(main())
    for e in failed:
        assert isinstance(e, EngineStepError) and isinstance(e.__cause__, RuntimeError)
    assert sorted(llm.engine.aborted) == ["x", "y"]
    assert after[-1].outputs[0].token_ids == [0, 1, 2] and llm.is_alive and llm.num_step_errors == 1


def test_a_request_that_fails_alone_fails_only_its_stream(make_llm):
    llm = make_llm(fail_ids={"bad"})
    llm.metrics = ServingMetrics("fake")

    async def main():
        return await asyncio.gather(collect(llm, 5, "good"), collect(llm, 5, "bad"), return_exceptions=True)

    good, bad = run(main())
    assert good[-1].outputs[0].token_ids == list(range(5)) and good[-1].finished
    assert isinstance(bad, RequestFailedError) and "its row broke" in str(bad)
    assert llm.is_alive and llm.num_step_errors == 0 and "bad" not in llm.engine.aborted
    llm.wait_until_idle()
    assert llm.metrics.finished_requests == {"length": 1, "error": 1} and llm.metrics.e2e.count == 2


def test_a_request_aborted_before_the_engine_took_it_is_counted_once(make_llm):
    llm = make_llm(step_delay=0.05)
    llm.metrics = ServingMetrics("fake")

    async def main():
        streams = [llm.add_request([1, 2], params(30), f"r{i}") for i in range(5)]
        for s in streams:               # before the engine thread drains its inbox (or right after)
            s.abort()
            s.abort()                   # a second abort changes nothing

    run(main())
    llm.wait_until_idle()
    assert llm.metrics.finished_requests == {"abort": 5} and llm.metrics.e2e.count == 5


def test_shutdown_fails_streams_and_refuses_new_requests(make_llm):
    llm = make_llm(step_delay=0.005)

    async def main():
        stream = llm.add_request([1], params(30), "cut")
        first = await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            llm.add_request([1], params(3), "late")
        return first

    # the first output holds the first token, and any that came before the reader took it (a stream merges
    # the outputs it has not handed out yet, so a slow reader may see [0, 1])
    assert run(main()).outputs[0].delta_token_ids[:1] == [0]
    assert not llm.is_alive and not llm.engine.has_unfinished_requests()


def test_failing_a_stream_raises_in_its_reader_and_aborts_the_request(make_llm):
    """RequestStream.fail (a stopping server's way to end a request): the reader's next read raises the
    error, even when it was not waiting at that moment, and the engine aborts the request."""
    llm = make_llm(step_delay=0.005)

    async def main():
        stream = llm.add_request([1], params(30), "r")
        await stream.__anext__()
        stream.fail(EngineDeadError("the server is shutting down"))
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        stream.fail(EngineDeadError("again"))           # once it ended: nothing
        assert stream.finished

    run(main())
    llm.wait_until_idle()
    assert llm.engine.aborted == ["r"] and not llm.engine.requests


def test_a_dead_engine_says_so_once_with_the_cause(make_llm):
    """The engine thread dies (a step raises, then aborting its requests raises too): the open stream's
    error, a later add_request's and the one /health answers with (engine_dead) each say that the engine
    has stopped once, and why."""
    llm = make_llm(fail_steps={2})

    def broken_abort(request_id):
        raise RuntimeError("abort failed")

    llm.engine.abort_request = broken_abort

    async def main():
        stream = llm.add_request([1], params(30), "r")
        with pytest.raises(EngineDeadError) as in_stream:
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError) as late:
            llm.add_request([1], params(3), "late")
        return [str(in_stream.value), str(late.value)]

    messages = run(main()) + [str(engine_dead(llm.error))]
    assert not llm.is_alive
    for m in messages:
        assert m == "the engine has stopped: RuntimeError('abort failed')", m


def test_merge_outputs_joins_deltas_into_the_newer_output():
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [5, 6], None, delta_text="b", delta_token_ids=[6]),
                                       CompletionOutput(1, "x", [9], None, delta_text="x", delta_token_ids=[9])],
                      finished=False)
    b = RequestOutput("r", None, [1], [CompletionOutput(0, "abc", [5, 6, 7], "stop", delta_text="c",
                                                        delta_token_ids=[7])], finished=True)
    m = merge_outputs(a, b)
    assert m.finished and [c.index for c in m.outputs] == [0, 1]
    c0, c1 = m.outputs
    assert (c0.text, c0.delta_text, c0.delta_token_ids, c0.finish_reason) == ("abc", "bc", [6, 7], "stop")
    assert (c1.delta_text, c1.delta_token_ids) == ("x", [9])
    assert m is b and a.outputs[0].delta_text == "b"           # the newer output is updated, the older kept
