"""The multi-process server: D engine cores and N API processes on one port.

    serve(ServeConfig(model=path, device="cuda", data_parallel_size=2, api_server_count=4, port=8000))

    launcher (this process: starts, watches, stops the others)
      |- engine core 0 .. D-1   pagedattn.serving.engine_core: scheduler + model, one per data-parallel
      |                         rank (each on its own GPUs; each may be tensor-parallel itself)
      |- API server 0 .. N-1    uvicorn + build_app(CoreClient): HTTP, tokenizing, detokenizing, SSE;
                                every one talks to every core and binds the same port with SO_REUSEPORT,
                                so the kernel spreads the connections over them

All children are started with "spawn" (torch and CUDA do not survive fork) and ask the kernel to
SIGTERM them when the launcher dies, so none is left holding a GPU. Ctrl-C or SIGTERM on the launcher
stops the API servers first (each gives its open requests shutdown_timeout_s, then ends the rest with an
error: api_server.Server), then the cores; anything still alive after the grace period is killed, and the
local cores' socket directory is removed. An API server that exits takes the whole server down with it;
a core that dies does not: the API servers answer 503 on /health and fail its streams, and whoever
supervises the server decides what to restart.

/metrics on any API server: the engine gauges and counters summed over the D cores (each core sends its
snapshot to every API server); the request latency histograms and token counters are those of the API
server that answered.

Cores started elsewhere (another node: `python -m pagedattn.serving.engine_core --bind tcp://0.0.0.0:5550
...`) are used instead of local ones by giving their addresses (engine_core_addresses); see
docs/engine_core.md.
"""
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
from dataclasses import dataclass, field, fields

from pagedattn.serving import engine_core as ec
from pagedattn.serving.api_server import SHUTDOWN_TIMEOUT_S, ServerLimits

logger = logging.getLogger("pagedattn.serving")


@dataclass
class ServeConfig:
    """What `serve` runs. engine: extra LLM(...) keyword arguments (block_size, num_blocks, max_model_len,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enforce_eager, tensor_parallel_size...).
    engine_core_addresses: cores already running elsewhere (then data_parallel_size is their count)."""
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    data_parallel_size: int = 1
    api_server_count: int = 1
    stream_interval: int = 1
    log_level: str = "info"
    engine: dict = field(default_factory=dict)
    engine_core_addresses: list = field(default_factory=list)
    startup_timeout_s: float = 900.0
    limits: ServerLimits = field(default_factory=ServerLimits)
    enable_docs: bool = False
    http_impl: str = "auto"
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S

    def __post_init__(self):
        for name in ("data_parallel_size", "api_server_count", "stream_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        v = self.shutdown_timeout_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"shutdown_timeout_s must be a number >= 0, got {v!r}")

    @classmethod
    def from_args(cls, args):
        """From `python -m pagedattn serve`'s parsed arguments (an argparse.Namespace)."""
        from pagedattn.serving.cli import limits_from_args

        a = vars(args)
        own = {f.name for f in fields(cls)} - {"engine", "limits"}
        config = {k: a[k] for k in own if a.get(k) is not None}
        engine = dict(block_size=a.get("block_size"), num_blocks=a.get("num_blocks"),
                      max_model_len=a.get("max_model_len"), max_num_seqs=a.get("max_num_seqs"),
                      max_num_batched_tokens=a.get("max_num_batched_tokens"),
                      tensor_parallel_size=a.get("tensor_parallel_size"), fake_step_ms=a.get("fake_step_ms"),
                      fake_prefill_ms=a.get("fake_prefill_ms"), prefill_delay_factor=a.get("prefill_delay_factor"))
        if a.get("no_prefix_caching"):
            engine["enable_prefix_caching"] = False
        if a.get("enforce_eager"):
            engine["enforce_eager"] = True
        if a.get("no_piecewise_graphs"):
            engine["piecewise_graphs"] = False
        return cls(**config, engine={k: v for k, v in engine.items() if v is not None}, limits=limits_from_args(args))

    def engine_kwargs(self):
        return dict(self.engine, model=self.model, device=self.device, dtype=self.dtype)


def reserve_port(host, port):
    """The port the API servers will share: `port`, or a free one the OS picks when it is 0. The socket
    stays bound (SO_REUSEPORT, never listening) so that nothing else takes the port meanwhile."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock, sock.getsockname()[1]


def run_api_server(config, addresses, index, port, events):
    """An API process's body (a spawn target): a CoreClient on every core, build_app, uvicorn on `port`
    (SO_REUSEPORT). Puts ("ready", index, core info) on `events` once it accepts connections."""
    ec.die_with_parent()
    ec.name_process(f"pagedattn-api{index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the launcher decides; uvicorn's own handlers follow
    from pagedattn.serving.api_server import Server, build_app, uvicorn_config
    from pagedattn.serving.core_client import CoreClient

    client = CoreClient(addresses, stream_interval=config.stream_interval, ready_timeout_s=config.startup_timeout_s)
    try:
        name = config.served_model_name or os.path.basename(os.path.normpath(client.model_path))
        app = build_app(client, name, api_key=config.api_key, limits=config.limits, enable_docs=config.enable_docs)
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((config.host, port))
        sock.listen(2048)                 # connections queue from now on, before uvicorn accepts them
        server = Server(uvicorn_config(app, config.host, port, config.log_level, config.limits,
                                       http_impl=config.http_impl, shutdown_timeout_s=config.shutdown_timeout_s,
                                       lifespan="off"))
        events.put(("ready", index, {"name": name, "cores": client.info}))
        ec.run_profiled(f"api{index}", lambda: server.run(sockets=[sock]))
    finally:
        client.shutdown()


def serve(config):
    """Run the server until Ctrl-C / SIGTERM (or an API server exits). config: ServeConfig, or the
    argparse.Namespace of `python -m pagedattn serve`. Returns the exit status (0 on a requested stop)."""
    if not isinstance(config, ServeConfig):
        config = ServeConfig.from_args(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    ctx = mp.get_context("spawn")
    cores, api, addresses = [], [], []
    reserved = None
    status = 0
    try:
        addresses = list(config.engine_core_addresses)
        if not addresses:
            cores, addresses = ec.start_engine_cores(config.engine_kwargs(), config.data_parallel_size)
        reserved, port = reserve_port(config.host, config.port)
        events = ctx.Queue()
        for i in range(config.api_server_count):
            p = ctx.Process(target=run_api_server, args=(config, addresses, i, port, events),
                            name=f"pagedattn-api-{i}")
            p.start()
            api.append(p)
        ready, info = set(), None
        deadline = time.monotonic() + config.startup_timeout_s
        while len(ready) < len(api) and stop["signal"] is None:
            with contextlib.suppress(queue.Empty):
                kind, index, info = events.get(timeout=0.2)
                ready.add(index)
            dead = [p for p in api + cores if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited while starting (exit code {dead[0].exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {config.startup_timeout_s} s")
        if stop["signal"] is None:
            c0 = info["cores"][0]
            print(f"serving {info['name']!r} ({c0['model_path']} on {len(info['cores'])} engine core(s), "
                  f"{c0['device']} {c0['dtype']}, KV pool {c0['num_blocks']} blocks x {c0['block_size']} tokens "
                  f"per core, max_model_len {c0['max_model_len']}) with {len(api)} API server(s) at "
                  f"http://{config.host}:{port}/v1{' (API key required)' if config.api_key else ''}",
                  file=sys.stderr, flush=True)
        reported = set()
        while stop["signal"] is None:
            time.sleep(0.2)
            gone = [p for p in api if not p.is_alive()]
            if gone:
                logger.error("%s exited (exit code %s): stopping the server", gone[0].name, gone[0].exitcode)
                status = 1
                break
            for p in cores:
                if not p.is_alive() and p.name not in reported:
                    reported.add(p.name)
                    logger.error("%s exited (exit code %s): /health now fails", p.name, p.exitcode)
    finally:
        # an API server gives its open requests shutdown_timeout_s, then ends the rest with an error (Server)
        ec.stop_processes(api, timeout=config.shutdown_timeout_s + 10.0)
        ec.stop_processes(cores, timeout=20.0)     # a core stops on SIGTERM between two steps
        if cores:                                   # the local cores' private socket directory
            ec.remove_socket_dir(addresses)
        if reserved is not None:
            reserved.close()
        for s, h in old.items():
            signal.signal(s, h)
    return status


def main(argv=None):
    """python -m pagedattn.serving.launcher: the same as `python -m pagedattn serve`, with its arguments."""
    from pagedattn.serving.cli import main as serve_main

    sys.exit(serve_main(argv))


if __name__ == "__main__":
    main()
