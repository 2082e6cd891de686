"""EngineConfig: everything `LLM(...)` accepts, validated on construction, and how big the KV pool gets.

    config = EngineConfig(model="path/to/qwen2_dir", device="cuda", dtype="float16")
    num_blocks = kv_pool_blocks(config, model_config, bytes_per_block)

Every bad value raises InvalidRequestError naming the field and its allowed range.
"""
import gc
import os
from dataclasses import dataclass

import torch

from pagedattn.errors import InvalidRequestError

GPU_MEMORY_ENV = "PAGEDATTN_GPU_MEMORY_UTILIZATION"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _check_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequestError(f"{name} must be an int >= {low}, got {value!r}")


def _check_fraction(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidRequestError(f"{name} must be a number in (0, 1], got {value!r}")


@dataclass
class EngineConfig:
    """model: HF Qwen2 directory; None = the bundled Qwen2.5-Coder-0.5B-Instruct.
    device: "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ...
    dtype: "auto" (float16 on CUDA, float32 on CPU) or float32 / float16 / bfloat16 (str or torch.dtype).
    block_size: tokens per KV block. num_blocks: KV pool size; None = sized from memory (kv_pool_blocks).
    max_model_len: prompt + generated tokens per sequence (capped at the model's max_position_embeddings).
    max_num_seqs / max_num_batched_tokens: per-step caps (default token budget: 2048 on CPU, 8192 on CUDA).
    enable_prefix_caching: reuse the KV of identical leading prompt blocks across requests.
    attn_backend: "auto" / "torch" / "numba" / "cpu" (the numba CPU kernels).
    enforce_eager: no CUDA graphs (pure-decode steps on CUDA replay captured graphs otherwise).
    piecewise_graphs: steps that hold prompt tokens replay the forward as CUDA graphs of the pieces between
        attentions, attention launched between them (pagedattn.engine.piecewise_graph); off: such steps run
        eagerly. None = on for CUDA (every padded size captured at start-up with the warm-up), off for CPU;
        ignored with enforce_eager, tensor_parallel_size > 1 or where graphs cannot run.
    async_scheduling: schedule and prepare step N+1 while the device runs step N (the sampled tokens
        stay on the device); the tokens are exactly those of the serial engine. None = on for CUDA
        (where it hides the host's work), off for CPU (where host and model share the cores).
    gpu_memory_utilization: fraction of free GPU memory the KV pool may take (after a reserve). None = the
        environment's PAGEDATTN_GPU_MEMORY_UTILIZATION, else 0.9 (processes that share a GPU, such as a
        test suite run in parallel, each take a share that way).
    cpu_kv_cache_fraction / cpu_kv_cache_max_gib: on CPU the pool takes at most this fraction of the
        available host memory and at most this many GiB (default 10% and 1 GiB: ~43k tokens of the
        bundled model in float32); set num_blocks to choose the size yourself.
    tensor_parallel_size: ranks the model is sharded over (NCCL on cuda:0..P-1, gloo on CPU).
    fused_allreduce: with tensor_parallel_size > 1, which steps run the all-reduces after o_proj and down_proj
        fused with the add + RMSNorm after them (a reduce-scatter, the norm on each rank's rows, an
        all-gather; pagedattn/distributed/allreduce_norm.py): "auto" (steps whose [T, hidden] message is at
        least 16 MiB, on CUDA; never on CPU), "on" (every eager step), "off", or a row count N (steps of at
        least N rows).
    warmup: compile every kernel and capture the CUDA graphs when the engine is built (a small workload of
        its own, pagedattn.engine.warmup), so the first request runs the program every later one does.
        None = on for CUDA (where compilation and capture are the cost), off for CPU.
    seed: the engine-level seed unseeded requests take their random keys from.
    weights: "auto", "quantized" or "float32". "quantized": the model's matrices stay the GGUF file's
        blocks (CPU, float32, one rank; ~0.46 GB for the bundled model instead of 2.4 GB, and ~1.5x the
        float32 path's decode speed, docs/cpu.md): the bundled model's GGUF, or the one *.gguf
        file in the model directory. "float32": the safetensors checkpoint (the bundled one
        dequantized). "auto": "quantized" where it can run (CPU, float32, one rank) and a GGUF file is
        there, "float32" otherwise. with_model_path resolves it and sets gguf_file.
    activations: "auto", "float32" or "int8", the quantized path's activations. "int8": each 32-value
        block of x rounded to int8 with its own scale, as llama.cpp does, and integer dot products per
        block (kernels_numba/cpu_quant_int8.py), and a prompt's GEMM on bfloat16 tiles where the CPU multiplies
        bfloat16 natively (kernels_numba/cpu_quant.native_bf16): ~1.3x the decode speed of "float32", a slightly
        different function (outputs off by ~1e-2 of their scale; on the bundled model's test prompts HF's
        greedy tokens up to near ties, docs/cpu.md). "float32": every product is the
        dequantized float32 matrix's. "auto" (default): "int8" where the CPU numba compiles for has AVX2
        (its byte multiply-adds make it fast), "float32" elsewhere and on float32 weights;
        with_model_path resolves it. "int8" needs weights="quantized" (or "auto" resolving to it).
    batch_invariant: a request's token ids and logprobs the same bits whatever else is in its steps (alone or
        batched, chunked at any token budget, after preemption, with prefix-cache hits; seeded sampling
        included): every row's arithmetic fixed by the row alone (docs/batch_invariance.md). One rank: on the
        CPU in float32 with the numba CPU backend (it costs a prompt's steps their large-GEMM speed), on a GPU
        in float16 / bfloat16 with the numba backend (every attention through the prefill kernel in one KV
        part, products 128 rows at a time, the sampler's split fixed).
    step_kernel: "auto", "on" or "off": a pure-decode step of at most 8 sequences whose contexts fit
        pagedattn.engine.model_runner.STEP_CONTEXT runs as kernels_numba.step's one-launch decode step (the whole
        forward, v5) instead of the model's kernels, the sampler after it; the model's parameters become views
        of the step's stacked weights (held once), and one KV block is kept for the decode graphs' padding rows.
        "on": wherever it can take a step; "auto": where it measured faster (model_runner.STEP_KERNEL_AUTO;
        empty until measured: off); "off": never. It runs on CUDA, one rank, float16 or float32, and not with
        batch_invariant (a request's arithmetic would change with its batch size).
    """

    model: str | None = None
    device: str = "auto"
    dtype: object = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    attn_backend: str = "auto"
    enforce_eager: bool = False
    piecewise_graphs: bool | None = None
    async_scheduling: bool | None = None
    gpu_memory_utilization: float | None = None
    cpu_kv_cache_fraction: float = 0.1
    cpu_kv_cache_max_gib: float = 1.0
    tensor_parallel_size: int = 1
    fused_allreduce: str | int = "auto"
    seed: int = 0
    weights: str = "auto"
    activations: str = "auto"
    gguf_file: str | None = None             # resolved by with_model_path on the quantized path
    warmup: bool | None = None
    batch_invariant: bool = False
    step_kernel: str = "auto"

    def __post_init__(self):
        if not isinstance(self.device, (str, torch.device)):
            raise InvalidRequestError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self.device = str(self.device)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            kind = torch.device(self.device).type
        except RuntimeError:
            raise InvalidRequestError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}") from None
        if kind not in ("cpu", "cuda"):
            raise InvalidRequestError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError(f"device={self.device!r} but no CUDA GPU is available (use 'cpu' or 'auto')")
        if isinstance(self.dtype, str):
            if self.dtype == "auto":
                self.dtype = torch.float16 if kind == "cuda" else torch.float32
            elif self.dtype in DTYPES:
                self.dtype = DTYPES[self.dtype]
            else:
                raise InvalidRequestError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidRequestError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if kind == "cuda" else 2048
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size"):
            _check_int(name, getattr(self, name))
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks)
        _check_int("seed", self.seed, 0)
        if self.gpu_memory_utilization is None:
            env = os.environ.get(GPU_MEMORY_ENV, "0.9")
            try:
                self.gpu_memory_utilization = float(env)
            except ValueError:
                raise InvalidRequestError(f"{GPU_MEMORY_ENV} must be a number in (0, 1], got {env!r}") from None
        for name in ("gpu_memory_utilization", "cpu_kv_cache_fraction"):
            _check_fraction(name, getattr(self, name))
        if isinstance(self.cpu_kv_cache_max_gib, bool) or not isinstance(self.cpu_kv_cache_max_gib, (int, float)) \
                or self.cpu_kv_cache_max_gib <= 0:
            raise InvalidRequestError(f"cpu_kv_cache_max_gib must be a number > 0, got {self.cpu_kv_cache_max_gib!r}")
        if self.attn_backend not in ("auto", "torch", "numba", "cpu") and not callable(self.attn_backend):
            raise InvalidRequestError(f"attn_backend must be 'auto', 'torch', 'numba' or 'cpu', got {self.attn_backend!r}")
        if self.async_scheduling is None:
            self.async_scheduling = kind == "cuda"
        if self.warmup is None:
            self.warmup = kind == "cuda"
        if self.piecewise_graphs is None:
            self.piecewise_graphs = kind == "cuda"
        for name in ("enable_prefix_caching", "enforce_eager", "piecewise_graphs", "async_scheduling", "warmup",
                     "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.fused_allreduce not in ("auto", "on", "off") and (
                isinstance(self.fused_allreduce, bool) or not isinstance(self.fused_allreduce, int)
                or self.fused_allreduce < 0):
            raise InvalidRequestError(f"fused_allreduce must be 'auto', 'on', 'off' or a row count >= 0, got "
                                      f"{self.fused_allreduce!r}")
        if self.weights not in ("auto", "quantized", "float32"):
            raise InvalidRequestError(f"weights must be 'auto', 'quantized' or 'float32', got {self.weights!r}")
        if self.weights == "quantized" and (kind != "cpu" or self.dtype != torch.float32
                                            or self.tensor_parallel_size > 1):
            raise InvalidRequestError(f"weights='quantized' (the GGUF blocks) runs on the CPU in float32 on one rank, "
                                      f"not device={self.device!r}, dtype={str(self.dtype).replace('torch.', '')}, "
                                      f"tensor_parallel_size={self.tensor_parallel_size}: use weights='float32'")
        if self.activations not in ("auto", "float32", "int8"):
            raise InvalidRequestError(f"activations must be 'auto', 'float32' or 'int8', got {self.activations!r}")
        if self.activations == "int8" and (self.weights == "float32" or not self.can_quantize):
            raise InvalidRequestError(f"activations='int8' runs on the quantized weights only (CPU, float32, one "
                                      f"rank), not weights={self.weights!r} on device={self.device!r}")
        if self.batch_invariant:
            backend, dtypes = {"cpu": ("cpu", (torch.float32,)),
                               "cuda": ("numba", (torch.float16, torch.bfloat16))}.get(kind, (None, ()))
            if self.dtype not in dtypes or self.attn_backend not in ("auto", backend) \
                    or self.tensor_parallel_size > 1:
                raise InvalidRequestError(
                    f"batch_invariant=True runs on one rank, on the CPU in float32 with the numba CPU backend or on "
                    f"a GPU in float16 / bfloat16 with the numba backend, not device={self.device!r}, dtype="
                    f"{str(self.dtype).replace('torch.', '')}, attn_backend={self.attn_backend!r}, "
                    f"tensor_parallel_size={self.tensor_parallel_size} (docs/batch_invariance.md)")
            if kind == "cuda" and self.block_size not in (8, 16, 32):
                raise InvalidRequestError(f"batch_invariant=True on a GPU needs block_size 8, 16 or 32 (the prefill "
                                          f"kernel's), got {self.block_size}")
        if self.step_kernel not in ("auto", "on", "off"):
            raise InvalidRequestError(f"step_kernel must be 'auto', 'on' or 'off', got {self.step_kernel!r}")
        if self.step_kernel == "on" and (kind != "cuda" or self.tensor_parallel_size > 1 or self.batch_invariant
                                         or self.dtype == torch.bfloat16):
            raise InvalidRequestError(
                f"step_kernel='on' runs on one GPU in float16 or float32 without batch_invariant, not device="
                f"{self.device!r}, dtype={str(self.dtype).replace('torch.', '')}, tensor_parallel_size="
                f"{self.tensor_parallel_size}, batch_invariant={self.batch_invariant}")
        if self.tensor_parallel_size > 1 and kind == "cuda" and self.device not in ("cuda", "cuda:0"):
            raise InvalidRequestError(f"tensor_parallel_size={self.tensor_parallel_size} runs rank r on cuda:r: "
                                      f"device must be 'auto', 'cuda' or 'cuda:0', got {self.device!r}")

    @property
    def device_type(self):
        return torch.device(self.device).type

    @property
    def can_quantize(self):
        """The quantized path's conditions besides the file: CPU, float32, one rank."""
        return self.device_type == "cpu" and self.dtype == torch.float32 and self.tensor_parallel_size == 1

    def with_model_path(self, path):
        """A copy whose `model` is a resolved directory (the bundled one converted on first use) and whose
        `weights` is "quantized" (with its gguf_file) or "float32". InvalidRequestError naming `weights`
        when "quantized" was asked for a checkpoint without a GGUF file, or naming `activations` when
        "int8" was asked and "auto" found none. `activations` "auto" becomes "int8" or "float32"."""
        from dataclasses import replace

        from pagedattn import bundled
        from pagedattn.errors import ModelLoadError
        from pagedattn.models.gguf_weights import find_gguf

        if self.weights in ("quantized", "float32") and self.gguf_file is not None:     # resolved already
            return replace(self, model=os.fspath(path), activations=self._activations(self.weights == "quantized"))
        wanted = self.weights == "quantized" or (self.weights == "auto" and self.can_quantize)
        gguf = None
        if path is None:
            path = bundled.bundled_model_path()
            if wanted:
                try:
                    gguf = bundled.bundled_gguf_path()
                except ModelLoadError:
                    if self.weights == "quantized":
                        raise
        elif wanted:
            path = os.fspath(path)
            gguf = find_gguf(path)
            if gguf is None and bundled.is_converted(path):
                root = os.path.dirname(os.path.abspath(path))
                if self.weights == "quantized" or os.path.isfile(bundled.gguf_cache_path(root)):
                    gguf = bundled.bundled_gguf_path(root)
        if self.weights == "quantized" and gguf is None:
            raise InvalidRequestError(f"weights='quantized' needs a GGUF file: {path!r} holds no *.gguf "
                                      "(use weights='float32')")
        if self.activations == "int8" and gguf is None:
            raise InvalidRequestError(f"activations='int8' runs on the quantized weights: {path!r} holds no *.gguf")
        quantized = gguf is not None
        return replace(self, model=os.fspath(path), weights="quantized" if quantized else "float32",
                       gguf_file=gguf if quantized else None, activations=self._activations(quantized))

    def _activations(self, quantized):
        """`activations` with "auto" resolved: "int8" on quantized weights where numba's target has AVX2."""
        if self.activations != "auto":
            return self.activations
        from kernels_numba.cpu_simd import target_has_avx2

        return "int8" if quantized and target_has_avx2() else "float32"


def activation_reserve_bytes(config, model_config):
    """Memory a step needs beside the weights and the KV pool: activations of a full token budget,
    the logits of max_num_seqs rows (and a float32 copy, which beam search makes), a fixed 512 MiB for the CUDA
    context's and the graphs' workspaces, and with piecewise graphs the outputs every piece keeps
    (pagedattn.engine.piecewise_graph: per padded size T, L + 1 pieces x T rows x (q + residual); the
    ladder's sizes sum to < 2x the budget)."""
    mc = model_config
    itemsize = torch.empty((), dtype=config.dtype).element_size()
    reserve = (config.max_num_batched_tokens * (mc.hidden_size * 8 + mc.intermediate_size * 3) * itemsize
               + config.max_num_seqs * mc.vocab_size * 4 * 2 + (512 << 20))
    if config.piecewise_graphs and not config.enforce_eager and config.tensor_parallel_size == 1:
        q = mc.num_attention_heads * mc.head_dim
        reserve += 2 * config.max_num_batched_tokens * (mc.num_hidden_layers + 1) * (q + mc.hidden_size) * itemsize
    return reserve


def kv_pool_blocks(config, model_config, bytes_per_block, max_model_len, device=None):
    """How many KV blocks fit when num_blocks is None (otherwise num_blocks itself).

    CUDA: (free device memory x gpu_memory_utilization - activation_reserve_bytes) / bytes_per_block,
    measured on `device` after the weights are loaded. CPU: enough blocks for max_num_seqs full-length
    sequences, capped at cpu_kv_cache_fraction of the available host memory and at
    cpu_kv_cache_max_gib. Raises InvalidRequestError when not even one max_model_len sequence fits.
    """
    bs = config.block_size
    need = -(-max_model_len // bs)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif config.device_type == "cuda":
        dev = torch.device(device or config.device)
        gc.collect()            # a dropped engine held in reference cycles gives its memory back first
        free, _ = torch.cuda.mem_get_info(dev)
        # what torch's caching allocator holds unused (a closed engine's pool, say) is free for this one too
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        budget = free * config.gpu_memory_utilization - activation_reserve_bytes(config, model_config)
        num_blocks = int(budget // bytes_per_block)
    else:
        wanted = -(-config.max_num_seqs * max_model_len // bs) * bytes_per_block
        budget = min(wanted, config.cpu_kv_cache_fraction * available_host_memory(),
                     config.cpu_kv_cache_max_gib * (1 << 30))
        num_blocks = int(budget // bytes_per_block)
    if num_blocks < need and config.num_blocks is None:
        raise InvalidRequestError(f"not enough memory for one max_model_len={max_model_len} sequence: "
                                  f"{num_blocks} KV blocks fit, {need} needed (lower max_model_len or set num_blocks)")
    return num_blocks


def available_host_memory():
    """MemAvailable from /proc/meminfo in bytes (total physical memory where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
