"""python -m pagedattn serve: the OpenAI-compatible server.

    python -m pagedattn serve                                  # the bundled model, 127.0.0.1:8000
    python -m pagedattn serve --model path/to/qwen2_dir --device cuda --port 8001 --api-key secret
    python -m pagedattn serve --model DIR --device cuda --data-parallel-size 2 --api-server-count 4
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m pagedattn serve --model DIR --device cuda --tensor-parallel-size 4     # docs/tensor_parallel.md

The engine runs in an engine-core process of its own and the HTTP side (tokenizing, detokenizing, SSE) in
one or more API processes that share the port (pagedattn.serving.launcher, docs/engine_core.md);
--in-process runs both in this process instead, the engine on a thread (one interpreter, one GIL).

then, with the official client:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b-instruct",
                                       messages=[{"role": "user", "content": "Write a haiku about caches."}])
    print(r.choices[0].message.content)
"""
import argparse
import os
import sys

from pagedattn.serving.api_server import SHUTDOWN_TIMEOUT_S, ServerLimits


def parse_args(argv=None):
    from pagedattn.serving.engine_core import PREFILL_DELAY_FACTOR

    ap = argparse.ArgumentParser(prog="python -m pagedattn serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF Qwen2 directory (default: the bundled model)")
    ap.add_argument("--served-model-name", default=None,
                    help="the name clients pass as `model` (default: the model directory's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    ap.add_argument("--api-key", default=os.environ.get("PAGEDATTN_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDATTN_API_KEY, else none)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: sized from memory)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--http-impl", default="auto", choices=["auto", "httptools", "h11"],
                    help="uvicorn's HTTP parser (auto: httptools where installed)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-piecewise-graphs", action="store_true",
                    help="steps with prompt tokens run eagerly (default on CUDA: the forward's pieces between "
                         "attentions replayed as CUDA graphs)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="send a stream's tokens once at least this many are waiting (first and last at once)")
    ap.add_argument("--switch-interval-ms", type=float, default=1.0,
                    help="--in-process only: the interpreter's thread switch interval (Python's default: 5 ms): how "
                         "long the engine thread may wait for the GIL while the HTTP thread is busy")
    ap.add_argument("--fake-step-ms", type=float, default=None,
                    help="benchmarks only: the model replaced by a synthetic device that runs every step in this "
                         "many ms and samples random tokens (pagedattn/serving/fake_engine.py)")
    ap.add_argument("--fake-prefill-ms", type=float, default=None,
                    help="with --fake-step-ms: what a step holding a prompt chunk costs on top (an eager step)")
    ap.add_argument("--prefill-delay-factor", type=float, default=None,
                    help="engine core: while sequences decode, hold new requests until this many times the last "
                         "prefill step's duration has passed since it ended, so arrivals share prefill steps "
                         f"(0: admit at once; default {PREFILL_DELAY_FACTOR}; docs/engine_core.md)")
    ap.add_argument("--log-level", default="info", help="uvicorn's: critical | error | warning | info | debug")
    ap.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=SHUTDOWN_TIMEOUT_S,
                    help="seconds the open requests get to finish once the server is told to stop (SIGTERM, Ctrl-C); "
                         "then each ends with an error (a stream: an error event and [DONE])")
    proc = ap.add_argument_group("processes", "how the server is spread over processes (docs/engine_core.md)")
    proc.add_argument("--data-parallel-size", type=int, default=1,
                      help="engine cores, each a process with its own GPUs; requests go to the least loaded")
    proc.add_argument("--api-server-count", type=int, default=1,
                      help="HTTP processes sharing the port (SO_REUSEPORT), each talking to every engine core")
    proc.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) per engine core")
    proc.add_argument("--engine-core-address", dest="engine_core_addresses", action="append", default=[],
                      metavar="ADDR", help="use an engine core already running at tcp://HOST:PORT (repeat for "
                                           "several) instead of starting local ones")
    proc.add_argument("--in-process", action="store_true",
                      help="the engine on a thread of the HTTP process (one interpreter: slower under load)")
    d = ServerLimits()
    lim = ap.add_argument_group("limits", "what one client may ask of the server (docs/serving.md)")
    lim.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="request body size (413 beyond)")
    lim.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                     help="seconds for a request body to arrive (408 beyond)")
    lim.add_argument("--head-timeout", type=float, default=d.head_timeout_s,
                     help="seconds for a connection's request headers to arrive (closed beyond)")
    lim.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive_s,
                     help="seconds an idle keep-alive connection stays open")
    lim.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                     help="prompts in one /v1/completions request")
    lim.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                     help="characters of one prompt (chat: of all the messages' content)")
    lim.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per request")
    lim.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters per stop string")
    ap.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    return ap.parse_args(argv)


def limits_from_args(a):
    """ServerLimits from parsed arguments (InvalidRequestError names a bad one)."""
    return ServerLimits(max_body_bytes=a.max_body_bytes, body_timeout_s=a.body_timeout, head_timeout_s=a.head_timeout,
                        timeout_keep_alive_s=a.timeout_keep_alive, max_prompts_per_request=a.max_prompts_per_request,
                        max_prompt_chars=a.max_prompt_chars, max_stop_strings=a.max_stop_strings,
                        max_stop_chars=a.max_stop_chars)


def main(argv=None):
    from pagedattn import LLM
    from pagedattn.distributed.worker import torchrun_launch
    from pagedattn.errors import InvalidRequestError
    from pagedattn.serving.api_server import Server, build_app, uvicorn_config
    from pagedattn.serving.async_llm import AsyncLLM

    a = parse_args(argv)
    try:
        limits = limits_from_args(a)
    except InvalidRequestError as e:
        raise SystemExit(str(e)) from e
    if a.switch_interval_ms <= 0:
        raise SystemExit(f"--switch-interval-ms must be > 0, got {a.switch_interval_ms}")
    if a.stream_interval < 1:
        raise SystemExit(f"--stream-interval must be >= 1, got {a.stream_interval}")
    if not a.shutdown_timeout_s >= 0:
        raise SystemExit(f"--shutdown-timeout must be >= 0, got {a.shutdown_timeout_s}")
    launch = torchrun_launch()
    if launch is not None:          # launched by torchrun: rank 0 serves, every other rank is a TP worker
        if a.data_parallel_size != 1 or a.engine_core_addresses or a.tensor_parallel_size != launch.world_size:
            raise SystemExit(f"under torchrun, serve runs one engine over all {launch.world_size} ranks: pass "
                             f"--tensor-parallel-size {launch.world_size}, no --data-parallel-size or "
                             "--engine-core-address")
        if launch.rank != 0:
            from pagedattn.serving.launcher import ServeConfig
            LLM(**ServeConfig.from_args(a).engine_kwargs())     # the worker loop; exits when rank 0 stops
    if not a.in_process:
        from pagedattn.serving.launcher import ServeConfig, serve

        try:
            config = ServeConfig.from_args(a)
        except ValueError as e:
            raise SystemExit(str(e)) from e
        return serve(config)
    if a.data_parallel_size != 1 or a.api_server_count != 1 or a.engine_core_addresses:
        raise SystemExit("--in-process runs one engine and one HTTP server: drop --data-parallel-size, "
                         "--api-server-count and --engine-core-address")
    # Two threads share the GIL here: the engine thread (Python between GPU launches) and uvicorn's event
    # loop (JSON and socket writes for every stream). A thread that wants the GIL waits up to the switch
    # interval for the other to drop it; a shorter interval bounds what a busy HTTP thread costs a step.
    sys.setswitchinterval(a.switch_interval_ms / 1000)
    llm = LLM(a.model, device=a.device, dtype=a.dtype, block_size=a.block_size, num_blocks=a.num_blocks,
              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=not a.no_prefix_caching,
              enforce_eager=a.enforce_eager, piecewise_graphs=False if a.no_piecewise_graphs else None,
              tensor_parallel_size=a.tensor_parallel_size)
    if a.fake_step_ms:
        from pagedattn.serving.fake_engine import install_fake_runner
        install_fake_runner(llm, a.fake_step_ms, prefill_ms=a.fake_prefill_ms or 0.0)
    engine = llm.engine
    name = a.served_model_name or os.path.basename(os.path.normpath(engine.model_path))
    async_llm = AsyncLLM(llm, stream_interval=a.stream_interval)
    app = build_app(async_llm, name, api_key=a.api_key, limits=limits, enable_docs=a.enable_docs)
    print(f"serving {name!r} ({engine.model_path} on {engine.config.device}, "
          f"{str(engine.config.dtype).replace('torch.', '')}, KV pool {engine.num_blocks} blocks x "
          f"{engine.config.block_size} tokens, max_model_len {engine.max_model_len}) at "
          f"http://{a.host}:{a.port}/v1{' (API key required)' if a.api_key else ''}", file=sys.stderr, flush=True)
    try:
        Server(uvicorn_config(app, a.host, a.port, a.log_level, limits, http_impl=a.http_impl,
                              shutdown_timeout_s=a.shutdown_timeout_s)).run()
    finally:
        async_llm.shutdown()
        llm.close()
    return 0
