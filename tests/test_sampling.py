import pytest
import torch

from specdec import SamplingParams
from specdec.sampling import logits_to_probs, make_generator, sample


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_k_most_probable():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, False, True]
    expected = torch.softmax(torch.tensor([3.0, 2.5]), dim=-1)
    torch.testing.assert_close(probs[0, [1, 4]], expected)


def test_top_p_keeps_smallest_set_reaching_mass():
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = target.log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 + 0.3 reaches 0.8: the rest is removed and the kept mass renormalised.
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_top_p_always_keeps_the_best_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert probs[0].tolist() == [1.0, 0.0, 0.0]


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError, match="greedy"):
        logits_to_probs(torch.zeros(1, 3), SamplingParams(temperature=0.0))


def test_same_seed_same_samples():
    probs = torch.softmax(torch.randn(4, 50), dim=-1)
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    assert torch.equal(a, b) and a.shape == (4,) and a.dtype == torch.int64
