"""Prompt-lookup (n-gram) drafting: copy what followed an earlier occurrence of the suffix.

Source: Saxena, "Prompt Lookup Decoding" (2023), and the n-gram drafter of vLLM; the same
idea as transformers' ``prompt_lookup_num_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT


def find_ngram_continuation(
    token_ids: np.ndarray, min_n: int, max_n: int, num_tokens: int
) -> np.ndarray:
    """Tokens that followed the earliest earlier occurrence of the longest matching suffix.

    Tries n = max_n, ..., min_n: the last n tokens are searched for in ``token_ids`` (the
    suffix itself excluded); at the first n with a match, returns up to ``num_tokens``
    tokens that followed its earliest occurrence.

    Args:
        token_ids: ``[L]`` int64 sequence (prompt + output so far).
        min_n, max_n: n-gram sizes, 1 <= min_n <= max_n.
        num_tokens: most tokens to return (>= 0).

    Returns:
        ``[m]`` int64, ``0 <= m <= num_tokens`` (empty when nothing matches).

    Example:
        >>> find_ngram_continuation(np.array([5, 6, 7, 8, 5, 6]), 1, 3, 2).tolist()
        [7, 8]
    """
    length = len(token_ids)
    if num_tokens <= 0:
        return token_ids[:0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        windows = sliding_window_view(token_ids[: length - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return token_ids[start : start + num_tokens]
    return token_ids[:0]


def ngram_candidates(
    token_ids: np.ndarray, min_n: int, max_n: int, width: int
) -> tuple[list[int], list[float]]:
    """Distinct tokens that followed earlier occurrences of the context's suffix.

    For n = max_n, ..., min_n, the token after every earlier occurrence of the last n
    tokens is a candidate. Longer matches rank first (they are more specific); within one
    n, by count, ties by earliest occurrence; a token already ranked by a longer match is
    not repeated. A candidate's score is its count's share among the candidates of its n,
    scaled so that each shorter n shares what the longer matches left over:
    ``score = share_n * (1/2) ** (number of longer n that matched)``.

    Args:
        token_ids: ``[L]`` int64 sequence.
        min_n, max_n: n-gram sizes.
        width: most candidates returned.

    Returns:
        ``(tokens, scores)``, each of length <= ``width`` (empty when nothing matches).

    Example:
        >>> ngram_candidates(np.array([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]), 2, 2, 3)
        ([3, 4], [0.6666666666666666, 0.3333333333333333])
    """
    length = len(token_ids)
    tokens: list[int] = []
    scores: list[float] = []
    weight = 1.0
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if len(tokens) >= width:
            break
        suffix = token_ids[length - n :]
        windows = sliding_window_view(token_ids[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if not hits.size:
            continue
        following = token_ids[hits + n]
        found, first, counts = np.unique(following, return_index=True, return_counts=True)
        total = float(counts.sum())
        for i in np.lexsort((first, -counts)):
            token = int(found[i])
            if token not in tokens and len(tokens) < width:
                tokens.append(token)
                scores.append(weight * float(counts[i]) / total)
        weight *= 0.5
    return tokens, scores


class NgramTreeSession:
    """Tree drafting by prompt lookup: at each node, the tokens that followed earlier
    occurrences of the node's context suffix. Expanding level by level merges several
    matching continuations into one tree by their shared prefix."""

    def __init__(self, token_ids: Sequence[int], min_n: int, max_n: int) -> None:
        self.base = np.asarray(token_ids, dtype=np.int64)
        self.min_n, self.max_n = min_n, max_n
        self.paths: list[list[int]] = []  # node -> tokens from the root's child down

    def add(self, parent: int, token: int) -> int:
        prefix = [] if parent == ROOT else self.paths[parent]
        self.paths.append([*prefix, int(token)])
        return len(self.paths) - 1

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        out = []
        for node in nodes:
            context = self.base
            if node != ROOT:
                context = np.concatenate([self.base, np.asarray(self.paths[node], np.int64)])
            tokens, scores = ngram_candidates(context, self.min_n, self.max_n, width)
            out.append(Expansion(tokens, scores))
        return out

    def close(self) -> None:
        pass


class NgramDrafter(DrafterBase):
    """Prompt lookup over prompt + generated text; deterministic (``draft_probs=None``).

    Stateless (everything is read from the sequence passed to ``propose``), so ``start``
    returns the drafter itself.

    Args:
        min_n, max_n: n-gram sizes to match, longest first.
    """

    #: Its sequences offer ``tree_session`` (token trees).
    supports_trees = True

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> NgramDrafter:
        return self

    def close(self) -> None:
        pass

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        ids = np.asarray(token_ids, dtype=np.int64)
        found = find_ngram_continuation(ids, self.min_n, self.max_n, num_tokens)
        return DraftProposal(found.tolist())

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> NgramTreeSession:
        """A :class:`~specdec.trees.builders.TreeSession` for this step (deterministic)."""
        return NgramTreeSession(token_ids, self.min_n, self.max_n)
