"""Exact output laws of one verification step, computed by running the production verifiers
under :func:`specdec.verify.exact.exact_output_law` (every uniform and categorical draw
integrated exactly) and summing over every possible draft.

A step's output (accepted tokens + one recovered or bonus token) has a variable length, so
each outcome is extended with plain target sampling to a fixed length; lossless means the
result equals the target's own joint law of that many tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from specdec.trees.tree import ROOT, TokenTree
from specdec.verify.exact import exact_output_law
from specdec.verify.rejection import rejection_sample
from specdec.verify.tree import verify_tree_sampling


class Synthetic:
    """Target and draft next-token tables keyed by context (float64), fixed by a seed.

    ``draft``: ``random``, ``identical`` (draft = target), ``peaked`` (a sharpened random
    draft), ``sparse-target`` (one target token per context has probability 0) or
    ``disjoint`` (the draft's mass sits on tokens the target never produces).
    """

    def __init__(self, seed: int, draft: str = "random", vocab: int = 4) -> None:
        self.seed, self.draft, self.vocab = seed, draft, vocab

    def _dist(self, ctx: tuple, salt: int, zeros: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, salt, ctx)) % 2**31)
        probs = torch.rand(self.vocab, generator=g, dtype=torch.float64) ** 2
        if zeros:
            probs[torch.randperm(self.vocab, generator=g)[:zeros]] = 0.0
        return probs / probs.sum()

    def p(self, ctx: tuple) -> torch.Tensor:
        if self.draft == "disjoint":
            probs = self._dist(ctx, 0)
            probs[self.vocab // 2 :] = 0.0
            return probs / probs.sum()
        return self._dist(ctx, 0, zeros=1 if self.draft == "sparse-target" else 0)

    def q(self, ctx: tuple) -> torch.Tensor:
        if self.draft == "identical":
            return self.p(ctx)
        if self.draft == "peaked":
            return (self._dist(ctx, 1) ** 4) / (self._dist(ctx, 1) ** 4).sum()
        if self.draft == "disjoint":
            probs = self._dist(ctx, 1)
            probs[: self.vocab // 2] = 0.0
            return probs / probs.sum()
        return self._dist(ctx, 1)


def draws(q: torch.Tensor, m: int, mode: str):
    """Every m-tuple of children with its probability under the drafting mode
    (``iid``, ``wor`` = without replacement, ``deterministic`` = the m most probable)."""
    if mode == "deterministic":
        yield tuple(torch.argsort(q, descending=True)[:m].tolist()), 1.0
        return
    for combo in itertools.product(range(len(q)), repeat=m):
        if mode == "iid":
            prob = float(torch.prod(q[list(combo)]))
            if prob > 0:
                yield combo, prob
            continue
        if len(set(combo)) < m:
            continue
        prob, rest = 1.0, q.clone()
        for token in combo:  # sequential draws without replacement
            prob *= float(rest[token] / rest.sum())
            rest[token] = 0.0
        if prob > 0:
            yield combo, prob


def target_sequences(model: Synthetic, ctx: tuple, length: int) -> dict:
    """The target's exact joint law of the next ``length`` tokens after ``ctx``."""
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


def _extend(model: Synthetic, law: dict, length: int, weight: float, into: dict) -> None:
    """Add ``weight *`` (step law, each outcome completed by target sampling) to ``into``."""
    for prefix, prob in law.items():
        for tail, tail_prob in target_sequences(model, prefix, length - len(prefix)).items():
            key = prefix + tail
            into[key] = into.get(key, 0.0) + weight * prob * tail_prob


def chain_step_law(model: Synthetic, k: int, mode: str, verifier=rejection_sample) -> dict:
    """Law of the first ``k + 1`` tokens: k drafts (sampled autoregressively from the draft,
    or its greedy chain as point masses for ``mode="deterministic"``), one production
    ``verifier`` step under exact integration, then plain target sampling."""
    total: dict = {}
    for drafts, prob in _chain_draws(model, k, mode):
        target_probs = torch.stack([model.p(drafts[:i]) for i in range(k + 1)])
        draft_probs = (
            None
            if mode == "deterministic"
            else torch.stack([model.q(drafts[:i]) for i in range(k)])
        )
        ids = torch.tensor(drafts, dtype=torch.long)

        def run(source, ids=ids, draft_probs=draft_probs, target_probs=target_probs):
            return tuple(verifier(ids, draft_probs, target_probs, source).output_token_ids)

        _extend(model, exact_output_law(run), k + 1, prob, total)
    return total


def _chain_draws(model: Synthetic, k: int, mode: str):
    seqs = {(): 1.0}
    for _ in range(k):
        nxt = {}
        for seq, prob in seqs.items():
            for (token,), p in draws(model.q(seq), 1, mode):
                nxt[seq + (token,)] = prob * p
        seqs = nxt
    return seqs.items()


def tree_step_law(
    model: Synthetic,
    shape: tuple[int, ...],
    mode: str,
    wrap: Callable | None = None,
    verify_without_replacement: bool | None = None,
) -> dict:
    """Law of the first ``len(shape) + 1`` tokens: a full tree (a node at depth d has
    ``shape[d]`` children drawn from the draft at its context), one production
    ``verify_tree_sampling`` step under exact integration, then plain target sampling.
    To plant bugs: ``wrap(source)`` may replace the random source, and
    ``verify_without_replacement`` overrides the rule the tree is verified with."""
    if verify_without_replacement is None:
        verify_without_replacement = mode == "wor"
    total: dict = {}
    for nodes, prob in _subtrees(model, shape, mode, (), 0):
        parents = [ROOT if parent < 0 else parent for parent, _, _ in nodes]
        tokens = [token for _, token, _ in nodes]
        rows = None if mode == "deterministic" else torch.stack([q for _, _, q in nodes])
        tree = TokenTree.build(
            parents, tokens, rows, without_replacement=verify_without_replacement
        )
        contexts = [()] + [
            tuple(tree.token_ids[n] for n in tree.path_to(i)) for i in range(len(tree))
        ]
        target_probs = torch.stack([model.p(ctx) for ctx in contexts])

        def run(source, tree=tree, target_probs=target_probs):
            source = wrap(source) if wrap else source
            return tuple(verify_tree_sampling(tree, target_probs, source).output_token_ids)

        _extend(model, exact_output_law(run), len(shape) + 1, prob, total)
    return total


def _subtrees(model: Synthetic, shape, mode: str, ctx: tuple, depth: int):
    """Every drafted subtree below ``ctx``: ``(nodes, prob)``, nodes as ``(parent, token,
    draft row)`` with parent -1 for a child of the subtree's root (indices local)."""
    if depth == len(shape):
        yield [], 1.0
        return
    q = model.q(ctx)
    for combo, prob in draws(q, shape[depth], mode):
        below = [list(_subtrees(model, shape, mode, ctx + (c,), depth + 1)) for c in combo]
        for choice in itertools.product(*below):
            nodes, weight = [], prob
            for token, (sub, sub_prob) in zip(combo, choice, strict=True):
                me = len(nodes)
                nodes.append((-1, token, q))
                offset = len(nodes)
                nodes += [(me if p < 0 else p + offset, t, r) for p, t, r in sub]
                weight *= sub_prob
            yield nodes, weight


def worst_error(got: dict, want: dict) -> float:
    """Largest absolute difference between two laws over the union of their outcomes."""
    return max(abs(got.get(key, 0.0) - want.get(key, 0.0)) for key in set(got) | set(want))
