"""The server on a GPU: the engine core's thread (not the thread that built the LLM) drives CUDA graphs and
async scheduling, while uvicorn's event loop streams.

* the tiny chat model (fp16, head_dim 64 as the GPU kernels want): each request alone, streamed == non-streamed == LLM.generate on a second
  engine (one request at a time on both sides, so the same kernels see the same shapes and greedy
  tokens must match exactly); 64 concurrent streaming clients, every 4th leaving early: every completed
  stream is whole (exactly max_tokens tokens with ignore_eos, usage right), /health answers throughout,
  no block is left behind;
* the bundled Qwen2.5-Coder-0.5B-Instruct: a chat request through the real chat template, streamed ==
  non-streamed == LLM.generate.
"""
import asyncio

import pytest

pytestmark = pytest.mark.gpu
openai = pytest.importorskip("openai")          # (a GPU machine without the serving extras skips, not errors)
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import bundled_model_dir  # noqa: E402,F401  (session fixture)
from serving_helpers import ServerThread, scrape, write_tiny_chat_checkpoint  # noqa: E402

from pagedattn import LLM, SamplingParams  # noqa: E402
from pagedattn.serving.app import build_app  # noqa: E402
from pagedattn.serving.core_client import CoreClient  # noqa: E402

ENGINE = dict(device="cuda", max_model_len=256, num_blocks=512, max_num_seqs=64)
GPU_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # head_dim 64
PROMPTS = ["def fib(n):", "The paged KV cache", "Hello world! How are you", "SELECT name FROM"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat_gpu"), **GPU_SHAPES)
    front = CoreClient.in_thread(LLM(path, **ENGINE))
    with ServerThread(build_app(front, "tiny")) as srv:
        yield srv.url, front, LLM(path, **ENGINE)
    front.shutdown()


def test_tiny_streamed_equals_unstreamed_equals_generate(tiny):
    url, _, ref = tiny
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        want = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=48, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=48, temperature=0, stream=True))
        assert got.choices[0].text == streamed == want.text
        assert got.usage.completion_tokens == len(want.token_ids)


def test_tiny_64_streaming_clients(tiny):
    url, front, _ = tiny
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=128)))

    async def one(i):
        n = 8 + (i * 13) % 120
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % 4] + " " * (i % 7), max_tokens=n,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        chunks, usage, finish = 0, None, None
        async for chunk in stream:
            if chunk.choices:
                chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
            if i % 4 == 3 and chunks == 2:
                await stream.close()
                return None
        assert finish == "length" and usage.completion_tokens == n, (i, finish, usage)
        return n

    async def main():
        load = asyncio.ensure_future(asyncio.gather(*[one(i) for i in range(64)]))
        codes = []
        async with httpx.AsyncClient() as h:
            while not load.done():
                codes.append((await h.get(url + "/health", timeout=30)).status_code)
                await asyncio.sleep(0.02)
        await client.close()
        return await load, codes

    results, codes = asyncio.run(asyncio.wait_for(main(), 300))
    assert codes and set(codes) == {200}
    assert sum(r is not None for r in results) >= 48
    front.wait_until_idle()
    bm = front.engine_core.engine.block_manager
    assert bm.num_free_blocks == bm.total_blocks
    free = scrape(url)[("pagedattn_kv_cache_free_blocks", frozenset({"model_name": "tiny"}.items()))]
    assert free == bm.total_blocks


def test_bundled_chat_streamed_equals_unstreamed_equals_generate(bundled_model_dir):  # noqa: F811
    kwargs = dict(device="cuda", max_model_len=1024, num_blocks=256, max_num_seqs=16)
    front = CoreClient.in_thread(LLM(bundled_model_dir, **kwargs))
    ref = LLM(bundled_model_dir, **kwargs)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    chat = ref.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = ref.generate([chat], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    try:
        with ServerThread(build_app(front, "qwen")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            got = client.chat.completions.create(model="qwen", messages=messages, max_tokens=64, temperature=0)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="qwen", messages=messages, max_tokens=64, temperature=0, stream=True))
    finally:
        front.shutdown()
    assert got.choices[0].message.content == streamed == want.text
    assert "def" in want.text
