"""Qwen2 decoder (Qwen2 / Qwen2.5 checkpoints) on the paged KV cache, nano-vllm style.

One forward call processes one engine step: a flat batch of T tokens (prefill chunks first, then one
token per decoding sequence) described by AttentionMetadata. There is no batch dimension and no
padding: every projection, norm and MLP is a row-wise op on [T, hidden]; only attention needs to know
which tokens belong to which sequence, and the backend reads that from the metadata.

The model is stated once, as stages:

    embed          ids -> x                                       embed_tokens
    per layer i    before_attention: x, residual -> q, residual   fused residual add + RMSNorm, the q/k/v GEMM
                                                                  (+ bias), rotary and the K/V write
                   attention: q -> o                              the backend's paged attention
                   after_attention: o, residual -> x, residual    o_proj, add + RMSNorm, gate_up GEMM,
                                                                  SiLU-and-mul, down_proj
    final          x, residual -> hidden                          the final add + RMSNorm
    logits         hidden rows -> logits                          the LM head

`forward` runs them in that order (each layer through the ops table's `decoder_layer`, which is the layer's
own forward except where a backend runs a whole layer as one call: the CPU's small steps,
pagedattn/layers/cpu.py). `piece(i, ...)` runs the same stages cut at the attentions, for the runner that
captures the pieces between attentions as CUDA graphs (pagedattn/engine/piecewise_graph.py). Kernels per
layer with the numba backend on fp16/bf16: norm 1, q/k/v 1 GEMM, rotary + K/V write 1, attention 1-2,
o_proj 1 GEMM, norm 1, gate_up 1 GEMM, SiLU-and-mul 1, down 1 GEMM.

Which kernel runs each op is decided once, when the model is built, from the backend, the device and the
dtype: the model's ops table (pagedattn/layers/ops.py), handed to every layer at construction. With the
torch backend, on CPU or in float32 the same layers run as torch ops with the same math.
Tensor parallelism: built for rank tp_rank of tp_size (pagedattn/layers/linear.py); the checkpoint stays
Hugging Face's (q_proj / k_proj / v_proj and gate_proj / up_proj are merged at load time:
`packed_modules_mapping`, pagedattn/models/loader.py). Steps of many rows may fuse the all-reduces after
o_proj and down_proj with the norms after them (`model.fused_allreduce`): then the residual stream between
layers is each rank's rows of it, and the layers pass partial sums (pagedattn/distributed/allreduce_norm.py):

    x, residual_rows = input_layernorm(x_partial, residual_rows)   reduce-scatter, add + norm, all-gather
    x_partial = o_proj(...)                                        no all-reduce
    x, residual_rows = post_attention_layernorm(x_partial, residual_rows)
    x_partial = down_proj(...)                                     no all-reduce
"""
from dataclasses import MISSING, dataclass, fields

import torch
from torch import nn

from pagedattn.distributed.allreduce_norm import fused_allreduce_for, shard_rows
from pagedattn.errors import ModelLoadError
from pagedattn.layers.activation import SiluAndMul
from pagedattn.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedattn.layers.norm import RMSNorm
from pagedattn.layers.ops import make_ops
from pagedattn.layers.rotary import RotaryEmbedding


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


def checkpoint_shapes(config):
    """{tensor name: shape} of a Hugging Face Qwen2 checkpoint with this config (unsharded, unmerged)."""
    H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    E, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (H * D, E), p + "self_attn.q_proj.bias": (H * D,),
            p + "self_attn.k_proj.weight": (Hkv * D, E), p + "self_attn.k_proj.bias": (Hkv * D,),
            p + "self_attn.v_proj.weight": (Hkv * D, E), p + "self_attn.v_proj.bias": (Hkv * D,),
            p + "self_attn.o_proj.weight": (E, H * D),
            p + "mlp.gate_proj.weight": (I, E), p + "mlp.up_proj.weight": (I, E), p + "mlp.down_proj.weight": (E, I),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, E)
    return shapes


class Qwen2Attention(nn.Module):
    def __init__(self, config, rotary_emb, ops, tp_rank=0, tp_size=1, fused=None):
        super().__init__()
        D = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, D, config.num_attention_heads,
                                          config.num_key_value_heads, True, tp_rank, tp_size, ops)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D
        self.o_proj = RowParallelLinear(config.num_attention_heads * D, config.hidden_size, False, tp_rank, tp_size,
                                        ops, fused)
        self.rotary_emb = rotary_emb                     # shared by every layer (one cos/sin cache)
        self.ops = ops

    def forward(self, positions, x, k_cache, v_cache, attn_metadata):
        """x (T, hidden) -> o_proj's output (T, hidden): project_q, the attention over the pool, project_out."""
        q = self.project_q(positions, x, k_cache, v_cache, attn_metadata.slot_mapping)
        o = self.ops.attention(q, k_cache, v_cache, attn_metadata)          # (T, H, D)
        return self.project_out(o)

    def project_q(self, positions, x, k_cache, v_cache, slot_mapping):
        """x (T, hidden) -> q (T, H, D) rotated; k rotated and v written into this layer's pool at slot_mapping."""
        qkv = self.qkv_proj(x)                                              # (T, (H + 2 Hkv) D)
        return self.ops.rotary_and_cache_write(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                               self.rotary_emb.cos_sin_cache, k_cache, v_cache, slot_mapping)

    def project_out(self, o):
        """The attention's output o (T, H, D) -> (T, hidden) (this rank's partial sum in a step whose
        all-reduce is fused with the norm after it)."""
        return self.o_proj(o.view(o.shape[0], self.num_heads * self.head_dim))       # (T, H D) -> (T, hidden)


class Qwen2MLP(nn.Module):
    def __init__(self, config, ops, tp_rank=0, tp_size=1, fused=None):
        super().__init__()
        I = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [I, I], False, tp_rank, tp_size, ops)
        self.act_fn = SiluAndMul(ops)
        self.down_proj = RowParallelLinear(I, config.hidden_size, False, tp_rank, tp_size, ops, fused)

    def forward(self, x):                                                   # SwiGLU: (T, hidden) -> (T, hidden)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))           # via (T, 2 I/P) and (T, I/P)


class Qwen2DecoderLayer(nn.Module):
    """A decoder layer as its two stages around attention. x: the previous layer's output (the embedding in
    the first layer); residual: the residual stream before it (None in the first layer). A step whose
    all-reduces are fused with the norms after them (self.fused.takes(T), several ranks) carries the residual
    stream as this rank's rows [token_rows(T, P), hidden], and x is this rank's partial sum
    (pagedattn/distributed/allreduce_norm.py)."""

    def __init__(self, config, rotary_emb, ops, tp_rank=0, tp_size=1, fused=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, fused)
        self.self_attn = Qwen2Attention(config, rotary_emb, ops, tp_rank, tp_size, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, fused)
        self.mlp = Qwen2MLP(config, ops, tp_rank, tp_size, fused)
        self.fused, self.tp_rank, self.tp_size = fused, tp_rank, tp_size

    def forward(self, positions, x, residual, k_cache, v_cache, attn_metadata):
        """The layer: (x, residual) -> (this layer's output, residual)."""
        x, residual = self.input_norm(x, residual)
        x = self.self_attn(positions, x, k_cache, v_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def input_norm(self, x, residual):
        """(x, residual) -> (the normed x, the residual stream): the first layer's input is the embedding."""
        if residual is not None:
            return self.input_layernorm(x, residual)
        residual = x                                      # the first layer: x is the (all-reduced) embedding
        if self.fused is not None and self.fused.takes(x.shape[0]):
            residual = shard_rows(x, self.tp_rank, self.tp_size)
        return self.input_layernorm(x), residual

    # The layer in two halves around its attention: the same stages, for the forward's pieces
    def before_attention(self, positions, x, residual, k_cache, v_cache, slot_mapping):
        """-> (q (T, H, D), residual): the input norm, the q/k/v projection, rotary, the K/V write."""
        x, residual = self.input_norm(x, residual)
        return self.self_attn.project_q(positions, x, k_cache, v_cache, slot_mapping), residual

    def after_attention(self, o, residual):
        """The attention's output o (T, H, D) -> (this layer's output, residual): o_proj, norm, MLP."""
        x, residual = self.post_attention_layernorm(self.self_attn.project_out(o), residual)
        return self.mlp(x), residual


class Qwen2Model(nn.Module):
    """The modules, named as Hugging Face's checkpoint names them (model.embed_tokens, model.layers.N, ...)."""

    def __init__(self, config, ops, tp_rank=0, tp_size=1, fused=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size, ops)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(config, self.rotary_emb, ops, tp_rank, tp_size, fused)
                                     for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, fused)    # gathers the rows when fused


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 on the paged KV cache (rank tp_rank of tp_size under tensor parallelism).

    config: Qwen2Config. attn_backend: a backend object, or "auto" / "torch" / "numba" / "cpu" (see
    pagedattn.layers.attention.get_backend). The model is built for the current default device and dtype
    (pagedattn.models.loader.build_model sets both): with them the backend's choices are made once, into the
    ops table `model.ops` (pagedattn.layers.ops) that every layer gets at construction; `model.attn_backend`
    is the resolved backend. weights: "float32" or "quantized" (the layers will hold GGUF blocks).
    fused_allreduce: at tp_size > 1, which steps run the all-reduces after o_proj and down_proj fused with
    the add + RMSNorm after them: "auto" (a cost model's threshold), "on" (every step), "off", or a row
    count (steps of at least that many rows); `model.fused_allreduce` is the resulting FusedAllReduceNorm
    (pagedattn/distributed/allreduce_norm.py) or None. Parameters are created uninitialised: load them
    (pagedattn.models.loader.load_model).
    """

    # checkpoint name -> (parameter name, shard id) for the weights merged at load time
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, attn_backend="auto", tp_rank=0, tp_size=1, weights="float32", fused_allreduce="auto"):
        super().__init__()
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        device, dtype = torch.empty(0).device, torch.get_default_dtype()
        self.ops = make_ops(attn_backend, device, dtype, config.hidden_size, config.intermediate_size // tp_size,
                            config.head_dim, weights=weights, tp_size=tp_size)
        self.attn_backend = self.ops.backend
        self.fused_allreduce = fused_allreduce_for(tp_size, device, dtype, config.hidden_size, fused_allreduce)
        self.model = Qwen2Model(config, self.ops, tp_rank, tp_size, self.fused_allreduce)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size, self.ops)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_cache, attn_metadata):
        """One step.

        input_ids: [T] int32/int64 token ids; positions: [T] int32/int64, each token's position in its sequence.
        kv_cache: KVCache with one pool per layer (written at attn_metadata.slot_mapping).
        attn_metadata: AttentionMetadata of the step. Returns the final-normed hidden states [T, hidden]
        (whole on every rank; with the fused all-reduce, the final norm all-gathers its rows).
        """
        x, residual = self.model.embed_tokens(input_ids), None                  # (T, hidden)
        for i, layer in enumerate(self.model.layers):
            x, residual = self.ops.decoder_layer(layer, positions, x, residual, kv_cache.k_caches[i],
                                                 kv_cache.v_caches[i], attn_metadata)
        return self.model.norm(x, residual)[0]

    @property
    def num_pieces(self):
        """Pieces of the forward cut at its attentions: one per layer and the last (see piece)."""
        return len(self.model.layers) + 1

    def piece(self, i, positions, x, residual, kv_cache, slot_mapping):
        """Piece i of the forward cut at its attentions: the same stages as forward, the attention of layer i
        left to the caller between piece i and piece i + 1.

            piece 0      x = ids [T] -> embedding -> layer 0 before attention            -> (q_0, residual)
            piece i      x = o_{i-1} [T, H, D] -> layer i-1 after attention -> layer i before attention
                                                                                        -> (q_i, residual)
            piece L      x = o_{L-1} -> layer L-1 after attention -> the final norm    -> (hidden, residual)
        """
        layers = self.model.layers
        if i == 0:
            x, residual = self.model.embed_tokens(x), None
        else:
            x, residual = layers[i - 1].after_attention(x, residual)
        if i == len(layers):
            return self.model.norm(x, residual)
        return layers[i].before_attention(positions, x, residual, kv_cache.k_caches[i], kv_cache.v_caches[i],
                                          slot_mapping)

    def compute_logits(self, hidden, float32=True):
        """hidden: [N, hidden] (usually the last token of each sequence) -> [N, vocab], float32 or (float32=False)
        the model's dtype as the LM head wrote it: the sampler reads fp16/bf16 rows itself, so the engine
        skips the copy (at batch 256 and a 152k vocabulary, 230 MB of traffic per step)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits
