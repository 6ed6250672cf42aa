"""Tree verifier oracles: exact output distributions, fast == slow reference, chain == tree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exact_laws import Synthetic, target_sequences, tree_step_law, worst_error
from specdec.trees import ROOT, TokenTree
from specdec.verify import rejection_sample, verify_greedy
from specdec.verify.reference import (
    sibling_outcome,
    tree_greedy_reference,
    tree_rejection_reference,
)
from specdec.verify.tree import SiblingRejection, verify_tree_greedy, verify_tree_sampling

SHAPES = [(1,), (3,), (1, 1, 1), (2, 1), (1, 2)]
DRAFTS = ["random", "identical", "peaked", "sparse-target", "disjoint"]


@pytest.mark.parametrize("mode", ["iid", "wor", "deterministic"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("draft", DRAFTS)
def test_tree_output_distribution_equals_target_exactly(mode, shape, draft):
    """The production verifier, integrated exactly over every draft tree, uniform and
    categorical draw, has the target's joint law (to float64 rounding)."""
    if draft == "disjoint" and mode == "wor" and max(shape) > 2:
        pytest.skip("the disjoint draft has 2 tokens: no 3 distinct children")
    model = Synthetic(seed=7, draft=draft, vocab=3)
    got = tree_step_law(model, shape, mode)
    want = target_sequences(model, (), len(shape) + 1)
    assert worst_error(got, want) < 1e-9
    assert abs(sum(got.values()) - 1.0) < 1e-9


@pytest.mark.parametrize("mode", ["wor", "deterministic"])
def test_bushy_tree_output_distribution_equals_target_exactly(mode):
    model = Synthetic(seed=5, vocab=3)
    assert worst_error(tree_step_law(model, (2, 2), mode), target_sequences(model, (), 3)) < 1e-9


class _BiasedUniforms:
    """A planted bias: the acceptance test becomes ``u < factor * a``."""

    def __init__(self, source, factor: float) -> None:
        self.source, self.factor = source, factor

    def uniform(self, n, device):
        return self.source.uniform(n, device) / self.factor

    def categorical(self, probs):
        return self.source.categorical(probs)


@pytest.mark.parametrize("factor", [0.98, 0.999])
def test_exact_oracle_detects_a_small_acceptance_bias(factor):
    model = Synthetic(seed=7, vocab=3)
    want = target_sequences(model, (), 3)
    got = tree_step_law(model, (2, 1), "iid", wrap=lambda s: _BiasedUniforms(s, factor))
    assert worst_error(got, want) > 1e-5
    assert abs(sum(got.values()) - 1.0) < 1e-9  # still a distribution, just the wrong one


def test_exact_oracle_detects_a_wrong_rule():
    """Planted bug: without-replacement children verified with the i.i.d. rule is lossy."""
    model = Synthetic(seed=3, vocab=4)
    got = tree_step_law(model, (3,), "wor", verify_without_replacement=False)
    assert worst_error(got, target_sequences(model, (), 2)) > 1e-3


def test_sibling_rejection_point_masses_sample_the_target():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    accept, residual = sibling_outcome(p, [3, 1], None, False)
    assert accept == pytest.approx([0.4, 0.2])
    torch.testing.assert_close(residual, torch.tensor([0.1, 0, 0.3, 0], dtype=torch.float64))
    rounds = SiblingRejection(p, [3, 1], None, False)
    assert rounds.accept_probability(0) == pytest.approx(0.4)


# ------------------------------------------------------------ fast == reference


@st.composite
def verify_cases(draw, mode: str):
    vocab = 8
    # at most vocab nodes: in "wor" mode one parent's children are distinct tokens, and a
    # parent may get every node (9 children of 8 tokens left nothing to draw)
    n = draw(st.integers(0, vocab))
    parents = [ROOT] + [draw(st.integers(ROOT, i - 1)) for i in range(1, n)] if n else []
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n + 1, vocab, generator=g) * 2
    target_probs = torch.softmax(logits, dim=-1)
    parent_rows = torch.softmax(torch.randn(n + 1, vocab, generator=g) * 2, dim=-1)
    tokens, rows = [], []
    used: dict[int, set] = {}
    for i, parent in enumerate(parents):
        q = parent_rows[parent + 1]
        if mode == "wor":
            taken = used.setdefault(parent, set())
            rest = q.clone()
            rest[list(taken)] = 0.0
            token = int(torch.multinomial(rest / rest.sum(), 1, generator=g))
            taken.add(token)
        elif mode == "greedy-match":  # often the target's argmax, to reach deep nodes
            token = (
                int(logits[parent + 1].argmax())
                if i % 3
                else int(torch.randint(vocab, (1,), generator=g))
            )
        else:
            token = int(torch.multinomial(q, 1, generator=g))
        tokens.append(token)
        rows.append(q)
    draft_probs = torch.stack(rows) if rows and mode in ("iid", "wor") else None
    tree = TokenTree(tuple(parents), tuple(tokens), draft_probs, without_replacement=mode == "wor")
    return tree, logits, target_probs, seed


@pytest.mark.parametrize("mode", ["iid", "wor", "deterministic"])
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_tree_sampling_fast_equals_reference(mode, data):
    tree, _, target_probs, seed = data.draw(verify_cases(mode))
    fast = verify_tree_sampling(tree, target_probs, torch.Generator().manual_seed(seed))
    slow = tree_rejection_reference(tree, target_probs, torch.Generator().manual_seed(seed))
    assert fast == slow
    assert fast.num_accepted == len(fast.accepted_nodes) == len(fast.output_token_ids) - 1
    assert fast.accepted_nodes == (
        tree.path_to(fast.accepted_nodes[-1]) if fast.accepted_nodes else []
    )


@given(data=st.data())
@settings(max_examples=100, deadline=None)
def test_tree_greedy_fast_equals_reference(data):
    tree, logits, _, _ = data.draw(verify_cases("greedy-match"))
    fast = verify_tree_greedy(tree, logits)
    assert fast == tree_greedy_reference(tree, logits)
    assert fast.output_token_ids[-1] == int(
        logits[(fast.accepted_nodes or [ROOT])[-1] + 1].argmax()
    )


def test_greedy_picks_the_deepest_matching_branch():
    # argmax after root: 1; after [1]: 2; after [1, 2]: 3. Two children carry token 1;
    # only the second continues with 2.
    tree = TokenTree.build([ROOT, ROOT, 1, 2], [1, 1, 2, 0])
    logits = torch.full((5, 4), -5.0)
    for row, best in enumerate([1, 0, 2, 3, 0]):  # rows: root, n0, n1, n2, n3
        logits[row, best] = 5.0
    result = verify_tree_greedy(tree, logits)
    assert result.accepted_nodes == [1, 2] and result.output_token_ids == [1, 2, 3]


# ------------------------------------------------------------ chain tree == chain


@pytest.mark.parametrize("seed", range(20))
def test_chain_tree_greedy_equals_chain_verification(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, generator=g)
    drafts = logits[:5].argmax(-1).clone()
    drafts[int(torch.randint(6, (1,), generator=g)) :] = 0  # mismatch somewhere (or not)
    chain = verify_greedy(drafts, logits)
    tree = verify_tree_greedy(TokenTree.chain(drafts.tolist()), logits)
    assert (tree.num_accepted, tree.output_token_ids) == (
        chain.num_accepted,
        chain.output_token_ids,
    )


@pytest.mark.parametrize("draft", ["random", "peaked", None])
def test_chain_tree_sampling_has_the_chain_law(draft):
    """Exact: a chain tree's output law equals chain rejection sampling's, sequence by
    sequence (both are the target's), and identical uniforms give identical decisions."""
    g = torch.Generator().manual_seed(11)
    k = 3
    target = torch.softmax(torch.randn(k + 1, 6, generator=g), -1)
    q = (
        None
        if draft is None
        else torch.softmax(torch.randn(k, 6, generator=g) * (3 if draft == "peaked" else 1), -1)
    )
    tokens = [int(torch.multinomial(target[i], 1, generator=g)) for i in range(k)]
    tree = TokenTree.chain(tokens, q)
    for seed in range(200):
        a = verify_tree_sampling(tree, target, torch.Generator().manual_seed(seed))
        b = rejection_sample(torch.tensor(tokens), q, target, torch.Generator().manual_seed(seed))
        assert a.num_accepted == b.num_accepted  # same uniforms, same accept decisions
        if a.num_accepted == k:
            assert a.output_token_ids[:k] == b.output_token_ids[:k]
