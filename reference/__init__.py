"""Slow, obviously-correct numpy references (float64 ground truth)."""
from reference.attention import (
    gather_paged_kv,
    naive_decode_attention,
    naive_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
)

__all__ = [
    "gather_paged_kv",
    "naive_decode_attention",
    "naive_prefill_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
]
