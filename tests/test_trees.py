"""TokenTree derivations, tree attention (branch equivalence) and KV compaction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.trees import ROOT, TokenTree

PROMPT = [1, 5, 9, 4, 7, 7, 3, 12, 8, 6]


@st.composite
def parent_arrays(draw, max_nodes: int = 12):
    """Random trees given in a shuffled order: (parents, tokens)."""
    n = draw(st.integers(0, max_nodes))
    canonical = [ROOT] + [draw(st.integers(ROOT, i - 1)) for i in range(1, n)]
    perm = draw(st.permutations(list(range(n))))  # perm[new] = canonical index
    where = {c: i for i, c in enumerate(perm)}
    parents = [ROOT if canonical[c] == ROOT else where[canonical[c]] for c in perm]
    tokens = [draw(st.integers(3, 31)) for _ in range(n)]
    return parents, tokens


def _ancestors(parents, node):
    out = []
    while node != ROOT:
        out.append(node)
        node = parents[node]
    return out


@given(parent_arrays())
@settings(max_examples=150, deadline=None)
def test_build_derives_consistent_structure(data):
    parents, tokens = data
    tree = TokenTree.build(parents, tokens)
    n = len(parents)
    assert tree.num_nodes == n and sorted(tree.order) == list(range(n))
    # flattened order: parents first, depths non-decreasing (breadth first)
    assert all(p == ROOT or p < i for i, p in enumerate(tree.parents))
    assert list(tree.depths) == sorted(tree.depths)
    for new, old in enumerate(tree.order):
        assert tree.token_ids[new] == tokens[old]
        old_parent = parents[old]
        new_parent = tree.parents[new]
        assert (old_parent == ROOT) == (new_parent == ROOT)
        if old_parent != ROOT:
            assert tree.order[new_parent] == old_parent
        assert tree.depths[new] == len(_ancestors(parents, old))
    mask = tree.attention_mask()
    for i in range(n):
        allowed = {0} | {a + 1 for a in _ancestors(list(tree.parents), i)}
        assert {j for j in range(n + 1) if mask[i + 1, j]} == allowed
    assert mask[0].tolist() == [True] + [False] * n
    assert tree.position_offsets().tolist() == [0, *tree.depths]
    leaves = [p[-1] for p in tree.paths()]
    assert leaves == [i for i in range(n) if i not in set(tree.parents)]
    for path in tree.paths():
        assert path[0] in tree.children(ROOT)
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:], strict=False))
    assert sum(len(tree.children(i)) for i in [ROOT, *range(n)]) == n


@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), max_size=6))
@settings(max_examples=100, deadline=None)
def test_from_sequences_is_a_trie_of_the_sequences(seqs):
    tree = TokenTree.from_sequences(seqs)
    spelled = {tuple(tree.token_ids[n] for n in tree.path_to(i)) for i in range(len(tree))}
    prefixes = {tuple(s[:j]) for s in seqs for j in range(1, len(s) + 1)}
    assert spelled == prefixes and len(tree) == len(prefixes)  # shared prefixes merged
    budgeted = TokenTree.from_sequences(seqs, budget=3)
    assert len(budgeted) == min(3, len(prefixes))


def test_chain_tree_is_a_path():
    tree = TokenTree.chain([4, 5, 6])
    assert tree.parents == (ROOT, 0, 1) and tree.depths == (1, 2, 3)
    assert tree.attention_mask().equal(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.paths() == [[0, 1, 2]]


@pytest.mark.parametrize(
    "parents",
    [[0], [1, 0], [ROOT, 5], [ROOT, -2]],
    ids=["self-loop", "cycle", "out-of-range", "negative"],
)
def test_invalid_parents_raise(parents):
    with pytest.raises(ValueError, match="parent|cycle"):
        TokenTree.build(parents, [3] * len(parents))


def test_other_bad_input_raises():
    with pytest.raises(ValueError, match="token ids"):
        TokenTree.build([ROOT, 0], [3])
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree(parents=(ROOT, 2, 0), token_ids=(3, 4, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        TokenTree.build([ROOT], [3], draft_probs=torch.ones(2, 4))


# ---------------------------------------------------------------- tree attention

TREES = {
    "chain": ([ROOT, 0, 1], [5, 6, 7]),
    "star": ([ROOT, ROOT, ROOT, ROOT], [5, 6, 7, 8]),
    "mixed": ([ROOT, ROOT, 0, 0, 1, 2, 2, 5], [5, 9, 6, 6, 10, 11, 12, 13]),
    "shuffled": ([3, ROOT, 1, ROOT, 0], [20, 21, 22, 23, 24]),
}


def _causal_logits(model, ids):
    cache = model.new_cache(len(ids))
    return model.forward(ids, cache)


@pytest.mark.parametrize("name", list(TREES))
def test_branch_equivalence_tiny(target, name):
    """Logits at every tree node equal a causal forward over its root-to-node path."""
    parents, tokens = TREES[name]
    tree = TokenTree.build(parents, tokens)
    cache = target.new_cache(4)  # grows during the tree forward
    target.forward(PROMPT[:-1], cache)
    logits = target.forward_tree(PROMPT[-1], tree, cache)
    assert logits.shape == (len(tree) + 1, target.vocab_size)
    root = _causal_logits(target, PROMPT)[-1]
    torch.testing.assert_close(logits[0], root, atol=1e-5, rtol=1e-5)
    for i in range(len(tree)):
        path = [tree.token_ids[n] for n in tree.path_to(i)]
        expected = _causal_logits(target, PROMPT + path)[-1]
        torch.testing.assert_close(logits[i + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixed", "shuffled"])
def test_compact_to_accepted_path_equals_recompute(target, name):
    """After compacting to a root-to-node path, the next forward equals a fresh prefill."""
    parents, tokens = TREES[name]
    tree = TokenTree.build(parents, tokens)
    for node in range(len(tree)):
        cache = target.new_cache(32)
        target.forward(PROMPT[:-1], cache)
        past = cache.num_tokens
        target.forward_tree(PROMPT[-1], tree, cache)
        path = tree.path_to(node)
        cache.compact([past + 1 + n for n in path], start=past + 1)
        assert cache.num_tokens == past + 1 + len(path)
        got = target.forward([31], cache)
        sequence = PROMPT + [tree.token_ids[n] for n in path] + [31]
        torch.testing.assert_close(
            got[-1], _causal_logits(target, sequence)[-1], atol=1e-5, rtol=1e-5
        )


def test_tree_forward_rejects_bad_mask(target):
    cache = target.new_cache(8)
    target.forward(PROMPT[:3], cache)
    with pytest.raises(ValueError, match="tree_mask"):
        target.forward([1, 2], cache, tree_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions"):
        target.forward([1, 2], cache, positions=[3])


def test_compact_start_bounds(target):
    cache = target.new_cache(8)
    target.forward(PROMPT[:5], cache)
    with pytest.raises(ValueError, match="lie in"):
        cache.compact([1], start=2)
    with pytest.raises(ValueError, match="start"):
        cache.compact([], start=9)
