"""A whole Qwen2 decode step in float64 numpy: the definition a decode step is checked against as one piece.

One step of S sequences, each bringing one new token at its position, over a paged KV pool that already
holds every earlier token:

    x = embed[token]
    per layer:   h = RMSNorm(x) ; q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv
                 q, k = rotary(q, k, position)            (Qwen2's rotate-half, theta = rope_theta)
                 k, v -> the pool at the token's slot     (block_table[pos // BS] * BS + pos % BS)
                 a = paged attention of q over the sequence's pos + 1 tokens (reference/attention.py)
                 x = x + a Wo^T
                 h = RMSNorm(x) ; x = x + (SiLU(h Wg^T) * (h Wu^T)) Wd^T
    logits = RMSNorm(x) W_lm^T                            (W_lm = embed where the embeddings are tied)

Everything is float64 (but the rotary angles, float32 as in HF's Qwen2), the weights and the pool widened from
whatever they are stored in, so the result is a
ground truth for a step computed in float32, float16 or bfloat16, fused into one kernel or not. The pool
arrays passed in are not changed: the step writes its K/V into float64 copies, which it returns.

    weights = load_weights("path/to/qwen2_dir")            # HF tensor names -> float64 arrays
    logits, k_pools, v_pools = decode_step(weights, config, token_ids, positions, k_pools, v_pools, tables)
"""
import json
import os

import numpy as np

from reference.attention import paged_decode_attention


def load_weights(path):
    """The HF checkpoint directory's tensors (*.safetensors) as float64 numpy arrays, by HF name."""
    from safetensors.numpy import load_file

    weights = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            weights.update({k: np.asarray(v, dtype=np.float64) for k, v in load_file(os.path.join(path, name)).items()})
    return weights


def load_config(path):
    """config.json's fields the step needs: a dict."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    return {"num_layers": c["num_hidden_layers"], "num_heads": heads, "num_kv_heads": c["num_key_value_heads"],
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "eps": c["rms_norm_eps"],
            "theta": c.get("rope_theta", 10000.0), "tied": c.get("tie_word_embeddings", False)}


def rms_norm(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rotary(x, positions, theta):
    """x [S, heads, D] rotated at positions [S]: each head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
    angle_i = position / theta^(2i / D). The angles, cos and sin are float32, as HF's Qwen2 computes them in
    every dtype (its rotary embedding casts to float32): they are part of the model's definition."""
    D = x.shape[-1]
    inv_freq = np.float32(1.0) / np.float32(theta) ** (np.arange(0, D, 2).astype(np.float32) / np.float32(D))
    angles = np.asarray(positions).astype(np.float32)[:, None] * inv_freq[None, :]        # (S, D/2) float32
    cos, sin = np.cos(angles)[:, None, :].astype(np.float64), np.sin(angles)[:, None, :].astype(np.float64)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _linear(x, weights, name):
    y = x @ weights[f"{name}.weight"].T
    bias = weights.get(f"{name}.bias")
    return y if bias is None else y + bias


def decode_step(weights, config, token_ids, positions, k_pools, v_pools, block_tables):
    """One decode step (module docstring).

    weights: load_weights(...); config: load_config(...); token_ids, positions: [S] ints (the new token of
    each sequence and its position, 0-based); k_pools, v_pools: one [num_blocks, num_kv_heads, block_size,
    head_dim] array per layer (any float dtype, torch or numpy), holding positions 0 .. position - 1 of each
    sequence; block_tables: [S, max_blocks] ints. Returns (logits [S, vocab] float64, the float64 K pools,
    the float64 V pools with this step's tokens written).
    """
    H, Hkv, D = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    token_ids, positions = np.asarray(token_ids), np.asarray(positions)
    tables = np.asarray(block_tables)
    S = token_ids.shape[0]
    k_pools = [np.array(_numpy(k), dtype=np.float64) for k in k_pools]
    v_pools = [np.array(_numpy(v), dtype=np.float64) for v in v_pools]
    BS = k_pools[0].shape[2]
    blocks, offsets = tables[np.arange(S), positions // BS], positions % BS
    x = weights["model.embed_tokens.weight"][token_ids]                                    # (S, E)
    for i in range(config["num_layers"]):
        p = f"model.layers.{i}"
        h = rms_norm(x, weights[f"{p}.input_layernorm.weight"], config["eps"])
        q = _linear(h, weights, f"{p}.self_attn.q_proj").reshape(S, H, D)
        k = _linear(h, weights, f"{p}.self_attn.k_proj").reshape(S, Hkv, D)
        v = _linear(h, weights, f"{p}.self_attn.v_proj").reshape(S, Hkv, D)
        q, k = rotary(q, positions, config["theta"]), rotary(k, positions, config["theta"])
        k_pools[i][blocks, :, offsets] = k
        v_pools[i][blocks, :, offsets] = v
        a = paged_decode_attention(q, k_pools[i], v_pools[i], tables, positions + 1)          # (S, H, D)
        x = x + _linear(a.reshape(S, H * D), weights, f"{p}.self_attn.o_proj")
        h = rms_norm(x, weights[f"{p}.post_attention_layernorm.weight"], config["eps"])
        g, u = _linear(h, weights, f"{p}.mlp.gate_proj"), _linear(h, weights, f"{p}.mlp.up_proj")
        x = x + _linear(g / (1.0 + np.exp(-g)) * u, weights, f"{p}.mlp.down_proj")
    head = weights["model.embed_tokens.weight"] if config["tied"] else weights["lm_head.weight"]
    return rms_norm(x, weights["model.norm.weight"], config["eps"]) @ head.T, k_pools, v_pools


def _numpy(t):
    return t.detach().cpu().double().numpy() if hasattr(t, "detach") else t
