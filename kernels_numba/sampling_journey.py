"""The sampling journey's versions side by side: {version: entry} and the entry point that runs any one.

v1: one CTA per row: the hot kernel (raw max and logsumexp, the Gumbel argmax with its skip bound,
    the top-k / top-p prefix test) and the fallback kernel (radix selection) after it.
v2: adds rows split over several CTAs (split_chunks(N, V) per row, partials merged by the next
    pass; the skip bound against the raw argmax, a lower bound of Z_k): the engine's path,
    sampling.sample_cuda (sampling.py stands alone).

Every version takes the same arguments in the same order (torch tensors, CUDA or the simulator's CPU):
    VERSIONS[n](logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                threads=, fallback_threads=, nbins_log2=)
and v2 also takes chunks= (CTAs per row). Both return (out_tokens, out_logprobs) and give the same
tokens as reference/sampling.py (tests/test_sampler.py); scripts/bench_sampling.py times both.
"""
from kernels_numba import sampling
from kernels_numba.errors import KernelLaunchError


def sample_one_cta(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                   threads=sampling.THREADS, fallback_threads=sampling.FALLBACK_THREADS,
                   nbins_log2=sampling.NBINS_LOG2):
    """v1: the arguments of sampling.sample_cuda (without chunks), one CTA per row."""
    params = (temperature, top_k, top_p, seed, index, position)
    sampling.check_args(logits, params, out_tokens, out_logprobs, on_cpu=False)
    if logits.shape[0] == 0:
        return out_tokens, out_logprobs
    words, vocab, kind, vec, args = sampling.torch_launch_args(logits, *params, out_tokens, out_logprobs, 0)
    config = dict(threads=threads, fallback_threads=fallback_threads, nbins_log2=nbins_log2)
    sampling.run_on_stream(logits.device, lambda **kw: sampling.launch(words, vocab, kind, vec, *args, **kw, **config))
    return out_tokens, out_logprobs


PRODUCTION_VERSION = 2
VERSIONS = {1: sample_one_cta, PRODUCTION_VERSION: sampling.sample_cuda}


def entry(version):
    """VERSIONS[version]; KernelLaunchError for a version the journey does not have."""
    if version not in VERSIONS:
        raise KernelLaunchError(f"version={version!r} is not one of {sorted(VERSIONS)}")
    return VERSIONS[version]


def sample(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
           version=PRODUCTION_VERSION, **options):
    """Version `version` (1, 2) with sampling.sample_cuda's arguments; options: threads=,
    fallback_threads=, nbins_log2=, and chunks= for v2. Returns (out_tokens, out_logprobs)."""
    return entry(version)(logits, temperature, top_k, top_p, seed, index, position, out_tokens, out_logprobs,
                          **options)
