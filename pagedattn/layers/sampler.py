"""Turn one step's logits into next tokens on the logits' own device: one row per sampled sequence.

The rule (exact; the CUDA kernel, the CPU version and reference/sampling.py give the same tokens):
  * temperature 0: greedy, the argmax of the logits (ties -> the lowest index; NaN counts as -inf).
  * otherwise x = logits / temperature; the allowed set S is the top_k tokens ranked by (x desc,
    index asc), cut to the top_p nucleus: a token stays while the probability mass of the allowed
    tokens ranked before it is < top_p (so the top token always stays); then
        token = argmax over S of x_i + g_i,   g_i = -log(-log(u_i)) Gumbel noise,
    which draws from softmax(x) restricted to S. The masses are integer weights
    floor(exp(x_i - max x) 2**40), summed exactly, so the nucleus cut does not depend on the order
    of the additions (a GPU and a loop add in different orders).
  * logprobs: log_softmax(logits)[token] of the unscaled logits (vLLM's "raw logprobs").

Random numbers without generator state: u_i comes from Philox4x32-10, a counter-based generator,
keyed by the request's 64-bit seed (low, high words) with counter (position, completion index,
i // 4, 0), word i % 4, where position = tokens this completion generated before. A seeded request
therefore draws the same numbers whatever else is in the batch, with or without CUDA graphs,
after preemption and recompute, on the GPU and on the CPU.

On CUDA, sample() launches numba kernels on torch's current stream (kernels_numba/sampling.py):
pass 1 raw max / logsumexp / argmax (greedy rows end here); pass 2 the Gumbel argmax j over all
tokens, drawing noise only for tokens that could still beat the raw argmax's score (rows without
top_k/top_p end here); pass 3 the mass ranked before j: if j is inside S it is S's argmax
(probability 1 - mass outside S); otherwise an exact radix selection finds S's boundary and a last
pass takes the argmax over S with the same noise. Each pass is one kernel whose rows are split over
several CTAs at small batches (64 per row at N = 1; a fixed function of N and V), the next kernel
merging the partials. Nothing is sorted, nothing vocab-sized touches the host, nothing synchronises:
sample() can be captured in a CUDA graph. On the CPU the same passes run one row after the other in
numba @njit code (kernels_numba/sampling_cpu.py); the CUDA sampler, and numba.cuda with it, is imported
on the first call with CUDA logits only.
"""
from dataclasses import dataclass

import torch

from kernels_numba.sampling_cpu import sample_cpu

_FIELDS = ("temperature", "top_k", "top_p", "seed", "index", "position")


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, one row per sampled sequence, on the logits' device.

    temperature [N] float32 (0 = greedy); top_k [N] int32 (<= 0 or >= V = off); top_p [N] float32
    (1 = off); seed [N] int64 (the 64-bit key, two's complement); index [N] int32 (completion index
    within its request); position [N] int32 (tokens the completion generated before this one).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    index: torch.Tensor
    position: torch.Tensor

    @classmethod
    def from_params(cls, params_list, seeds, indices, positions, device="cpu"):
        """Build on the host from N SamplingParams and N-long lists of keys (ints; the engine gives an
        unseeded request one from its own seed), completion indices and positions, then move to
        `device` (one copy per field; not for use inside a captured graph)."""
        n = len(params_list)
        if not len(seeds) == len(indices) == len(positions) == n:
            raise ValueError(f"need one seed, index and position per row ({n}), got "
                             f"{len(seeds)}, {len(indices)}, {len(positions)}")
        keys = [(int(s) & 0xFFFFFFFFFFFFFFFF) for s in seeds]
        host = cls(
            temperature=torch.tensor([p.temperature for p in params_list], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params_list], dtype=torch.int32),
            top_p=torch.tensor([p.top_p for p in params_list], dtype=torch.float32),
            seed=torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys], dtype=torch.int64),
            index=torch.tensor(list(indices), dtype=torch.int32),
            position=torch.tensor(list(positions), dtype=torch.int32),
        )
        return host.to(device)

    def to(self, device):
        return SamplingTensors(*(getattr(self, f).to(device) for f in _FIELDS))

    def __len__(self):
        return self.temperature.shape[0]


def sample(logits, st, out_tokens=None, out_logprobs=None, validate=True, batch_invariant=False):
    """Next token and its raw log-probability for each row.

    logits: [N, V] float32/float16/bfloat16, contiguous; st: SamplingTensors of N rows on the same
    device. out_tokens: optional [N] int32, out_logprobs: optional [N] float32, written in place
    (pass them when capturing a CUDA graph). validate: the samplers' argument checks (the engine, which
    checks its step's arrays once on the host, passes False). batch_invariant: on CUDA, every row split over
    the same number of CTAs whatever N (kernels_numba.sampling.invariant_chunks), so that a row's sums (its
    logprob's logsumexp, top-p's masses) never depend on the other rows (the CPU sampler's do not anyway).
    Returns (tokens [N] int32, logprobs [N] float32) on logits.device: CUDA runs the kernels on torch's
    current stream, CPU the numba CPU version.
    """
    n = logits.shape[0]
    if out_tokens is None:
        out_tokens = torch.empty(n, dtype=torch.int32, device=logits.device)
    if out_logprobs is None:
        out_logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    args = (logits, st.temperature, st.top_k, st.top_p, st.seed, st.index, st.position, out_tokens, out_logprobs)
    if logits.is_cuda:
        # imported on the first CUDA call: numba.cuda takes ~0.4 s to import, which a CPU engine never needs
        from kernels_numba import sampling

        return sampling.sample_cuda(*args, validate=validate,
                                    chunks=sampling.invariant_chunks(logits.shape[1]) if batch_invariant else None)
    return sample_cpu(*args, validate=validate)
