"""A tiny random Qwen2 checkpoint WITH a real tokenizer and chat template, for the serving tests.

The tokenizer is a byte-level BPE (the kind Qwen2 uses) trained in a fraction of a second on the small
corpus below: any text encodes, and random generations contain multi-byte characters split over
several tokens, which the incremental detokenizer has to reassemble. The chat template is ChatML
(Qwen's) without the default system prompt. The model is tests/helpers.py's tiny Qwen2 with the
vocabulary resized to the tokenizer's.

    from serving_helpers import write_tiny_chat_checkpoint, ServerThread
    path = write_tiny_chat_checkpoint(tmp_dir)       # config.json, model.safetensors, tokenizer files
    with ServerThread(app) as srv:                   # uvicorn on 127.0.0.1:<free port>, in a thread
        httpx.get(srv.url + "/health")
"""
import gc
import json
import os
import signal
import threading
import time

import pytest
from helpers import write_tiny_checkpoint

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512              # 256 bytes + 3 special tokens + 253 merges

_CORPUS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The paged KV cache stores keys and values in fixed-size blocks.",
    "A block table maps each sequence's logical blocks to physical ones.",
    "Continuous batching admits new requests between decoding steps.",
    "Prefix caching shares the blocks of identical prompt prefixes.",
    "for i in range(10):\n    print(i * i)\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n",
    "Café crème, naïve façade, 中文字符, emoji 🙂🚀 and math ∑∫√.",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "Hello world! How are you today? I am fine, thank you.",
]


def train_tokenizer(vocab_size=VOCAB_SIZE):
    """A HF fast tokenizer: byte-level BPE over the corpus, ChatML template, eos <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHATML
    return hf


def write_tiny_chat_checkpoint(path, seed=0, **overrides):
    """Tokenizer files + a tiny random Qwen2 sized to its vocabulary into `path`; returns str(path).

    overrides: helpers.TINY_CONFIG entries to change (e.g. head_dim 64 shapes for the GPU kernels).
    EOS: <|endoftext|> in config.json, <|im_end|> added by generation_config.json (as Qwen2.5 does)."""
    tok = train_tokenizer()
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    write_tiny_checkpoint(path, seed=seed, vocab_size=len(tok), bos_token_id=endoftext, eos_token_id=endoftext,
                          **overrides)
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext]}, f)
    return str(path)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<a free port the OS picks> in a daemon thread; `url` once entered.
    The server and its settings are `python -m pagedattn serve`'s (http_server.Server, uvicorn_config with the
    app's limits)."""

    def __init__(self, app, limits=None, **config_kwargs):
        from pagedattn.serving.http_server import Server, uvicorn_config

        limits = getattr(app.state, "limits", None) if limits is None else limits
        config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning", limits=limits, lifespan="off",
                                **config_kwargs)
        self.config = config
        self.server = Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def scrape(url):
    """{(sample name, frozenset of its labels): value} from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---- the event loop while a long prompt tokenizes ----------------------------------------------------------
# /health must answer within this while the largest prompt the server accepts tokenizes. The goal is 100 ms;
# the bound is 5x that because the test machine is shared: with the fix, the slowest of ~150-250 polls per
# request was 5-40 ms on its 2 cores at load average ~4, but 0.1-0.23 s (several polls in a row: the OS
# sharing the cores among 3+ busy processes, not the server) at load average 5+ with another test suite
# running beside it. The stall this guards against lasts the whole tokenization, 1-2.5 s for this prompt on
# the same machine (2.6-8 s where it was found), and grows with the load.
HEALTH_BOUND_S = 0.5


def long_prompt(num_chars, seed=0):
    """num_chars random CJK characters: the slowest text of those tried for the byte-level tokenizer
    (~3 tokens a character, one pre-tokenizer word), ~1.5 s for 1,000,000 on the test machine."""
    import random

    rng = random.Random(seed)
    return "".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(num_chars))


def health_while(url, send):
    """(send()'s result, the latency in seconds of every /health poll sent while send() ran): a thread polls
    /health every ~10 ms over one keep-alive connection from before send() starts until it returns."""
    import httpx

    latencies, done, started = [], threading.Event(), threading.Event()
    window = [None, None]               # send()'s start and end, perf_counter

    def poll():
        with httpx.Client(timeout=30) as h:
            h.get(url + "/health")      # (the connection is open before the window starts)
            started.set()
            while not done.is_set():
                t = time.perf_counter()
                assert h.get(url + "/health").status_code == 200
                latencies.append((t, time.perf_counter() - t))
                time.sleep(0.01)        # (a poll every ~10 ms: the poller's own load stays small)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    assert started.wait(30), "/health did not answer"
    # A full collection of this process's heap (the test process: torch, models, pytest) takes 0.1-0.4 s on the
    # test machine and would land in the window whenever it falls due; done now, none falls due in the seconds
    # the window lasts. (It is the test process's pause, not the server's tokenizing.)
    gc.collect()
    window[0] = time.perf_counter()
    try:
        result = send()
    finally:
        window[1] = time.perf_counter()
        done.set()
        poller.join(30)
    return result, [d for t, d in latencies if window[0] <= t <= window[1]]


def assert_loop_free_while_tokenizing(url, limits, model, headers=None):
    """A completions prompt and a chat message of limits.max_prompt_chars characters each (accepted by the
    character limit, far over max_model_len in tokens): each is refused naming its field, and every /health poll
    made meanwhile answers within HEALTH_BOUND_S."""
    import json

    import httpx

    text = long_prompt(limits.max_prompt_chars)
    for path, body, param in [("/v1/completions", {"prompt": text}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages")]:
        data = json.dumps({"model": model, **body}, ensure_ascii=False).encode()
        r, polls = health_while(url, lambda: httpx.post(
            url + path, content=data, headers={"Content-Type": "application/json", **(headers or {})}, timeout=120))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:500]
        assert "tokens" in r.json()["error"]["message"]
        assert polls and max(polls) <= HEALTH_BOUND_S, (f"{path}: /health took up to {max(polls) * 1000:.0f} ms "
                                                        f"while the prompt tokenized ({len(polls)} polls)")
        assert len(polls) >= 5, f"{path}: only {len(polls)} polls: the window was too short to tell"


# ---- the test process's signal handling ---------------------------------------------------------------------
@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """Autouse in every module that imports it: the test leaves this process's SIGTERM and SIGINT handlers as
    it found them. (A handler left behind by code that ran an engine core or a profile in the calling process
    turned a later SIGTERM into a SystemExit inside an unrelated test.)"""
    watched = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in watched}
    yield
    after = {s: signal.getsignal(s) for s in watched}
    changed = {signal.Signals(s).name: (before[s], after[s]) for s in watched if after[s] is not before[s]}
    for s in watched:                   # put them back, so that one failure does not spread to the next tests
        signal.signal(s, before[s])
    assert not changed, f"the test changed this process's signal handlers (before, after): {changed}"
