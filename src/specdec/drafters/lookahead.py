"""Lookahead decoding: Jacobi iteration generates n-grams, verified in the same forward.

Source: Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding" (ICML 2024, arXiv:2402.02057), §3: every step runs, in one forward of the
target,

* the **lookahead branch**: a 2D window of ``N - 1`` rows (levels) by ``W`` columns of
  guessed tokens. Row 0's column ``c`` sits ``c + 1`` positions after the pending token and
  row ``r``'s column ``c`` at ``c + 1 + r``; the token at ``(r, c)`` attends to row 0's
  columns ``0..c`` then rows ``1..r`` of column ``c`` (one causal chain of consecutive
  positions, Fig. 3's mask). The target's argmax after the last row's column ``c`` ends
  the n-gram ``(row 0 .. row N-2 of column c, that token)``, which enters the **n-gram
  pool** keyed by its first token; the oldest row is dropped and the new tokens form the
  last row (one Jacobi iteration per step);
* the **verification branch**: the pool's n-grams that start with the pending token (at
  most ``G``, most recent first) drafted as a chain (the most recent) or a token tree.

Here the lookahead branch runs as the engine's auxiliary rows
(:class:`~specdec.drafters.base.AuxRows`): they share the forward but no draft row sees
them and they never enter the KV cache, so verification is unchanged and output stays
lossless. The window starts from the prompt's last tokens (the paper: random prompt
tokens), so runs are deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import AuxRows, DrafterBase, DraftProposal, VerificationFeedback
from specdec.drafters.options import LookaheadOptions
from specdec.sampling import greedy_ids
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT


def lookahead_mask(levels: int, window: int) -> tuple[list[int], torch.Tensor]:
    """Position offsets and attention mask of a ``levels x window`` lookahead branch.

    Rows are flattened level by level (row ``r``, column ``c`` -> ``r * window + c``).

    Returns:
        ``(offsets, mask)``: ``[levels * window]`` offsets from the pending token
        (``c + 1 + r``) and the ``[levels * window, levels * window]`` bool mask.

    Example:
        >>> offsets, mask = lookahead_mask(2, 2)  # rows: (0,0) (0,1) (1,0) (1,1)
        >>> offsets
        [1, 2, 2, 3]
        >>> mask.int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    n = levels * window
    offsets = [c + 1 + r for r in range(levels) for c in range(window)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for r in range(levels):
        for c in range(window):
            row = r * window + c
            mask[row, : c + 1] = True  # row 0, columns 0..c
            for above in range(1, r + 1):
                mask[row, above * window + c] = True  # column c of rows 1..r
    return offsets, mask


class NgramPool:
    """n-grams found by the lookahead branch, keyed by their first token; at most
    ``per_key`` continuations per key, the least recently found dropped first.

    Example:
        >>> pool = NgramPool(per_key=2)
        >>> for gram in [(5, 6, 7), (5, 8, 9), (5, 6, 7), (5, 1, 2)]:
        ...     pool.add(gram)
        >>> pool.get(5, 3)  # most recent first; (5, 8, 9) was the oldest
        [(1, 2), (6, 7)]
    """

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: Sequence[int]) -> None:
        key, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        entries = self._grams.setdefault(key, OrderedDict())
        entries.pop(rest, None)
        entries[rest] = None
        while len(entries) > self.per_key:
            entries.popitem(last=False)

    def get(self, key: int, limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` continuations of ``key``, most recently found first."""
        entries = self._grams.get(int(key))
        return list(reversed(entries))[:limit] if entries else []


class LookaheadDrafter(DrafterBase):
    """Lookahead decoding (see the module docstring); deterministic drafts
    (``draft_probs=None``), one pool and window per sequence.

    Args:
        options: :class:`~specdec.drafters.options.LookaheadOptions` (``window`` W,
            ``ngram`` N, ``candidates`` G).
    """

    supports_trees = True
    observes = True

    def __init__(self, options: LookaheadOptions | None = None) -> None:
        self.options = options or LookaheadOptions()
        self.max_aux_rows = (self.options.ngram - 1) * self.options.window

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> LookaheadSequence:
        return LookaheadSequence(self.options, prompt_ids)


class LookaheadSequence(DrafterBase):
    """One sequence's 2D window and n-gram pool."""

    observes = True

    def __init__(self, options: LookaheadOptions, prompt_ids: Sequence[int]) -> None:
        self.options = options
        levels, width = options.ngram - 1, options.window
        seed = [int(t) for t in prompt_ids[-levels * width :]]
        seed = (seed * (levels * width // len(seed) + 1))[: levels * width]
        self.rows = [seed[r * width : (r + 1) * width] for r in range(levels)]
        self.pool = NgramPool(max(options.candidates, 1) * 2)
        self._offsets, self._mask = lookahead_mask(levels, width)

    def candidates(self, token: int) -> list[tuple[int, ...]]:
        return self.pool.get(token, self.options.candidates)

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        found = self.candidates(int(token_ids[-1]))
        return DraftProposal(list(found[0][:num_tokens]) if found and num_tokens > 0 else [])

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> LookaheadSession:
        return LookaheadSession(self.candidates(int(token_ids[-1])))

    def aux_rows(self, token_ids: Sequence[int]) -> AuxRows:
        tokens = [t for row in self.rows for t in row]
        return AuxRows(tokens, self._offsets, self._mask)

    def observe(self, feedback: VerificationFeedback) -> None:
        """One Jacobi iteration: the last row's argmax continues each column's n-gram."""
        if feedback.aux_logits is None:
            return
        width = self.options.window
        last = feedback.aux_logits[-width:]
        new_row = greedy_ids(last).tolist()
        for c in range(width):
            self.pool.add([row[c] for row in self.rows] + [new_row[c]])
        self.rows = [*self.rows[1:], new_row]


class LookaheadSession:
    """Tree drafting over the pool's n-grams for the pending token: a trie of them, each
    node's children ranked by how many n-grams pass through them."""

    def __init__(self, grams: list[tuple[int, ...]]) -> None:
        self.grams = grams
        self.paths: list[tuple[int, ...]] = []

    def add(self, parent: int, token: int) -> int:
        prefix = () if parent == ROOT else self.paths[parent]
        self.paths.append((*prefix, int(token)))
        return len(self.paths) - 1

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        out = []
        for node in nodes:
            prefix = () if node == ROOT else self.paths[node]
            depth = len(prefix)
            counts: dict[int, int] = {}
            for gram in self.grams:  # most recent first: ties keep that order
                if len(gram) > depth and gram[:depth] == prefix:
                    counts[gram[depth]] = counts.get(gram[depth], 0) + 1
            total = sum(counts.values())
            ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:width]
            out.append(Expansion([t for t, _ in ranked], [c / total for _, c in ranked]))
        return out

    def close(self) -> None:
        pass
