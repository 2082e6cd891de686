"""ServeConfig: everything `python -m pagedattn serve` runs, parsed once and handed on as it is.

    config = ServeConfig(engine=dict(model=path, device="cuda"), data_parallel_size=2, api_server_count=4)
    serve(config)                                   # pagedattn.serving.serve

The command line becomes a ServeConfig in one place (pagedattn.serving.cli); from there the same object goes
to the in-process server, the launcher, every API process and every engine core (spawn pickles it), so no
process re-parses arguments or keeps defaults of its own. The engine options are LLM(...)'s keyword arguments,
and whatever is left out takes EngineConfig's default. Every bad value raises ValueError naming the field
(InvalidRequestError, a ValueError, for the engine's and the limits' fields).
"""
import importlib
import os
import re
from dataclasses import dataclass, field, fields

from pagedattn.errors import InvalidRequestError

# Once told to stop, a server gives its open requests this long to finish (then they end with an error).
SHUTDOWN_TIMEOUT_S = 5.0
# The engine core's admission rule: how many times the last prefill's duration new requests wait while
# others decode (pagedattn.serving.engine_core.EngineCore says why).
PREFILL_DELAY_FACTOR = 2.0
HTTP_IMPLS = ("auto", "httptools", "h11")
_HOOK = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass
class ServerLimits:
    """What one client may ask of the server (docs/serving.md: defaults and `serve` flags).

    max_body_bytes: request body size (413 beyond). body_timeout_s: the whole body must arrive within it (408).
    head_timeout_s: a connection's request line and headers must be complete within it, or it is closed.
    timeout_keep_alive_s: an idle keep-alive connection is closed after it.
    max_prompts_per_request: prompts in one /v1/completions call.
    max_prompt_chars: characters of one completions prompt, or of a chat request's message content in all.
    max_stop_strings, max_stop_chars: stop strings per request, characters per stop string.
    """

    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 30.0
    head_timeout_s: float = 10.0
    timeout_keep_alive_s: float = 5.0
    max_prompts_per_request: int = 256
    max_prompt_chars: int = 1_000_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidRequestError(f"{f.name} must be a number > 0, got {v!r}")


@dataclass
class ServeConfig:
    """The engine (each engine core builds LLM(**engine) and serves it):
      engine: LLM keyword arguments, EngineConfig's fields (model, device, dtype, block_size, num_blocks,
        max_model_len, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enforce_eager,
        piecewise_graphs, tensor_parallel_size, ...); checked by building an EngineConfig from them.
      prefill_delay_factor: the engine core's admission rule (EngineCore; 0: admit at once).
      engine_hook: "module:function", called as function(llm, **engine_hook_args) with the built LLM in
        every engine core before it serves. For benchmarks and tests: scripts/fake_engine.py's synthetic
        device (`--engine-hook scripts.fake_engine:install_fake_runner --engine-hook-arg step_ms=2`).

    Where it runs:
      in_process: the engine core on a thread of the HTTP process (one interpreter, one GIL) rather than
        in a process of its own; then one engine and one HTTP server.
      switch_interval_ms: in_process only: the interpreter's thread switch interval (Python's default: 5 ms),
        how long the engine thread may wait for the GIL while the HTTP side is busy.
      data_parallel_size: engine core processes, each with its own GPUs. api_server_count: HTTP processes on
        one port (SO_REUSEPORT). engine_core_addresses: cores already running elsewhere (tcp://HOST:PORT),
        used instead of starting local ones (then data_parallel_size is their count).
      startup_timeout_s: how long every process may take to come up (loading a model takes a while).

    The HTTP side: served_model_name (default: the model directory's name), host, port (0: one the OS
    picks), api_key (required on /v1/* when set), stream_interval (send a stream's tokens once at least
    this many wait; the first and the last at once), log_level (uvicorn's), http_impl (uvicorn's HTTP
    parser: auto, httptools or h11), shutdown_timeout_s (the open requests' grace period once told to
    stop), enable_docs (/docs, /redoc, /openapi.json), limits (ServerLimits).
    """
    engine: dict = field(default_factory=dict)
    prefill_delay_factor: float = PREFILL_DELAY_FACTOR
    engine_hook: str | None = None
    engine_hook_args: dict = field(default_factory=dict)
    in_process: bool = False
    switch_interval_ms: float = 1.0
    data_parallel_size: int = 1
    api_server_count: int = 1
    engine_core_addresses: list = field(default_factory=list)
    startup_timeout_s: float = 900.0
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    stream_interval: int = 1
    log_level: str = "info"
    http_impl: str = "auto"
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
    enable_docs: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)

    def __post_init__(self):
        from pagedattn.config import EngineConfig

        if not isinstance(self.engine, dict):
            raise ValueError(f"engine must be a dict of LLM keyword arguments, got {self.engine!r}")
        try:
            EngineConfig(**self.engine)
        except TypeError as e:          # a name EngineConfig does not have
            raise ValueError(f"engine: {e}") from None
        for name in ("data_parallel_size", "api_server_count", "stream_interval"):
            _check_int(name, getattr(self, name), 1)
        _check_int("port", self.port, 0)
        for name, low, closed in (("shutdown_timeout_s", 0, True), ("prefill_delay_factor", 0, True),
                                  ("switch_interval_ms", 0, False), ("startup_timeout_s", 0, False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= low if closed else v > low):
                raise ValueError(f"{name} must be a number {'>=' if closed else '>'} {low}, got {v!r}")
        if self.http_impl not in HTTP_IMPLS:
            raise ValueError(f"http_impl must be one of {HTTP_IMPLS}, got {self.http_impl!r}")
        if not isinstance(self.limits, ServerLimits):
            raise ValueError(f"limits must be a ServerLimits, got {self.limits!r}")
        if self.engine_hook is not None and not (isinstance(self.engine_hook, str) and _HOOK.match(self.engine_hook)):
            raise ValueError(f"engine_hook must be 'module:function', got {self.engine_hook!r}")
        if not isinstance(self.engine_hook_args, dict) or not all(isinstance(k, str) for k in self.engine_hook_args):
            raise ValueError(f"engine_hook_args must be a dict with str keys, got {self.engine_hook_args!r}")
        if self.engine_hook_args and self.engine_hook is None:
            raise ValueError("engine_hook_args given without an engine_hook")
        for a in self.engine_core_addresses:
            if not isinstance(a, str) or not a.startswith(("tcp://", "ipc://")):
                raise ValueError(f"engine_core_addresses must be tcp://HOST:PORT or ipc://PATH, got {a!r}")
        if self.in_process and (self.data_parallel_size != 1 or self.api_server_count != 1
                                or self.engine_core_addresses):
            raise ValueError("in_process runs one engine and one HTTP server in this process: data_parallel_size "
                             "and api_server_count must be 1, and engine_core_addresses empty")

    def hook(self):
        """The engine_hook function (imported now), or None."""
        if self.engine_hook is None:
            return None
        module, _, name = self.engine_hook.partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"engine_hook {self.engine_hook!r} cannot be loaded: {e}") from e

    def model_name(self, model_path):
        """The name clients pass as `model`: served_model_name, else the model directory's name."""
        return self.served_model_name or os.path.basename(os.path.normpath(model_path))


def _check_int(name, v, low):
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
