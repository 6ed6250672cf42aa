"""Token Recycling: draft from the target's own earlier top-k candidates per token.

Source: Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large Language
Models with Token Recycling" (2024, arXiv:2408.08696), §3: an adjacency matrix holds, for
every token, the top-k candidate next tokens the target predicted the last time that token
was an input; after each verification, every verified row's top-k replaces its input
token's entry (§3.2 "update"); drafting walks the matrix from the last token, a chain by
top-1 or a tree by breadth-first expansion of each token's candidates (§3.3, "static
tree" -- here any of specdec's tree builders). Memory is fixed: ``vocab_size * top_k``
entries, whatever the number of requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import (
    DrafterBase,
    DraftProposal,
    VerificationFeedback,
    needs_isolation,
)
from specdec.drafters.options import RecyclingOptions
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT


class RecyclingTable:
    """The adjacency matrix: ``tokens[t]`` are the target's ``top_k`` candidates after
    token ``t`` (most probable first, ``-1`` where none is known yet) and ``probs[t]``
    their probabilities.

    Args:
        vocab_size: rows (the target's logit width).
        top_k: candidates per row.

    Example:
        >>> table = RecyclingTable(vocab_size=4, top_k=2)
        >>> logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 0.0, 0.0]])
        >>> table.update([2, 3], logits)  # after token 2 the target ranked 1, 3; after 3: 0
        >>> table.tokens.tolist()
        [[-1, -1], [-1, -1], [1, 3], [0, 1]]
        >>> table.chain(2, 3)  # 2 -> 1, and nothing is known after 1
        [1]
    """

    def __init__(self, vocab_size: int, top_k: int) -> None:
        self.top_k = top_k
        self.tokens = torch.full((vocab_size, top_k), -1, dtype=torch.long)
        self.probs = torch.zeros((vocab_size, top_k), dtype=torch.float32)

    def update(self, input_ids: Sequence[int], target_logits: torch.Tensor) -> None:
        """Replace each input token's entry with the top-k of its row's logits.

        A token that appears in several rows keeps the last row's candidates.

        Args:
            input_ids: ``[n]`` tokens that were verified.
            target_logits: ``[n, V]`` the target's logits after each of them.
        """
        last = {int(t): row for row, t in enumerate(input_ids)}  # one write per token
        rows = torch.tensor(list(last.values()), dtype=torch.long)
        logits = target_logits[rows.to(target_logits.device)].float()
        top = torch.topk(logits, self.top_k, dim=-1)  # on the target's device; the table
        probs = torch.softmax(logits, dim=-1).gather(1, top.indices)  # stays on the CPU
        ids = torch.tensor(list(last), dtype=torch.long)
        self.tokens[ids] = top.indices.cpu()
        self.probs[ids] = probs.cpu()

    def candidates(self, token: int, width: int) -> tuple[list[int], list[float]]:
        """The first ``width`` known candidates after ``token`` and their probabilities."""
        tokens = self.tokens[token, :width].tolist()
        probs = self.probs[token, :width].tolist()
        known = [i for i, t in enumerate(tokens) if t >= 0]
        return [tokens[i] for i in known], [probs[i] for i in known]

    def chain(self, token: int, length: int) -> list[int]:
        """Follow the top-1 candidate from ``token`` for up to ``length`` tokens."""
        out: list[int] = []
        top1 = self.tokens[:, 0]
        while len(out) < length:
            token = int(top1[token])
            if token < 0:
                break
            out.append(token)
        return out


class RecyclingDrafter(DrafterBase):
    """Token Recycling (see the module docstring); deterministic (``draft_probs=None``).

    Args:
        vocab_size: the target's logit width.
        options: :class:`~specdec.drafters.options.RecyclingOptions` (``shared``: one
            table for all sequences, kept across requests).
    """

    supports_trees = True
    observes = True

    def __init__(self, vocab_size: int, options: RecyclingOptions | None = None) -> None:
        self.options = options or RecyclingOptions()
        self.vocab_size = vocab_size
        self.table = RecyclingTable(vocab_size, self.options.top_k) if self.options.shared else None

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> RecyclingSequence:
        """A sequence's view of the shared table, or of its own empty one (``shared=false``,
        or a seeded sampled generation, whose output must not depend on earlier requests)."""
        table = self.table
        if table is None or needs_isolation(params):
            table = RecyclingTable(self.vocab_size, self.options.top_k)
        return RecyclingSequence(table)


class RecyclingSequence(DrafterBase):
    """One sequence's view of a table (shared or its own)."""

    observes = True

    def __init__(self, table: RecyclingTable) -> None:
        self.table = table

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        return DraftProposal(self.table.chain(int(token_ids[-1]), num_tokens))

    def observe(self, feedback: VerificationFeedback) -> None:
        self.table.update(feedback.input_ids, feedback.target_logits)

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> RecyclingSession:
        return RecyclingSession(self.table, int(token_ids[-1]))


class RecyclingSession:
    """Tree drafting: a node's candidates are its token's row of the table."""

    def __init__(self, table: RecyclingTable, root_token: int) -> None:
        self.table = table
        self.tokens = [root_token]  # node i + 1 -> its token; index 0 = the root

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(int(token))
        return len(self.tokens) - 2

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        out = []
        for node in nodes:
            token = self.tokens[0 if node == ROOT else node + 1]
            out.append(Expansion(*self.table.candidates(token, width)))
        return out

    def close(self) -> None:
        pass
