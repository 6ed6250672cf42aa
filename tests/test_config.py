import pytest

from specdec import SamplingParams, SpeculativeConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": -1.0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": "x"}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
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


def test_vllm_spellings_of_nothing_are_accepted():
    """vLLM scripts pass ``stop=None``, ``stop_token_ids=None`` and ``top_k=-1`` (its
    defaults); each means what specdec's own default means."""
    params = SamplingParams(stop=None, stop_token_ids=None, top_k=-1, temperature=0.5)
    assert params == SamplingParams(temperature=0.5)
    assert params.stop == () and params.stop_token_ids == () and params.top_k == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "cerberus"}, "unknown drafter"),
        ({"method": "suffix@static:tree-8"}, "give them apart: --drafter suffix --tree static"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 65}, "from 1 to 64"),
        ({"method": "ngram:min_n=0"}, "min_n must be an integer >= 1"),
        ({"method": "ngram:min_n=3,max_n=2"}, "min_n <= max_n"),
        ({"method": "ngram", "options": {"min_n": 3, "max_n": 2}}, "min_n <= max_n"),
        ({"method": "ngram:min_n=x"}, "needs an integer"),
        ({"method": "ngram:size=2"}, "has no option 'size'"),
        ({"method": "ngram:min_n"}, "not key=value"),
        ({"method": "ngram:min_n=1", "options": {"max_n": 3}}, "not both"),
        ({"method": "suffix", "options": {"min_n": 1}}, "has no option 'min_n'"),
        ({"method": "suffix:global_cache=maybe"}, "needs true or false"),
        ({"method": "suffix:max_spec_factor=0"}, "max_spec_factor must be a number > 0"),
        ({"method": "recycling:top_k=0"}, "top_k must be an integer >= 1"),
        ({"method": "none", "tree": "static:tree-8"}, "needs a drafter"),
        ({"method": "suffix", "tree": "static:tree-8,draw=iid"}, "has none"),
        ({"method": "custom:x=1"}, "takes no options"),
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
