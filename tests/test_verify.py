"""Verifier oracles: exact analytic marginals, fast == slow reference, Monte Carlo."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from exact_laws import Synthetic, chain_step_law, target_sequences, worst_error
from specdec.verify import rejection_sample, residual_distribution, verify_greedy
from specdec.verify.reference import first_token_marginal, greedy_reference, rejection_reference


def _dist(generator, vocab_size, zeros=0):
    probs = torch.rand(vocab_size, generator=generator, dtype=torch.float64) ** 3
    if zeros:
        probs[torch.randperm(vocab_size, generator=generator)[:zeros]] = 0.0
    return probs / probs.sum()


def _draft_cases(vocab_size=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = _dist(g, vocab_size)
    yield "random", target, _dist(g, vocab_size)
    yield "identical", target, target.clone()
    disjoint_target = torch.zeros(vocab_size, dtype=torch.float64)
    disjoint_target[: vocab_size // 2] = _dist(g, vocab_size // 2)
    disjoint_draft = torch.zeros(vocab_size, dtype=torch.float64)
    disjoint_draft[vocab_size // 2 :] = _dist(g, vocab_size - vocab_size // 2)
    yield "disjoint support", disjoint_target, disjoint_draft
    point = torch.zeros(vocab_size, dtype=torch.float64)
    point[3] = 1.0
    yield "point mass", target, point
    yield "point mass off target support", _dist(g, vocab_size, zeros=4), point
    yield "sparse target (top-k)", _dist(g, vocab_size, zeros=8), _dist(g, vocab_size)


@pytest.mark.parametrize("case", list(_draft_cases()), ids=lambda c: c[0])
def test_rejection_marginal_equals_target_exactly(case):
    _, target, draft = case
    marginal = first_token_marginal(target, draft)
    torch.testing.assert_close(marginal, target, atol=1e-6, rtol=0)


CHAIN_DRAFTS = ["random", "identical", "peaked", "sparse-target", "disjoint"]


@pytest.mark.parametrize("mode", ["iid", "deterministic"])
@pytest.mark.parametrize("draft", CHAIN_DRAFTS)
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_step_law_equals_target_exactly(k, draft, mode):
    """The production ``rejection_sample``, integrated exactly over every draft, uniform and
    categorical draw: the first k + 1 tokens follow the target's joint law (float64)."""
    model = Synthetic(seed=11, draft=draft, vocab=4)
    got = chain_step_law(model, k, mode)
    assert worst_error(got, target_sequences(model, (), k + 1)) < 1e-9
    assert abs(sum(got.values()) - 1.0) < 1e-9


def _biased_acceptance(factor):
    """``rejection_sample`` whose acceptance test is ``u < factor * a`` (a planted bias)."""

    class Biased:
        def __init__(self, source):
            self.source = source

        def uniform(self, n, device):
            return self.source.uniform(n, device) / factor

        def categorical(self, probs):
            return self.source.categorical(probs)

    def verifier(ids, draft_probs, target_probs, source):
        return rejection_sample(ids, draft_probs, target_probs, Biased(source))

    return verifier


@pytest.mark.parametrize("factor", [0.98, 0.999])
@pytest.mark.parametrize("mode", ["iid", "deterministic"])
def test_exact_step_law_catches_a_small_acceptance_bias(factor, mode):
    """2% (and 0.1%) too many rejections is a lossy sampler; the exact law shows it."""
    model = Synthetic(seed=11, vocab=4)
    got = chain_step_law(model, 2, mode, verifier=_biased_acceptance(factor))
    assert worst_error(got, target_sequences(model, (), 3)) > 1e-5


def test_exact_step_law_catches_a_wrong_residual(monkeypatch):
    """Resampling from the target instead of the residual after a rejection is caught."""
    import specdec.verify.rejection as rejection

    monkeypatch.setattr(rejection, "residual_distribution", lambda target, draft: target)
    model = Synthetic(seed=11, vocab=4)
    assert worst_error(chain_step_law(model, 1, "iid"), target_sequences(model, (), 2)) > 1e-3


def test_marginal_oracle_detects_the_classic_bug():
    # Resampling from the target instead of the residual after a rejection is a common bug;
    # its marginal differs from the target, so the exact check above has power.
    from specdec.verify import acceptance_probability

    g = torch.Generator().manual_seed(1)
    target, draft = _dist(g, 10), _dist(g, 10)
    accepted_mass = draft * acceptance_probability(target, draft)
    buggy = accepted_mass + (1.0 - accepted_mass.sum()) * target
    assert (buggy - target).abs().max() > 1e-3


@given(k=st.integers(0, 6), seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_greedy_matches_reference(k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, 5, generator=g)
    argmax = logits.argmax(-1)
    # Drafts agree with the argmax up to a random point, then random.
    draft = torch.where(
        torch.rand(k, generator=g) < 0.7, argmax[:k], torch.randint(0, 5, (k,), generator=g)
    )
    fast = verify_greedy(draft, logits)
    slow = greedy_reference(draft.tolist(), logits)
    assert fast == slow
    assert len(fast.output_token_ids) == fast.num_accepted + 1


@given(k=st.integers(0, 5), seed=st.integers(0, 10_000), deterministic=st.booleans())
@settings(max_examples=80, deadline=None)
def test_rejection_matches_reference_under_same_generator(k, seed, deterministic):
    g = torch.Generator().manual_seed(seed)
    vocab_size = 7
    target = torch.softmax(2 * torch.randn(k + 1, vocab_size, generator=g), -1)
    draft_probs = torch.softmax(2 * torch.randn(k, vocab_size, generator=g), -1)
    draft = (
        torch.multinomial(draft_probs, 1, generator=g).view(-1)
        if k
        else torch.empty(0, dtype=torch.long)
    )
    probs = None if deterministic else draft_probs
    fast = rejection_sample(draft, probs, target, torch.Generator().manual_seed(seed + 1))
    slow = rejection_reference(
        draft.tolist(), probs, target, torch.Generator().manual_seed(seed + 1)
    )
    assert fast == slow


def test_point_mass_equals_explicit_one_hot():
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(4, 9, generator=g), -1)
    draft = torch.tensor([1, 4, 2])
    one_hot = torch.nn.functional.one_hot(draft, 9).float()
    for seed in range(50):
        a = rejection_sample(draft, None, target, torch.Generator().manual_seed(seed))
        b = rejection_sample(draft, one_hot, target, torch.Generator().manual_seed(seed))
        assert a == b


def test_residual_examples():
    target = torch.tensor([0.5, 0.3, 0.2])
    draft = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_distribution(target, draft), torch.tensor([1.0, 0.0, 0.0]))
    # No residual mass (target == draft): falls back to the target.
    torch.testing.assert_close(residual_distribution(target, target), target)


def test_rejection_sampler_monte_carlo_two_positions():
    """Empirical first output token of the real sampler matches the target (chi-square)."""
    g = torch.Generator().manual_seed(5)
    vocab_size = 6
    target = torch.softmax(torch.randn(3, vocab_size, generator=g), -1)
    draft_probs = torch.softmax(torch.randn(2, vocab_size, generator=g), -1)
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(vocab_size)
    n = 20_000
    for _ in range(n):
        draft = torch.multinomial(draft_probs, 1, generator=gen).view(-1)
        result = rejection_sample(draft, draft_probs, target, gen)
        counts[result.output_token_ids[0]] += 1
    assert chisquare(counts.numpy(), (target[0] * n).numpy()).pvalue > 1e-3
    # The same statistic flags the draft distribution as different from the target.
    assert chisquare(counts.numpy(), (draft_probs[0] * n).numpy()).pvalue < 1e-3


def test_all_accepted_gives_bonus_from_last_row():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    result = rejection_sample(torch.tensor([1, 2]), None, target, torch.Generator().manual_seed(0))
    assert result.num_accepted == 2 and result.output_token_ids == [1, 2, 0]


def test_zero_target_probability_is_always_rejected():
    target = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(20):
        result = rejection_sample(
            torch.tensor([0]), None, target, torch.Generator().manual_seed(seed)
        )
        assert result.num_accepted == 0 and result.output_token_ids[0] in (1, 2)
