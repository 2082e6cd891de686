"""SamplingParams / BeamSearchParams validation and the sampler's behaviour.

Sampler checks: temperature 0 is exactly argmax; top_k=1 and a tiny top_p collapse to argmax; the
top-k / top-p masks keep exactly the tokens they should; a seeded generator reproduces its draws
whatever the other rows are; draws follow softmax(logits / T) (a chi-square test on 20k draws).
"""
import pytest
import torch

from pagedattn.engine.sequence import make_generator
from pagedattn.errors import InvalidRequestError
from pagedattn.layers.sampler import apply_top_k_top_p, sample
from pagedattn.sampling_params import BeamSearchParams, SamplingParams

BAD_SAMPLING = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(seed=-1), "seed"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
]
BAD_BEAM = [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
]


@pytest.mark.parametrize("kwargs,field", BAD_SAMPLING)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kwargs,field", BAD_BEAM)
def test_bad_beam_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        BeamSearchParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(5,))
    assert p.stop == ["###"] and p.stop_token_ids == [5] and p.n == 1 and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert BeamSearchParams(beam_width=4, max_tokens=16).length_penalty == 1.0


def logits_fixture(n=5, vocab=40, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    logits = logits_fixture()
    params = [SamplingParams(temperature=0.0)] * 5
    assert torch.equal(sample(logits, params, [None] * 5), logits.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_argmax(params):
    logits = logits_fixture()
    assert torch.equal(sample(logits, [params] * 5, [make_generator(i, 0) for i in range(5)]), logits.argmax(-1))


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([4, 2]), torch.tensor([0.7, 1.0]))
    keep = torch.isfinite(masked)
    # row 0: top_p 0.7 keeps 0.5 and 0.3 (mass before 0.15 is 0.8 >= 0.7); row 1: top_k 2 keeps 0.4, 0.3
    assert keep.tolist() == [[True, True, False, False], [False, False, True, True]]


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = logits_fixture(n=6)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [int(sample(logits[i:i + 1], [p], [make_generator(7, i)])[0]) for i in range(6)]
    batch = sample(logits, [p] * 6, [make_generator(7, i) for i in range(6)]).tolist()
    mixed_params = [p, SamplingParams(temperature=0.0)] * 3
    mixed_gens = [make_generator(7, i) if i % 2 == 0 else None for i in range(6)]
    mixed = sample(logits, mixed_params, mixed_gens).tolist()
    assert batch == alone
    assert [mixed[i] for i in (0, 2, 4)] == [alone[i] for i in (0, 2, 4)]


def test_draws_follow_the_softmax():
    vocab, n = 8, 20_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]])
    temperature = 0.7
    g = make_generator(123, 0)
    p = SamplingParams(temperature=temperature)
    draws = torch.cat([sample(logits.expand(1000, vocab), [p] * 1000, [g] * 1000) for _ in range(n // 1000)])
    counts = torch.bincount(draws, minlength=vocab).double()
    expected = (logits[0] / temperature).softmax(-1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, f"chi-square {chi2:.1f} (7 dof, p=0.001 threshold 24.3): counts {counts.tolist()}"
