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
import json
import os
import threading
import time

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
    The uvicorn settings are `python -m pagedattn serve`'s (api_server.uvicorn_config, with the app's limits)."""

    def __init__(self, app, limits=None, **config_kwargs):
        import uvicorn

        from pagedattn.serving.api_server import uvicorn_config

        limits = getattr(app.state, "limits", None) if limits is None else limits
        config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning", limits=limits, lifespan="off",
                                **config_kwargs)
        self.config = config
        self.server = uvicorn.Server(config)
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
