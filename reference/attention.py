"""Reference attention in numpy: the ground truth every kernel and backend is tested against.

Two families, written to be read rather than to be fast:

* naive attention over a *contiguous* K/V history (decode: one query per sequence;
  prefill: many causal queries whose positions end where the history ends);
* paged attention that finds every token through the block table, one token at a time:

      block  = block_table[j // block_size]
      offset = j % block_size
      k_j    = k_cache[block, kv_head, offset]

GQA: query head h reads KV head h // (num_heads // num_kv_heads). Everything is computed
in float64 whatever the input dtype, so the result is a ground truth for fp16/bf16/fp32 kernels.

Pool layout (the one pagedattn.kv_cache allocates and the kernels read):
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
"""
import numpy as np


def _f64(x):
    """numpy float64 copy of a numpy array or a torch tensor (any device/dtype)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _ints(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def _kv_head_of(num_heads, num_kv_heads):
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    return [h // group for h in range(num_heads)]


def _softmax_attend(q, k, v, scale):
    """q: [D], k: [L, D], v: [L, D] (float64) -> [D]. Plain two-pass softmax."""
    scores = (k @ q) * scale  # (L,)
    scores = scores - scores.max()
    p = np.exp(scores)
    return (p / p.sum()) @ v  # (D,)


def naive_decode_attention(q, k, v, scale=None):
    """One decode query attending to a contiguous history.

    q: [num_heads, head_dim]; k, v: [context_len, num_kv_heads, head_dim] (any float dtype).
    scale: softmax scale, default 1/sqrt(head_dim).
    Returns [num_heads, head_dim] float64.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    num_heads, head_dim = q.shape
    context_len, num_kv_heads, _ = k.shape
    if context_len == 0:
        raise ValueError("context_len must be >= 1")
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.empty((num_heads, head_dim), dtype=np.float64)
    for h, kvh in enumerate(_kv_head_of(num_heads, num_kv_heads)):
        out[h] = _softmax_attend(q[h], k[:, kvh], v[:, kvh], scale)
    return out


def naive_prefill_attention(q, k, v, scale=None):
    """Causal attention of q_len new queries over a history that ends with them.

    q: [q_len, num_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim], kv_len >= q_len.
    Query i sits at position kv_len - q_len + i and sees keys 0..that position (the cached
    prefix plus the new tokens up to itself).
    Returns [q_len, num_heads, head_dim] float64.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    q_len = q.shape[0]
    kv_len = k.shape[0]
    if kv_len < q_len:
        raise ValueError(f"kv_len={kv_len} must be >= q_len={q_len}")
    out = np.empty(q.shape, dtype=np.float64)
    for i in range(q_len):
        pos = kv_len - q_len + i
        out[i] = naive_decode_attention(q[i], k[: pos + 1], v[: pos + 1], scale)
    return out


def gather_paged_kv(k_cache, v_cache, block_table, context_len):
    """Read one sequence's K and V out of the pool, token by token, through its block table.

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    block_table: [>= ceil(context_len / block_size)] int physical block ids
    Returns k, v: [context_len, num_kv_heads, head_dim] float64.
    """
    k_cache, v_cache = _f64(k_cache), _f64(v_cache)
    block_table = _ints(block_table)
    block_size = k_cache.shape[2]
    k = np.empty((context_len, k_cache.shape[1], k_cache.shape[3]), dtype=np.float64)
    v = np.empty_like(k)
    for j in range(context_len):
        block = block_table[j // block_size]
        offset = j % block_size
        k[j] = k_cache[block, :, offset, :]
        v[j] = v_cache[block, :, offset, :]
    return k, v


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Decode attention for a batch of sequences of different lengths over the paged pool.

    q: [num_seqs, num_heads, head_dim]
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq] int (entries past a sequence's end are ignored)
    context_lens: [num_seqs] int, tokens of history per sequence (>= 1), the new token included
    Returns [num_seqs, num_heads, head_dim] float64.
    """
    q = _f64(q)
    block_tables, context_lens = _ints(block_tables), _ints(context_lens)
    out = np.empty(q.shape, dtype=np.float64)
    for s in range(q.shape[0]):
        k, v = gather_paged_kv(k_cache, v_cache, block_tables[s], int(context_lens[s]))
        out[s] = naive_decode_attention(q[s], k, v, scale)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None):
    """Causal prefill for a batch of sequences whose new K/V are already in the pool.

    q: [total_q_tokens, num_heads, head_dim], sequences packed one after another
    cu_seqlens_q: [num_seqs + 1] int, sequence s owns q[cu_seqlens_q[s]:cu_seqlens_q[s+1]]
    context_lens: [num_seqs] int, tokens in the pool for s *after* this step's write
        (cached prefix + new tokens); the new tokens are the last q_len of them.
    k_cache, v_cache, block_tables: as in paged_decode_attention.
    Returns [total_q_tokens, num_heads, head_dim] float64.
    """
    q = _f64(q)
    block_tables, context_lens = _ints(block_tables), _ints(context_lens)
    cu = _ints(cu_seqlens_q)
    out = np.empty(q.shape, dtype=np.float64)
    for s in range(len(context_lens)):
        k, v = gather_paged_kv(k_cache, v_cache, block_tables[s], int(context_lens[s]))
        out[cu[s] : cu[s + 1]] = naive_prefill_attention(q[cu[s] : cu[s + 1]], k, v, scale)
    return out
