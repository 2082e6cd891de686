"""serve(config): the server a ServeConfig describes, in one process or spread over several.

    serve(ServeConfig(engine=dict(model=path, device="cuda"), data_parallel_size=2, api_server_count=4))

In one process (config.in_process): the engine core on a thread, a CoreClient on it, uvicorn serving
build_app's app, all in this process (one interpreter, one GIL).

Otherwise this process is the launcher; it starts, watches and stops the others:

    launcher (this process)
      |- engine core 0 .. D-1   pagedattn.serving.engine_core: scheduler + model, one per data-parallel
      |                         rank (each on its own GPUs; each may be tensor-parallel itself)
      |- API server 0 .. N-1    uvicorn + build_app(CoreClient): HTTP, tokenizing, detokenizing, SSE;
                                every one talks to every core and binds the same port with SO_REUSEPORT,
                                so the kernel spreads the connections over them

Every child gets the same ServeConfig (spawn pickles it) and asks the kernel to SIGTERM it when the
launcher dies, so none is left holding a GPU. Ctrl-C or SIGTERM on the launcher stops the API servers first
(each gives its open requests shutdown_timeout_s, then ends the rest with an error: http_server.Server),
then the cores; anything still alive after the grace period is killed, and the local cores' socket
directory is removed. An API server that exits takes the whole server down with it; a core that dies does
not: the API servers answer 503 on /health and fail its streams, and whoever supervises the server decides
what to restart.

/metrics on any API server: the engine gauges and counters summed over the D cores (each core sends its
snapshot to every API server); the request latency histograms and token counters are those of the API
server that answered.

Cores started elsewhere (another node: `python -m pagedattn.serving.engine_core --bind tcp://0.0.0.0:5550
...`) are used instead of local ones by giving their addresses (engine_core_addresses); see
docs/serving.md.
"""
import contextlib
import logging
import multiprocessing as mp
import queue
import signal
import socket
import sys
import threading
import time

from pagedattn.serving import engine_core as ec
from pagedattn.serving.processes import die_with_parent, name_process, run_profiled, signal_handlers, stop_processes

logger = logging.getLogger("pagedattn.serving")


def serve(config):
    """Run the server `config` (ServeConfig) describes until Ctrl-C / SIGTERM (or, with several processes,
    an API server exits). Returns the exit status (0 on a requested stop)."""
    if config.in_process:
        return serve_in_process(config)
    return launch(config)


def serve_in_process(config):
    """The engine core on a thread of this process, the HTTP server on this thread's event loop."""
    from pagedattn.serving.app import build_app
    from pagedattn.serving.core_client import CoreClient
    from pagedattn.serving.http_server import Server, uvicorn_config

    # Two threads share the GIL here: the engine core's loop (Python between GPU launches) and uvicorn's
    # event loop (detokenizing, JSON and socket writes for every stream). A thread that wants the GIL waits up
    # to the switch interval for the other to drop it; a shorter interval bounds what a busy HTTP side costs
    # a step.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    client = CoreClient.start(config)
    # uvicorn stops on SIGINT / SIGTERM and, once it has shut down, raises that signal again with the handler
    # it found: this one ends the run here, so that the core is shut down and the exit status is 0.
    stops = {signal.SIGINT: _requested_stop, signal.SIGTERM: _requested_stop}
    try:
        name = config.model_name(client.model_path)
        app = build_app(client, name, api_key=config.api_key, limits=config.limits, enable_docs=config.enable_docs)
        announce(config, name, client.info, 1, config.port, "on a thread of this process")
        with signal_handlers(stops if threading.current_thread() is threading.main_thread() else {}):
            Server(uvicorn_config(app, config.host, config.port, config.log_level, config.limits,
                                  http_impl=config.http_impl, shutdown_timeout_s=config.shutdown_timeout_s)).run()
    except _Stopped:
        pass
    finally:
        client.shutdown()
        sys.setswitchinterval(switch)
    return 0


class _Stopped(Exception):
    """A requested stop (SIGINT / SIGTERM), raised by the signal's handler once uvicorn has shut down."""


def _requested_stop(signum, frame):
    raise _Stopped


def announce(config, name, cores, api_servers, port, where):
    """The one line a started server prints: what it serves, where, how."""
    c0 = cores[0]
    print(f"serving {name!r} ({c0['model_path']} on {len(cores)} engine core(s) {where}, {c0['device']} "
          f"{c0['dtype']}, KV pool {c0['num_blocks']} blocks x {c0['block_size']} tokens per core, max_model_len "
          f"{c0['max_model_len']}) with {api_servers} API server(s) at "
          f"http://{config.host}:{port}/v1{' (API key required)' if config.api_key else ''}",
          file=sys.stderr, flush=True)


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
    die_with_parent()
    name_process(f"pagedattn-api{index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the launcher decides; uvicorn's own handlers follow
    from pagedattn.serving.app import build_app
    from pagedattn.serving.core_client import CoreClient
    from pagedattn.serving.http_server import Server, uvicorn_config

    client = CoreClient(addresses, stream_interval=config.stream_interval, ready_timeout_s=config.startup_timeout_s)
    try:
        name = config.model_name(client.model_path)
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
        run_profiled(f"api{index}", lambda: server.run(sockets=[sock]))
    finally:
        client.shutdown()


def launch(config):
    """The launcher: D engine cores (or config.engine_core_addresses) and N API processes on one port,
    watched until Ctrl-C / SIGTERM or an API server exits; then everything stopped in order."""
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
            cores, addresses = ec.start_engine_cores(config)
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
            announce(config, info["name"], info["cores"], len(api), port, "in processes of their own")
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
        stop_processes(api, timeout=config.shutdown_timeout_s + 10.0)
        stop_processes(cores, timeout=20.0)         # a core stops on SIGTERM between two steps
        if cores:                                   # the local cores' private socket directory
            ec.remove_socket_dir(addresses)
        if reserved is not None:
            reserved.close()
        for s, h in old.items():
            signal.signal(s, h)
    return status
