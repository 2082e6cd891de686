"""Sampling (pagedattn/layers/sampler.py; kernels_numba/sampling*.py: the rule's shared pieces, the CPU
sampler, the CUDA kernels and the journey's v1) against reference/sampling.py.

Layers: the Philox words (Random123's known answers; numpy == numba CPU == the kernels' device function),
the written-out exp/log (bit for bit across the three, and close to float64), the rule on whole rows
(CPU version == reference on thousands of rows, the kernels under the CUDA simulator == reference on
rows chosen to hit every path, the split path on several CTAs per row), the split kernels' skip bound,
the distribution it samples (chi-square against float64), and reproducibility (a seeded row draws the
same token alone and in a mixed batch). gpu tests: real shapes on the H200 == the CPU version (N = 1,
3, 8 and 256, both paths), and a capture-and-replay in a CUDA graph (N = 1, 8, 64).

Tolerances: tokens are compared exactly. Logprobs: the kernels compute log_softmax in float32
(online max/sum, libdevice exp/log), the CPU version in float64; against the float64 reference both
stay within 2e-6 absolute on these rows (|logprob| < 60, float32 eps 1.2e-7 times the ~10 roundings
of a sum over V terms, measured 1e-6 at most).
"""
import numpy as np
import pytest
import torch

import reference.sampling as ref
from helpers import capture_after_warmup
from kernels_numba import sampling as ks, sampling_journey as journey, sampling_parts as parts
from kernels_numba import sampling_rule as rule
from pagedattn.layers.sampler import SamplingTensors, sample
from pagedattn.sampling_params import SamplingParams

HAS_GPU = torch.cuda.is_available()
LOGPROB_TOL = 2e-6

# Random123 tests/kat_vectors (github.com/DEShawResearch/random123), the philox4x32 10 lines:
# counter[4], key[2] -> output[4]
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# the kernels under the simulator: one warp per CTA and 64 radix bins, so a key range takes up to
# 6 levels (the GPU's 512/384 threads and 2048 bins take up to 3); chunks: CTAs per row of the split
# path (0: the one-CTA path), several even on tiny rows so that partials are merged
SIM = dict(threads=32, fallback_threads=32, nbins_log2=6)


def _u32(values):
    return [np.uint32(v) for v in values]


def make_rows(n, vocab, seed, ties=True):
    """n rows of mixed difficulty: scales 0.3..10, integer logits (many ties), half -inf, NaN; every
    parameter combination (greedy, tiny temperature, top_k 1/2/7/30/V-1/V, top_p 1e-7..1)."""
    g = np.random.default_rng(seed)
    kind = g.integers(0, 4, n) if ties else np.zeros(n, dtype=np.int64)
    logits = (g.standard_normal((n, vocab)) * g.choice([0.3, 1, 3, 10], (n, 1))).astype(np.float32)
    logits[kind == 1] = np.round(logits[kind == 1])
    masked = kind == 2
    logits[masked] = np.where(g.random((masked.sum(), vocab)) < 0.5, -np.inf, logits[masked])
    logits[kind == 3, :3] = np.nan
    return dict(
        logits=logits,
        temperature=g.choice([0.0, 0.3, 1.0, 2.5, 1e-6], n).astype(np.float32),
        top_k=g.choice([0, 1, 2, 7, 30, vocab - 1, vocab], n).astype(np.int32),
        top_p=g.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-7], n).astype(np.float32),
        seed=g.integers(-2**63, 2**63 - 1, n, dtype=np.int64),
        index=g.integers(0, 4, n).astype(np.int32),
        position=g.integers(0, 1000, n).astype(np.int32),
    )


def unrestricted_argmax_misses(rows):
    """Per row: True when the Gumbel argmax over all tokens is outside S (the kernels' fallback path)."""
    out = []
    for r in range(len(rows["temperature"])):
        l = np.where(np.isnan(rows["logits"][r]), -np.inf, rows["logits"][r]).astype(np.float32)
        if not rows["temperature"][r] > 0 or l.max() == -np.inf:
            out.append(False)
            continue
        x = ref.scaled_logits(l, ref.inverse_temperature(rows["temperature"][r]))
        ids = np.arange(l.shape[0])
        score = x + ref.gumbel(ref.noise_words(rows["seed"][r], rows["index"][r], rows["position"][r], ids))
        j = ids[score == score.max()].min()
        out.append(j not in set(ref.allowed_set(x, int(rows["top_k"][r]), rows["top_p"][r]).tolist()))
    return np.array(out)


def run_reference(rows):
    return ref.sample(rows["logits"], rows["temperature"], rows["top_k"], rows["top_p"], rows["seed"],
                      rows["index"], rows["position"])


def tensors(rows, dtype=torch.float32):
    st = SamplingTensors(*(torch.from_numpy(np.ascontiguousarray(rows[f])) for f in
                           ("temperature", "top_k", "top_p", "seed", "index", "position")))
    return torch.from_numpy(rows["logits"]).to(dtype), st


def check_against_reference(tokens, logprobs, want_tokens, want_logprobs, what):
    bad = np.nonzero(tokens != want_tokens)[0]
    assert bad.size == 0, f"{what}: rows {bad[:10].tolist()} got {tokens[bad[:10]].tolist()}, " \
                          f"want {want_tokens[bad[:10]].tolist()}"
    assert np.array_equal(np.isnan(logprobs), np.isnan(want_logprobs)), what
    err = np.abs(logprobs - want_logprobs)[~np.isnan(want_logprobs)]
    assert err.max() <= LOGPROB_TOL, f"{what}: logprob error max {err.max():.3g} mean {err.mean():.3g}"


# ----------------------------------------------------------------------------------------
# Philox and the written-out math


def test_constants_match_the_reference():
    for name in ("PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1", "FLT_MAX", "INV_T_MIN", "TWO_M23",
                 "WEIGHT_ONE", "WEIGHT_CUT", "MAX_VOCAB", "SQRT2", "LN2_HI", "LN2_LO", "LOG2E", "G_MAX",
                 "G_MIN", "G_TOP"):
        assert getattr(rule, name) == getattr(ref, name), name
    assert (rule.LOG_C11, rule.LOG_C9, rule.LOG_C7, rule.LOG_C5, rule.LOG_C3) == ref.LOG_C
    assert (rule.EXP_C7, rule.EXP_C6, rule.EXP_C5, rule.EXP_C4, rule.EXP_C3, rule.EXP_C2, rule.ONE,
            rule.ONE) == ref.EXP_C


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    assert tuple(int(w) for w in ref.philox4x32_10(*counter, *key)) == want
    assert tuple(int(w) for w in rule.philox(*_u32(counter), *_u32(key))) == want        # numba CPU
    assert tuple(int(w) for w in parts.GPU.philox(*_u32(counter), *_u32(key))) == want    # device function


def test_philox_numpy_cpu_and_device_agree():
    g = np.random.default_rng(0)
    c = g.integers(0, 2**32, (4, 200), dtype=np.uint64).astype(np.uint32)
    k = g.integers(0, 2**32, (2, 200), dtype=np.uint64).astype(np.uint32)
    words = np.stack(ref.philox4x32_10(*c, *k))                                      # (4, 200)
    cpu = np.array([rule.philox(*c[:, i], *k[:, i]) for i in range(200)]).T
    dev = np.array([parts.GPU.philox(*c[:, i], *k[:, i]) for i in range(0, 200, 10)]).T
    assert np.array_equal(cpu, words)
    assert np.array_equal(dev, words[:, ::10])


@pytest.fixture(scope="module")
def uniforms_words():
    """2**20 Philox-like words whose uniforms sweep (0, 1) (every 8th of the 2**23 values), and both ends."""
    top = np.arange(0, 1 << 23, 8, dtype=np.uint32)
    top = np.concatenate([top, np.array([1, (1 << 23) - 1], dtype=np.uint32)])
    return (top << np.uint32(9)) | np.uint32(0x1A5)


def test_gumbel_bitwise_equal_and_accurate(uniforms_words):
    from numba import njit

    @njit
    def gumbel_all(r):
        out = np.empty(r.shape[0], dtype=np.float32)
        for i in range(r.shape[0]):
            out[i] = rule.gumbel(r[i])
        return out

    want = ref.gumbel(uniforms_words)
    cpu = gumbel_all(uniforms_words)
    dev = np.array([parts.GPU.gumbel(r) for r in uniforms_words[::2049]], dtype=np.float32)
    assert np.array_equal(cpu.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(dev.view(np.uint32), want[::2049].view(np.uint32))
    u = ref.uniform(uniforms_words).astype(np.float64)
    exact = -np.log(-np.log(u))
    # float32 noise of magnitude < 17: a few ulp (1.9e-6 at 16) is what float32 can hold
    assert np.abs(want - exact).max() < 2e-6
    # the kernels skip tokens by these bounds: every draw must lie inside them
    assert ref.G_MIN < want.min() and want.max() < ref.G_MAX
    # the split kernels' bound is the largest noise itself, that of the largest word
    assert want.max() == ref.G_TOP == ref.gumbel(np.uint32(0xFFFFFFFF))
    order = np.argsort(uniforms_words >> np.uint32(9))
    assert np.all(np.diff(want[order]) >= 0), "the noise must be monotone in u"


def test_det_exp_bitwise_equal_and_accurate():
    from numba import njit

    @njit
    def exp_all(d):
        out = np.empty(d.shape[0], dtype=np.float32)
        for i in range(d.shape[0]):
            out[i] = rule.det_exp(d[i])
        return out

    d = -np.linspace(0, 28, 500_001).astype(np.float32)
    want = ref.det_exp(d)
    assert np.array_equal(exp_all(d).view(np.uint32), want.view(np.uint32))
    dev = np.array([parts.GPU.det_exp(v) for v in d[::997]], dtype=np.float32)
    assert np.array_equal(dev.view(np.uint32), want[::997].view(np.uint32))
    assert want[0] == 1.0                                 # the top token's weight is exactly 2**40
    assert np.abs(want / np.exp(d.astype(np.float64)) - 1).max() < 3e-7


def fast_gumbel_numpy(r):
    """parts.fast_gumbel with an exact log2 in place of the hardware's, in float32 numpy."""
    u = ref.uniform(r)
    v = np.float32(1) - u
    p = parts.LOG1M_C8
    for c in (parts.LOG1M_C7, parts.LOG1M_C6, parts.LOG1M_C5, parts.LOG1M_C4, parts.LOG1M_C3, parts.LOG1M_C2, rule.ONE):
        p = p * v + c
    e = np.where(u <= 0.75, -parts.LN2 * np.log2(u), v * p).astype(np.float32)
    return -parts.LN2 * np.log2(e)


def test_fast_noise_is_within_the_margin(uniforms_words):
    # the kernels compute the exact noise only for tokens whose fast score comes within FAST_MARGIN of
    # the best so far: the fast noise must stay far inside it (the GPU test checks the hardware log2)
    want = ref.gumbel(uniforms_words)
    err = np.abs(fast_gumbel_numpy(uniforms_words) - want).max()
    assert err < parts.FAST_MARGIN / 100, err
    dev = np.array([parts.fast_gumbel(r) for r in uniforms_words[::4099]], dtype=np.float32)
    assert np.abs(dev - want[::4099]).max() < parts.FAST_MARGIN / 100


# ----------------------------------------------------------------------------------------
# the rule on whole rows


@pytest.mark.parametrize("vocab", [97, 300, 64])
def test_cpu_version_equals_reference(vocab):
    rows = make_rows(1500, vocab, seed=vocab)
    assert unrestricted_argmax_misses(rows).sum() > 200            # the fallback path is well exercised
    want_t, want_lp = run_reference(rows)
    logits, st = tensors(rows)
    tokens, logprobs = sample(logits, st)
    assert tokens.dtype == torch.int32 and logprobs.dtype == torch.float32
    check_against_reference(tokens.numpy(), logprobs.numpy().astype(np.float64), want_t, want_lp, "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_version_half_logits(dtype):
    rows = make_rows(300, 128, seed=7)
    logits, st = tensors(rows, dtype)
    rows["logits"] = logits.float().numpy()
    want_t, want_lp = run_reference(rows)
    tokens, logprobs = sample(logits, st)
    check_against_reference(tokens.numpy(), logprobs.numpy().astype(np.float64), want_t, want_lp, str(dtype))


def sample_path(logits, *args, chunks=None, **options):
    """The journey's kernels by chunks: 0 -> v1 (one CTA per row), else v2 (the split path) with
    chunks CTAs per row (None: its plan). Arguments as sampling.sample_cuda's."""
    if chunks == 0:
        return journey.sample(logits, *args, version=1, **options)
    return journey.sample(logits, *args, version=2, chunks=chunks, **options)


# vocab, dtype, rows, chunks: V % 4 == 0 reads 16-byte (f32) or 8-byte (fp16/bf16) words, otherwise
# one element per load; chunks 0 is the one-CTA path. The simulator takes seconds per fallback row, so
# the default run takes one case of the split path (v2, the engine's); the one-CTA path (v1) runs in the
# slow set
SIM_CASES = [(96, torch.float32, 6, 3),
             pytest.param(98, torch.bfloat16, 4, 0, marks=pytest.mark.slow),
             pytest.param(97, torch.float32, 9, 7, marks=pytest.mark.slow),
             pytest.param(98, torch.bfloat16, 6, 5, marks=pytest.mark.slow),
             pytest.param(200, torch.float16, 12, 1, marks=pytest.mark.slow),
             pytest.param(128, torch.bfloat16, 12, 4, marks=pytest.mark.slow),
             pytest.param(97, torch.float32, 12, 0, marks=pytest.mark.slow),
             pytest.param(200, torch.float16, 12, 0, marks=pytest.mark.slow),
             pytest.param(128, torch.bfloat16, 12, 0, marks=pytest.mark.slow)]


@pytest.mark.parametrize("vocab,dtype,n,chunks", SIM_CASES)
def test_kernels_in_simulator_equal_reference(vocab, dtype, n, chunks):
    rows = make_rows(300, vocab, seed=vocab + 1)
    misses = unrestricted_argmax_misses(rows)
    # two thirds fallback rows (top_k, top_p, both; ties, -inf), the rest end in passes 1-3
    pick = np.concatenate([np.nonzero(misses)[0][: 2 * n // 3], np.nonzero(~misses)[0][: n - 2 * n // 3]])
    rows = {k: np.ascontiguousarray(v[pick]) for k, v in rows.items()}
    logits, st = tensors(rows, dtype)
    rows["logits"] = logits.float().numpy()
    want_t, want_lp = run_reference(rows)
    tokens, logprobs = torch.empty(n, dtype=torch.int32), torch.empty(n)
    sample_path(logits, st.temperature, st.top_k, st.top_p, st.seed, st.index, st.position, tokens,
                logprobs, **SIM, chunks=chunks)
    check_against_reference(tokens.numpy(), logprobs.numpy().astype(np.float64), want_t, want_lp, "kernels")


def tie_at_the_bound_row(vocab, position, i, a):
    """T = 1 logits where token i < a ties the raw argmax a's score exactly, and sits exactly at the
    split kernels' skip bound: fl(l_i + G_TOP) == s_a == fl(l_i + g_i) (l near 2**24, where floats are
    2 apart; seed 12345, index 0 and `position` give token i a noise above 15). The rule picks i (the
    lower index of a tie); a kernel that skipped tokens at the bound (> instead of >=) would pick a."""
    g = ref.gumbel(ref.noise_words(12345, 0, position, np.arange(vocab)))
    l = np.zeros(vocab, np.float32)
    l[a] = np.float32(2**24 + 64)
    s_a = l[a] + g[a]
    l[i] = s_a - np.float32(16)
    assert l[i] < l[a] and l[i] + ref.G_TOP == s_a and l[i] + g[i] == s_a, "not a tie at the bound"
    return l


@pytest.mark.filterwarnings("ignore:invalid value encountered")    # -inf - -inf in the all -inf row
@pytest.mark.parametrize("chunks", [3, pytest.param(0, marks=pytest.mark.slow)])
def test_kernel_boundary_cases_in_simulator(chunks):
    """A top-k boundary inside a group of ties (the index selection), top_k with top_p splitting the
    group, top_p taking the whole group, a row of -inf, an all-equal row; greedy ties in three chunks
    (the lowest index is not in the first); a Gumbel tie at the skip bound, in two chunks (rows 6, 7)."""
    vocab = 64
    tie_row = np.zeros(vocab, dtype=np.float32)
    tie_row[[3, 9, 17, 40, 41, 63]] = 2.0                        # six tied leaders, one group
    greedy_row = np.zeros(vocab, dtype=np.float32)
    greedy_row[[47, 23, 48]] = 3.0                                # chunks of 24 tokens: 0-23, 24-47, 48-63
    rows = dict(
        logits=np.stack([tie_row, tie_row, tie_row, np.full(vocab, -np.inf, np.float32),
                         np.zeros(vocab, np.float32), greedy_row, tie_at_the_bound_row(vocab, 2031, 7, 50),
                         tie_at_the_bound_row(vocab, 8117, 37, 50)]),
        temperature=np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0], np.float32),
        top_k=np.array([4, 5, 0, 3, 2, 0, 0, 0], np.int32),
        top_p=np.array([1.0, 0.3, 0.4, 0.5, 1.0, 1.0, 1.0, 1.0], np.float32),
        seed=np.array([0, 1, 2, 3, 4, 5, 12345, 12345], dtype=np.int64) * np.array([1_000_003] * 6 + [1, 1]),
        index=np.zeros(8, np.int32),
        position=np.array([0, 1, 2, 3, 4, 5, 2031, 8117], dtype=np.int32),
    )
    # draw positions until every row hits the fallback (the unrestricted argmax lies outside S)
    for r in range(3):
        while not unrestricted_argmax_misses({k: v[r:r + 1] for k, v in rows.items()})[0]:
            rows["position"][r] += 5
    want_t, want_lp = run_reference(rows)
    logits, st = tensors(rows)
    tokens, logprobs = torch.empty(8, dtype=torch.int32), torch.empty(8)
    sample_path(logits, st.temperature, st.top_k, st.top_p, st.seed, st.index, st.position, tokens,
                logprobs, **SIM, chunks=chunks)
    assert tokens.tolist() == want_t.tolist()
    assert tokens[3] == 0 and torch.isnan(logprobs[3])             # all -inf: token 0, logprob NaN
    assert tokens[4] in (0, 1)                                      # all equal, top_k 2: the lowest two
    assert tokens[5:].tolist() == [23, 7, 37]


def test_skip_bound_never_drops_the_winner():
    """The split kernels draw no noise for a token with fl(x_i + G_TOP) < s_a, the raw argmax a's
    score: such a token scores strictly below the winner (no tie either). On model-like rows (a few
    leaders ~20 above a randn floor) it skips > 99% of the tokens; on flat rows it skips nothing."""
    g = np.random.default_rng(4)
    vocab, ids = 4096, np.arange(4096)
    skipped = []
    for r in range(60):
        model_like = r % 2 == 0
        l = (g.standard_normal(vocab) * (2.0 if model_like else 1.0)).astype(np.float32)
        if model_like:
            l[g.choice(vocab, 10, replace=False)] = 20 + g.standard_normal(10).astype(np.float32)
        if r % 3 == 0:
            l = np.round(l)                                         # ties, also among the leaders
        x = ref.scaled_logits(l, ref.inverse_temperature(np.float32(0.8)))
        score = x + ref.gumbel(ref.noise_words(r, 0, 7, ids))
        a = int(np.argmax(x))
        skip = x + ref.G_TOP < score[a]
        assert not skip[score == score.max()].any()
        assert (score[skip] < score.max()).all()
        skipped.append(skip.mean())
    assert min(skipped[0::2]) > 0.99 and max(skipped[1::2]) < 0.01, skipped


def test_split_chunks():
    # N = 1: 64 CTAs per row; N = 8: 33 (264 in all); N >= 264: one; tiny rows: one group per thread
    assert [ks.split_chunks(n, 151936) for n in (1, 4, 8, 16, 256, 264, 1024)] == [64, 64, 33, 17, 2, 1, 1]
    assert ks.split_chunks(1, 96, threads=32) == 1 and ks.split_chunks(1, 4096, threads=32) == 32


# ----------------------------------------------------------------------------------------
# the distribution


def float64_distribution(logits, temperature, top_k, top_p):
    """softmax(logits / T) cut to top_k then the top_p nucleus, in float64, written independently of
    the rule's integer weights (a stable sort: ties rank by index)."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = order[:top_k] if 0 < top_k < len(x) else order
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = keep[before < top_p]
    out = np.zeros(len(x))
    out[keep] = np.exp(x[keep] - x[keep].max())
    return out / out.sum()


# logits with no top_p cut closer than 1e-3 to a cumulative mass: float64 and the rule agree on S
LOGITS_20 = np.array([3.1, 2.0, 1.7, 1.2, 1.1, 0.9, 0.4, 0.2, 0.0, -0.3,
                      -0.6, -0.8, -1.1, -1.5, -1.9, -2.2, -2.8, -3.3, -4.0, -5.0], dtype=np.float32)
DIST_CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 0, 0.9), (0.8, 8, 0.95), (2.0, 0, 0.5)]
DRAWS = 24_000


def chi2_pvalue(counts, probs):
    """Pearson chi-square p-value over the tokens with probability > 0 (upper regularized gamma)."""
    expected = probs[probs > 0] * counts.sum()
    stat = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    dof = (probs > 0).sum() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), stat


@pytest.mark.parametrize("temperature,top_k,top_p", DIST_CASES)
def test_draws_follow_the_exact_distribution(temperature, top_k, top_p):
    probs = float64_distribution(LOGITS_20, temperature, top_k, top_p)
    rule = ref.exact_distribution(LOGITS_20, temperature, top_k, top_p)
    assert np.array_equal(probs > 0, rule > 0), "the test logits sit too close to a nucleus boundary"
    logits = torch.from_numpy(LOGITS_20).expand(DRAWS, -1).contiguous()
    # one seed, a new position per draw: independent draws of one row
    st = SamplingTensors.from_params([SamplingParams(temperature=temperature, top_k=top_k or -1, top_p=top_p)] * DRAWS,
                                     [20240917] * DRAWS, [0] * DRAWS, list(range(DRAWS)))
    tokens, _ = sample(logits, st)
    counts = np.bincount(tokens.numpy(), minlength=len(LOGITS_20)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a token outside top_k / top_p was drawn"
    # fixed seed: the statistic is deterministic; 1e-4 leaves no room for flakiness and still catches
    # a wrong temperature (0.7 vs 0.8 on these logits gives p < 1e-30)
    p, stat = chi2_pvalue(counts, probs)
    assert p > 1e-4, f"chi-square {stat:.1f}, p = {p:.2e}: counts {counts.tolist()}"


def test_chi_square_detects_a_wrong_temperature():
    probs = float64_distribution(LOGITS_20, 0.8, 0, 1.0)
    logits = torch.from_numpy(LOGITS_20).expand(DRAWS, -1).contiguous()
    st = SamplingTensors.from_params([SamplingParams(temperature=0.7)] * DRAWS, [5] * DRAWS, [0] * DRAWS,
                                     list(range(DRAWS)))
    counts = np.bincount(sample(logits, st)[0].numpy(), minlength=len(LOGITS_20)).astype(np.float64)
    assert chi2_pvalue(counts, probs)[0] < 1e-6


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1e-6),
                                    SamplingParams(temperature=2.0, top_p=1e-6)])
def test_top_k_1_tiny_temperature_and_tiny_top_p_are_greedy(params):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3)) * 3     # no exact ties
    st = SamplingTensors.from_params([params] * 64, list(range(64)), [0] * 64, [0] * 64)
    tokens, logprobs = sample(logits, st)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(logprobs, logits.log_softmax(-1).gather(1, tokens.long()[:, None])[:, 0], atol=1e-6)


def test_greedy_ties_take_the_lowest_index():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [float("nan"), 2.0, 2.0, 2.0]])
    st = SamplingTensors.from_params([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0], [0, 0])
    assert sample(logits, st)[0].tolist() == [1, 1]


# ----------------------------------------------------------------------------------------
# reproducibility


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(24, 300, generator=g) * 2
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3), SamplingParams(temperature=0.6, top_p=0.5)] * 6
    seeds, indices, positions = [7 + i % 3 for i in range(24)], [i % 2 for i in range(24)], list(range(24))
    batch, _ = sample(logits, SamplingTensors.from_params(params, seeds, indices, positions))
    for i in (0, 5, 10, 23):
        alone, _ = sample(logits[i:i + 1], SamplingTensors.from_params(params[i:i + 1], seeds[i:i + 1],
                                                                       indices[i:i + 1], positions[i:i + 1]))
        assert int(alone[0]) == int(batch[i])
    # other positions, indices and seeds draw other numbers
    moved, _ = sample(logits, SamplingTensors.from_params(params, seeds, indices, [p + 1 for p in positions]))
    assert moved.tolist() != batch.tolist()


def test_kernel_in_simulator_is_batch_independent():
    rows = make_rows(3, 64, seed=5, ties=False)
    rows["temperature"][:] = 1.0
    rows["top_k"][:], rows["top_p"][:] = 0, 1.0
    logits, st = tensors(rows)
    both = torch.empty(3, dtype=torch.int32), torch.empty(3)
    ks.sample_cuda(logits, st.temperature, st.top_k, st.top_p, st.seed, st.index, st.position, *both, **SIM)
    one = torch.empty(1, dtype=torch.int32), torch.empty(1)
    r = 2
    ks.sample_cuda(logits[r:r + 1], st.temperature[r:r + 1], st.top_k[r:r + 1], st.top_p[r:r + 1],
                   st.seed[r:r + 1], st.index[r:r + 1], st.position[r:r + 1], *one, **SIM)
    cpu, _ = sample(logits, st)
    assert both[0].tolist() == cpu.tolist()
    assert int(one[0][0]) == int(both[0][r])


# ----------------------------------------------------------------------------------------
# the API


def test_from_params_builds_the_documented_tensors():
    params = [SamplingParams(temperature=0.5, top_k=20, top_p=0.9), SamplingParams()]
    st = SamplingTensors.from_params(params, [2**64 - 1, 12345], [0, 3], [7, 0])
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int32
    assert st.top_p.dtype == torch.float32 and st.seed.dtype == torch.int64
    assert st.index.dtype == torch.int32 and st.position.dtype == torch.int32
    assert st.top_k.tolist() == [20, -1] and st.seed.tolist() == [-1, 12345] and len(st) == 2
    with pytest.raises(ValueError, match="one seed"):
        SamplingTensors.from_params(params, [1], [0, 0], [0, 0])


def test_a_64_bit_key_uses_both_words():
    logits = torch.zeros(64, 1000)                                  # uniform: the noise alone decides
    params = [SamplingParams(temperature=1.0)] * 64
    lo = sample(logits, SamplingTensors.from_params(params, [5] * 64, [0] * 64, list(range(64))))[0]
    hi = sample(logits, SamplingTensors.from_params(params, [5 + (1 << 40)] * 64, [0] * 64, list(range(64))))[0]
    assert lo.tolist() != hi.tolist()
    key = 5 + (1 << 40)
    r = ref.noise_words(key, 0, 3, np.arange(1000))
    want = int(np.argmax(ref.gumbel(r)))
    assert int(hi[3]) == want


def test_sample_writes_the_given_buffers():
    logits = torch.randn(3, 50)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.7)] * 3, [1, 2, 3], [0] * 3, [0] * 3)
    tokens, logprobs = torch.full((3,), -1, dtype=torch.int32), torch.zeros(3)
    out = sample(logits, st, out_tokens=tokens, out_logprobs=logprobs)
    assert out[0] is tokens and out[1] is logprobs and tokens.min() >= 0
    empty = sample(logits[:0], SamplingTensors.from_params([], [], [], []))
    assert empty[0].shape == (0,)


def test_bad_arguments_are_named():
    from pagedattn.errors import KernelLaunchError

    logits = torch.randn(2, 10)
    st = SamplingTensors.from_params([SamplingParams()] * 2, [0, 0], [0, 0], [0, 0])
    with pytest.raises(KernelLaunchError, match="top_k"):
        sample(logits, SamplingTensors(st.temperature, st.top_k.long(), st.top_p, st.seed, st.index, st.position))
    with pytest.raises(KernelLaunchError, match="seed"):
        sample(logits, SamplingTensors(st.temperature, st.top_k, st.top_p, st.seed[:1], st.index, st.position))
    with pytest.raises(KernelLaunchError, match="logits"):
        sample(logits.double(), st)


# ----------------------------------------------------------------------------------------
# GPU: real shapes, against the CPU version, and inside a CUDA graph

# Qwen2's vocabulary (V % 4 == 0: 16-byte / 8-byte words) and odd sizes (element loads); chunks None:
# the default (the split path, 2 CTAs per row at N = 256), 0: the one-CTA path
GPU_CASES = [(torch.float32, 151936, None), (torch.float16, 151936, None), (torch.bfloat16, 151936, None),
             (torch.float32, 151935, None), (torch.bfloat16, 151934, None), (torch.float32, 151936, 0),
             (torch.bfloat16, 151934, 0)]


def real_batch(n=256, vocab=151936, seed=0):
    """Model-like logits (a few peaked leaders over a wide flat tail) and mixed parameters."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 2.5
    logits[:, :200] += torch.rand(n, 200, generator=g) * 15                  # leaders
    logits[::7] = torch.randn(len(range(0, n, 7)), vocab, generator=g)      # flat rows
    combos = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.8, top_p=0.95),
              dict(temperature=0.7, top_k=50), dict(temperature=1.0, top_k=40, top_p=0.9),
              dict(temperature=1.2, top_p=0.5), dict(temperature=0.8, top_k=4000)]
    combos = [SamplingParams(**c) for c in combos]
    params = [combos[i % len(combos)] for i in range(n)]
    st = SamplingTensors.from_params(params, [i * 7919 + 1 for i in range(n)], [i % 3 for i in range(n)],
                                     [(i * 37) % 500 for i in range(n)])
    return logits, st


def sample_gpu(logits, st, chunks=None):
    """The kernels on CUDA copies of logits [N, V] and st; chunks as in sample_path. Returns CPU
    (tokens, logprobs)."""
    fields = [getattr(st, f).cuda() for f in ("temperature", "top_k", "top_p", "seed", "index", "position")]
    n = logits.shape[0]
    tokens, logprobs = torch.empty(n, dtype=torch.int32, device="cuda"), torch.empty(n, device="cuda")
    sample_path(logits.cuda(), *fields, tokens, logprobs, chunks=chunks)
    return tokens.cpu(), logprobs.cpu()


def check_gpu_against_cpu(got_t, got_lp, want_t, want_lp, what=""):
    bad = (got_t != want_t).nonzero()[:, 0].tolist()
    assert not bad, f"{what} rows {bad[:10]}: gpu {got_t[bad[:10]].tolist()} cpu {want_t[bad[:10]].tolist()}"
    assert torch.allclose(got_lp, want_lp, atol=1e-4, rtol=0), what  # float32 logsumexp over 151936 terms


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,vocab,chunks", GPU_CASES, ids=str)
def test_gpu_real_shapes_equal_cpu(dtype, vocab, chunks):
    logits, st = real_batch()
    logits = logits[:, :vocab].contiguous().to(dtype)
    want_t, want_lp = sample(logits, st)
    check_gpu_against_cpu(*sample_gpu(logits, st, chunks), want_t, want_lp)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 151936), (torch.bfloat16, 151934)], ids=str)
def test_gpu_small_batches_equal_cpu(dtype, vocab):
    """The split path where it splits most: every row alone (N = 1: 64 CTAs per row), N = 3 (64) and
    N = 8 (33), each row's parameters from the mixed batch (greedy, T, top_p, top_k, both)."""
    logits, st = real_batch(n=16, seed=1)
    logits = logits[:, :vocab].contiguous().to(dtype)
    want_t, want_lp = sample(logits, st)
    for rows in [slice(r, r + 1) for r in range(16)] + [slice(0, 3), slice(8, 16)]:
        part = SamplingTensors(*(getattr(st, f)[rows].contiguous() for f in
                                 ("temperature", "top_k", "top_p", "seed", "index", "position")))
        check_gpu_against_cpu(*sample_gpu(logits[rows].contiguous(), part), want_t[rows], want_lp[rows], str(rows))


@pytest.mark.gpu
def test_gpu_noise_and_weights_bitwise_on_every_uniform():
    """On the device: the exact noise of all 2**23 uniforms == numpy bit for bit, the hardware-log2
    noise within FAST_MARGIN / 100 of it, det_exp == numpy bit for bit."""
    from numba import cuda

    gumbel, fast, det_exp = parts.GPU.gumbel, parts.fast_gumbel, parts.GPU.det_exp

    @cuda.jit
    def noise(words, exact, approx, d, e):
        i = cuda.grid(1)
        if i < words.shape[0]:
            exact[i] = gumbel(words[i])
            approx[i] = fast(words[i])
        if i < d.shape[0]:
            e[i] = det_exp(d[i])

    words = (np.arange(1 << 23, dtype=np.uint32) << np.uint32(9)) | np.uint32(0x1A5)
    d = -np.linspace(0, 28, 1 << 20).astype(np.float32)
    exact, approx = cuda.device_array(1 << 23, np.float32), cuda.device_array(1 << 23, np.float32)
    e = cuda.device_array(1 << 20, np.float32)
    noise[(1 << 23) // 256, 256](cuda.to_device(words), exact, approx, cuda.to_device(d), e)
    exact, approx, e = exact.copy_to_host(), approx.copy_to_host(), e.copy_to_host()
    want = ref.gumbel(words)
    assert np.array_equal(exact.view(np.uint32), want.view(np.uint32))
    assert np.abs(approx - exact).max() < parts.FAST_MARGIN / 100
    assert np.array_equal(e.view(np.uint32), ref.det_exp(d).view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 1, 8])
def test_gpu_sampling_replays_in_a_cuda_graph(n):
    if n == 64:
        logits, st = real_batch(n=64)
    else:                                                          # flat rows: every draw differs
        logits = torch.randn(n, 151936, generator=torch.Generator().manual_seed(n))
        params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_p=0.9)] * n
        st = SamplingTensors.from_params(params[:n], list(range(n)), [0] * n, [0] * n)
    logits, st = logits.cuda(), st.to("cuda")
    tokens = torch.zeros(n, dtype=torch.int32, device="cuda")
    logprobs = torch.zeros(n, device="cuda")
    sample(logits, st, tokens, logprobs)                           # compile and allocate before capture
    eager = tokens.clone()
    graph = capture_after_warmup(lambda: sample(logits, st, tokens, logprobs))
    for step in range(3):                                          # new positions, new draws, same rule
        st.position.add_(1)
        tokens.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want, _ = sample(logits.cpu(), st.to("cpu"))
        assert tokens.cpu().tolist() == want.tolist(), f"replay {step}"
    assert tokens.cpu().tolist() != eager.cpu().tolist()
