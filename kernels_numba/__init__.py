"""numba.cuda kernels of pagedattn, by family.

    paged_attention.py             decode attention: the kernel the engine runs (v10), its launch plan,
                                   the torch entry point paged_attention(...); imports no journey file
    decode_journey.py              the decode journey's VERSIONS (v1-v10) and the entry points that run
                                   any one of them (tests, benches)
    decode_journey_cuda_core.py    the decode journey on CUDA cores: v1 naive -> v4 GQA CTAs, 128-bit
                                   loads, split-KV (and v4's split plan, launch and merge kernel)
    decode_journey_tensor_core.py  the decode journey on tensor cores: v5 mma.sync -> v9 cp.async ring
                                   launched by occupancy
    attention_parts.py             the decode pieces v10 is built from, written once (v5-v9 use them
                                   too): the entry points' checks and LaunchArgs, q fragments, the mma
                                   step, the warps' merge, the cp.async ring, v10's split-KV merge
    paged_prefill_fa2.py           prefill attention the engine runs (v7: a work list over all sequences'
                                   tiles, FlashAttention-2 structure), its plan and merge kernels, one
                                   entry point paged_prefill(...); imports no journey file
    prefill_journey.py             the prefill journey's VERSIONS (v1-v9) and paged_prefill(..., version=N)
    paged_prefill.py               the prefill journey's first era (v1-v3)
    prefill_journey_fa2.py         the prefill journey's FlashAttention-2 era but v7: v4 cp.async ring and
                                   ldmatrix -> v6 split-KV, v8 block ids ahead, v9 persistent CTAs
    prefill_parts.py               the prefill pieces, written once: the host checks every version runs,
                                   and the copies, mma step, softmax and epilogue v7 and v4-v9 are built from
    sampling.py                    sampling the engine runs on the GPU (v2: rows split over CTAs),
                                   sample_cuda(...); imports no journey file
    sampling_parts.py              the sampling kernels' device pieces, written once (v1 uses them too):
                                   the rule's device functions, loads, CTA reductions, merges of partials
    sampling_rule.py               what the CPU and GPU samplers share: the rule's constants, its scalar
                                   functions written once for @njit and for device code, the checks
                                   (imports no numba.cuda)
    sampling_cpu.py                the CPU sampler, sample_cpu(...) (numba @njit; no numba.cuda)
    sampling_journey.py            the sampling journey: v1 (one CTA per row: the hot kernel), VERSIONS
                                   (v1, v2) and sample(...)
    rmsnorm.py, rotary.py,         the glue: RMSNorm (+ residual add), rotary + cache write, SiLU-and-mul
      activation.py
    cpu_*.py                       the CPU kernels (numba @njit): attention, GEMMs, quantized blocks
                                   (cpu_quant.py on cpu_simd.py's vector intrinsics), a small step's glue
                                   and whole layer (cpu_layer.py)
    cache_ops.py                   reshape_and_cache (write K/V at their slots), copy_blocks
    common.py                      device intrinsics: packed fp16/bf16 math, 128-bit loads and stores,
                                   cp.async, ldmatrix, mma.sync, ex2, warp reductions (each with a
                                   simulator fallback)
    bridge.py                      torch <-> numba: cached array views, torch's stream, scratch
                                   buffers, SM count, tensor checks, dynamic shared memory opt-in
    sources.py                     the digest of these sources, which stamps every disk-cached kernel
                                   (a callee edited in another file recompiles its callers)
    precompile.py                  a cold start's kernels compiled in parallel worker processes into the
                                   disk cache (record the launches, compile, load)
    simulator.py                   warp shuffles for numba's CUDA simulator
    errors.py                      KernelLaunchError, the kernels' own error (pagedattn.errors re-exports it);
                                   no module here imports pagedattn

Under NUMBA_ENABLE_CUDASIM=1 (CI, no GPU) the kernels run in numba's CUDA simulator on CPU tensors;
importing this package installs the warp shuffles the simulator lacks (see simulator.py).
"""
from kernels_numba import simulator as _simulator
from kernels_numba import sources as _sources

_simulator.install()
_sources.install()
