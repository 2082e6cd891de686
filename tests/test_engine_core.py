"""The engine core in its own process (and on a thread), against LLM.generate (the tiny chat model, CPU, float32).

Greedy and seeded tokens do not depend on the batch a request runs in, nor on the process the engine
lives in, so every comparison is exact: text, token ids, logprobs, finish reasons, the concatenated
deltas, usage counts. Checked: the core client equals LLM.generate, with its core in a process of its own
and on a thread (concurrent requests, n=2, stop strings that end a completion mid-way, logprobs, token-id
prompts); the step message's arrays; the synthetic device (scripts/fake_engine.py) and the core's
admission rule on it; a stream closed early aborts its request in the core and frees its blocks; the core
killed mid-load ends every open stream with EngineDeadError and turns is_alive False in bounded time
(behind an HTTP server: /health and new requests answer 503 saying so once, /metrics shows
pagedattn_engine_alive 0 and no stale engine series); a prompt at the default character limit tokenizes
on the API side while /health answers within 0.5 s; two data-parallel cores give the same results as one,
both get work, their per-rank metrics add up to the totals and neither leaks a block; build_app on the
client through uvicorn and the openai client (streamed == unstreamed); a request failing alone (its row in
the core, its text in the API process) ends with RequestFailedError while the others complete;
`python -m pagedattn serve` runs the engine in its own process and stops every process on Ctrl-C, removing
the cores' socket directory; SIGTERM while requests run ends each with an OpenAI-shaped error (a stream:
its error event, then [DONE]) before the exit, the steps slowed by the engine hook in the core process;
its core killed, /health and /metrics say so and the stop still removes the socket directory; the
launcher with two cores and two API processes on one port (slow: five processes), stopped by SIGTERM
with no process left behind.
"""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers import ROOT, is_gone
from serving_helpers import ServerThread, assert_loop_free_while_tokenizing, scrape, write_tiny_chat_checkpoint
from serving_helpers import signal_handlers_kept  # noqa: F401 (autouse: SIGTERM/SIGINT handlers kept)

from pagedattn import LLM, SamplingParams
from pagedattn.distributed.parallel import free_port
from pagedattn.serving.app import build_app
from pagedattn.serving.config import ServeConfig, ServerLimits
from pagedattn.serving.core_client import CoreClient
from pagedattn.serving.messages import core_endpoints, decode_step, encode_step
from pagedattn.serving.metrics import aggregate_metrics
from pagedattn.serving.stream import EngineDeadError
from scripts import fake_engine

MODEL = "tiny-chat"
NUM_BLOCKS = 48
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_blocks=NUM_BLOCKS, max_num_seqs=32)
PROMPTS = ["def fib(n):", "The paged KV cache", "Hello world! How are you", "SELECT name FROM", [5, 17, 301, 42]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


def config(checkpoint, **kwargs):
    return ServeConfig(engine=dict(model=checkpoint, **ENGINE), **kwargs)


@pytest.fixture(scope="module")
def ref(checkpoint):
    """LLM.generate on an engine of its own."""
    return LLM(checkpoint, **ENGINE)


@pytest.fixture(scope="module")
def core(checkpoint):
    client = CoreClient.start(config(checkpoint))
    yield client
    client.shutdown()


def _free_port_pair():
    """A port P with P + 1 free too (a tcp:// core address uses both)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def dp2(checkpoint):
    """Two cores on TCP, as two nodes would be addressed (here both on 127.0.0.1)."""
    addresses = [f"tcp://127.0.0.1:{_free_port_pair()}", f"tcp://127.0.0.1:{_free_port_pair()}"]
    client = CoreClient.start(config(checkpoint, data_parallel_size=2), addresses=addresses)
    yield client
    client.shutdown()


async def collect(llm, prompt, params):
    """Everything a caller can observe of one request: per completion (text, token ids, finish reason,
    logprobs, the deltas joined), and the prompt's token count."""
    deltas = {}
    out = None
    async for out in llm.generate(prompt, params):
        for c in out.outputs:
            text, ids = deltas.get(c.index, ("", []))
            deltas[c.index] = (text + c.delta_text, ids + list(c.delta_token_ids))
    assert out is not None and out.finished
    return (len(out.prompt_token_ids),
            [(c.index, c.text, list(c.token_ids), c.finish_reason, c.logprobs, deltas[c.index])
             for c in out.outputs])


def assert_same(got, expected):
    """Exact equality, except logprobs to 1e-5: the batch a request runs in (its size, its order) changes
    how float32 sums round in the model, which moves a logprob in its last digits but not an argmax here."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g[0] == e[0]
        for gc, ec in zip(g[1], e[1], strict=True):
            assert gc[:4] + gc[5:] == ec[:4] + ec[5:]
            assert (gc[4] is None) == (ec[4] is None)
            if ec[4] is not None:
                assert gc[4] == pytest.approx(ec[4], abs=1e-5, rel=1e-5)


def run_all(llm, cases):
    """What collect() observes of each (prompt, params), the requests sent at once: through a client, or
    from LLM.generate (an LLM: its outputs, whose deltas are the whole completion)."""
    if isinstance(llm, LLM):
        outs = llm.generate([p for p, _ in cases], [params for _, params in cases], use_tqdm=False)
        return [(len(o.prompt_token_ids), [(c.index, c.text, list(c.token_ids), c.finish_reason, c.logprobs,
                                            (c.text, list(c.token_ids))) for c in o.outputs]) for o in outs]

    async def main():
        return await asyncio.gather(*[collect(llm, p, params) for p, params in cases])
    return asyncio.run(main())


@pytest.fixture(scope="module")
def cases(ref):
    """Concurrent requests of every kind; the stop strings are cut from the middle of the greedy text, so
    that they do end their completion early."""
    greedy = run_all(ref, [(p, SamplingParams(temperature=0, max_tokens=24)) for p in PROMPTS[:3]])
    stops = []
    for _, comps in greedy:
        text = comps[0][1]      # random weights: much of it is odd bytes; cut at plain letters
        stops.append(next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isascii()
                           and text[i:i + 2].isalpha()))
    out = [(p, SamplingParams(temperature=0, max_tokens=24)) for p in PROMPTS]
    out += [(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, n=2, logprobs=True)),
            (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, n=2, logprobs=True))]
    out += [(p, SamplingParams(temperature=0, max_tokens=24, stop=[s, "never-in-the-text"]))
            for p, s in zip(PROMPTS[:3], stops)]
    out += [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, n=2, stop=[stops[0]], logprobs=True))]
    return out


@pytest.fixture(scope="module")
def expected(ref, cases):
    return run_all(ref, cases)


def test_step_message_round_trips_as_arrays():
    entries = [(3, 0, [7, 8], [-0.5, -1.25], -1.75, None), (9, 1, [], None, 0.0, "length"), (4, 0, [1], None, -2.0, "stop")]
    step = decode_step(encode_step(0, entries, [9], [(5, "invalid", "bad")]))
    assert step["wire_ids"].tolist() == [3, 9, 4] and step["index"].tolist() == [0, 1, 0]
    assert step["num_tokens"].tolist() == [2, 0, 1] and step["token_ids"].tolist() == [7, 8, 1]
    assert step["logprobs"].tolist() == [-0.5, -1.25, 0.0] and step["finish"].tolist() == [0, 2, 1]
    assert step["finished"] == [9] and step["errors"] == [(5, "invalid", "bad")]
    assert core_endpoints("tcp://10.0.0.2:5550") == ("tcp://10.0.0.2:5550", "tcp://10.0.0.2:5551")


def test_run_profiled_writes_the_process_profile_only_when_asked(tmp_path, monkeypatch):
    import pstats

    from pagedattn.serving.processes import run_profiled

    def body():
        return sum(i * i for i in range(1000))

    monkeypatch.delenv("PAGEDATTN_PROFILE_DIR", raising=False)
    assert run_profiled("core0", body) == 332833500 and not list(tmp_path.iterdir())
    monkeypatch.setenv("PAGEDATTN_PROFILE_DIR", str(tmp_path / "prof"))
    assert run_profiled("core0", body) == 332833500
    stats = pstats.Stats(str(tmp_path / "prof" / "core0.prof"))
    assert any(func[2] == "body" for func in stats.stats)


def test_core_steps_carry_only_each_steps_new_tokens(checkpoint):
    """The core's output processor (deltas_only): the running requests' progress is one StepDeltas a step,
    a row per completion holding the step's new token ids and logprobs alone; joined, they are the final
    output. "r" (n=2; with this seed completion 1 samples the end-of-sequence id early, while completion 0
    runs to max_tokens) goes through the per-request path, "s" (n=1) through the row made as its token is."""
    from pagedattn.engine.output_processor import OutputProcessor
    from pagedattn.engine.outputs import StepDeltas

    llm = LLM(checkpoint, **ENGINE)
    try:
        engine = llm.engine
        engine.outputs = OutputProcessor(None, engine.eos_token_ids, engine.max_model_len, deltas_only=True)
        engine.add_request("r", [5, 17, 301, 42], SamplingParams(temperature=0.8, seed=3, max_tokens=17, n=2,
                                                                 logprobs=True), stream=True)
        engine.add_request("s", [9, 8, 7], SamplingParams(temperature=0.8, seed=4, max_tokens=11, logprobs=True,
                                                          ignore_eos=True), stream=True)
        joined, final, steps = {}, {}, 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            assert sum(type(out) is StepDeltas for out in outs) <= 1
            for out in outs:
                if out.finished:
                    final[out.request_id] = out
                    continue
                assert isinstance(out, StepDeltas)
                steps += 1
                for rid, index, ids, lps, cumulative, reason in out.rows:
                    assert len(lps) == len(ids) and cumulative < 0
                    old_ids, old_lps = joined.get((rid, index), ([], []))
                    joined[rid, index] = (old_ids + ids, old_lps + lps)
        assert steps >= 10 and set(final) == {"r", "s"}
        reasons = {}
        for rid, out in final.items():          # the final output is complete; its delta is the rest
            for c in out.outputs:
                ids, lps = joined[rid, c.index]
                assert ids + c.delta_token_ids == c.token_ids and len(c.logprobs) == len(c.token_ids)
                assert lps == c.logprobs[:len(lps)] and c.cumulative_logprob == pytest.approx(sum(c.logprobs))
                reasons[rid, c.index] = (c.finish_reason, len(c.token_ids))
        assert reasons["r", 0] == ("length", 17) and reasons["r", 1][0] == "stop" and reasons["r", 1][1] < 17
        assert reasons["s", 0] == ("length", 11) and len(joined["s", 0][0]) == 10     # the last in the final
    finally:
        llm.close()


def test_fake_runner_runs_steps_of_the_given_time_to_max_tokens(checkpoint):
    """The synthetic device (benchmarks): requests run to max_tokens (no end-of-sequence id is drawn), and
    a step takes at least step_ms."""
    llm = fake_engine.install_fake_runner(LLM(checkpoint, **ENGINE), step_ms=5.0)
    try:
        t0 = time.perf_counter()
        outs = llm.generate([[5, 17, 301], [9, 9]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        seconds = time.perf_counter() - t0
        eos = llm.engine.eos_token_ids
        for o in outs:
            assert len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length"
            assert not eos & set(o.outputs[0].token_ids)
        assert seconds >= 12 * 0.005            # a prefill step and 11 decode steps at least, one after another
    finally:
        llm.close()


def test_core_holds_arrivals_while_decoding_so_they_share_a_prefill_step(checkpoint, tmp_path):
    """Admission: an idle engine takes a request at once; while sequences decode, arrivals are held (and
    counted as waiting) until prefill_delay_factor x the last prefill's time has passed since it ended,
    then they all join one prefill step. Factor 0 admits every arrival at once (each makes a prefill step
    of its own). An AbortRequests, or its client going away, removes a held request (that client's only)."""
    from pagedattn.serving.engine_core import EngineCore
    from pagedattn.serving.messages import AbortRequests, AddRequest

    llm = fake_engine.install_fake_runner(LLM(checkpoint, **ENGINE), step_ms=1.0, prefill_ms=50.0)
    execute, prefill_steps = llm.engine.runner.execute, []

    def counting(step):
        prefill_steps.append(step.num_prefills)
        return execute(step)
    llm.engine.runner.execute = counting
    params = SamplingParams(temperature=0, max_tokens=40)
    cores = []

    def run(factor):
        core = EngineCore(llm, f"ipc://{tmp_path}/core-{factor}", prefill_delay_factor=factor)
        cores.append(core)
        core._send = lambda client, msg: None           # no client: the outputs are not under test here
        prefill_steps.clear()
        core.held.append(AddRequest(b"c", 0, [5, 17, 301], params))
        core._admit_due()                               # idle: admitted at once
        assert not core.held and llm.engine.has_unfinished_requests()
        for _ in range(4):                              # the prefill step (timed) and decodes
            core._step()
        waits = []
        for wid in range(1, 6):                         # five arrivals, one per decode step
            core.held.append(AddRequest(b"c", wid, [9, 9, wid], params))
            core._admit_due()
            waits.append(len(core.held))
            core._step()
        metrics = core._metrics()
        while llm.engine.has_unfinished_requests() or core.held:
            core._admit_due()
            core._step()
        assert sum(1 for p in prefill_steps if p) == (2 if factor else 6)
        return core, waits, metrics

    try:
        core, waits, metrics = run(2.0)
        assert waits == [1, 2, 3, 4, 5]                 # a few 1 ms steps << 2 x the 50 ms prefill: all held
        assert metrics["num_waiting"] == 5 and metrics["num_admissions"] == 1

        core.held.append(AddRequest(b"c", 10, [5, 17, 301], params))      # a crowd is not held:
        core._admit_due()
        for _ in range(4):
            core._step()
        held = []
        for wid in range(11, 16):                       # 5 x 210 prompt tokens >= half the 2048-token budget
            core.held.append(AddRequest(b"c", wid, [7] * 210, params))
            core._admit_due()
            held.append(len(core.held))
            core._step()
        assert held == [1, 2, 3, 4, 0]
        while llm.engine.has_unfinished_requests() or core.held:
            core._admit_due()
            core._step()
        _, waits, metrics = run(0.0)
        assert waits == [0] * 5 and metrics["num_waiting"] == 0 and metrics["num_admissions"] == 6

        core.held = [AddRequest(b"a", 1, [5, 6], params), AddRequest(b"b", 1, [5, 6], params),
                     AddRequest(b"a", 2, [5, 6], params)]
        core._receive(_OneMessage(core.encoder.encode(AbortRequests(b"a", [1]))))
        assert [(m.client, m.wire_id) for m in core.held] == [(b"b", 1), (b"a", 2)]
        core._drop_client(b"b")
        assert [(m.client, m.wire_id) for m in core.held] == [(b"a", 2)]
    finally:
        for c in cores:
            for sock in (c.input, c.output):
                sock.close(0)
            c.ctx.term()
        llm.close()


class _OneMessage:
    """A socket stand-in that yields one message, then none."""

    def __init__(self, data):
        self.frames = [data]

    def recv_multipart(self, flags=0):
        import zmq
        if not self.frames:
            raise zmq.Again()
        return [self.frames.pop()]

    def close(self, linger=None):
        pass


@pytest.fixture(scope="module", params=["process", "thread"])
def either_core(request, core, checkpoint):
    """The core client with its core in a process of its own, then on a thread of this process."""
    if request.param == "process":
        yield core
        return
    client = CoreClient.start(config(checkpoint, in_process=True))
    yield client
    client.shutdown()


def test_core_client_equals_generate(either_core, cases, expected):
    core = either_core
    got = run_all(core, cases)
    assert_same(got, expected)
    for (_, params), (_, comps) in zip(cases, got):
        for _, text, ids, reason, logprobs, (delta_text, delta_ids) in comps:
            assert (delta_text, delta_ids) == (text, ids)
            assert (logprobs is not None) == params.logprobs
        if params.stop:
            assert any(c[3] == "stop" for c in comps)          # the stop string did end a completion
    assert core.wait_until_idle()["num_free_blocks"] == NUM_BLOCKS


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(core):
    before = core.wait_until_idle()["num_generated_tokens"]

    async def leave_early():
        stream = core.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        seen = 0
        async for out in stream:
            seen += len(out.outputs[0].delta_token_ids)
            if seen >= 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(leave_early()) >= 3
    snap = core.wait_until_idle()
    assert snap["num_free_blocks"] == NUM_BLOCKS and snap["num_running"] == 0 and core.num_requests_in_flight == 0
    assert snap["num_generated_tokens"] - before < 100      # stopped long before its 200 tokens


def test_bad_requests_are_refused_before_anything_is_sent(core):
    from pagedattn.errors import InvalidRequestError

    async def bad(prompt, params):
        with pytest.raises(InvalidRequestError):
            core.add_request(prompt, params)

    asyncio.run(bad([1, 2, 100000], SamplingParams(max_tokens=4)))        # outside the vocabulary
    asyncio.run(bad("x", SamplingParams(max_tokens=10_000)))              # longer than max_model_len
    assert core.num_requests_in_flight == 0


def test_two_data_parallel_cores_equal_one_and_their_metrics_add_up(dp2, cases, expected):
    assert dp2.data_parallel_size == 2
    assert [m["num_blocks"] for m in dp2.engine_metrics_per_rank()] == [NUM_BLOCKS, NUM_BLOCKS]   # from the start
    before = [m["num_generated_tokens"] for m in (dp2.wait_until_idle(), *dp2.engine_metrics_per_rank())]
    assert_same(run_all(dp2, cases), expected)
    plain = [(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p in PROMPTS * 2]
    outs = run_all(dp2, plain)
    total = dp2.wait_until_idle()
    ranks = dp2.engine_metrics_per_rank()
    assert aggregate_metrics(ranks) == total
    for m in ranks:
        assert m["num_free_blocks"] == m["num_blocks"] == NUM_BLOCKS and m["num_running"] == m["num_waiting"] == 0
    grew = [m["num_generated_tokens"] - b for m, b in zip([total, *ranks], before)]
    assert grew[0] == grew[1] + grew[2]
    assert min(grew[1:]) > 0                                 # least-load routing used both cores
    assert total["num_blocks"] == 2 * NUM_BLOCKS and total["kv_cache_usage"] == 0.0
    plain_tokens = sum(len(c[2]) for _, comps in outs for c in comps)
    assert plain_tokens == len(plain) * 16


def test_killed_core_ends_every_stream_with_an_error(checkpoint):
    client = CoreClient.start(config(checkpoint))
    socket_dir = os.path.dirname(client._cores[0].address.removeprefix("ipc://"))
    assert os.path.basename(socket_dir).startswith("pagedattn-core-") and os.path.isdir(socket_dir)
    try:
        async def main():
            streams = [client.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                       for p in PROMPTS]
            for s in streams:                       # every one is running
                await asyncio.wait_for(s.__anext__(), 60)
            os.kill(client.processes[0].pid, signal.SIGKILL)

            async def drain(s):
                with pytest.raises(EngineDeadError):
                    async for _ in s:
                        pass
            await asyncio.wait_for(asyncio.gather(*[drain(s) for s in streams]), 30)
            with pytest.raises(EngineDeadError):
                client.add_request(PROMPTS[0], SamplingParams(max_tokens=4))

        asyncio.run(main())
        assert not client.is_alive and client.num_requests_in_flight == 0
    finally:
        client.shutdown()
    assert not client.processes[0].is_alive()
    assert not os.path.exists(socket_dir)                   # the directory start() made for the core's sockets


def test_a_dead_core_shows_in_health_metrics_and_errors(checkpoint):
    """The core killed behind a running HTTP server: /health answers 503 and a new request 503, each saying
    once that the engine has stopped and why; /metrics answers with pagedattn_engine_alive 0 and without the
    dead core's last (stale) engine series."""
    client = CoreClient.start(config(checkpoint))
    label = frozenset({"model_name": MODEL}.items())
    try:
        with ServerThread(build_app(client, MODEL)) as srv:
            live = scrape(srv.url)
            assert live[("pagedattn_engine_alive", label)] == 1
            assert live[("pagedattn_kv_cache_blocks", label)] == NUM_BLOCKS
            os.kill(client.processes[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 30            # (noticed within ~100 ms: the client's socket monitor)
            while client.is_alive:
                assert time.monotonic() < deadline, "the client did not notice the core's death"
                time.sleep(0.05)
            health = httpx.get(srv.url + "/health", timeout=30)
            late = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
            for r in (health, late):
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
                message = r.json()["error"]["message"]
                assert message.count("the engine has stopped") == 1 and "lost the connection" in message, message
            dead = scrape(srv.url)
            assert dead[("pagedattn_engine_alive", label)] == 0
            assert not any(name.startswith(("pagedattn_kv_cache", "pagedattn_num_requests_running",
                                            "pagedattn_num_requests_waiting", "pagedattn_engine_step"))
                           for name, _ in dead), sorted({name for name, _ in dead})
    finally:
        client.shutdown()


def test_http_server_on_the_core_client(core, ref):
    with ServerThread(build_app(core, MODEL)) as srv:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert httpx.get(srv.url + "/health", timeout=30).json() == {"status": "ok"}
        for prompt in PROMPTS[:2]:
            full = api.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
            pieces = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
            assert "".join(c.choices[0].text for c in pieces if c.choices) == full.choices[0].text
            assert pieces[-1].usage.completion_tokens == full.usage.completion_tokens
            (_, comps), = run_all(ref, [(prompt, SamplingParams(temperature=0, max_tokens=20))])
            assert full.choices[0].text == comps[0][1] and full.usage.completion_tokens == len(comps[0][2])
        messages = [{"role": "user", "content": "Explain blocks, 中文 🙂"}]
        full = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        pieces = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                  stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == full.choices[0].message.content
        core.wait_until_idle()
        samples = scrape(srv.url)
        label = frozenset({"model_name": MODEL}.items())
        assert samples[("pagedattn_kv_cache_blocks", label)] == NUM_BLOCKS
        assert samples[("pagedattn_kv_cache_free_blocks", label)] == NUM_BLOCKS
        assert samples[("pagedattn_num_requests_in_flight", label)] == 0


def test_a_prompt_at_the_character_limit_leaves_the_event_loop_free(core):
    """The engine core's client tokenizes on the server's worker thread too: a 1,000,000-character prompt
    (the default limit) takes seconds there while /health answers all along (serving_helpers.HEALTH_BOUND_S)."""
    limits = ServerLimits()
    with ServerThread(build_app(core, MODEL, limits=limits)) as srv:
        assert_loop_free_while_tokenizing(srv.url, limits, MODEL)


def _gather_outcomes(llm, cases):
    """Per case: ("ok", text) or (exception type name, message)."""
    async def one(prompt, params):
        try:
            out = None
            async for out in llm.generate(prompt, params):
                pass
            return "ok", out.outputs[0].text
        except Exception as e:  # noqa: BLE001 (the outcome under test)
            return type(e).__name__, str(e)

    async def main():
        return await asyncio.gather(*[one(p, params) for p, params in cases])
    return asyncio.run(main())


@pytest.fixture
def core_in_thread(checkpoint):
    """A client whose core runs on a thread of this process (so a test can reach into its engine)."""
    client = CoreClient.in_thread(LLM(checkpoint, **ENGINE))
    yield client
    client.shutdown()


def test_a_request_failing_in_the_core_fails_alone(core_in_thread, ref):
    """A request whose row fails inside the engine (its output processing raises, as a kernel's bad
    token or a failing stop check would) ends with RequestFailedError; the batch around it completes with
    the right text and no block leaks."""
    client = core_in_thread
    engine = client.engine_core.engine
    bad_prompt = "Prefix caching shares"
    bad_ids = client.tokenize(bad_prompt)
    append = engine.outputs.append

    def failing_append(seq, token, logprob, t):
        if list(seq.token_ids[:seq.num_prompt_tokens]) == bad_ids:
            raise RuntimeError("this request's row failed")
        return append(seq, token, logprob, t)

    engine.outputs.append = failing_append
    good = [(p, SamplingParams(temperature=0, max_tokens=12)) for p in PROMPTS[:3]]
    got = _gather_outcomes(client, good[:2] + [(bad_prompt, SamplingParams(temperature=0, max_tokens=6))] + good[2:])
    want = [("ok", comps[0][1]) for _, comps in run_all(ref, good)]
    assert got[:2] + got[3:] == want
    assert got[2][0] == "RequestFailedError" and "this request's row failed" in got[2][1]
    client.wait_until_idle()
    assert engine.block_manager.num_free_blocks == engine.block_manager.total_blocks == NUM_BLOCKS
    assert client.is_alive


def test_a_request_failing_to_detokenize_fails_alone(core, ref):
    """The API side's text (incremental detokenization) failing for one request ends that request with
    RequestFailedError and aborts it in the core; the others complete and no block leaks."""
    class Broken:
        def add(self, token):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer failure in this request")

    async def bad():
        stream = core.add_request("Prefix caching shares", SamplingParams(temperature=0, max_tokens=40,
                                                                          ignore_eos=True))
        core._live[stream._wire_id].completions[0].detok = Broken()     # before its first tokens come back
        try:
            async for _ in stream:
                pass
            return "ok", ""
        except Exception as e:  # noqa: BLE001 (the outcome under test)
            return type(e).__name__, str(e)

    good = [(p, SamplingParams(temperature=0, max_tokens=12)) for p in PROMPTS[:3]]

    async def main():
        return await asyncio.gather(*[collect(core, p, params) for p, params in good], bad())
    *got, failed = asyncio.run(main())
    assert_same(got, run_all(ref, good))
    assert failed[0] == "RequestFailedError" and "detokenizer failure" in failed[1]
    m = core.wait_until_idle()
    assert m["num_running"] == m["num_waiting"] == 0 and m["num_free_blocks"] == NUM_BLOCKS


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _comm(pid):
    """A process's name (/proc/PID/comm: what engine_core.name_process set), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""




def serve_args(checkpoint, port):
    """`serve`'s arguments for the tiny model on ENGINE's settings."""
    return ["--model", checkpoint, "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
            "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "32", "--port", str(port), "--served-model-name", MODEL,
            "--log-level", "warning"]


def wait_for_health(proc, url, timeout=240):
    """Until the server process `proc` answers 200 on /health (it must not exit meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


@pytest.mark.slow
def test_launcher_two_cores_two_api_servers_one_port(checkpoint, ref):
    port = free_port()
    cmd = [sys.executable, "-m", "pagedattn", "serve", *serve_args(checkpoint, port),
           "--data-parallel-size", "2", "--api-server-count", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url)
        children = _children(proc.pid)
        assert len(children) >= 4                           # 2 cores + 2 API servers (+ spawn's tracker)
        expected = run_all(ref, [(p, SamplingParams(temperature=0, max_tokens=16)) for p in PROMPTS[:4]])
        with httpx.Client(timeout=120) as http:             # a fresh connection each: both API servers serve
            for prompt, (_, comps) in zip(PROMPTS[:4] * 2, expected * 2):
                r = http.post(url + "/v1/completions", headers={"Connection": "close"},
                              json=dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == comps[0][1]
        text = httpx.get(url + "/metrics", timeout=30).text
        assert f'pagedattn_kv_cache_blocks{{model_name="{MODEL}"}} {2.0 * NUM_BLOCKS}' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, proc.stderr.read()[-4000:]
    deadline = time.monotonic() + 30
    while not all(is_gone(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(is_gone(p) for p in children)


def start_serve(checkpoint, tmp_path, *flags):
    """(process, url) of `python -m pagedattn serve` on the tiny model in its own session, with its temporary
    directory (where the core's socket directory goes) in tmp_path."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedattn", "serve", *serve_args(checkpoint, port), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def socket_dirs(tmp_path):
    return sorted(p.name for p in tmp_path.glob("pagedattn-core-*"))


def stop_serve(proc, sig, group=False):
    """Send `sig` (to the process group: what a terminal's Ctrl-C does), wait for the exit; kill what is left."""
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_command_runs_the_engine_in_its_own_process(checkpoint, ref, tmp_path):
    """`python -m pagedattn serve` (no process flags): one engine-core process and one API process; a
    request is answered with the in-process engine's text; Ctrl-C (SIGINT to the group) stops every
    process, the command exits 0 and the core's socket directory is gone."""
    proc, url = start_serve(checkpoint, tmp_path)
    try:
        wait_for_health(proc, url)
        assert len(socket_dirs(tmp_path)) == 1
        children = _children(proc.pid)
        assert len(children) >= 2                           # the engine core and the API server
        (_, comps), = run_all(ref, [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16))])
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json=dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == comps[0][1], r.text
    finally:
        stop_serve(proc, signal.SIGINT, group=True)         # what Ctrl-C in a terminal sends
    assert proc.returncode == 0, proc.stderr.read()[-4000:]
    deadline = time.monotonic() + 30
    while not all(is_gone(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(is_gone(p) for p in children)
    assert socket_dirs(tmp_path) == []


def _read_events(url, body, opened, out):
    """(a thread) POST a streamed completion; append each SSE `data:` payload to out; set `opened` at the first."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[len("data: "):])
                opened.set()


@pytest.mark.parametrize("in_process", [False, True], ids=["core-process", "in-process"])
def test_sigterm_ends_open_streams_with_an_error_then_done(checkpoint, tmp_path, in_process):
    """SIGTERM to `python -m pagedattn serve` (and to `serve --in-process`) while requests run: the open
    requests get --shutdown-timeout (1 s) to finish; the ones still running then end with an OpenAI-shaped
    error (a stream: `data: {"error": ...}` then `data: [DONE]`; a non-streamed request: 503) before the
    process exits 0, and the core's socket directory is gone (in-process: there is none). The engine's steps
    take 20 ms (the synthetic device, through --engine-hook: the tiny model's own are too quick to keep a
    request open), so 200 tokens take 4 s, well past the grace period."""
    import json
    import threading

    proc, url = start_serve(checkpoint, tmp_path, *fake_engine.serve_flags(20), "--shutdown-timeout", "1",
                            *(["--in-process"] if in_process else []))
    try:
        wait_for_health(proc, url)
        assert len(socket_dirs(tmp_path)) == (0 if in_process else 1)
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, ignore_eos=True)
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [threading.Thread(target=_read_events, args=(url, {**body, "stream": True}, opened, events),
                                    daemon=True) for events, opened in streams]
        plain = []
        threads.append(threading.Thread(target=lambda: plain.append(httpx.post(url + "/v1/completions", json=body,
                                                                                timeout=60)), daemon=True))
        for t in threads:
            t.start()
        for _, opened in streams:
            assert opened.wait(60), "a stream did not start"
        os.kill(proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a request did not end"
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, proc.stderr.read()[-4000:]
    for events, _ in streams:
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "server_shutting_down", error
        assert "shutting down" in error["message"]
        assert len(events) >= 3         # (at least one chunk of tokens came before the error)
    (r,) = plain
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert socket_dirs(tmp_path) == []


def test_a_dead_core_behind_serve_and_its_socket_dir(checkpoint, tmp_path):
    """The engine core of `python -m pagedattn serve` killed: /health answers 503, /metrics says
    pagedattn_engine_alive 0; SIGTERM then stops the server (exit 0) and removes the socket directory."""
    proc, url = start_serve(checkpoint, tmp_path)
    try:
        wait_for_health(proc, url)
        assert len(socket_dirs(tmp_path)) == 1
        cores = [pid for pid in _children(proc.pid) if _comm(pid) == "pagedattn-core0"]
        assert len(cores) == 1, [(pid, _comm(pid)) for pid in _children(proc.pid)]
        os.kill(cores[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health did not fail"
            time.sleep(0.1)
        text = httpx.get(url + "/metrics", timeout=10).text
        assert f'pagedattn_engine_alive{{model_name="{MODEL}"}} 0.0' in text and "pagedattn_kv_cache_blocks" not in text
        stop_serve(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, proc.stderr.read()[-4000:]
    assert socket_dirs(tmp_path) == []


def test_serve_in_process_refuses_process_flags():
    proc = subprocess.run([sys.executable, "-m", "pagedattn", "serve", "--in-process", "--data-parallel-size", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "in_process runs one engine" in proc.stderr
