"""The decoder layers of a small CPU step, one numba call per layer (kernels_numba/cpu_layer.py).

    layers = cpu_layers_for(ops, weights, tp_size, device, dtype)    # None where it does not apply
    if layers is not None and layers.takes(model, num_rows, kv_cache):
        x, residual = layers(model, positions, x, kv_cache, attn_metadata)

It applies to a float32 model on the CPU on one rank, whose matrices are GGUF blocks (weights="quantized")
or float32 tensors (weights="float32", the small step's products then kernels_numba/cpu_linear.py's), with the
numba CPU attention backend and float32 pools, in a small step (at most cpu_quant.MAX_ROWS rows, inside the
step's scope: decodes and short chunks alike, as the attention plan covers both). Every layer's weights,
norms and cache views are gathered into the tuples the kernel reads at the first step and kept; each step
adds its positions, slots and the attention plan (the backend's, shared with the unfused path). The
results are the unfused layers' bit for bit (tests/test_cpu_layer.py), so `PAGEDATTN_CPU_LAYER=0` (or
`model.cpu_layers = None`) gives the same tokens the slow way.
"""
import math
import os

import numpy as np
import torch

from kernels_numba import cpu_layer as kernels
from kernels_numba import cpu_quant
from kernels_numba.cpu_threads import numba_threads


def cpu_layers_for(ops, weights, tp_size, device, dtype, enabled=None):
    """A CpuLayers for a model built with these arguments, or None: not one rank, not the numba CPU backend,
    not float32 on the CPU, or switched off (enabled False, or PAGEDATTN_CPU_LAYER=0). weights: "quantized"
    or "float32"."""
    from pagedattn.layers.attention import CpuNumbaBackend

    if enabled is None:
        enabled = os.environ.get("PAGEDATTN_CPU_LAYER", "1") != "0"
    if (not enabled or weights not in ("quantized", "float32") or tp_size != 1 or CpuNumbaBackend is None
            or not isinstance(ops.backend, CpuNumbaBackend) or torch.device(device).type != "cpu"
            or dtype != torch.float32):
        return None
    return CpuLayers(ops.backend)


def _product(linear):
    """(kind, the product's tuple): a linear layer holding a QuantWeight -> (its activations, (codes, parts,
    offsets, bias)); holding a float32 tensor -> (None, (weight, bias)); bias float32 numpy, empty for none.
    (None, None) for anything else (a 16-bit or non-contiguous weight)."""
    w = linear.weight
    bias = cpu_quant._NO_BIAS if linear.bias is None else linear.bias.detach().numpy()
    if isinstance(w, torch.Tensor):
        if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
            return None, None
        return None, (w.detach().numpy(), bias)
    return w.activations, (*w.checked.kernel_args, bias)


class CpuLayers:
    """Runs every decoder layer of a small step (module docstring). backend: the model's CpuNumbaBackend
    (its step's threads and its per-step attention plan)."""

    def __init__(self, backend):
        self.backend = backend
        self._layers = None          # per layer: (the kernel's weight tuple, k_cache, v_cache) of one pool
        self._pool_key = None
        self.kind = None             # a kernels.LAYERS key, once the weights are seen; False: they do not fit

    def takes(self, model, num_rows, kv_cache):
        """True in a small step's scope on float32 pools, when the layers' weights are of one kind (blocks
        with one activations, or float32 tensors); the first such step gathers them (`_prepare`)."""
        return (self.kind is not False and self.backend.step.small and num_rows <= cpu_quant.MAX_ROWS
                and kv_cache.k_caches[0].dtype == torch.float32 and self._prepare(model, kv_cache))

    def _prepare(self, model, kv_cache):
        key = tuple(c.data_ptr() for c in kv_cache.k_caches) + tuple(c.data_ptr() for c in kv_cache.v_caches)
        if self._layers is not None and key == self._pool_key:
            return True
        layers, kinds = [], set()
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            products = [_product(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            kinds.update((kind, p is None) for kind, p in products)
            w = (layer.input_layernorm.weight.detach().numpy(), layer.post_attention_layernorm.weight.detach().numpy(),
                 np.float32(layer.input_layernorm.eps), *(p for _, p in products))
            layers.append((w, kv_cache.k_caches[i].numpy(), kv_cache.v_caches[i].numpy()))
        if len(kinds) != 1 or next(iter(kinds))[1]:
            self.kind = False                       # mixed or unsupported weights: the layer modules run them
            return False
        attn = model.model.layers[0].self_attn
        self.kind = kernels.layer_kind(next(iter(kinds))[0])
        self.geometry = (model.model.rotary_emb.cos_sin_cache.numpy(), attn.num_heads, attn.num_kv_heads,
                         attn.head_dim, np.float32(1.0 / math.sqrt(attn.head_dim)))   # as cpu_attention's default
        self._layers, self._pool_key = layers, key
        return True

    def __call__(self, model, positions, x, kv_cache, attn_metadata):
        """x: the embedding [T, E] float32 -> (the last layer's output, the residual stream), torch tensors.
        Only after `takes` said yes for this step."""
        plan = self.backend.plan(attn_metadata, kv_cache.k_caches[0])
        threads = self.backend.step.threads()
        numba_threads(threads)
        step = (positions.numpy(), attn_metadata.slot_mapping.numpy(), plan.block_tables, plan.cu_seqlens_q,
                plan.context_lens, plan.tile_seq, plan.tile_q0, plan.order, min(threads, len(plan.order)))
        cos_sin, H, Hkv, D, scale = self.geometry
        xa, residual = x.numpy(), None
        for w, k_cache, v_cache in self._layers:
            xa, residual = kernels.run_layer(self.kind, xa, residual, w, (k_cache, v_cache, cos_sin, H, Hkv, D, scale),
                                             step, threads)
        return torch.from_numpy(xa), torch.from_numpy(residual)
