"""A GGUF file's tensors as stored: quantized blocks kept as they are, memory-mapped, never copied to float32.

    tensors = read_gguf("model.gguf")             # {GGUF name: GGUFTensor}
    t = tensors["blk.0.attn_q.weight"]           # t.fmt "Q5_0", t.shape (896, 896), t.data uint8 [896, 616]
    y = quant_linear(x, t, tensors["blk.0.attn_q.bias"])   # x float32 [M, 896] -> [M, 896]

GGUF names tensors by its own scheme; `hf_name` gives the Hugging Face Qwen2 name of each (the converted
checkpoint of the bundled model holds exactly these tensors, dequantized):

    token_embd.weight             model.embed_tokens.weight
    output_norm.weight            model.norm.weight
    output.weight                 lm_head.weight
    blk.N.attn_norm.weight        model.layers.N.input_layernorm.weight
    blk.N.ffn_norm.weight         model.layers.N.post_attention_layernorm.weight
    blk.N.attn_{q,k,v}.{weight,bias}  model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}
    blk.N.attn_output.weight      model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_{gate,up,down}.weight   model.layers.N.mlp.{gate,up,down}_proj.weight

GGUF writes a shape innermost-first ([K, N] for a weight of N rows of K); GGUFTensor.shape is torch's
order (N, K). For Qwen2 the GGUF conversion reorders nothing (no rotary permutation of q/k rows, as it
does for Llama): row n of blk.N.attn_q.weight dequantizes to row n of q_proj.weight, bit for bit
(tests/test_cpu_quant.py checks every tensor of the bundled file against its converted checkpoint).

The file stays memory-mapped (numpy.memmap, read-only): a tensor's bytes are read from the page cache
when a kernel first touches them, and the process's resident size grows to about the file's size, not
the 4-5x of a float32 copy. Quantized formats: those kernels_numba.cpu_quant reads (Q8_0, Q5_0, Q6_K,
Q4_K); F32 (norms, biases) and F16 tensors are float32 numpy arrays.
"""
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from kernels_numba import cpu_quant
from pagedattn.errors import ModelLoadError

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(gguf_name):
    """The Hugging Face Qwen2 name of a GGUF tensor name; ModelLoadError for a name it does not know."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Qwen2 counterpart")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    name: the GGUF name. fmt: "Q8_0", "Q5_0", "Q6_K", "Q4_K" or "F32". shape: torch's order, (N, K)
    for a matrix, (n,) for a vector. data: quantized formats: uint8 [N, bytes_per_row], the blocks as
    stored (a read-only view of the memory-mapped file); F32 / F16: float32 of `shape`.
    """
    name: str
    fmt: str
    shape: tuple
    data: np.ndarray

    @property
    def quantized(self):
        return self.fmt in cpu_quant.FORMATS

    @property
    def nbytes(self):
        """Bytes held (the file's bytes for quantized tensors)."""
        return self.data.nbytes

    def dequantize(self):
        """float32 numpy array of `shape`: the values the blocks stand for (a copy)."""
        if not self.quantized:
            return np.array(self.data, np.float32)
        return cpu_quant.dequantize(self.data, self.fmt).reshape(self.shape)


def read_gguf(path):
    """{GGUF name: GGUFTensor} of every tensor in the GGUF file at `path`, memory-mapped.

    Raises ModelLoadError when the file cannot be read or holds a tensor type this loader has no
    kernel for."""
    from gguf import GGMLQuantizationType, GGUFReader

    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:       # the reader raises ValueError / struct errors on a damaged header
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e
    tensors = {}
    for t in reader.tensors:
        fmt = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))            # innermost-first -> torch's order
        if fmt in cpu_quant.FORMATS:
            data = t.data.reshape(-1, t.data.shape[-1])              # [N, bytes_per_row], no copy
            if (data.shape[0],) + (cpu_quant.row_values(fmt, data.shape[1]),) != (int(np.prod(shape[:-1])), shape[-1]):
                raise ModelLoadError(f"GGUF tensor {t.name!r}: {data.shape} bytes do not hold shape {shape}")
        elif t.tensor_type == GGMLQuantizationType.F32:
            data = np.array(t.data, np.float32).reshape(shape)                # small: norms, biases
        elif t.tensor_type == GGMLQuantizationType.F16:
            data, fmt = np.asarray(t.data, np.float16).astype(np.float32).reshape(shape), "F32"
        else:
            raise ModelLoadError(f"GGUF tensor {t.name!r} is {fmt}: supported are "
                                 f"{sorted(cpu_quant.FORMATS)}, F32 and F16")
        tensors[t.name] = GGUFTensor(t.name, fmt, shape, data)
    return tensors


def quant_linear(x, qweight, bias=None, num_threads=None):
    """x [M, K] @ W^T (+ bias) -> float32 torch tensor [M, N], W the GGUFTensor qweight [N, K].

    x: float32 CPU torch tensor. bias: GGUFTensor, torch tensor or numpy array [N], or None.
    Quantized weights go to kernels_numba.cpu_quant.linear (the block kernel at 1-16 rows, tiles
    dequantized for torch's GEMM above); an F32 weight to torch's F.linear."""
    b = bias.data if isinstance(bias, GGUFTensor) else bias
    if isinstance(b, np.ndarray):
        b = torch.from_numpy(b)
    if not qweight.quantized:
        return torch.nn.functional.linear(x, torch.from_numpy(qweight.data), b)
    return cpu_quant.linear(x, qweight.data, qweight.fmt, b, num_threads=num_threads)


class QuantLinear:
    """y = x W^T (+ b) with W kept as its GGUF blocks: a callable holding the weight and bias."""

    def __init__(self, qweight, bias=None):
        self.qweight, self.bias = qweight, bias
        if bias is not None and tuple(np.shape(getattr(bias, "data", bias))) != (qweight.shape[0],):
            raise ModelLoadError(f"bias of {qweight.name!r}: shape {np.shape(getattr(bias, 'data', bias))}, "
                                 f"expected ({qweight.shape[0]},)")

    def __call__(self, x, num_threads=None):
        return quant_linear(x, self.qweight, self.bias, num_threads)


def embedding(ids, table, num_threads=None):
    """float32 torch tensor [T, K]: rows `ids` (int [T]) of the embedding table GGUFTensor [vocab, K]."""
    if not table.quantized:
        return torch.from_numpy(table.data)[torch.as_tensor(ids, dtype=torch.long)]
    return cpu_quant.embedding(ids, table.data, table.fmt, num_threads=num_threads)
