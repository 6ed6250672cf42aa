"""Block verification (Sun et al. 2024): the exact output law of one production step equals
the target's, it keeps at least as many tokens as token-wise rejection in expectation,
planted bugs are caught, and it runs end to end (greedy identity, sampled chi-square,
configuration and server)."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS
from test_statistical import PARAMS, chi_square_pvalue, empirical_joint, exact_joint

import specdec.verify.block as block
from exact_laws import Synthetic, _chain_draws, chain_step_law, target_sequences, worst_error
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.verify.block import block_verify
from specdec.verify.exact import exact_output_law
from specdec.verify.rejection import rejection_sample

DRAFTS = ["random", "identical", "peaked", "sparse-target", "disjoint"]


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("mode", ["iid", "deterministic"])
@pytest.mark.parametrize("k", [1, 2])
def test_block_verification_law_equals_the_target(draft, mode, k):
    for seed in range(2):
        model = Synthetic(seed, draft)
        got = chain_step_law(model, k, mode, verifier=block_verify)
        assert worst_error(got, target_sequences(model, (), k + 1)) < 1e-9


@pytest.mark.parametrize("draft", ["random", "peaked", "sparse-target"])
def test_block_verification_law_equals_the_target_three_deep(draft):
    """k = 3: the first length at which a later passing position can hide an earlier one
    twice over (the oracle's masked-breakpoint search is exercised)."""
    model = Synthetic(0, draft)
    got = chain_step_law(model, 3, "iid", verifier=block_verify)
    assert worst_error(got, target_sequences(model, (), 4)) < 1e-9


def _expected_kept(model: Synthetic, k: int, mode: str, verifier) -> float:
    """E[kept draft tokens] of one step, exactly (drafts summed, draws integrated)."""
    total = 0.0
    for drafts, prob in _chain_draws(model, k, mode):
        target = torch.stack([model.p(drafts[:i]) for i in range(k + 1)])
        q = (
            None
            if mode == "deterministic"
            else torch.stack([model.q(drafts[:i]) for i in range(k)])
        )
        ids = torch.tensor(drafts, dtype=torch.long)

        def run(source, ids=ids, q=q, target=target):
            return verifier(ids, q, target, source).num_accepted

        law = exact_output_law(run)
        total += prob * sum(n * w for n, w in law.items())
    return total


def test_block_keeps_at_least_as_many_tokens_as_token_wise_rejection():
    """The paper's Theorem 3, exactly: never fewer tokens in expectation, and more on some
    draft / target pairs (else the verifier would be pointless)."""
    gains = []
    for seed in range(3):
        for draft in ("random", "peaked"):
            model = Synthetic(seed, draft)
            tokenwise = _expected_kept(model, 3, "iid", rejection_sample)
            blockwise = _expected_kept(model, 3, "iid", block_verify)
            assert blockwise >= tokenwise - 1e-9
            gains.append(blockwise - tokenwise)
    assert max(gains) > 1e-3


def test_block_equals_token_wise_for_point_mass_drafts():
    """With deterministic drafts token-wise rejection already keeps the prefix X^i with
    probability p(X^i), the most any lossless verifier can: block verification gains
    nothing there (it pays with drafters that sample from a distribution)."""
    for seed in range(3):
        model = Synthetic(seed, "peaked")
        tokenwise = _expected_kept(model, 3, "deterministic", rejection_sample)
        blockwise = _expected_kept(model, 3, "deterministic", block_verify)
        assert abs(blockwise - tokenwise) < 1e-9


def test_planted_bug_unweighted_residual_is_caught(monkeypatch):
    """The residual after keeping tau tokens must weigh the target by w_tau; the ordinary
    residual (w = 1) breaks the law."""
    model = Synthetic(0, "random")
    real = block._residual
    monkeypatch.setattr(block, "_residual", lambda w, p, q: real(1.0, p, q))
    got = chain_step_law(model, 2, "iid", verifier=block_verify)
    assert worst_error(got, target_sequences(model, (), 3)) > 1e-4


def test_planted_bug_stop_probability_without_the_residual_ratio_is_caught(monkeypatch):
    """h_i = w_i at every position (the last position's rule everywhere) breaks the law."""
    model = Synthetic(2, "peaked")
    monkeypatch.setattr(block, "_stop_probability", lambda w, p, q: w)
    got = chain_step_law(model, 2, "iid", verifier=block_verify)
    assert worst_error(got, target_sequences(model, (), 3)) > 1e-4


def test_block_verifies_an_empty_draft_as_plain_sampling():
    target = torch.tensor([[0.2, 0.8]])
    law = exact_output_law(
        lambda s: tuple(
            block_verify(torch.tensor([], dtype=torch.long), None, target, s).output_token_ids
        )
    )
    assert law == pytest.approx({(0,): 0.2, (1,): 0.8})


@pytest.mark.parametrize("method, draft_name", [("ngram", None), ("draft-model", "near_draft")])
def test_greedy_with_block_verifier_equals_plain(request, target, method, draft_name):
    draft = request.getfixturevalue(draft_name) if draft_name else None
    spec = SpeculativeConfig(method, num_speculative_tokens=4, verifier="block")
    llm = LLM(target, draft=draft, speculative=spec)
    plain = LLM(target, speculative=SpeculativeConfig("none"))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in PROMPTS:
        assert llm.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


@pytest.mark.parametrize("method", ["draft-model", "ngram"])
def test_sampled_block_verification_matches_target_distribution(small, method):
    target, draft = small
    spec = SpeculativeConfig(method, num_speculative_tokens=3, verifier="block")
    llm = LLM(target, draft=draft, speculative=spec)
    joint = exact_joint(target, SamplingParams(**PARAMS))
    counts = empirical_joint(llm, PARAMS, 1500, 3)
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_verifier_configuration_is_checked():
    assert SpeculativeConfig("ngram", verifier="block").verifier == "block"
    with pytest.raises(ValueError, match="unknown verifier 'medusa'"):
        SpeculativeConfig("ngram", verifier="medusa")
    with pytest.raises(ValueError, match="verifies chains"):
        SpeculativeConfig("ngram", verifier="block", tree="static:tree-8")


def test_bench_method_option_selects_the_verifier():
    from specdec.bench.methods import parse_method

    method = parse_method("ngram:k=6,verifier=block")
    config = method.speculative_config()
    assert config.verifier == "block" and config.num_speculative_tokens == 6
    assert parse_method("ngram:k=6").settings != method.settings
