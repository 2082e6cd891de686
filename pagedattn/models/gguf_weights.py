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


# GGUF metadata value types -> struct format of one value (8: string, 9: array, handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml tensor type ids of the formats read here
_TYPES = {0: "F32", 1: "F16", 8: "Q8_0", 6: "Q5_0", 14: "Q6_K", 12: "Q4_K"}


class _Header:
    """A GGUF file's header read with struct from its bytes: the metadata values are skipped (only
    general.alignment is kept), the tensor infos kept. The gguf package's reader builds a Python object
    for each of the tokenizer's ~300k metadata strings (~15 s); this walks past them in a compiled loop
    (kernels_numba.cpu_quant.skip_strings) in milliseconds."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version, n_tensors, n_kv = self.unpack("<IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (2 and later are)")
        self.alignment = 32
        for _ in range(n_kv):
            key, vtype = self.string(), self.unpack("<I")[0]
            value = self.value(vtype)
            if key == "general.alignment":
                self.alignment = int(value)
        self.tensors = []                  # (name, type id, dims innermost-first, offset in the data section)
        for _ in range(n_tensors):
            name = self.string()
            (n_dims,) = self.unpack("<I")
            dims = self.unpack(f"<{n_dims}Q")
            ttype, offset = self.unpack("<IQ")
            self.tensors.append((name, ttype, dims, offset))
        self.data_start = -(-self.pos // self.alignment) * self.alignment

    def unpack(self, fmt):
        import struct

        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self):
        (n,) = self.unpack("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def value(self, vtype):
        """The value (scalars; None for strings and arrays, which are skipped)."""
        import struct

        if vtype in _SCALAR:
            return self.unpack("<" + _SCALAR[vtype])[0]
        if vtype == 8:
            (n,) = self.unpack("<Q")
            self.pos += n
            return None
        if vtype == 9:
            itype, count = self.unpack("<IQ")
            if itype in _SCALAR:
                self.pos += count * struct.calcsize("<" + _SCALAR[itype])
            elif itype == 8:                 # strings (the tokenizer's ~150k tokens and merges): lengths only
                self.pos = int(cpu_quant.skip_strings(np.frombuffer(self.buf, np.uint8), self.pos, count))
                if self.pos < 0:
                    raise ValueError("a string array runs past the end of the file")
            else:
                for _ in range(count):
                    self.value(itype)
            return None
        raise ValueError(f"metadata value type {vtype} is unknown")


def read_gguf(path):
    """{GGUF name: GGUFTensor} of every tensor in the GGUF file at `path`, memory-mapped.

    Raises ModelLoadError when the file cannot be read or holds a tensor type this loader has no
    kernel for."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    try:
        # a plain ndarray over the mapping (it keeps the mapping alive): slicing a np.memmap runs its
        # __array_finalize__, ~0.6 ms a tensor here
        mapped = np.memmap(path, np.uint8, mode="r").view(np.ndarray)
        header = _Header(memoryview(mapped))
    except Exception as e:       # struct errors / ValueError on a damaged or truncated header
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e
    tensors = {}
    for name, ttype, dims, offset in header.tensors:
        fmt = _TYPES.get(ttype)
        if fmt is None:
            raise ModelLoadError(f"GGUF tensor {name!r} has ggml type {ttype}: supported are "
                                 f"{sorted(cpu_quant.FORMATS)}, F32 and F16")
        shape = tuple(int(d) for d in reversed(dims))               # innermost-first -> torch's order
        rows, K = int(np.prod(shape[:-1])), shape[-1]
        if fmt in cpu_quant.FORMATS:
            _, qk, block_bytes = cpu_quant.FORMATS[fmt]
            if K % qk:
                raise ModelLoadError(f"GGUF tensor {name!r}: rows of {K} values are not whole {fmt} blocks")
            row_bytes = K // qk * block_bytes
        else:
            row_bytes = K * (4 if fmt == "F32" else 2)
        a = header.data_start + offset
        if a + rows * row_bytes > mapped.shape[0]:
            raise ModelLoadError(f"GGUF tensor {name!r}: its bytes run past the end of {path!r} (truncated?)")
        data = mapped[a:a + rows * row_bytes].reshape(rows, row_bytes)        # [N, bytes_per_row], no copy
        if fmt == "F32":
            data = np.array(data.view(np.float32)).reshape(shape)            # small: norms, biases
        elif fmt == "F16":
            data, fmt = data.view(np.float16).astype(np.float32).reshape(shape), "F32"
        tensors[name] = GGUFTensor(name, fmt, shape, data)
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


class QuantWeight:
    """A layer's weight [N, K] kept as GGUF blocks: one or more GGUFTensors stacked along the output rows.

    The model fuses q/k/v (and gate/up) into one layer where the GGUF stores them apart, in different
    formats (q Q5_0, v Q8_0): a fused layer holds its parts in output order, and one kernel call
    (cpu_quant.linear_parts) writes every part's outputs into its columns of the result. Held by the
    linear layers, the embedding and the LM head in place of a float32 Parameter
    (pagedattn/models/loader.py: load_gguf_model); the ops table (pagedattn/layers/ops.py) calls it.

        w = QuantWeight([q, k, v])           # shape (Nq + Nk + Nv, K)
        y = w(x, bias)                       # x float32 [M, K] -> [M, N]
        QuantWeight([q, k, v], "int8")       # the same with x rounded to int8 per block of 32
                                             # (kernels_numba/cpu_quant_int8.py; 1-16 rows), and a
                                             # prompt's GEMM in bfloat16 where the CPU has it natively
        rows = w.embedding(ids)              # one part only: rows of the table
    """

    def __init__(self, parts, activations="float32"):
        parts = list(parts)
        if activations not in ("float32", "int8"):
            raise ModelLoadError(f"activations must be 'float32' or 'int8', got {activations!r}")
        self.activations = activations
        # a prompt's rows (> cpu_quant.MAX_ROWS): the dequantized tiles' GEMM. With int8 activations (a rounded
        # x already) in bfloat16 where the CPU multiplies it natively: its error (~3e-3 of a product's scale)
        # is below int8's (~5e-3), and the GEMM is the prompt's cost (docs/cpu.md)
        low = activations == "int8" and cpu_quant.native_bf16()
        self.tile_dtype = torch.bfloat16 if low else torch.float32
        if not parts or any(p.fmt not in cpu_quant.FORMATS or len(p.shape) != 2 for p in parts):
            raise ModelLoadError(f"QuantWeight takes quantized matrices, got {[(p.name, p.fmt) for p in parts]}")
        K = parts[0].shape[1]
        if any(p.shape[1] != K for p in parts):
            raise ModelLoadError(f"parts {[p.name for p in parts]} have different input widths")
        self.parts = parts
        self.checked = cpu_quant.Parts([(p.data, p.fmt) for p in parts])      # checked once for every call
        self.shape = (sum(p.shape[0] for p in parts), K)
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + p.shape[0])

    @property
    def nbytes(self):
        """The blocks' bytes (as in the file)."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x, bias=None, num_threads=None, any_rows=False):
        """x float32 [M, K] -> x W^T (+ bias [N]) float32 [M, N]: every part in one kernel call, each part's
        outputs written into its columns of the one result. any_rows: the block kernel at any row count
        (default: above cpu_quant.MAX_ROWS rows, the dequantized tiles' GEMM)."""
        max_rows = None if any_rows else cpu_quant.MAX_ROWS
        if bias is not None and not isinstance(bias, torch.Tensor):
            bias = torch.from_numpy(np.asarray(getattr(bias, "data", bias)))
        if self.activations == "int8":
            from kernels_numba import cpu_quant_int8

            return cpu_quant_int8.linear_parts(x, self.checked, bias, num_threads=num_threads,
                                               tile_dtype=self.tile_dtype, max_rows=max_rows)
        return cpu_quant.linear_parts(x, self.checked, bias, num_threads=num_threads, max_rows=max_rows)

    def embedding(self, ids, num_threads=None):
        """float32 [T, K]: rows ids (int [T]) of a one-part table."""
        if len(self.parts) != 1:
            raise ModelLoadError("an embedding table is one GGUF tensor")
        return embedding(ids, self.parts[0], num_threads)

    def dequantize(self):
        """float32 torch tensor [N, K] (a copy): the values the blocks stand for."""
        return torch.cat([torch.from_numpy(p.dequantize()) for p in self.parts])

    def __repr__(self):
        return f"QuantWeight({', '.join(f'{p.name} {p.fmt} {p.shape}' for p in self.parts)})"


def find_gguf(path):
    """The one *.gguf file in the checkpoint directory `path`, or None (none there, or several)."""
    if not os.path.isdir(path):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    return os.path.join(path, files[0]) if len(files) == 1 else None
