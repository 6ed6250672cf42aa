"""Sequoia: the tree shape that maximises expected accepted tokens for a node budget.

Source: Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative
Decoding" (arXiv:2402.12374), §3.1. Under the *positional acceptance* assumption the
child of rank ``r`` (the draft's r-th most probable token at its parent) is the accepted
one with probability ``p[r]``, independently of where it sits. A node's contribution is
then the product of ``p`` over the ranks on its root path, a tree's value is the sum of its
nodes' contributions, and the best tree for a node budget follows from a dynamic program
over (subtree size, first free child rank, depth).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

RankPath = tuple[int, ...]


def sequoia_tree(
    acceptance: Sequence[float], budget: int, max_depth: int
) -> tuple[float, list[RankPath]]:
    """Optimal tree shape as rank paths (Medusa "choices" style).

    Args:
        acceptance: ``[R]`` probabilities ``p[r]`` that the rank-``r`` child is accepted
            (each in [0, 1]; ranks >= R are never used).
        budget: draft nodes (the root, i.e. the pending token, not counted), >= 0.
        max_depth: deepest draft level allowed (>= 1).

    Returns:
        ``(value, paths)``: ``value`` = expected tokens per step (accepted draft tokens plus
        the bonus token) and the tree as rank paths, e.g. ``[(0,), (1,), (0, 0)]``, sorted
        by length then lexicographically. Every prefix of a path is in the list.

    Raises:
        ValueError: on a probability outside [0, 1] or a negative budget / depth < 1.

    Example:
        >>> value, paths = sequoia_tree([0.6, 0.2], budget=3, max_depth=3)
        >>> paths, round(value, 3)
        ([(0,), (0, 0), (0, 0, 0)], 2.176)
    """
    probs = tuple(float(p) for p in acceptance)
    if any(not 0.0 <= p <= 1.0 for p in probs):
        raise ValueError(f"acceptance probabilities must lie in [0, 1], got {probs}")
    if budget < 0 or max_depth < 1:
        raise ValueError(f"need budget >= 0 and max_depth >= 1, got {budget} and {max_depth}")
    num_ranks = len(probs)

    @cache
    def subtree(size: int, depth: int) -> tuple[float, tuple]:
        """Best value of a subtree of ``size`` nodes (its root included) and ``depth`` levels
        (its root's level included); returns (value, children as ((rank, subtree), ...))."""
        if size == 1 or depth == 1:
            return (1.0, ()) if size == 1 else (-math.inf, ())
        value, kids = children(size - 1, 0, depth - 1)
        return 1.0 + value, kids

    @cache
    def children(size: int, rank: int, depth: int) -> tuple[float, tuple]:
        """Best value of ``size`` nodes spread over children of ranks rank, rank+1, ...
        (contiguous: a rank is used only if every better rank is)."""
        if size == 0:
            return 0.0, ()
        if rank >= num_ranks:
            return -math.inf, ()
        best: tuple[float, tuple] = (-math.inf, ())
        for own in range(1, size + 1):
            sub_value, sub_kids = subtree(own, depth)
            rest_value, rest_kids = children(size - own, rank + 1, depth)
            value = probs[rank] * sub_value + rest_value
            if value > best[0] + 1e-12:
                best = (value, ((rank, sub_kids), *rest_kids))
        return best

    # Fewer nodes than the budget can be optimal only if extra nodes have nowhere to go
    # (all ranks used up to the depth); take the best size <= budget.
    best_value, best_kids = 1.0, ()
    for size in range(budget, -1, -1):
        value, kids = children(size, 0, max_depth)
        if value > -math.inf:
            best_value, best_kids = 1.0 + value, kids
            break
    paths: list[RankPath] = []

    def walk(prefix: RankPath, kids: tuple) -> None:
        for rank, sub in kids:
            path = (*prefix, rank)
            paths.append(path)
            walk(path, sub)

    walk((), best_kids)
    return best_value, sorted(paths, key=lambda p: (len(p), p))


def tree_value(acceptance: Sequence[float], paths: Sequence[RankPath]) -> float:
    """Expected tokens per step of a rank-path tree under positional acceptance (+1 bonus)."""
    total = 1.0
    for path in paths:
        value = 1.0
        for rank in path:
            value *= acceptance[rank] if rank < len(acceptance) else 0.0
        total += value
    return total


class RankAcceptance:
    """Measured per-rank acceptance of one drafter (Sequoia's positional acceptance vector).

    Each observation is one verified context: the rank of the token the target chose among
    the draft's top ``num_ranks`` candidates there, or a miss. Estimates are smoothed
    toward a geometric prior (``prior_weight`` pseudo-observations) so the first steps
    still get a sensible tree.

    Args:
        num_ranks: candidate ranks tracked (R).
        prior: ``[R]`` prior acceptance per rank (default ``0.5 ** (r + 1)``).
        prior_weight: pseudo-observations behind the prior.
    """

    def __init__(
        self, num_ranks: int = 8, prior: Sequence[float] | None = None, prior_weight: float = 8.0
    ) -> None:
        self.num_ranks = num_ranks
        self.prior = (
            list(prior) if prior is not None else [0.5 ** (r + 1) for r in range(num_ranks)]
        )
        self.prior_weight = prior_weight
        self.hits = [0] * num_ranks
        self.total = 0

    def observe(self, rank: int | None) -> None:
        """One verified context; ``rank`` of the target's token, or ``None`` (not in top R)."""
        self.total += 1
        if rank is not None and 0 <= rank < self.num_ranks:
            self.hits[rank] += 1

    def estimate(self) -> list[float]:
        """``[R]`` smoothed acceptance probability per rank."""
        w = self.prior_weight
        return [(h + w * p) / (self.total + w) for h, p in zip(self.hits, self.prior, strict=True)]
