"""Steps of a few rows through the skinny GEMM: a decoder layer in five launches plus attention's one or two.

At decode a step multiplies a handful of rows by every weight once. In a CUDA graph each launch still costs
a few microseconds of latency, and at batch 1 a Qwen2 layer was ~10.7 launches, of which only the four GEMMs
move real bytes. kernels_numba/skinny_gemm.py's GEMM (v2) takes the glue with it: an RMSNorm prologue (with
the residual add) and a bias or SiLU-and-mul epilogue. A layer of a step with T <= max_rows rows runs as

    unfused (larger steps)                            fused (this module)
    x, r = add_rms_norm(x, r)      norm kernel        qkv = skinny(x, W_qkv, b; prologue: r' = r + x, norm)
    qkv = x W_qkv^T + b            cuBLAS
    q = rotary + K/V write         rotary kernel      q = rotary + K/V write          the same op
    o = attention                  decode kernel      o = attention                   the same op
    h = o W_o^T                    cuBLAS             h = skinny(o, W_o)
    x, r = add_rms_norm(h, r)      norm kernel        a = skinny(h, W_gate_up; prologue: r'' = r' + h, norm;
    g = x W_gate_up^T              cuBLAS                        epilogue: silu(gate) * up)
    a = silu(g_gate) * g_up        SiLU kernel
    y = a W_down^T                 cuBLAS             y = skinny(a, W_down)

The layer's interface does not change: it takes and returns (x, residual) as before (x: the previous
layer's MLP output, residual: the stream before it), self_attn returns o_proj's output and mlp returns
down_proj's, so forward hooks see the same quantities on either path. The residual add stays in the norm's
place (the next GEMM's prologue) rather than in the previous GEMM's residual epilogue: the same launches
and the same roundings either way, and only this arrangement keeps those hooked outputs. The prologue
writes the new stream r' to a new buffer (the kernel's other CTAs still read r).

Roundings are the unfused path's (kernels_numba/skinny_gemm.py): z = round(r + x); x' = round(w round(z /
rms(z))); each GEMM rounds once (after its bias); SiLU-and-mul rounds silu(round(gate)) and the product.
What differs: the order of the float32 sums (the tensor cores' k order against cuBLAS's; the norm's sum of
squares, which is rmsnorm.py's while a prologue thread holds at most one 16-byte piece).

Which steps: T <= max_rows (decode graphs are captured per batch size, so the branch on T is fixed inside
each graph). Off by default (DEFAULT_ROWS = 0): measured end to end on the H200 (docs/kernels.md, "The skinny
GEMM in the model: outcome") the fused steps are correct and 6 kernels per layer, but no faster at batch 1
(1.02x) and slower at batch 8 (0.87x): the fused kernels' GPU time exceeds what the dropped launches saved.
PAGEDATTN_SKINNY_ROWS=8 (FUSED_ROWS) turns it on. That threshold comes from the kernel measurements (docs/kernels.md, "Skinny
GEMM for decode"): at M <= 8 rows the plain v2 GEMM is 0.88-1.11x cuBLAS on Qwen2-0.5B's four layer
shapes (their sum within ~1 us of cuBLAS's) and the fused path drops three launches of ~2-2.5 us each; at
M = 16 v2 is 0.70-0.81x cuBLAS (+8 us per layer), more than the launches it saves. The final norm and the
LM head stay unfused: v2 is 0.96-0.99x cuBLAS on the 151,936-row head at M = 1-8, so fusing its norm would
trade one ~2 us launch for ~1-3 us of slower GEMM.

Only with the numba backend's glue kernels (fp16/bf16 on the GPU; CPU tensors under numba's simulator,
where the default is 0 rows: ~0.5 s per simulated CTA, so tests enable it), tensor_parallel_size 1 (a
row-parallel layer's output needs its all-reduce before the next norm) and widths that are multiples of 8
(16-byte pieces). PAGEDATTN_SKINNY_ROWS=n overrides the default (0: off).
"""
import os
from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_ROWS = 0             # off by default: not faster end to end yet (see the module docstring)
FUSED_ROWS = 8               # the threshold the kernel measurements give, for PAGEDATTN_SKINNY_ROWS
MAX_ROWS = 16                # what the skinny GEMM takes
ENV_ROWS = "PAGEDATTN_SKINNY_ROWS"


@dataclass
class Prologue:
    """An RMSNorm that the next GEMM applies to its input rows x in its prologue.

    norm: the RMSNorm module (its weight [hidden] and eps). residual: None (x itself is normed), or the
    residual stream [T, hidden]: then z = round(residual + x) is normed and written to residual_out
    [T, hidden] (a buffer other than residual), the stream after this add."""

    norm: torch.nn.Module
    residual: Tensor | None = None
    residual_out: Tensor | None = None


class SkinnyDecode:
    """The fused layer path for steps of at most max_rows rows (0: never). validate: the kernel's host checks
    (the backend's setting). Shared by every layer of a model: changing max_rows changes them all (graphs
    already captured keep the path they were captured with)."""

    def __init__(self, max_rows=FUSED_ROWS, validate=True):
        if not 0 <= max_rows <= MAX_ROWS:
            raise ValueError(f"the skinny decode path takes 0 to {MAX_ROWS} rows, got max_rows={max_rows}")
        from kernels_numba.skinny_gemm import skinny_linear

        self.max_rows, self.validate = max_rows, validate
        self._skinny_linear = skinny_linear

    def __repr__(self):
        return f"SkinnyDecode(max_rows={self.max_rows})"

    def takes(self, num_rows):
        """Whether a step of num_rows rows runs its layers fused."""
        return num_rows <= self.max_rows

    def prologue(self, norm, x, residual):
        """The norm of a layer's input (x [T, hidden], residual [T, hidden] or None in the first layer) for
        the next GEMM's prologue. Returns (Prologue, the residual stream after it: residual_out, or x)."""
        if residual is None:
            return Prologue(norm), x
        out = torch.empty_like(residual)
        return Prologue(norm, residual, out), out

    def linear(self, x, layer, prologue=None, silu=False):
        """y = layer(x) in one launch: x [T, in] (normed first by `prologue`), layer a linear module (its
        weight [out, in] and bias). silu: layer is the merged [gate; up] projection and y = silu(gate) * up
        [T, out / 2]. Returns y [T, out] (or [T, out / 2])."""
        kw = {}
        if prologue is not None:
            kw = dict(norm_weight=prologue.norm.weight, eps=prologue.norm.eps, norm_residual=prologue.residual,
                      residual_out=prologue.residual_out)
        return self._skinny_linear(x, layer.weight, layer.bias, silu=silu, validate=self.validate, **kw)


def layer_kernels(config, is_bf16, max_rows=FUSED_ROWS, num_sms=132):
    """{name: make_gemm_kernel_v2 arguments} of every skinny kernel a few-row step of a Qwen2 model with
    `config` launches (kernels_numba.skinny_gemm.v2_kernel_flags: the launch's own choice), for steps of 1
    to max_rows rows; names like "qkv_norm_bias" (the first layer), "qkv_norm_add_bias", "o", "gate_up_norm_add_silu",
    "down", with "_m16" for the two-group kernels of steps of more than 8 rows. For the codegen tests."""
    from kernels_numba.skinny_gemm import v2_kernel_flags

    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    E, I = config.hidden_size, config.intermediate_size
    calls = {  # name: (N, K, bias, silu, norm, add), as the layers call the GEMM
        "qkv_norm_bias": ((H + 2 * Hkv) * D, E, True, False, True, False),
        "qkv_norm_add_bias": ((H + 2 * Hkv) * D, E, True, False, True, True),
        "o": (E, H * D, False, False, False, False),
        "gate_up_norm_add_silu": (2 * I, E, False, True, True, True),
        "down": (E, I, False, False, False, False),
    }
    out = {}
    for M, tag in ((1, ""), (MAX_ROWS, "_m16")):
        if M == 1 or max_rows > 8:
            for name, (N, K, bias, silu, norm, add) in calls.items():
                out[name + tag] = v2_kernel_flags(M, N, K, is_bf16, bias, silu, False, norm, add, num_sms=num_sms)
    return out


def rows_from_env(default):
    """PAGEDATTN_SKINNY_ROWS as an int, or `default` when it is unset or empty."""
    value = os.environ.get(ENV_ROWS, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV_ROWS} must be an integer (rows; 0 = off), got {value!r}") from None


def skinny_decode_for(ops, config, tp_size, device, dtype, max_rows=None):
    """The SkinnyDecode of a Qwen2 model built with the ops table `ops` on `device` in `dtype`, or None where
    the fused path does not apply (another backend, float32, the CPU without the simulator, tp_size > 1,
    a width not a multiple of 8, the kernel module missing).

    config: the Qwen2Config; max_rows: steps of at most this many rows run fused; None: PAGEDATTN_SKINNY_ROWS
    if set, else DEFAULT_ROWS (0: off)."""
    from pagedattn.layers.attention import NumbaBackend

    backend = ops.backend
    if not isinstance(backend, NumbaBackend) or not backend.glue_kernels_for(device, dtype) or tp_size != 1:
        return None
    widths = (config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size)
    if any(w % 8 for w in widths):                    # K of every GEMM in 16-byte pieces
        return None
    try:
        import kernels_numba.skinny_gemm  # noqa: F401
    except ImportError:
        return None
    if max_rows is None:
        max_rows = rows_from_env(DEFAULT_ROWS)
    return SkinnyDecode(max_rows, validate=backend.validate)
