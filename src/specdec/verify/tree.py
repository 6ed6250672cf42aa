"""Tree verification: greedy path matching and lossless multi-draft rejection sampling.

Greedy: from the root, follow the child whose token is the target's argmax; stop where no
child matches and emit the argmax (a correction, or the bonus token after a leaf). The
output equals plain greedy decoding token for token.

Sampling: at each visited node the children are tried one after another with recursive
rejection sampling; a rejected child turns the target distribution into its residual,
and if every child is rejected a token is drawn from the last residual.

* i.i.d. children (SpecInfer, Miao et al. 2024, arXiv:2305.09781, Algorithm 2 "multi-step
  speculative sampling"): child ``i`` was drawn from its own draft distribution ``q_i``
  independently of its siblings. Accept with ``min(1, p(x_i) / q_i(x_i))``; on rejection
  ``p <- norm(max(0, p - q_i))``.
* children drawn *without replacement* from one draft distribution ``q`` (Recursive
  Speculative Decoding, Jeon et al. 2024, arXiv:2402.14160, RSD-C): as above, but the
  proposal of the next sibling is ``q`` with the earlier siblings removed and
  renormalised, ``q <- norm(q * [x != x_i])``, and that is what the residual subtracts.
  Lossless because each round is an ordinary rejection step for the current target
  against the distribution the next sibling was actually drawn from.
* deterministic children (``draft_probs is None``) are point masses: the rule becomes
  "sample from the target; descend if a child holds that token".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.sampling import (
    RandomSource,
    TokenHistory,
    as_random_source,
    dead_rows,
    greedy_ids,
    logits_to_probs,
    no_allowed_token,
    process_logits,
)
from specdec.trees.tree import ROOT, TokenTree
from specdec.verify.rejection import acceptance_probability, residual_distribution
from specdec.verify.result import VerifyResult


@dataclass
class TreeVerifyResult(VerifyResult):
    """A :class:`VerifyResult` plus the accepted path through the tree.

    Attributes:
        accepted_nodes: node indices (flattened order) of the accepted path, root excluded;
            ``len(accepted_nodes) == num_accepted``.
    """

    accepted_nodes: list[int] = field(default_factory=list)


class SiblingRejection:
    """Recursive rejection over the children of one node (used by the fast verifier and by
    the exact-distribution oracle, so the oracle checks the production math).

    Args:
        target_probs: ``[V]`` float target distribution at the parent.
        child_tokens: ``[m]`` the children's tokens, in the order they are tried.
        child_draft_probs: ``[m, V]`` the distribution each child was drawn from, or
            ``None`` (point masses).
        without_replacement: the children were drawn without replacement from
            ``child_draft_probs[0]`` (then each row must be that same distribution).

    Use: for ``i`` in order, :meth:`accept_probability` ``(i)``; if not accepted call
    :meth:`reject` ``(i)``; after every child is rejected, draw from :attr:`residual`.
    """

    def __init__(
        self,
        target_probs: torch.Tensor,
        child_tokens: list[int],
        child_draft_probs: torch.Tensor | None,
        without_replacement: bool,
    ) -> None:
        self.residual = target_probs
        self.child_tokens = child_tokens
        self.child_draft_probs = child_draft_probs
        self.without_replacement = without_replacement and child_draft_probs is not None
        self._proposal = child_draft_probs[0] if self.without_replacement else None

    def _draft_row(self, i: int) -> torch.Tensor:
        if self.child_draft_probs is None:
            row = torch.zeros_like(self.residual)
            row[self.child_tokens[i]] = 1.0
            return row
        if self.without_replacement:
            return self._proposal
        return self.child_draft_probs[i]

    def accept_probability(self, i: int) -> float:
        """``min(1, p(x_i) / q(x_i))`` for the current residual target and proposal."""
        token = self.child_tokens[i]
        if self.child_draft_probs is None:
            return float(self.residual[token])
        draft = self._draft_row(i)[token]
        return float(acceptance_probability(self.residual[token], draft))

    def reject(self, i: int) -> None:
        """Child ``i`` was rejected: move to the residual, and drop it from the proposal."""
        self.residual = residual_distribution(self.residual, self._draft_row(i))
        if self.without_replacement:
            proposal = self._proposal.clone()
            proposal[self.child_tokens[i]] = 0.0
            mass = proposal.sum()
            self._proposal = proposal / mass if mass > 0 else proposal


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> TreeVerifyResult:
    """Longest root-to-node path matching the target's argmax, plus one bonus/correction.

    Args:
        tree: the verified tree (N nodes).
        target_logits: ``[N + 1, V]`` logits of the tree forward (row 0 = root).

    Returns:
        :class:`TreeVerifyResult`: the deepest matching node (ties: first in flattened
        order), its path, and the target's argmax after it.
    """
    best = greedy_ids(target_logits).tolist()
    matched: list[bool] = []  # node i's path matches the argmax all the way down
    deepest = ROOT
    for i, (parent, token) in enumerate(zip(tree.parents, tree.token_ids, strict=True)):
        ok = (parent == ROOT or matched[parent]) and token == best[parent + 1]
        matched.append(ok)
        if ok and (deepest == ROOT or tree.depths[i] > tree.depths[deepest]):
            deepest = i
    path = [] if deepest == ROOT else tree.path_to(deepest)
    tokens = [tree.token_ids[n] for n in path]
    return TreeVerifyResult(len(path), tokens + [best[deepest + 1]], path)


def verify_tree_sampling(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | RandomSource
) -> TreeVerifyResult:
    """Lossless multi-draft verification of a token tree (see the module docstring).

    Args:
        tree: the tree; ``tree.draft_probs[i]`` is the distribution node ``i`` was drawn
            from (``None``: deterministic drafts); ``tree.without_replacement`` selects RSD.
        target_probs: ``[N + 1, V]`` float32 target distributions (after temperature,
            top-k, top-p); row 0 = root, row ``i + 1`` = node ``i``.
        generator: a ``torch.Generator`` (or a :class:`~specdec.sampling.RandomSource`);
            draws, in order: one uniform per child tried, then one categorical sample
            (recovered or bonus token).

    Returns:
        :class:`TreeVerifyResult`. The output follows the target distribution exactly.
    """
    source = as_random_source(generator)
    children = tree.children_lists()
    node, path = ROOT, []
    while True:
        kids = children[node + 1]
        row = target_probs[node + 1]
        nxt = None
        if kids:
            q = None if tree.draft_probs is None else tree.draft_probs[kids]
            rounds = SiblingRejection(
                row, [tree.token_ids[c] for c in kids], q, tree.without_replacement
            )
            for i, child in enumerate(kids):
                u = float(source.uniform(1, row.device))
                if u < rounds.accept_probability(i):
                    nxt = child
                    break
                rounds.reject(i)
            row = rounds.residual
        if nxt is None:
            last = int(source.categorical(row.unsqueeze(0)))
            tokens = [tree.token_ids[n] for n in path]
            return TreeVerifyResult(len(path), tokens + [last], path)
        path.append(nxt)
        node = nxt


def verify_tree(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    history: TokenHistory | None = None,
) -> TreeVerifyResult:
    """Greedy path matching at temperature 0, lossless multi-draft sampling otherwise,
    both on the processed target logits: each node's row gets
    :func:`~specdec.sampling.process_logits` with the committed ``history`` plus the
    tokens of its root-to-node path (the root's row: none).

    Args:
        tree: the step's draft tree (N nodes).
        target_logits: ``[N + 1, V]`` raw target logits (the root's row first, then the
            nodes in flattened order).
        history: the sequence's prompt and committed output (needed when
            ``params.needs_history``).

    Raises:
        NoAllowedToken: a row of the tree allows no token (its transforms exclude all).
    """
    if params.transforms_logits:
        prefixes = [()] + [
            tuple(tree.token_ids[m] for m in tree.path_to(n)) for n in range(len(tree))
        ]
        target_logits = process_logits(target_logits, params, history, prefixes)
        if dead_rows(target_logits):  # stricter than chains: any dead end in the tree
            raise no_allowed_token(history, params)
    if params.greedy:
        return verify_tree_greedy(tree, target_logits)
    return verify_tree_sampling(tree, logits_to_probs(target_logits, params), generator)
