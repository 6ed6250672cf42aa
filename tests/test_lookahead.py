"""Lookahead decoding: the lookahead branch's mask and positions, one Jacobi iteration on
given logits, the n-gram pool, auxiliary rows in the engine (seen by nothing that is
verified, never cached), and the drafter conformance suite."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import DrafterConformance

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import AuxRows, DrafterBase, DraftProposal, VerificationFeedback
from specdec.drafters.lookahead import LookaheadDrafter, NgramPool, lookahead_mask
from specdec.drafters.options import LookaheadOptions
from specdec.engine import EngineConfig

GENERATOR = torch.Generator()


def test_every_lookahead_row_sees_one_causal_chain_of_consecutive_positions():
    levels, window = 3, 4
    offsets, mask = lookahead_mask(levels, window)
    for r in range(levels):
        for c in range(window):
            row = r * window + c
            seen = torch.nonzero(mask[row]).flatten().tolist()
            expected = list(range(c + 1)) + [a * window + c for a in range(1, r + 1)]
            assert seen == expected
            assert [offsets[i] for i in seen] == list(range(1, c + r + 2))  # 1, 2, ..., c+r+1


def test_one_jacobi_iteration_on_given_logits():
    options = LookaheadOptions(window=2, ngram=3, candidates=2)
    state = LookaheadDrafter(options).start([9, 10, 11, 12, 13], SamplingParams())
    assert state.rows == [[10, 11], [12, 13]]  # the prompt's last (N-1)*W tokens
    aux = state.aux_rows([9, 10, 11, 12, 13])
    assert aux.token_ids == [10, 11, 12, 13] and aux.position_offsets == [1, 2, 2, 3]
    logits = torch.zeros(4, 20)
    logits[2, 7] = logits[3, 8] = 1.0  # the last row's argmax: column 0 -> 7, column 1 -> 8
    feedback = VerificationFeedback([13], None, torch.zeros(1, 20), [0], [5], logits)
    state.observe(feedback)
    assert state.rows == [[12, 13], [7, 8]]
    assert state.pool.get(10, 5) == [(12, 7)] and state.pool.get(11, 5) == [(13, 8)]
    assert state.propose([1, 10], 4, GENERATOR).token_ids == [12, 7]
    assert state.propose([1, 10], 1, GENERATOR).token_ids == [12]
    assert state.propose([1, 99], 4, GENERATOR).token_ids == []


def test_pool_keeps_the_most_recent_ngrams_per_key():
    pool = NgramPool(per_key=2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 6, 7), (2, 3, 4)]:
        pool.add(gram)
    assert pool.get(1, 5) == [(6, 7), (4, 5)]
    pool.add((1, 4, 5))  # found again: most recent
    assert pool.get(1, 1) == [(4, 5)]


class AuxProbe(DrafterBase):
    """Drafts a fixed chain and adds junk auxiliary rows; records their logits."""

    observes = True
    max_aux_rows = 3

    def __init__(self):
        self.aux_logits = []

    def start(self, prompt_ids, params):
        return self

    def propose(self, token_ids, num_tokens, generator):
        return DraftProposal([5, 6][:num_tokens])

    def aux_rows(self, token_ids):
        mask = torch.ones(3, 3, dtype=torch.bool).tril()
        return AuxRows([30, 31, 29], [1, 2, 3], mask)

    def observe(self, feedback):
        self.aux_logits.append(feedback.aux_logits)


def test_aux_rows_change_nothing_verified_and_are_not_cached(target):
    probe = AuxProbe()
    spec = SpeculativeConfig(method="custom", num_speculative_tokens=2)
    llm = LLM(target, drafter=probe, speculative=spec)
    prompt = [1, 9, 4]
    out = llm.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    plain = llm.generate(
        prompt,
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        speculative=SpeculativeConfig(method="none"),
    )
    assert out.token_ids == plain.token_ids
    # the first step's auxiliary rows: a causal chain 30 31 29 right after the pending token
    ref = target.forward(prompt + [30, 31, 29], target.new_cache(8))[-3:]
    torch.testing.assert_close(probe.aux_logits[0], ref, atol=1e-5, rtol=1e-5)


def test_aux_rows_count_in_the_token_budget(target):
    drafter = LookaheadDrafter(LookaheadOptions(window=4, ngram=3))  # 8 auxiliary rows
    llm = LLM(target, drafter=drafter, speculative=SpeculativeConfig(method="custom"))
    llm.engine_config = EngineConfig(max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="8 rows to a verification"):
        llm.generate([1, 5, 6], SamplingParams(max_new_tokens=4))


def test_lookahead_finds_ngrams_on_its_own_output(target):
    llm = LLM(target, speculative=SpeculativeConfig(method="lookahead", num_speculative_tokens=3))
    prompt = [1, 20, 21, 22, 23, 24, 20, 21, 22]
    out = llm.generate(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert out.metrics.num_accepted_tokens > 0


class TestLookaheadConformance(DrafterConformance):
    spec = "lookahead"


class TestNarrowLookaheadConformance(DrafterConformance):
    spec = "lookahead:window=2,ngram=2,candidates=1"
    trees = ("dynamic:top_k=2,depth=4,budget=8",)
