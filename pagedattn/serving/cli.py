"""python -m pagedattn serve: the OpenAI-compatible server.

    python -m pagedattn serve                                  # the bundled model, 127.0.0.1:8000
    python -m pagedattn serve --model path/to/qwen2_dir --device cuda --port 8001 --api-key secret
    python -m pagedattn serve --model DIR --device cuda --data-parallel-size 2 --api-server-count 4
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m pagedattn serve --model DIR --device cuda --tensor-parallel-size 4     # docs/tensor_parallel.md

The engine runs in an engine-core process of its own and the HTTP side (tokenizing, detokenizing, SSE) in
one or more API processes that share the port; --in-process runs both in this process instead, the engine
core on a thread (one interpreter, one GIL). The arguments are parsed once, into a ServeConfig, which every
process gets as it is (pagedattn.serving.config, docs/serving.md).

then, with the official client:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b-instruct",
                                       messages=[{"role": "user", "content": "Write a haiku about caches."}])
    print(r.choices[0].message.content)
"""
import argparse
import json
import os
from dataclasses import fields

from pagedattn.serving.config import HTTP_IMPLS, ServeConfig, ServerLimits

_DEFAULTS = {f.name: f.default for f in fields(ServeConfig)}
# the engine flags that are LLM keyword arguments of the same name (left out: EngineConfig's default)
_ENGINE = ("model", "device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_blocks",
           "block_size", "tensor_parallel_size", "step_kernel")
# (ServerLimits field, --flag)
_LIMITS = [("max_body_bytes", "--max-body-bytes"), ("body_timeout_s", "--body-timeout"),
           ("head_timeout_s", "--head-timeout"), ("timeout_keep_alive_s", "--timeout-keep-alive"),
           ("max_prompts_per_request", "--max-prompts-per-request"), ("max_prompt_chars", "--max-prompt-chars"),
           ("max_stop_strings", "--max-stop-strings"), ("max_stop_chars", "--max-stop-chars")]


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m pagedattn serve", description=__doc__.split("\n")[0])
    eng = ap.add_argument_group("engine", "LLM(...)'s options (left out: EngineConfig's default)")
    eng.add_argument("--model", help="HF Qwen2 directory (default: the bundled model)")
    eng.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    eng.add_argument("--dtype", help="auto | float32 | float16 | bfloat16 (default auto)")
    eng.add_argument("--max-model-len", type=int, help="prompt + generated tokens per sequence (default 4096)")
    eng.add_argument("--max-num-seqs", type=int, help="sequences per step (default 256)")
    eng.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default 8192 on CUDA, 2048 on CPU)")
    eng.add_argument("--num-blocks", type=int, help="KV pool size (default: sized from memory)")
    eng.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    eng.add_argument("--tensor-parallel-size", type=int, help="GPUs (ranks) per engine core (default 1)")
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    eng.add_argument("--batch-invariant", action="store_true",
                     help="a request's tokens and logprobs independent of the rest of its batch (CPU float32, "
                          "GPU float16/bfloat16; docs/batch_invariance.md)")
    eng.add_argument("--step-kernel", choices=("auto", "on", "off"),
                     help="decode steps of <= 8 sequences as one kernel (kernels_numba/step.py; default auto: where "
                          "measured faster)")
    eng.add_argument("--no-piecewise-graphs", action="store_true",
                     help="steps with prompt tokens run eagerly (default on CUDA: the forward's pieces between "
                          "attentions replayed as CUDA graphs)")
    eng.add_argument("--prefill-delay-factor", type=float, default=_DEFAULTS["prefill_delay_factor"],
                     help="engine core: while sequences decode, hold new requests until this many times the last "
                          "prefill step's duration has passed since it ended, so arrivals share prefill steps "
                          "(0: admit at once; default %(default)s; docs/serving.md)")
    eng.add_argument("--engine-hook", metavar="MODULE:FUNCTION",
                     help="benchmarks and tests: FUNCTION(llm, **args) is called on the engine core's LLM before it "
                          "serves (e.g. scripts.fake_engine:install_fake_runner, a synthetic device)")
    eng.add_argument("--engine-hook-arg", dest="engine_hook_args", action="append", default=[], metavar="KEY=VALUE",
                     help="a keyword argument of --engine-hook (repeat for several; VALUE read as JSON, else text)")
    http = ap.add_argument_group("HTTP")
    http.add_argument("--served-model-name", help="the name clients pass as `model` (default: the model directory's)")
    http.add_argument("--host", default=_DEFAULTS["host"])
    http.add_argument("--port", type=int, default=_DEFAULTS["port"])
    http.add_argument("--api-key", default=os.environ.get("PAGEDATTN_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDATTN_API_KEY, else none)")
    http.add_argument("--stream-interval", type=int, default=_DEFAULTS["stream_interval"],
                      help="send a stream's tokens once at least this many are waiting (first and last at once)")
    http.add_argument("--http-impl", default=_DEFAULTS["http_impl"], choices=HTTP_IMPLS,
                      help="uvicorn's HTTP parser (auto: httptools where installed)")
    http.add_argument("--log-level", default=_DEFAULTS["log_level"],
                      help="uvicorn's: critical | error | warning | info | debug")
    http.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float,
                      default=_DEFAULTS["shutdown_timeout_s"],
                      help="seconds the open requests get to finish once the server is told to stop (SIGTERM, "
                           "Ctrl-C); then each ends with an error (a stream: an error event and [DONE])")
    http.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    proc = ap.add_argument_group("processes", "how the server is spread over processes (docs/serving.md)")
    proc.add_argument("--data-parallel-size", type=int, default=_DEFAULTS["data_parallel_size"],
                      help="engine cores, each a process with its own GPUs; requests go to the least loaded")
    proc.add_argument("--api-server-count", type=int, default=_DEFAULTS["api_server_count"],
                      help="HTTP processes sharing the port (SO_REUSEPORT), each talking to every engine core")
    proc.add_argument("--engine-core-address", dest="engine_core_addresses", action="append", default=[],
                      metavar="ADDR", help="use an engine core already running at tcp://HOST:PORT (repeat for "
                                           "several) instead of starting local ones")
    proc.add_argument("--in-process", action="store_true",
                      help="the engine core on a thread of the HTTP process (one interpreter: slower under load)")
    proc.add_argument("--switch-interval-ms", type=float, default=_DEFAULTS["switch_interval_ms"],
                      help="--in-process only: the interpreter's thread switch interval (Python's default: 5 ms): "
                           "how long the engine thread may wait for the GIL while the HTTP side is busy")
    d = ServerLimits()
    lim = ap.add_argument_group("limits", "what one client may ask of the server (docs/serving.md)")
    helps = {"max_body_bytes": "request body size (413 beyond)",
             "body_timeout_s": "seconds for a request body to arrive (408 beyond)",
             "head_timeout_s": "seconds for a connection's request headers to arrive (closed beyond)",
             "timeout_keep_alive_s": "seconds an idle keep-alive connection stays open",
             "max_prompts_per_request": "prompts in one /v1/completions request",
             "max_prompt_chars": "characters of one prompt (chat: of all the messages' content)",
             "max_stop_strings": "stop strings per request", "max_stop_chars": "characters per stop string"}
    for name, flag in _LIMITS:
        value = getattr(d, name)
        lim.add_argument(flag, dest=name, type=type(value), default=value, help=helps[name])
    return ap


def parse_config(argv=None):
    """`serve`'s arguments -> a ServeConfig (argparse's usage error, naming the field, when one is bad)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    engine = {name: getattr(a, name) for name in _ENGINE if getattr(a, name) is not None}
    if a.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    if a.enforce_eager:
        engine["enforce_eager"] = True
    if a.batch_invariant:
        engine["batch_invariant"] = True
    if a.no_piecewise_graphs:
        engine["piecewise_graphs"] = False
    try:
        hook_args = dict(_key_value(x) for x in a.engine_hook_args)
        return ServeConfig(
            engine=engine, prefill_delay_factor=a.prefill_delay_factor, engine_hook=a.engine_hook,
            engine_hook_args=hook_args, in_process=a.in_process, switch_interval_ms=a.switch_interval_ms,
            data_parallel_size=a.data_parallel_size, api_server_count=a.api_server_count,
            engine_core_addresses=a.engine_core_addresses, served_model_name=a.served_model_name, host=a.host,
            port=a.port, api_key=a.api_key, stream_interval=a.stream_interval, log_level=a.log_level,
            http_impl=a.http_impl, shutdown_timeout_s=a.shutdown_timeout_s, enable_docs=a.enable_docs,
            limits=ServerLimits(**{name: getattr(a, name) for name, _ in _LIMITS}))
    except ValueError as e:
        ap.error(str(e))


def _key_value(text):
    """"KEY=VALUE" -> (KEY, VALUE read as JSON, else the text itself)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--engine-hook-arg must be KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv=None):
    from pagedattn.distributed.worker import torchrun_launch
    from pagedattn.serving.serve import serve

    config = parse_config(argv)
    launch = torchrun_launch()
    if launch is not None:          # launched by torchrun: rank 0 serves, every other rank is a TP worker
        if (config.data_parallel_size != 1 or config.engine_core_addresses
                or config.engine.get("tensor_parallel_size", 1) != launch.world_size):
            raise SystemExit(f"under torchrun, serve runs one engine over all {launch.world_size} ranks: pass "
                             f"--tensor-parallel-size {launch.world_size}, no --data-parallel-size or "
                             "--engine-core-address")
        if launch.rank != 0:
            from pagedattn import LLM
            LLM(**config.engine)    # the worker loop; exits when rank 0 stops
    return serve(config)
