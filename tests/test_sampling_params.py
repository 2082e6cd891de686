"""SamplingParams / BeamSearchParams validation: every bad value raises InvalidRequestError naming
its field; defaults and normalisation. The sampler that consumes the parameters (greedy, top_k,
top_p, seeds, the distribution it draws) is tested in tests/test_sampler.py.
"""
import pytest

from pagedattn.errors import InvalidRequestError
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
    # what the kernels cannot represent: int32 arrays, a 64-bit seed key, float32 values
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=-1.0), "top_k"),
    (dict(n=2**31), "n"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=10**400), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=7e-46), "top_p"),
    (dict(top_p=1e-40), "top_p"),
    (dict(stop=5), "stop"),
]
BAD_BEAM = [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2**31, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty"),
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


@pytest.mark.parametrize("t", [1e-6, 1e-38, 1e-45, 5e-324])
def test_a_temperature_below_the_greedy_threshold_is_greedy(t):
    p = SamplingParams(temperature=t)
    assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy


def test_validate_checks_a_changed_params_again():
    p = SamplingParams(top_k=5)
    p.top_k = 2**40
    with pytest.raises(InvalidRequestError, match="top_k"):
        p.validate()
