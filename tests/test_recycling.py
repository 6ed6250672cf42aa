"""Token Recycling: the adjacency table after given logits, drafting from it, the engine's
feedback, and the drafter conformance suite (plus ngram and draft-model, which predate
the suite)."""

from __future__ import annotations

import torch
from drafter_conformance import DrafterConformance

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import DrafterBase, DraftProposal, VerificationFeedback
from specdec.drafters.options import RecyclingOptions
from specdec.drafters.recycling import RecyclingDrafter, RecyclingTable
from specdec.trees.builders import make_tree_builder
from specdec.trees.spec import TreeSpec

GENERATOR = torch.Generator()


def test_table_after_given_logits():
    table = RecyclingTable(vocab_size=5, top_k=2)
    logits = torch.tensor(
        [
            [0.0, 1.0, 4.0, 3.0, 0.0],  # after token 4: 2 then 3
            [9.0, 0.0, 0.0, 0.0, 8.0],  # after token 2: 0 then 4
            [0.0, 0.0, 0.0, 5.0, 6.0],  # after token 4 again: 4 then 3 (overwrites)
        ]
    )
    table.update([4, 2, 4], logits)
    assert table.tokens.tolist() == [[-1, -1], [-1, -1], [0, 4], [-1, -1], [4, 3]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.allclose(table.probs[2], probs[1, [0, 4]])
    assert torch.allclose(table.probs[4], probs[2, [4, 3]])
    assert table.candidates(2, 1) == ([0], [float(probs[1, 0])])
    assert table.candidates(1, 2) == ([], [])
    assert table.chain(2, 5) == [0]  # 2 -> 0 is known, nothing after 0
    table.update([0], torch.tensor([[0.0, 0.0, 7.0, 0.0, 0.0]]))  # 0 -> 2: a cycle
    assert table.chain(2, 5) == [0, 2, 0, 2, 0]


def test_tree_session_is_a_bfs_over_the_table():
    table = RecyclingTable(vocab_size=6, top_k=3)
    table.update([1, 2, 3], torch.tensor([
        [0.0, 0.0, 5.0, 4.0, 0.0, 0.0],  # 1 -> 2, 3
        [0.0, 0.0, 0.0, 0.0, 5.0, 0.0],  # 2 -> 4
        [0.0, 0.0, 0.0, 0.0, 0.0, 5.0],  # 3 -> 5
    ]))  # fmt: skip
    drafter = RecyclingDrafter(6, RecyclingOptions(top_k=3))
    drafter.table = table
    state = drafter.start([1], SamplingParams())
    builder = make_tree_builder(TreeSpec.parse("dynamic:top_k=2,depth=2,budget=4"))
    tree = builder.build(state.tree_session([7, 1], SamplingParams()), 2, False, GENERATOR).tree
    paths = {tuple(tree.token_ids[n] for n in p) for p in tree.paths()}
    assert paths == {(2, 4), (3, 5)}


class FeedbackRecorder(DrafterBase):
    """Proposes a fixed chain and records every feedback."""

    observes = True

    def __init__(self, draft):
        self.draft, self.seen = draft, []

    def start(self, prompt_ids, params):
        return self

    def propose(self, token_ids, num_tokens, generator):
        return DraftProposal(self.draft[:num_tokens])

    def observe(self, feedback: VerificationFeedback):
        self.seen.append(feedback)


def test_engine_feedback_holds_the_verified_rows(target):
    recorder = FeedbackRecorder([5, 6, 7])
    llm = LLM(
        target,
        drafter=recorder,
        speculative=SpeculativeConfig(method="custom", num_speculative_tokens=3),
    )
    prompt = [1, 9, 4]
    out = llm.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    first = recorder.seen[0]
    assert first.input_ids == [4, 5, 6, 7] and first.parents is None
    assert first.target_logits.shape == (4, target.vocab_size)
    # row i predicts the token after input_ids[i]: the target's own logits for that context
    ref = target.forward(prompt + [5, 6, 7], target.new_cache(8))[-4:]
    torch.testing.assert_close(first.target_logits, ref, atol=1e-5, rtol=1e-5)
    accepted = first.num_accepted
    assert first.accepted_rows == list(range(accepted + 1))
    assert first.output_token_ids == out.token_ids[: accepted + 1]


def test_engine_feedback_for_a_tree(target):
    llm = LLM(target, speculative=SpeculativeConfig(method="recycling", tree="static:tree-8"))
    drafter = llm.drafter(llm.speculative)
    seen = []
    original = type(drafter.start([1], SamplingParams()))
    observe = original.observe

    def spy(self, feedback):
        seen.append(feedback)
        observe(self, feedback)

    original.observe = spy
    try:
        llm.generate([1, 5, 6, 5, 6, 5], SamplingParams(max_new_tokens=30, ignore_eos=True))
    finally:
        original.observe = observe
    trees = [f for f in seen if f.parents is not None]
    assert trees, "the table never drafted a tree"
    for f in trees:
        assert len(f.parents) == len(f.input_ids) - 1 == f.num_drafted
        assert f.accepted_rows[0] == 0
        for a, b in zip(f.accepted_rows[1:], f.accepted_rows[2:], strict=False):
            assert f.parents[b - 1] == a - 1  # each accepted node's parent is the previous


def test_shared_table_carries_across_requests_and_private_does_not(target):
    prompt = [1, 9, 4, 17]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    shared = LLM(target, speculative=SpeculativeConfig(method="recycling"))
    private = LLM(target, speculative=SpeculativeConfig(method="recycling:shared=false"))
    a1, a2 = shared.generate(prompt, params), shared.generate(prompt, params)
    b1, b2 = private.generate(prompt, params), private.generate(prompt, params)
    assert a1.token_ids == a2.token_ids == b1.token_ids == b2.token_ids
    assert a2.metrics.num_accepted_tokens > a1.metrics.num_accepted_tokens
    assert b2.metrics.num_accepted_tokens == b1.metrics.num_accepted_tokens


class TestRecyclingConformance(DrafterConformance):
    spec = "recycling"


class TestPrivateRecyclingConformance(DrafterConformance):
    spec = "recycling:shared=false,top_k=2"
    trees = ("dynamic:top_k=2,depth=4,budget=8",)


class TestNgramConformance(DrafterConformance):
    spec = "ngram:min_n=1,max_n=3"


class TestDraftModelConformance(DrafterConformance):
    spec = "draft-model"
    draft_fixture = "near_draft"
    ks = (1, 4)
