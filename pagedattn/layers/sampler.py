"""Turn one step's logits into next tokens, one row per sampling sequence.

Greedy rows (temperature 0) take the argmax, exactly. The other rows are divided by their
temperature, cut to their top_k and top_p, and sampled with the exponential race

    token = argmax_i p_i / E_i,   E_i ~ Exponential(1)

which draws from p exactly. The E_i come from the row's own torch.Generator when the request has
a seed, so a seeded request draws the same numbers whatever else is in the batch.
"""
import torch


def apply_top_k_top_p(logits, top_k, top_p):
    """Mask (to -inf) everything outside each row's top_k and top_p nucleus.

    logits: [N, V] float32 (already divided by the temperature).
    top_k: [N] int64, V where disabled; top_p: [N] float32, 1.0 where disabled.
    Returns [N, V] float32.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)                 # (N, V)
    rank = torch.arange(logits.shape[-1], device=logits.device)                  # (V,)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep token i while the mass strictly before it is < top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits, params, generators):
    """Next token of each row.

    logits: [N, V] float32; params: N SamplingParams; generators: N torch.Generator or None
    (CPU generators; the noise is drawn on the CPU and moved, so results match across devices).
    Returns [N] int64 on logits.device.
    """
    n, vocab = logits.shape
    tokens = logits.argmax(dim=-1)                                               # greedy rows: done
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return tokens
    idx = torch.tensor(rows, device=logits.device)
    x = logits[idx] / torch.tensor([params[i].temperature for i in rows],
                                   dtype=torch.float32, device=logits.device)[:, None]
    top_k = [params[i].top_k if params[i].top_k > 0 else vocab for i in rows]
    top_p = [params[i].top_p for i in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        x = apply_top_k_top_p(x, torch.tensor(top_k, device=x.device),
                              torch.tensor(top_p, dtype=torch.float32, device=x.device))
    probs = x.softmax(dim=-1)                                                    # (R, V)
    noise = torch.empty(len(rows), vocab, dtype=torch.float32)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    chosen = (probs / noise.to(probs.device)).argmax(dim=-1)
    tokens[idx] = chosen
    return tokens
