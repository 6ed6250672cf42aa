import pytest

from specdec import SamplingParams, SpeculativeConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": "x"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams(stop="END", stop_token_ids=[5])
    assert params.greedy and params.stop == ("END",) and params.stop_token_ids == (5,)
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "medusa"}, "unknown drafter"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"ngram_min": 0}, "ngram_min"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ],
)
def test_invalid_speculative_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_configs_are_frozen_and_hashable():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(AttributeError):
        config.num_speculative_tokens = 4
    assert {config: 1}[SpeculativeConfig(method="ngram", num_speculative_tokens=3)] == 1
