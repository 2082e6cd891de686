"""The prefill journey's versions side by side: {version: entry} and the entry point that runs any one.

v1-v3: the first era (paged_prefill.py): v1 fp32 FMA on CUDA cores from shared-memory tiles;
    v2 adds tensor cores (mma.sync m16n8k16, Q and P in registers); v3 adds the block size as a
    compile-time constant and the softmax on ex2.approx.
v4-v9: the FlashAttention-2 structure (prefill_journey_fa2.py): v4 adds the cp.async ring of
    swizzled K/V tiles, ldmatrix fragments and heaviest-tile-first scheduling; v5 adds 128 rows
    per CTA at d=64; v6 adds split-KV when the grid is short; v7, the kernel the engine runs
    (paged_prefill_fa2.py, which stands alone), adds a work list written by a one-CTA plan kernel
    (no CTA searches the sequences for its tile: that search grew with the number of sequences
    and dominated short prompts) and 128 rows per CTA at d=128 (tiles of 32 keys); v8 loads each
    tile's block ids one tile ahead (v7's copies waited on four dependent block-table loads a tile)
    and moves the softmax's running max only when it grows by 2^8 (O's rescale skipped most tiles);
    v9 runs v7's kernel as one wave of CTAs, each looping over several work items with the next
    item's Q and first K/V tile copied during the current item's last tile (short prompts: a CTA's
    fixed cost paid once per CTA instead of once per item).

Every version takes the same arguments in the same order (torch tensors):
    VERSIONS[n](q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                validate=False)
and v4-v9 also take max_context_len=, stages= and plans= (a step's work list, reused by its later
layers; used by the versions with a work list, v7-v9), v6-v8 splits=, v9 ctas= and prefetch=. The entry point
    paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  version=PRODUCTION_VERSION, validate=False, **options)
runs version `version` with those arguments. Every version is tested (tests/test_paged_prefill_cuda.py,
tests/test_prefill_fa2.py) and timed (scripts/bench_prefill.py).
"""
from functools import partial

from kernels_numba import paged_prefill as first_era
from kernels_numba import paged_prefill_fa2 as shipped
from kernels_numba import prefill_journey_fa2 as fa2
from kernels_numba.errors import KernelLaunchError

PRODUCTION_VERSION = fa2.PRODUCTION_VERSION
VERSIONS = dict(sorted({
    **{v: partial(first_era.paged_prefill, v) for v in first_era.BUILDERS},
    **fa2.VERSIONS,
    PRODUCTION_VERSION: shipped.paged_prefill,
}.items()))
# the versions that take max_context_len=, stages= and plans=
FA2_VERSIONS = tuple(sorted({*fa2.VERSIONS, PRODUCTION_VERSION}))
SPLITS_KV = fa2.SPLITS_KV  # the versions that split the KV range


def entry(version):
    """VERSIONS[version]; KernelLaunchError for a version the journey does not have."""
    if version not in VERSIONS:
        raise KernelLaunchError(f"version={version!r} is not one of {sorted(VERSIONS)}")
    return VERSIONS[version]


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  version=PRODUCTION_VERSION, validate=False, **options):
    """Version `version` (1..9) on torch tensors, on torch's current CUDA stream. The arguments are
    paged_prefill_fa2.paged_prefill's; options (max_context_len=, stages=, plans=, splits=, ctas=,
    prefetch=) reach v4-v9 only (see the module docstring for which).
    Returns out [total_q, num_heads, head_dim] in q's dtype."""
    return entry(version)(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=scale, out=out,
                          validate=validate, **options)
