"""Qwen2 decoder (Qwen2 / Qwen2.5 checkpoints) in torch ops, attending over the paged KV cache.

One forward call processes one engine step: a flat batch of T tokens (prefill chunks first, then one
token per decoding sequence) described by AttentionMetadata. There is no batch dimension and no
padding: every projection, norm and MLP is a row-wise op on [T, hidden]; only attention needs to know
which tokens belong to which sequence, and the backend reads that from the metadata.

Module and parameter names mirror Hugging Face's (model.layers.0.self_attn.q_proj.weight, ...), so a
checkpoint's safetensors load without renaming.
"""
from dataclasses import MISSING, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.layers.attention import get_backend
from pagedattn.errors import ModelLoadError


@dataclass
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = None                     # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int = None
    eos_token_id: object = None              # int or list of ints

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"config.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ModelLoadError(f"config.hidden_act={self.hidden_act!r} is not supported (Qwen2 uses 'silu')")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ModelLoadError(f"config.rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be > 0")

    @classmethod
    def from_dict(cls, d):
        """From a config.json dict (transformers 4 style `rope_theta` or 5 style `rope_parameters`)."""
        model_type, archs = d.get("model_type"), d.get("architectures") or []
        if model_type != "qwen2" and "Qwen2ForCausalLM" not in archs:
            raise ModelLoadError(f"not a Qwen2 checkpoint: model_type={model_type!r}, architectures={archs} "
                                 "(expected model_type 'qwen2' / Qwen2ForCausalLM)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"rope type {rope_type!r} is not supported (only the default rotary embedding)")
        if d.get("use_sliding_window"):
            raise ModelLoadError("use_sliding_window=true is not supported (full attention in every layer)")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        kwargs["rope_theta"] = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        kwargs.setdefault("num_key_value_heads", d.get("num_attention_heads"))
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in kwargs]
        if missing:
            raise ModelLoadError(f"config.json lacks {missing}")
        return cls(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):                                                   # x: (T, hidden)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(positions, head_dim, theta):
    """cos, sin: [T, head_dim] float32 for integer positions [T] (computed in float32, like HF)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]                 # (T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                 # (T, head_dim)
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):
    """x: [T, heads, head_dim]; rotates the two halves of each head by the position's angles."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)          # (T, 1, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Qwen2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, H * D, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, Hkv * D, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, Hkv * D, bias=True)
        self.o_proj = nn.Linear(H * D, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, attn_metadata, backend):
        T = x.shape[0]                                                      # x: (T, hidden)
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)          # (T, H, D)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)       # (T, Hkv, D)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)       # (T, Hkv, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = backend(q, k, v, k_cache, v_cache, attn_metadata)               # (T, H, D), K/V now cached
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))   # (T, hidden)


class Qwen2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):                                                   # SwiGLU: (T, hidden) -> (T, hidden)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen2MLP(config)

    def forward(self, x, cos, sin, k_cache, v_cache, attn_metadata, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, attn_metadata, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 on the paged KV cache.

    config: Qwen2Config. attn_backend: a backend object, or "auto" / "torch" / "numba" (resolved for the
    device of the first forward's inputs; see pagedattn.layers.attention.get_backend).
    """

    def __init__(self, config, attn_backend="auto"):
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn_backend = attn_backend

    def forward(self, input_ids, positions, kv_cache, attn_metadata):
        """One step.

        input_ids: [T] int64 token ids; positions: [T] int64, each token's position in its sequence.
        kv_cache: KVCache with one pool per layer (written at attn_metadata.slot_mapping).
        attn_metadata: AttentionMetadata of the step. Returns the final-normed hidden states [T, hidden].
        """
        if isinstance(self.attn_backend, str):
            self.attn_backend = get_backend(self.attn_backend, input_ids.device)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # (T, D) each
        x = self.model.embed_tokens(input_ids)                              # (T, hidden)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache.k_caches[i], kv_cache.v_caches[i], attn_metadata, self.attn_backend)
        return self.model.norm(x)

    def compute_logits(self, hidden):
        """hidden: [N, hidden] (usually the last token of each sequence) -> [N, vocab] float32."""
        return self.lm_head(hidden).float()
