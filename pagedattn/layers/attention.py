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
of every layer. NumbaBackend.glue_kernels_for(device, dtype) says whether its glue kernels (RMSNorm,
rotary + K/V write, SiLU-and-mul) load and cover that device and dtype; pagedattn/layers/ops.py reads it
once, when the model is built.

Backends:
  * TorchPagedBackend (pagedattn/layers/torch_attention.py): torch ops on any device. Gathers each
    sequence's K/V through its block table into one padded dense tensor and runs
    scaled_dot_product_attention with an explicit mask (causal + context length), in float32. Not
    capturable (it sizes the gather on the host).
  * NumbaBackend (here): the numba CUDA kernels of kernels_numba, loaded when the backend is made; a
    piece whose kernel module does not import falls back to the torch version of that piece. The prefill
    kernel's work list is made by a step's first layer and reused by its other layers (kept in the step's
    AttentionMetadata.prefill_plans).
  * CpuNumbaBackend (pagedattn/layers/cpu_attention.py): numba CPU kernels reading the pool in place.

get_backend("auto" | "torch" | "numba" | "cpu", device) picks one.
"""
import importlib
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pagedattn.errors import KernelLaunchError
from pagedattn.kv_cache import slots_for
from pagedattn.layers.torch_attention import TorchPagedBackend

try:
    from pagedattn.layers.cpu_attention import CpuNumbaBackend
except ImportError:          # numba's CPU target unavailable: "auto" on CPU is the torch backend
    CpuNumbaBackend = None


@dataclass
class AttentionMetadata:
    num_prefills: int                 # sequences in prefill, first in the batch
    num_prefill_tokens: int           # their tokens, first in the batch
    num_decode_tokens: int            # one per decoding sequence, after them
    slot_mapping: Tensor              # [num_tokens] int64, where each token's new K/V goes (-1 = skip)
    context_lens: Tensor              # [num_seqs] int32, tokens in the cache *after* this step's write
    block_tables: Tensor              # [num_seqs, max_blocks] int32, prefills first then decodes
    cu_seqlens_q: Tensor              # [num_prefills + 1] int32, prefill chunk boundaries
    max_context_len: int | None = None  # host int >= every context_len (eager steps: sizes the decode
                                        # kernel's split-KV plan, spares the torch path a sync); None inside
                                        # CUDA graphs: block-table width x block size
    # The prefill kernel's work lists of this step (kernels_numba.paged_prefill_fa2's plans=): built by the
    # first layer's attention, reused by the others; a new step is a new object, so never a stale plan
    prefill_plans: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        # Shape checks only: they never read tensor data, so they cost no device sync.
        num_seqs = self.num_prefills + self.num_decode_tokens
        checks = [
            (self.slot_mapping.shape[0] == self.num_tokens, "slot_mapping", (self.num_tokens,), self.slot_mapping.shape),
            (self.context_lens.shape[0] == num_seqs, "context_lens", (num_seqs,), self.context_lens.shape),
            (self.block_tables.dim() == 2 and self.block_tables.shape[0] == num_seqs,
             "block_tables", (num_seqs, "max_blocks"), self.block_tables.shape),
        ]
        if self.num_prefills > 0:
            n = self.num_prefills + 1
            checks.append((self.cu_seqlens_q.shape[0] == n, "cu_seqlens_q", (n,), self.cu_seqlens_q.shape))
        for ok, name, want, got in checks:
            if not ok:
                raise KernelLaunchError(f"AttentionMetadata.{name} has shape {tuple(got)}, expected {want} "
                                        f"(num_prefills={self.num_prefills}, num_prefill_tokens="
                                        f"{self.num_prefill_tokens}, num_decode_tokens={self.num_decode_tokens})")
        if self.num_prefills > self.num_prefill_tokens:
            raise KernelLaunchError(f"num_prefills={self.num_prefills} > num_prefill_tokens={self.num_prefill_tokens}: "
                                    "every prefill chunk has at least one token")

    @property
    def num_tokens(self):
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self):
        return self.num_prefills + self.num_decode_tokens

    @property
    def prefill_only(self):
        return self.num_decode_tokens == 0

    @property
    def decode_only(self):
        return self.num_prefills == 0

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size, num_prefills, device="cpu"):
        """Metadata for a step given per-sequence lists (tests, scripts, simple loops).

        query_lens: [num_seqs] ints, new tokens of each sequence this step (decodes: 1), prefills first.
        context_lens: [num_seqs] ints, tokens in the cache after this step's write (>= query_len).
        block_tables: [num_seqs] lists of physical block ids (enough for context_len tokens).
        block_size: tokens per block; num_prefills: how many leading sequences are prefills.
        The new tokens are the last query_len positions of each sequence; their slots are computed
        from the block tables.
        """
        query_lens, context_lens = [int(x) for x in query_lens], [int(x) for x in context_lens]
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables need one entry per sequence")
        if any(q != 1 for q in query_lens[num_prefills:]):
            raise ValueError(f"decode sequences have query_len 1, got {query_lens[num_prefills:]}")
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
            if not 1 <= q_len <= ctx or len(table) * block_size < ctx:
                raise ValueError(f"sequence with query_len={q_len}, context_len={ctx} and "
                                 f"{len(table)} blocks of {block_size} is inconsistent")
        width = max([len(t) for t in block_tables] + [1])
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        rows = np.repeat(np.arange(len(query_lens)), query_lens)                       # (T,) sequence of a token
        positions = np.concatenate([np.arange(c - q, c) for q, c in zip(query_lens, context_lens)] or [[]])
        slots = slots_for(np.asarray(tables, dtype=np.int64).reshape(len(tables), width), rows,
                          positions.astype(np.int64), block_size).tolist()
        cu = [0]
        for q_len in query_lens[:num_prefills]:
            cu.append(cu[-1] + q_len)
        return cls(
            num_prefills=num_prefills,
            num_prefill_tokens=cu[-1],
            num_decode_tokens=len(query_lens) - num_prefills,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(tables), width),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            max_context_len=max(context_lens, default=0),
        )


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
    """

    name = "numba"
    KERNEL_DTYPES = (torch.float16, torch.bfloat16)
    KERNEL_HEAD_DIMS = (64, 128)
    KERNEL_BLOCK_SIZES = (8, 16, 32)
    FUSED_MODULES = ("rmsnorm", "rotary", "activation")

    def __init__(self, validate=True):
        self.validate = validate
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
        if pa is None or short is None or short >= max_context_len:
            return [max_context_len]
        from kernels_numba import bridge
        sms = bridge.num_sms(torch.device(device))
        a, b = (pa.decode_plan(num_seqs, num_kv_heads, group, n, sms) for n in (short, max_context_len))
        if a.splits == b.splits == 1 and a.warps == b.warps:      # one partition each: the same launch
            return [max_context_len]
        return [short, max_context_len]

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

    def prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out, plans=None):
        """q, out: [Np, H, D]; plans: the step's work lists (AttentionMetadata.prefill_plans), or None: the
        first layer's call builds the work list, the step's other layers reuse it (one plan kernel a step)."""
        if self.paged_prefill is None or not self._kernel_ok(q, k_cache):
            return super().prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, out)
        _run_into(out, self.paged_prefill.paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                        context_lens, scale=scale, out=out,
                                                        validate=self.validate, plans=plans))

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len=None):
        if self.paged_attention is None or not self._kernel_ok(q, k_cache):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, max_context_len)
        _run_into(out, self.paged_attention.paged_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                            scale=scale, out=out, validate=self.validate,
                                                            max_context_len=max_context_len))


BACKENDS = {"torch": TorchPagedBackend, "numba": NumbaBackend}


def _cpu_backend_class():
    """CpuNumbaBackend (numba's CPU target) when pagedattn.layers.cpu_attention imported, else None."""
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
            raise ValueError("attention backend 'cpu' needs pagedattn.layers.cpu_attention, which did not import")
        return cls()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose 'auto', 'cpu', " +
                         ", ".join(repr(n) for n in BACKENDS))
    return BACKENDS[name]()
