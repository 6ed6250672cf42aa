"""Statistical end-to-end oracle: sampled speculative output follows the target distribution.

The exact joint distribution of the first two generated tokens is computed from the tiny
target; seeded speculative runs must match it (chi-square), and a deliberately lossy
verifier must be caught by the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdec.engine.commit as engine
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.sampling import logits_to_probs, sample
from specdec.verify.result import VerifyResult

PROMPT = [1, 3, 4, 5, 3, 4, 5, 3, 4]  # repeated n-grams: the ngram drafter proposes "5 3 4"
PARAMS = dict(temperature=1.0, top_k=6)  # top-k makes some target probabilities exactly 0


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(x1, x2) = P(x1 | prompt) * P(x2 | prompt, x1) of the processed target distribution."""

    def next_probs(ids):
        logits = target.forward(ids, target.new_cache(len(ids)), num_logits=1)
        return logits_to_probs(logits, params)[0].double()

    first = next_probs(PROMPT)
    vocab = first.numel()
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x1 in range(vocab):
        if first[x1] > 0:
            joint[x1] = first[x1] * next_probs(PROMPT + [x1])
    return joint.numpy()


def empirical_joint(llm, params_kwargs, n, max_new_tokens):
    vocab = llm.target.vocab_size
    counts = np.zeros((vocab, vocab))
    for seed in range(n):
        params = SamplingParams(
            seed=seed, max_new_tokens=max_new_tokens, ignore_eos=True, **params_kwargs
        )
        ids = llm.generate(PROMPT, params).token_ids
        counts[ids[0], ids[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expected < 5 times are pooled into one."""
    n = counts.sum()
    expected = probs.ravel() * n
    observed = counts.ravel()
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was generated"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


# max_new_tokens=3 drafts 2 tokens in the first step (accept / recover at both positions);
# max_new_tokens=2 drafts 1 token, so the second token is the bonus when it is accepted.
CASES = [("draft-model", 3), ("draft-model", 2), ("ngram", 3), ("ngram", 2)]


@pytest.mark.parametrize("method, max_new_tokens", CASES)
def test_sampled_speculation_matches_target_distribution(small, method, max_new_tokens):
    target, draft = small
    llm = LLM(
        target, draft=draft, speculative=SpeculativeConfig(method=method, num_speculative_tokens=3)
    )
    joint = exact_joint(target, SamplingParams(**PARAMS))
    counts = empirical_joint(llm, PARAMS, 1500, max_new_tokens)
    assert chi_square_pvalue(counts, joint) > 1e-3


def _lossy_rejection_sample(draft_token_ids, draft_probs, target_probs, generator):
    """The classic bug: after a rejection, resample from the target, not the residual."""
    k = draft_token_ids.numel()
    for i in range(k):
        token = int(draft_token_ids[i])
        draft_p = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if float(torch.rand(1, generator=generator, device=generator.device)) >= min(
            1.0, float(target_probs[i, token]) / draft_p
        ):
            recovered = int(sample(target_probs[i : i + 1], generator))
            return VerifyResult(i, draft_token_ids[:i].tolist() + [recovered])
    bonus = int(sample(target_probs[k : k + 1], generator))
    return VerifyResult(k, draft_token_ids.tolist() + [bonus])


@pytest.mark.parametrize("method", ["draft-model", "ngram"])
def test_lossy_verifier_is_detected(small, monkeypatch, method):
    target, draft = small
    monkeypatch.setattr(engine, "rejection_sample", _lossy_rejection_sample)
    llm = LLM(
        target, draft=draft, speculative=SpeculativeConfig(method=method, num_speculative_tokens=3)
    )
    joint = exact_joint(target, SamplingParams(**PARAMS))
    counts = empirical_joint(llm, PARAMS, 1500, 3)
    assert chi_square_pvalue(counts, joint) < 1e-3
