"""Attention over the paged KV cache: the per-step metadata and the backends that use it.

A step's tokens are one flat batch: first the prefill chunks of `num_prefills` sequences, then one
token per decoding sequence. A backend does two things per layer:

    backend.write(k, v, k_cache, v_cache, slot_mapping)         # the step's new K/V into the pool
    out = backend.attend(q, k_cache, v_cache, attn_metadata)     # q [T, H, D] -> out [T, H, D]

and `backend(q, k, v, k_cache, v_cache, attn_metadata)` is the two in a row. The model writes K/V through
its ops table's one rotary + K/V write (pagedattn/layers/ops.py: the fused kernel, or rotary then the
backend's `write`) and then only attends.
Query i of a prefill chunk of length q_len sits at position context_len - q_len + i and sees every cached
token up to itself; a decode query sees all context_len tokens. Scale 1/sqrt(D); GQA query head h reads
KV head h // (H // Hkv).

A backend also has `validate`, which turns the kernels' host-side checks on (False in the engine, which
checks each step's metadata once on the host); `can_capture(dtype, head_dim, block_size)`, whether every
piece of a decode step can be recorded in a CUDA graph; and `copy_blocks`, the copy-on-write block copies
of every layer. And `ops_table(device, dtype, widths)`: the model's ops table (pagedattn/layers/ops.py), the
backend's kernels for every op of a layer on that device and dtype, chosen once when the model is built
(NumbaBackend: its glue kernels where glue_kernels_for(device, dtype) says they load and cover it).

Backends:
  * TorchPagedBackend (pagedattn/layers/torch_attention.py): torch ops on any device. Gathers each
    sequence's K/V through its block table into one padded dense tensor and runs
    scaled_dot_product_attention with an explicit mask (causal + context length), in float32. Not
    capturable (it sizes the gather on the host).
  * NumbaBackend (here): the numba CUDA kernels of kernels_numba, loaded when the backend is made; a
    piece whose kernel module does not import falls back to the torch version of that piece. The prefill
    kernel's work list is made by a step's first layer and reused by its other layers (kept in the step's
    AttentionMetadata.prefill_plans).
  * CpuNumbaBackend (pagedattn/layers/cpu.py): numba CPU kernels reading the pool in place, and a small
    step's whole decoder layer as one call.

get_backend("auto" | "torch" | "numba" | "cpu", device) picks one.
"""
import importlib
import warnings
from functools import partial

import torch

from pagedattn.errors import InvalidRequestError
from pagedattn.kv_cache import AttentionMetadata  # noqa: F401 - the backends' contract, re-exported
from pagedattn.layers.torch_attention import TorchPagedBackend

try:
    from pagedattn.layers.cpu import CpuNumbaBackend
except ImportError:          # numba's CPU target unavailable: "auto" on CPU is the torch backend
    CpuNumbaBackend = None


def _run_into(out, result):
    """Kernels take out=; copy only if one returned a different tensor."""
    if result is not None and result.data_ptr() != out.data_ptr():
        out.copy_(result)


def _as_dtype(dtype):
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class NumbaBackend(TorchPagedBackend):
    """The numba CUDA kernels (kernels_numba), with the torch pieces as fallback.

    Falls back to torch for a piece whose kernel module is missing, and for attention on inputs the
    kernels do not cover (float32, head_dim other than 64/128, block_size other than 8/16/32).
    Without a GPU it runs only under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), for tests.

    validate: the kernels' host-side checks (shapes, and value checks that cost a device sync each,
    skipped inside CUDA-graph capture). The engine turns it off and checks each step's metadata once.

    batch_invariant: a row's result never depends on the other rows of its step (EngineConfig.batch_invariant;
    docs/batch_invariance.md). Set it before the model is built (its ops table reads it): every attention,
    prefill and decode, runs the prefill kernel with its keys cut into parts of INVARIANT_PART_KEYS keys from
    position 0 (a query's keys summed in the same parts, each in the same 64-key tiles, the parts merged in
    the same order, whichever call it is in: a prompt's query is exactly its decode; decodes run in the
    kernel's one-warp CTAs, whose rows get the bits of its 128-row ones), and every product gives
    the bits of INVARIANT_ROWS rows at a time (ops.fixed_rows_linear; in one call at the row counts where a
    check showed the GEMM library gives them: ops.InvariantLinear).
    """

    name = "numba"
    KERNEL_DTYPES = (torch.float16, torch.bfloat16)
    KERNEL_HEAD_DIMS = (64, 128)
    KERNEL_BLOCK_SIZES = (8, 16, 32)
    FUSED_MODULES = ("rmsnorm", "rotary", "activation")
    INVARIANT_ROWS = 128            # the batch-invariant mode's rows per product (docs/batch_invariance.md)
    INVARIANT_PART_KEYS = 256       # ... and keys per attention part (4 of the kernel's 64-key tiles)

    def __init__(self, validate=True, batch_invariant=False):
        self.validate = validate
        self.batch_invariant = batch_invariant
        self._query_starts = {}         # device -> int32 [0, 1, 2, ...]: decodes as one-query prefill chunks
        self._outgrown = []
        self.cache_ops = self._load("kernels_numba.cache_ops")
        self.paged_attention = self._load("kernels_numba.paged_attention")
        # prefill: the shipped kernel (v7, kernels_numba/paged_prefill_fa2.py); the journey is not a fallback
        self.paged_prefill = self._load("kernels_numba.paged_prefill_fa2")
        missing = [n for n, m in (("cache_ops", self.cache_ops), ("paged_attention", self.paged_attention),
                                  ("paged_prefill", self.paged_prefill)) if m is None]
        self.fallbacks = missing
        if missing:
            warnings.warn(f"kernels_numba.{{{', '.join(missing)}}} not available: using torch for those pieces",
                          stacklevel=2)
        fused = [self._load(f"kernels_numba.{n}") for n in self.FUSED_MODULES]
        self.fused_kernels = all(m is not None for m in fused)
        common = self._load("kernels_numba.common")
        self.simulated = common is not None and common.SIMULATOR

    @staticmethod
    def _load(module_name):
        try:
            return importlib.import_module(module_name)
        except ImportError:
            return None

    def _on_kernel_device(self, t):
        return t.is_cuda or (self.simulated and t.device.type == "cpu")

    def glue_kernels_for(self, device, dtype):
        """The glue kernels run on fp16/bf16 tensors on the GPU (CPU tensors under the simulator)."""
        device = torch.device(device)
        on_device = device.type == "cuda" or (self.simulated and device.type == "cpu")
        return self.fused_kernels and _as_dtype(dtype) in self.KERNEL_DTYPES and on_device

    def decode_context_bounds(self, num_seqs, num_kv_heads, group, max_context_len, device):
        """[SHORT_CONTEXT, max_context_len] where v10 plans a batch of short contexts (<= 512 tokens) otherwise
        than one of max_context_len-token ones (small batches: one CTA per sequence and head group against
        split partitions and their merge), else [max_context_len]."""
        pa = self.paged_attention
        short = getattr(pa, "SHORT_CONTEXT", None)
        if pa is None or short is None or short >= max_context_len or self.batch_invariant:
            return [max_context_len]
        from kernels_numba import bridge
        sms = bridge.num_sms(torch.device(device))
        a, b = (pa.decode_plan(num_seqs, num_kv_heads, group, n, sms) for n in (short, max_context_len))
        if a.splits == b.splits == 1 and a.warps == b.warps:      # one partition each: the same launch
            return [max_context_len]
        return [short, max_context_len]

    def ops_table(self, device, dtype, hidden_size, intermediate_size, head_dim, tp_size=1):
        """The model's ops table (pagedattn.layers.ops.make_ops asks the backend): the numba CUDA glue kernels
        where they cover the device, the dtype and the widths (rows moved in 16-byte pieces), torch ops and
        this backend's K/V write elsewhere."""
        from pagedattn.layers import ops

        table = ops.torch_ops(self)
        if self.batch_invariant:
            self._check_invariant_model(device, dtype, hidden_size, intermediate_size, head_dim)
            table.linear = ops.InvariantLinear(self.INVARIANT_ROWS, min_rows=16)
            self.query_starts(torch.empty(0, device=device).device, 1024)        # before any graph is captured
        if not self.glue_kernels_for(device, dtype):
            return table
        from kernels_numba import activation, rmsnorm

        v = self.validate
        if hidden_size % 8 == 0:
            table.rms_norm = partial(rmsnorm.rms_norm, validate=v)
            table.add_rms_norm = partial(rmsnorm.fused_add_rms_norm, validate=v)
        if intermediate_size % 8 == 0:
            table.silu_and_mul = partial(activation.silu_and_mul, validate=v)
        if head_dim % 16 == 0:                          # 8-element pieces of each half
            table.rotary_and_cache_write = partial(fused_rotary_and_cache_write, v)
        return table

    def _check_invariant_model(self, device, dtype, hidden_size, intermediate_size, head_dim):
        """The batch-invariant mode holds where every op of a layer is one of this backend's per-row kernels
        (torch's reductions, and its attention's gather, are sized by the whole step)."""
        missing = [what for what, ok in (
            ("the glue kernels on this device and dtype", self.glue_kernels_for(device, dtype)),
            ("the prefill kernel", self.paged_prefill is not None),
            (f"head_dim in {self.KERNEL_HEAD_DIMS} (got {head_dim})", head_dim in self.KERNEL_HEAD_DIMS),
            (f"hidden_size and intermediate_size multiples of 8 (got {hidden_size}, {intermediate_size})",
             hidden_size % 8 == 0 and intermediate_size % 8 == 0)) if not ok]
        if missing:
            raise InvalidRequestError("batch_invariant=True needs " + "; ".join(missing))

    def can_capture(self, dtype, head_dim, block_size):
        """Every piece of a decode step is a numba kernel or a torch op without host syncs for fp16/bf16
        at the head_dim / block_size the decode kernel covers."""
        writes = self.cache_ops is not None or (self.fused_kernels and head_dim % 16 == 0)
        return (self.paged_attention is not None and writes and _as_dtype(dtype) in self.KERNEL_DTYPES
                and head_dim in self.KERNEL_HEAD_DIMS and block_size in self.KERNEL_BLOCK_SIZES)

    def write(self, k, v, k_cache, v_cache, slot_mapping):
        if self.cache_ops is None or not self._on_kernel_device(k_cache):
            return super().write(k, v, k_cache, v_cache, slot_mapping)
        self.cache_ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, validate=self.validate)

    def copy_blocks(self, k_caches, v_caches, block_copies):
        if self.cache_ops is None or len(block_copies) == 0 or not self._on_kernel_device(k_caches[0]):
            return super().copy_blocks(k_caches, v_caches, block_copies)
        self.cache_ops.copy_blocks(k_caches, v_caches, block_copies, validate=self.validate)

    def _kernel_ok(self, q, k_cache):
        return (q.dtype in self.KERNEL_DTYPES and k_cache.dtype == q.dtype and self._on_kernel_device(q)
                and q.shape[-1] in self.KERNEL_HEAD_DIMS and k_cache.shape[2] in self.KERNEL_BLOCK_SIZES)

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, plans=None,
                warps=4):
        """q, out: [Np, H, D]; plans: the step's work lists (AttentionMetadata.prefill_plans), or None: the
        first layer's call builds the work list, the step's other layers reuse it (one plan kernel a step).
        warps: the prefill kernel's CTA (4 warps, 128 rows; 1: one warp, 16 rows, for one-query chunks). The
        mode's parts: as many as the block table's width needs (a bound on every context that no caller sets)."""
        if self.batch_invariant and not self._kernel_ok(q, k_cache):
            raise InvalidRequestError(f"batch_invariant=True needs the prefill kernel's inputs: float16/bfloat16 "
                                      f"on the GPU, head_dim in {self.KERNEL_HEAD_DIMS}, block_size in "
                                      f"{self.KERNEL_BLOCK_SIZES} (got {q.dtype}, head_dim {q.shape[-1]}, "
                                      f"block_size {k_cache.shape[2]})")
        if self.paged_prefill is None or not self._kernel_ok(q, k_cache):
            return super().prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out)
        _run_into(out, self.paged_prefill.paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                        context_lens, scale=scale, out=out,
                                                        validate=self.validate, plans=plans,
                                                        warps=warps, part_keys=self.INVARIANT_PART_KEYS
                                                        if self.batch_invariant else None))

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len=None,
               plans=None):
        if self.batch_invariant:            # n one-query chunks: query s at context_lens[s] - 1, as in a prompt,
            n = q.shape[0]                  # in one-warp CTAs (a row's arithmetic is the 128-row CTA's)
            return self.prefill(q, k_cache, v_cache, block_tables, self.query_starts(q.device, n + 1)[:n + 1],
                                context_lens, scale, out, plans=plans, warps=1)
        if self.paged_attention is None or not self._kernel_ok(q, k_cache):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len)
        _run_into(out, self.paged_attention.paged_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                            scale=scale, out=out, validate=self.validate,
                                                            max_context_len=max_context_len))

    def query_starts(self, device, n):
        """int32 [0, 1, ..., n - 1] or longer on `device`: the chunk boundaries of decodes run as one-query
        prefill chunks. Made outside any CUDA-graph capture (the engine's eager warm-up steps come first): a
        tensor first written inside a capture would hold its values only once the graph replays."""
        from kernels_numba import bridge

        have = self._query_starts.get(device)
        if have is None or have.shape[0] < n:
            if bridge.capturing():
                raise RuntimeError(f"the batch-invariant decode's query starts for {n} rows were first asked for "
                                   "inside a CUDA-graph capture: run an eager step of that size first")
            size = max(n, 2 * (0 if have is None else have.shape[0]), 1024)
            self._query_starts[device] = torch.arange(size, dtype=torch.int32, device=device)
            if have is not None:
                self._outgrown.append(have)             # kept: a captured graph may read it
        return self._query_starts[device]


def fused_rotary_and_cache_write(validate, positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache,
                                 k_cache, v_cache, slot_mapping):
    """One kernel (kernels_numba/rotary.py): q rotated into a new contiguous buffer, k rotated and v copied
    into the pool."""
    from kernels_numba.rotary import rotary_embedding_and_cache
    from pagedattn.layers.ops import split_qkv

    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return rotary_embedding_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                      q_out=q_out, validate=validate)


BACKENDS = {"torch": TorchPagedBackend, "numba": NumbaBackend}


def _cpu_backend_class():
    """CpuNumbaBackend (numba's CPU target) when pagedattn.layers.cpu imported, else None."""
    return CpuNumbaBackend


def get_backend(name="auto", device="cpu"):
    """An attention backend: "auto" = numba on CUDA, on CPU the numba CPU backend when it is available
    (else torch); "torch" / "numba" / "cpu" force one.

    Accepts an existing backend object (returned as is). device: str or torch.device.
    """
    if not isinstance(name, str):
        return name
    if name == "auto":
        if torch.device(device).type == "cuda":
            name = "numba"
        else:
            cls = _cpu_backend_class()
            return cls() if cls is not None else TorchPagedBackend()
    if name == "cpu":
        cls = _cpu_backend_class()
        if cls is None:
            raise ValueError("attention backend 'cpu' needs pagedattn.layers.cpu, which did not import")
        return cls()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose 'auto', 'cpu', " +
                         ", ".join(repr(n) for n in BACKENDS))
    return BACKENDS[name]()
