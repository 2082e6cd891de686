"""The OpenAI-compatible server end to end, through the official `openai` client and raw HTTP.

A real uvicorn server on 127.0.0.1 (a free port, in a thread) serves the tiny random Qwen2 with a real
byte-level BPE tokenizer and a ChatML template (serving_helpers.py), CPU, float32, with an API key.
Reference outputs come from LLM.generate on a second LLM over the same checkpoint: greedy tokens do not
depend on the batch a request runs in, so served text must equal it exactly.

Checked: completions and chat, streamed and not, against each other and LLM.generate; n=2; stop strings;
usage (also in the last stream chunk); logprobs; /v1/models, /health, /metrics (and that its counters
move by exactly the usage of a request; after the engine stops, pagedattn_engine_alive 0 and no stale engine
series); bad input (malformed JSON, no body, wrong types, unknown model, negative max_tokens, temperature -1,
over-long prompts, a prompt that leaves no room to generate, a request the KV pool can never hold, missing
or wrong API key) -> status, OpenAI-shaped body naming the field, and the server keeps serving; HEAD on the
GET routes, 405 with Allow, no redirect built from the Host header; clients that disconnect (streaming or
not) free their blocks; a server told to stop ends its open stream with an error event and [DONE] and its
open plain request with a 503 after the grace period; 64 concurrent streaming clients, some leaving early.
"""
import asyncio
import json
import logging
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from serving_helpers import ServerThread, scrape, write_tiny_chat_checkpoint
from serving_helpers import signal_handlers_kept  # noqa: F401 (autouse: SIGTERM/SIGINT handlers kept)

from pagedattn import LLM, SamplingParams
from pagedattn.serving import protocol as P
from pagedattn.serving.app import build_app
from pagedattn.serving.core_client import CoreClient
from pagedattn.serving.metrics import Histogram
from scripts.fake_engine import install_fake_runner

MODEL = "tiny-chat"
API_KEY = "test-key"
# max_model_len 256 (the tiny model's positions); a pool of 48 blocks x 16 = 768 tokens and 32 sequences
# per step: the 64-client load queues requests and preempts some, as a full server would.
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, num_blocks=48, max_num_seqs=32)
PROMPTS = ["def fib(n):", "The paged KV cache", "Hello world! How are you", "SELECT name FROM"]
CHATS = [[{"role": "user", "content": "Write a haiku about caches."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain blocks, 中文 🙂"}]]


def serve(checkpoint, api_key=API_KEY, **engine):
    """(ServerThread context, CoreClient) for an engine core on `checkpoint`, on a thread of this process
    (what `serve --in-process` runs)."""
    client = CoreClient.in_thread(LLM(checkpoint, **{**ENGINE, **engine}))
    return ServerThread(build_app(client, MODEL, api_key=api_key)), client


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def server(checkpoint):
    srv, front = serve(checkpoint)
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        yield SimpleNamespace(url=srv.url, front=front, client=client)
    front.shutdown()


@pytest.fixture(scope="module")
def ref(checkpoint):
    """LLM.generate on its own engine over the same checkpoint."""
    return LLM(checkpoint, **ENGINE)


def chat_prompt(ref, messages):
    return ref.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generate(ref, prompt, **params):
    return ref.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def metric(samples, name, **labels):
    labels = {"model_name": MODEL, **labels}
    return samples.get((name, frozenset(labels.items())), 0.0)


def assert_no_leak(server):
    server.front.wait_until_idle()
    bm = server.front.engine_core.engine.block_manager
    samples = scrape(server.url)
    assert bm.num_free_blocks == bm.total_blocks == ENGINE["num_blocks"]
    assert metric(samples, "pagedattn_kv_cache_free_blocks") == ENGINE["num_blocks"]
    assert metric(samples, "pagedattn_kv_cache_usage") == 0.0
    assert metric(samples, "pagedattn_num_requests_running") == 0 == metric(samples, "pagedattn_num_requests_in_flight")


def test_histogram_buckets_are_cumulative_with_le_bounds():
    h = Histogram(bounds=(0.1, 1.0))
    for v, n in [(0.05, 1), (0.1, 2), (0.5, 1), (3.0, 4)]:
        h.observe(v, n)
    buckets, total = h.snapshot()
    assert buckets == [("0.1", 3), ("1.0", 4), ("+Inf", 8)] and h.count == 8
    assert total == pytest.approx(0.05 + 0.2 + 0.5 + 12.0)


# ---------------------------------------------------------------- the openai client: text and usage
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completion_streamed_equals_unstreamed_equals_generate(server, ref, prompt):
    want = generate(ref, prompt, temperature=0, max_tokens=24)
    got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    c = want.outputs[0]
    assert got.choices[0].text == streamed == c.text
    assert got.choices[0].finish_reason == c.finish_reason
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    usage = (len(want.prompt_token_ids), len(c.token_ids))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == usage
    assert got.usage.total_tokens == sum(usage)
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_continuous_usage_counts_every_chunks_tokens(server, ref):
    """stream_options.continuous_usage_stats (vLLM's extra): every chunk carries the usage so far, its
    completion tokens growing by the chunk's tokens, up to the total in the last chunk."""
    want = generate(ref, PROMPTS[0], temperature=0, max_tokens=20, ignore_eos=True)
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None and ch.usage.prompt_tokens == len(want.prompt_token_ids) for ch in chunks)
    assert counts == sorted(counts) and counts[-1] == len(want.outputs[0].token_ids) == 20
    assert chunks[-1].choices == [] and len({c for c in counts}) > 1


def test_chat_streamed_equals_unstreamed_equals_generate(server, ref):
    for messages in CHATS:
        want = generate(ref, chat_prompt(ref, messages), temperature=0, max_tokens=32)
        got = server.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=32,
                                                    temperature=0)
        chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                                            temperature=0, stream=True,
                                                            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        c = want.outputs[0]
        assert got.choices[0].message.content == streamed == c.text
        assert got.choices[0].message.role == "assistant" and got.choices[0].finish_reason == c.finish_reason
        usage = (len(want.prompt_token_ids), len(c.token_ids))
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == usage
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == usage


def test_chat_default_max_tokens_fills_the_context(server, ref):
    messages = CHATS[0]
    n_prompt = len(ref.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
    got = server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={
        "ignore_eos": True})
    assert got.usage.completion_tokens == ENGINE["max_model_len"] - n_prompt == got.usage.total_tokens - n_prompt
    assert got.choices[0].finish_reason == "length"


def test_n2_seeded_sampling(server, ref):
    params = dict(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, n=2)
    want = generate(ref, PROMPTS[2], **params)
    got = server.client.completions.create(model=MODEL, prompt=PROMPTS[2], **params)
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPTS[2], stream=True, **params))
    streamed = ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(2)]
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == streamed == [c.text for c in want.outputs]
    assert want.outputs[0].token_ids != want.outputs[1].token_ids       # two different samples
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)       # the prompt counts once


def test_several_prompts_in_one_completion_request(server, ref):
    got = server.client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in got.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS[:3]):
        want = generate(ref, prompt, temperature=0, max_tokens=8).outputs[0].text
        assert got.choices[2 * i].text == got.choices[2 * i + 1].text == want


def test_stop_strings_cut_the_text_streamed_or_not(server, ref):
    full = generate(ref, PROMPTS[0], temperature=0, max_tokens=48).outputs[0].text
    # a stop string from the middle of the greedy text, made of complete characters
    start = len(full) // 2
    stop = next(full[i:i + 2] for i in range(start, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    want = full[:full.index(stop)]
    got = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0, stop=[stop])
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0,
                                                   stop=stop, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert got.choices[0].text == streamed == want and stop not in streamed
    assert got.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"


def test_token_id_prompt_and_logprobs(server, ref):
    ids = ref.get_tokenizer().encode(PROMPTS[1], add_special_tokens=False)
    want = generate(ref, ids, temperature=0, max_tokens=12, logprobs=True).outputs[0]
    got = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, logprobs=0)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(want.token_ids) == got.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert all(v <= 0 for v in lp.token_logprobs)
    chunks = list(server.client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                                   logprobs=0, stream=True))
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_chat_logprobs(server, ref):
    want = generate(ref, chat_prompt(ref, CHATS[0]), temperature=0, max_tokens=8, logprobs=True).outputs[0]
    got = server.client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=8, temperature=0,
                                                logprobs=True)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want.logprobs, abs=1e-5)
    # each token's text is what it completes (a character split over tokens belongs to the last of them:
    # test_request_isolation checks the pieces of known split characters), so the pieces join to the text
    # up to a character the last tokens left incomplete; the bytes are the tokens' own
    joined = "".join(c.token for c in content)
    assert want.text.startswith(joined) and want.text[len(joined):].strip("\ufffd") == ""
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", errors="replace") == want.text


def test_models_health_and_metrics_counters(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    server.front.wait_until_idle()      # (the engine's figures in /metrics are a snapshot: this one exact)
    before = scrape(server.url)
    got = server.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    server.front.wait_until_idle()
    after = scrape(server.url)
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert delta("pagedattn_prompt_tokens_total") == got.usage.prompt_tokens
    assert delta("pagedattn_generation_tokens_total") == got.usage.completion_tokens == 10
    assert delta("pagedattn_request_finished_total", finished_reason="length") == 1
    assert delta("pagedattn_time_to_first_token_seconds_count") == 1
    assert delta("pagedattn_e2e_request_latency_seconds_count") == 1
    assert delta("pagedattn_inter_token_latency_seconds_count") == 9             # 10 tokens, 9 gaps
    # the engine's own counters: 10 tokens take 10 steps at least (a prompt may be chunked), each a decode or
    # a prompt chunk; the time inside steps grows with them
    assert delta("pagedattn_engine_steps_total") >= 10
    # the prompt (less what the prefix cache served; its last token always runs) and 9 fed-back tokens
    assert 1 + 9 <= delta("pagedattn_engine_computed_tokens_total") <= got.usage.prompt_tokens + 9
    assert delta("pagedattn_engine_step_seconds_total") > 0
    assert metric(after, "pagedattn_kv_cache_blocks") == ENGINE["num_blocks"]
    assert metric(after, "pagedattn_prefix_cache_queries_total") >= metric(after, "pagedattn_prefix_cache_hits_total")
    assert 0 <= metric(after, "pagedattn_prefix_cache_hit_rate") <= 1


def test_metrics_say_when_the_engine_has_stopped(checkpoint):
    """/metrics after the engine stopped: still 200 (the server's own series stay readable), with
    pagedattn_engine_alive 0 and none of the dead engine's stale series; /health answers 503 saying why."""
    srv, front = serve(checkpoint, api_key=None)
    label = frozenset({"model_name": MODEL}.items())
    with srv:
        r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                 key=None)
        assert r.status_code == 200, r.text
        front.wait_until_idle()
        live = scrape(srv.url)
        assert live[("pagedattn_engine_alive", label)] == 1
        assert live[("pagedattn_kv_cache_blocks", label)] == ENGINE["num_blocks"]
        front.shutdown()
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        dead = scrape(srv.url)
        assert dead[("pagedattn_engine_alive", label)] == 0
        engine_series = {name for name, _ in live} - {name for name, _ in dead}
        assert {"pagedattn_kv_cache_blocks", "pagedattn_kv_cache_usage", "pagedattn_num_requests_running",
                "pagedattn_engine_steps_total"} <= engine_series
        assert dead[("pagedattn_num_requests_in_flight", label)] == 0              # the server's own count
        assert dead[("pagedattn_request_finished_total", label | {("finished_reason", "length")})] == 1
        health = httpx.get(srv.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert health.json()["error"]["message"] == str(front.error) == "the engine has been shut down"


# ---------------------------------------------------------------- bad input
def post(url, path, body, key=API_KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(url + path, content=raw, headers={**headers, "Content-Type": "application/json"},
                          timeout=60)
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


TOO_LONG = "cache " * 300            # > 256 tokens
BAD_REQUESTS = [  # (path, body or raw bytes, status, param, words the message must contain)
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi",', 400, None, ["malformed JSON"]),
    ("/v1/completions", b"[1, 2]", 400, None, ["dictionary"]),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", ["prompt", "required"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", ["integer"]),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", ["gpt-9", "does not exist"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens", [">= 1", "-5"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", [">= 0"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", ["n must be"]),
    ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG}, 400, "prompt", ["max_model_len=256"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 300}, 400, "max_tokens", ["max_model_len"]),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", ["vocabulary"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs", ["not supported"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty",
     ["not supported"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}]}, 400,
     "messages", ["tokens", "after the chat template", "no room to generate"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens", [">= 1"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", ["empty"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", ["list"]),
    ("/v1/nothing-here", {}, 404, None, ["Not Found"]),
    ("/v1/completions", b"", 400, "prompt", ["request body is empty", "prompt is required"]),
    ("/v1/chat/completions", b"", 400, "messages", ["request body is empty", "messages is required"]),
    # a prompt of exactly max_model_len tokens: no room for one generated token (default max_tokens or not)
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 256}, 400, "prompt",
     ["256 tokens", "no room to generate", "< max_model_len=256"]),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 256, "max_tokens": 4}, 400, "prompt",
     ["256 tokens", "no room to generate"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 4},
     400, "messages", ["after the chat template", "no room to generate", "< max_model_len=256"]),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{r[3] or r[2]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_an_openai_error(server, path, body, status, param, words):
    r = post(server.url, path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    for w in words:
        assert w in err["message"], err["message"]
    if status == 404 and param == "model":
        assert err["code"] == "model_not_found"
    ok = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_api_key(server):
    for key, word in [(None, "missing"), ("wrong", "incorrect")]:
        r = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert word in r.json()["error"]["message"].lower()
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200         # open without a key
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_get_routes_answer_head(server):
    """HEAD on every GET route: 200 with GET's headers and no body (the API key still needed on /v1/*); another
    method: 405 whose Allow header names GET and HEAD."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}"]:
        got = httpx.get(server.url + path, headers=auth, timeout=30)
        head = httpx.head(server.url + path, headers=auth, timeout=30)
        assert got.status_code == head.status_code == 200, (path, head.status_code)
        assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"], path
        post = httpx.post(server.url + path, headers=auth, timeout=30)
        assert post.status_code == 405, (path, post.text)
        assert set(post.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}, post.headers
        error = post.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "GET, HEAD" in error["message"], error
    assert httpx.head(server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server.url + "/v1/completions", headers=auth, timeout=30).headers["allow"] == "POST"


def test_no_redirect_is_built_from_the_host_header(server):
    """A trailing slash is an unknown path (404 in OpenAI's shape), never a redirect: Starlette's would send the
    client to whatever host its Host header named."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for method, path in [("GET", "/health/"), ("GET", "/metrics/"), ("POST", "/v1/completions/")]:
        r = httpx.request(method, server.url + path, headers={**auth, "Host": "evil.example.com"}, timeout=30,
                          follow_redirects=False)
        assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
        assert r.json()["error"]["code"] == "not_found"


def test_openai_client_raises_the_right_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_a_request_the_pool_can_never_hold_is_refused(checkpoint):
    srv, front = serve(checkpoint, api_key=None, num_blocks=8)      # 8 x 16 = 128 tokens < max_model_len 256
    try:
        with srv:
            r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 200}, key=None)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "max_tokens" and "never fit" in r.json()["error"]["message"]
            r = post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "ignore_eos": True}, key=None)
            assert r.status_code == 200, r.text        # the default max_tokens is what the pool can hold
            usage = r.json()["usage"]
            assert usage["total_tokens"] == 8 * 16
            # a prompt that fills the pool by itself: no max_tokens could help, and the message says so
            chat = {"messages": [{"role": "user", "content": TOO_LONG[:900]}]}       # ~160 tokens
            for path, body, param in [("/v1/completions", {"prompt": [5] * 128, "max_tokens": 1}, "prompt"),
                                      ("/v1/chat/completions", chat, "messages")]:
                r = post(srv.url, path, body, key=None)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                assert "no room to generate in the KV pool" in r.json()["error"]["message"], r.text
                assert "must be < 128" in r.json()["error"]["message"], r.text
    finally:
        front.shutdown()


def test_a_stopping_server_ends_its_open_requests_with_an_error(checkpoint):
    """The server told to stop (what SIGTERM and Ctrl-C do) while a stream and a non-streamed request run:
    after the shutdown grace period (0.5 s here) the stream ends with an OpenAI-shaped error event and
    `data: [DONE]`, the other request answers 503, both are aborted in the engine (every block free), and the
    engine itself keeps running. Steps take 20 ms (the synthetic device, scripts/fake_engine.py: the tiny model's
    are too quick to keep a request open), so 200 tokens take 4 s, well past the grace period."""
    front = CoreClient.in_thread(install_fake_runner(LLM(checkpoint, **ENGINE), 20.0))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
    events, plain, opened = [], [], threading.Event()

    def stream(url):
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    opened.set()

    try:
        with ServerThread(build_app(front, MODEL), shutdown_timeout_s=0.5) as srv:
            threads = [threading.Thread(target=stream, args=(srv.url,), daemon=True),
                       threading.Thread(target=lambda: plain.append(httpx.post(srv.url + "/v1/completions", json=body,
                                                                               timeout=60)), daemon=True)]
            for t in threads:
                t.start()
            assert opened.wait(60), "the stream did not start"
            while front.num_requests_in_flight < 2:
                time.sleep(0.01)
        for t in threads:               # (leaving the block stopped the server)
            t.join(30)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "server_shutting_down"
        assert "grace period (0.5 s)" in error["message"], error
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutting_down"
        m = front.wait_until_idle()
        assert front.is_alive and m["num_free_blocks"] == ENGINE["num_blocks"]
        assert front.metrics.finished_requests == {"abort": 2}
    finally:
        front.shutdown()


# ---------------------------------------------------------------- clients that leave, and load
def aborted(before, after):
    return (metric(after, "pagedattn_request_finished_total", finished_reason="abort")
            - metric(before, "pagedattn_request_finished_total", finished_reason="abort"))


def test_streaming_client_that_disconnects_frees_its_blocks(server, caplog):
    """The request is aborted (its blocks freed) and the server logs no error for it: the writer is cancelled,
    not left to fail."""
    uvicorn_log = logging.getLogger("uvicorn.error")          # (uvicorn's loggers do not propagate)
    uvicorn_log.addHandler(caplog.handler)
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert next(r.iter_lines()).startswith("data: ")        # generating; now leave
    assert_no_leak(server)
    assert aborted(before, scrape(server.url)) == 1
    time.sleep(0.5)                                             # the server's side of the disconnect
    uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_non_streaming_client_that_disconnects_frees_its_blocks(server):
    before = scrape(server.url)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:     # raw HTTP: hang up once it is running
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (host.encode(), API_KEY.encode(), len(body), body))
        deadline = time.monotonic() + 30
        while not server.front.engine_metrics()["num_running"]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
    assert_no_leak(server)
    assert aborted(before, scrape(server.url)) == 1


NUM_CLIENTS = 64


def test_64_concurrent_streaming_clients_some_leaving_early(server, ref):
    # mixed prompt and output lengths; every 4th client leaves after its second chunk
    jobs = []
    for i in range(NUM_CLIENTS):
        prompt = f"{PROMPTS[i % 4]} {i} " + "cache " * (i % 9)
        jobs.append(dict(prompt=prompt, max_tokens=4 + (i * 7) % 37, leave=i % 4 == 3))
    want = ref.generate([j["prompt"] for j in jobs],
                        [SamplingParams(temperature=0, max_tokens=j["max_tokens"]) for j in jobs], use_tqdm=False)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * NUM_CLIENTS)))
    before = scrape(server.url)

    async def one(job):
        stream = await client.completions.create(model=MODEL, prompt=job["prompt"], max_tokens=job["max_tokens"],
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        texts, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
            if job["leave"] and len(texts) == 2:
                await stream.close()
                return None
        return "".join(texts), finish, usage

    async def health_during(load):
        codes = []
        while not load.done():
            async with httpx.AsyncClient() as h:
                codes.append((await h.get(server.url + "/health", timeout=30)).status_code)
            await asyncio.sleep(0.05)
        return codes

    async def main():
        load = asyncio.ensure_future(asyncio.gather(*[one(j) for j in jobs]))
        codes = await health_during(load)
        await client.close()
        return await load, codes

    results, codes = asyncio.run(asyncio.wait_for(main(), 300))
    assert codes and set(codes) == {200}                  # /health answered all along
    completed = 0
    for job, out, res in zip(jobs, want, results):
        if res is None:
            continue
        completed += 1
        text, finish, usage = res
        c = out.outputs[0]
        assert (text, finish) == (c.text, c.finish_reason), job       # every completed stream is whole
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(out.prompt_token_ids), len(c.token_ids))
    assert completed >= NUM_CLIENTS * 3 // 4
    assert_no_leak(server)
    after = scrape(server.url)
    ended = sum(metric(after, "pagedattn_request_finished_total", finished_reason=r)
                - metric(before, "pagedattn_request_finished_total", finished_reason=r)
                for r in ("stop", "length", "abort"))
    assert ended == NUM_CLIENTS


def test_streamed_chunks_are_the_protocol_models_json():
    """The streamed chunks are written without the pydantic models (from a job's frame of bytes, or with
    logprobs from plain dicts encoded by msgspec): byte for byte what the protocol models write (non-ASCII
    text, quotes, a model name to escape, logprobs, usage or none, a finish reason or none, the chat role chunk)."""
    import types

    from pagedattn.engine.outputs import CompletionOutput
    from pagedattn.serving import protocol as P
    from pagedattn.serving.responses import ChatJob, CompletionJob, _sse

    c = CompletionOutput(0, "x", [65, 66], None, -1.5, [-0.5, -1.0])
    c.delta_text, c.delta_token_ids = 'h\u00e9 "\U0001f642"\n\\', [65, 66]
    streams = [types.SimpleNamespace(prompt_token_ids=[1, 2, 3])]       # what a job reads of its stream
    model = 'm "\u00e9"'
    for logprobs in (None, 1):
        req = P.CompletionRequest(model="m", prompt="p", logprobs=logprobs, stream=True)
        for index, finish, usage in ((0, "length", True), (3, None, False)):
            job = CompletionJob("cmpl-1", model, req, streams, None)
            assert (job.frame is None) == (logprobs is not None)
            got = job.event(index, c, finish, job.usage_dict() if usage else None)
            job2 = CompletionJob("cmpl-1", model, req, streams, None)
            want = P.CompletionChunk(id="cmpl-1", created=job.created, model=model,
                                     usage=job2.usage() if usage else None, choices=[
                P.CompletionChoice(index=index, text=c.delta_text, finish_reason=finish,
                                   logprobs=job2.logprobs(index, c, c.delta_token_ids))])
            assert got == b"data: " + want.model_dump_json().encode() + b"\n\n", (logprobs, index)
    for logprobs in (False, True):
        chat = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=logprobs,
                                       stream=True)
        job = ChatJob("chatcmpl-1", model, chat, streams, None)
        assert (job.frame is None) == logprobs
        job2 = ChatJob("chatcmpl-1", model, chat, streams, None)
        got = [_sse(job.first_chunks()[0]), job.event(1, c, None, None), job.event(0, c, "stop", job.usage_dict())]
        want = [P.ChatCompletionChunk(id="chatcmpl-1", created=job.created, model=model, choices=[
                    P.ChatCompletionStreamChoice(index=0, delta=P.DeltaMessage(role="assistant", content=""))]),
                P.ChatCompletionChunk(id="chatcmpl-1", created=job.created, model=model, choices=[
                    P.ChatCompletionStreamChoice(index=1, delta=P.DeltaMessage(content=c.delta_text),
                                                 logprobs=job2.logprobs(1, c, c.delta_token_ids))]),
                P.ChatCompletionChunk(id="chatcmpl-1", created=job.created, model=model, usage=job2.usage(), choices=[
                    P.ChatCompletionStreamChoice(index=0, delta=P.DeltaMessage(content=c.delta_text),
                                                 finish_reason="stop", logprobs=job2.logprobs(0, c, c.delta_token_ids))])]
        assert got == [b"data: " + w.model_dump_json().encode() + b"\n\n" for w in want], logprobs

def test_a_send_that_waits_for_the_socket_keeps_the_order_of_later_writes():
    """responses._Sender: a write whose ASGI send returns at once is sent on the spot; one whose send waits (a
    full socket buffer) goes on as a task, the writes made meanwhile follow it in one message, in order, and
    `then` resolves once all went out; an error of a send reaches the future `then` resolves."""
    from pagedattn.serving.responses import _Sender

    async def main():
        sent, writable = [], asyncio.Event()
        writable.set()

        async def send(message):
            if not writable.is_set():
                await writable.wait()
            sent.append((message["body"], message["more_body"]))

        sender = _Sender(send)
        sender.write(b"a")
        assert sent == [(b"a", True)] and sender.task is None      # sent at once, no task
        writable.clear()
        sender.write(b"b")                                          # waits for the socket
        sender.write(b"c")
        sender.write(b"d", more_body=False)
        done = asyncio.get_running_loop().create_future()
        sender.then(done)
        assert sent == [(b"a", True)] and not done.done()
        writable.set()
        await asyncio.wait_for(done, 5)
        assert sent == [(b"a", True), (b"b", True), (b"cd", False)]

        async def broken(message):
            await asyncio.sleep(0)
            raise OSError("gone")

        sender = _Sender(broken)
        sender.write(b"x")
        failed = asyncio.get_running_loop().create_future()
        sender.then(failed)
        with pytest.raises(OSError, match="gone"):
            await asyncio.wait_for(failed, 5)

    asyncio.run(main())


def test_response_ids_are_unique_and_a_forked_process_draws_its_own():
    """protocol.random_id: 128 random bits from a per-process generator (no system call per id); a forked
    child reseeds, so two API processes never hand out the same ids."""
    ids = {P.random_id("cmpl") for _ in range(10000)}
    assert len(ids) == 10000 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                        # the child: its next id, to the parent
        os.write(write, P.random_id("cmpl").encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    assert child != P.random_id("cmpl") and child not in ids
