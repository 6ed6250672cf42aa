"""Overlapped drafting (``draft-model:overlap=true``, PEARL's post-verify): background
drafts are used exactly when the sequence is what they assumed, outputs stay the
target's (the conformance suite, greedy and sampled), seeded sampling is reproducible,
and drafters that cannot run beside verification are refused."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import PROMPTS, DrafterConformance, hf_greedy
from test_cross_tokenizer import OracleCharDraft

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import DraftProposal
from specdec.drafters.overlap import OverlapDrafter
from specdec.drafters.recycling import RecyclingDrafter

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


class TestOverlapConformance(DrafterConformance):
    spec = "draft-model:overlap=true"
    draft_fixture = "near_draft"
    ks = (1, 4)

    @pytest.mark.parametrize("max_new_tokens", [3])  # one length: CI time (each ~15 s)
    def test_sampling_follows_the_target_distribution(self, request, small, max_new_tokens):
        super().test_sampling_follows_the_target_distribution(request, small, max_new_tokens)


def _llm(target, draft, k=4, spec="draft-model:overlap=true", **kw) -> LLM:
    config = SpeculativeConfig(method=spec, num_speculative_tokens=k, **kw)
    return LLM(target, draft=draft, speculative=config)


def test_background_drafts_are_used_when_everything_is_accepted(target):
    """The target as its own draft: every draft is accepted and the bonus guessed, so
    after the first step every draft comes from the background."""
    llm = _llm(target, target)
    out = llm.generate(PROMPTS[0], GREEDY)
    assert out.token_ids == hf_greedy(target, PROMPTS[0], 40)
    stats = llm.drafter(llm.speculative).stats
    assert stats["used"] >= out.metrics.num_steps - 2
    assert stats["discarded"] <= 1


def test_background_drafts_are_discarded_after_a_rejection(target, near_draft):
    llm = _llm(target, near_draft)
    sequential = _llm(target, near_draft, spec="draft-model")
    for prompt in PROMPTS:
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == hf_greedy(target, prompt, 40)
        alone = sequential.generate(prompt, GREEDY)
        # the same drafts (a background draft is the one the sequence would have made)
        assert out.metrics.num_accepted_tokens == alone.metrics.num_accepted_tokens
    stats = llm.drafter(llm.speculative).stats
    assert stats["used"] > 0 and stats["discarded"] > 0


def test_seeded_sampling_is_reproducible(target, near_draft):
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    first = _llm(target, near_draft).generate(PROMPTS[1], params).token_ids
    used = _llm(target, near_draft)
    used.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=0.8))
    assert used.generate(PROMPTS[1], params).token_ids == first


def test_overlap_with_another_tokenizer():
    target = make_model(make_tokenizer(), seed=0)
    llm = _llm(target, OracleCharDraft(target), k=4)
    for prompt in PROMPTS:
        assert llm.generate(prompt, GREEDY).token_ids == hf_greedy(target, prompt, 40)
    assert llm.drafter(llm.speculative).stats["used"] > 0


def test_refusals(target, near_draft):
    with pytest.raises(ValueError, match="learns from each verification"):
        OverlapDrafter(RecyclingDrafter(target.vocab_size))
    with pytest.raises(ValueError, match="overlap=true cannot draft token trees"):
        _llm(target, near_draft, tree="dynamic:top_k=2,depth=3,budget=6").generate([1, 5], GREEDY)
    with pytest.raises(ValueError, match="overlap_threads must be an integer >= 1"):
        SpeculativeConfig(method="draft-model:overlap=true,overlap_threads=0")
    with pytest.raises(ValueError, match="overlap_threads applies only with overlap=true"):
        SpeculativeConfig(method="draft-model:overlap_threads=2")


def test_close_waits_for_the_background_draft(target):
    """A sequence closed while its background draft runs closes its inner state only
    after that draft finished (no use of a closed draft cache)."""
    events = []

    class SlowInner:
        def start(self, prompt_ids, params):
            return self

        def propose(self, token_ids, num_tokens, generator):
            import time

            time.sleep(0.05)
            events.append("propose")
            return DraftProposal([5] * num_tokens)

        def close(self):
            events.append("close")

    drafter = OverlapDrafter(SlowInner())
    state = drafter.start([1, 5], GREEDY)
    state.propose([1, 5], 3, torch.Generator())
    state.close()
    assert events == ["propose", "propose", "close"]
