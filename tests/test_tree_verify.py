"""Tree verifier oracles: exact output distributions, fast == slow reference, chain == tree."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.trees import ROOT, TokenTree
from specdec.verify import rejection_sample, verify_greedy
from specdec.verify.reference import (
    sibling_outcome,
    tree_greedy_reference,
    tree_rejection_reference,
)
from specdec.verify.tree import SiblingRejection, verify_tree_greedy, verify_tree_sampling

VOCAB = 4


class Synthetic:
    """Target and draft next-token tables keyed by context (float64), fixed by a seed."""

    def __init__(self, seed: int, draft: str = "random", vocab: int = VOCAB) -> None:
        self.seed, self.draft, self.vocab = seed, draft, vocab

    def _dist(self, ctx: tuple, salt: int, zeros: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, salt, ctx)) % 2**31)
        probs = torch.rand(self.vocab, generator=g, dtype=torch.float64) ** 2
        if zeros:
            probs[torch.randperm(self.vocab, generator=g)[:zeros]] = 0.0
        return probs / probs.sum()

    def p(self, ctx: tuple) -> torch.Tensor:
        return self._dist(ctx, 0, zeros=1 if self.draft == "sparse-target" else 0)

    def q(self, ctx: tuple) -> torch.Tensor:
        if self.draft == "identical":
            return self.p(ctx)
        if self.draft == "peaked":
            return (self._dist(ctx, 1) ** 4) / (self._dist(ctx, 1) ** 4).sum()
        return self._dist(ctx, 1)


def _draws(q: torch.Tensor, m: int, mode: str):
    """Every m-tuple of children with its probability under the drafting mode."""
    if mode == "deterministic":  # the m most probable draft tokens, point masses
        yield tuple(torch.argsort(q, descending=True)[:m].tolist()), 1.0
        return
    for combo in itertools.product(range(len(q)), repeat=m):
        if mode == "iid":
            yield combo, float(torch.prod(q[list(combo)]))
            continue
        if len(set(combo)) < m:
            continue
        prob, rest = 1.0, q.clone()
        for token in combo:  # sequential draws without replacement
            prob *= float(rest[token] / rest.sum())
            rest[token] = 0.0
        if prob > 0:
            yield combo, prob


def _target_sequences(model: Synthetic, ctx: tuple, length: int) -> dict:
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, prob in out.items():
            p = model.p(ctx + seq)
            for y in range(model.vocab):
                if p[y] > 0:
                    nxt[seq + (y,)] = prob * float(p[y])
        out = nxt
    return out


def exact_tree_output(model: Synthetic, shape: tuple[int, ...], mode: str) -> dict:
    """Exact law of the first ``len(shape) + 1`` tokens: one tree verification step, with
    plain target sampling after it ends. Node at depth d has ``shape[d]`` children."""

    @cache
    def outcome(ctx: tuple, depth: int) -> dict:
        remaining = len(shape) - depth  # tokens still to produce after this node's one
        p = model.p(ctx)
        result: dict = {}

        def add(prefix: tuple, dist: dict, weight: float) -> None:
            for seq, prob in dist.items():
                key = prefix + seq
                result[key] = result.get(key, 0.0) + weight * prob

        if depth == len(shape):  # leaf: bonus token from the target
            for y in range(model.vocab):
                if p[y] > 0:
                    add((y,), _target_sequences(model, ctx + (y,), remaining), float(p[y]))
            return result
        q = model.q(ctx)
        for children, prob in _draws(q, shape[depth], mode):
            rows = None if mode == "deterministic" else q.expand(len(children), -1)
            accept, residual = sibling_outcome(p, list(children), rows, mode == "wor")
            for token, a in zip(children, accept, strict=True):
                if a > 0:
                    add((token,), outcome(ctx + (token,), depth + 1), prob * a)
            for y in range(model.vocab):
                if residual[y] > 0:
                    tail = _target_sequences(model, ctx + (y,), remaining)
                    add((y,), tail, prob * float(residual[y]))
        return result

    return outcome((), 0)


SHAPES = [(1,), (3,), (1, 1, 1), (2, 2), (3, 1), (1, 3)]
DRAFTS = ["random", "identical", "peaked", "sparse-target"]


@pytest.mark.parametrize("mode", ["iid", "wor", "deterministic"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("draft", DRAFTS)
def test_tree_output_distribution_equals_target_exactly(mode, shape, draft):
    """Sum over all drafts and acceptance paths = the target's joint law, to 1e-6."""
    if mode == "wor" and max(shape) > VOCAB:
        pytest.skip("cannot draw more distinct children than tokens")
    model = Synthetic(seed=7, draft=draft)
    got = exact_tree_output(model, shape, mode)
    want = _target_sequences(model, (), len(shape) + 1)
    assert set(got) <= set(want) | {k for k, v in got.items() if v < 1e-12}
    worst = max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))
    assert worst < 1e-6, worst
    assert abs(sum(got.values()) - 1.0) < 1e-9


def test_exact_oracle_detects_a_wrong_rule():
    """Planted bug: without-replacement children verified with the i.i.d. rule is lossy."""
    model = Synthetic(seed=3)
    q = model.q(())
    p = model.p(())
    total = torch.zeros(VOCAB, dtype=torch.float64)
    for children, prob in _draws(q, 3, "wor"):
        accept, residual = sibling_outcome(p, list(children), q.expand(3, -1), False)
        for token, a in zip(children, accept, strict=True):
            total[token] += prob * a
        total += prob * residual
    assert (total - p).abs().max() > 1e-3


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
    n = draw(st.integers(0, 9))
    vocab = 8
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
