"""Medusa: trained heads on the target's last hidden state each guess one token further.

Source: Medusa (Cai et al. 2024, arXiv:2401.10774): ``K`` heads read the target's
final-normed hidden state of the last verified token (the state whose logits gave the
pending token); head ``k`` predicts the token ``k + 1`` places after the pending one.
The head is :class:`specdec.heads.modules.MedusaHead`.

* A chain of ``k <= K`` tokens is head 0's choice, head 1's, ... (each head guesses
  independently of the earlier guesses, as in Medusa).
* Trees: any tree builder; a node at depth ``d`` is offered head ``d - 1``'s candidates
  whatever its ancestors are, which is Medusa's tree of top-k products (Sec. 2.1.2), and
  ``dynamic`` keeps the most probable paths within a budget. Depth is at most ``K``.
* Sampling draws from ``logits_to_probs`` of a head's logits spread over the target
  vocabulary (0 outside the draft vocabulary) and returns them as ``draft_probs``, so
  rejection sampling and tree verification stay lossless (Medusa-1's typical acceptance,
  which is lossy, is not implemented).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DraftProposal
from specdec.drafters.draft_model import expansions_from_logits
from specdec.drafters.head import LastStateDrafter, LastStateSequence, chain_from_positions
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT


class MedusaDrafter(LastStateDrafter):
    """Drafts with trained Medusa heads (see the module docstring).

    Args:
        target: the target backend.
        head: a loaded :class:`~specdec.heads.modules.MedusaHead` for this target.
        options: :class:`~specdec.drafters.options.MedusaOptions`.
    """

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> MedusaSequence:
        return MedusaSequence(self, params)


class MedusaSequence(LastStateSequence):
    """One sequence: the target's last verified state and the heads' logits on it."""

    def __init__(self, drafter: MedusaDrafter, params: SamplingParams) -> None:
        super().__init__(drafter, params)
        self._logits: torch.Tensor | None = None

    def _set_state(self, state: torch.Tensor) -> None:
        self._state, self._logits = state, None

    @torch.inference_mode()
    def head_logits(self) -> torch.Tensor:
        """``[K, V]`` float32 target-vocabulary logits of every head on the last state.

        Raises:
            ValueError: no state yet (a one-token prompt has no verified state).
        """
        if self._logits is None:
            if self._state is None:
                raise ValueError("no target state yet: the prompt needs at least 2 tokens")
            head = self.drafter.head
            logits = head(self._state.to(head.dtype))[0]
            self._logits = self.drafter.full_logits(logits)
        return self._logits

    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        *,
        stop_drafting: Callable[[int, float], bool] | None = None,
    ) -> DraftProposal:
        """Up to ``min(num_tokens, K)`` tokens, head ``i`` choosing position ``i``."""
        num_tokens = min(num_tokens, self.drafter.num_heads)
        if num_tokens <= 0 or self._state is None:  # a one-token prompt: a plain step
            return DraftProposal([])
        logits = self.head_logits()[:num_tokens]
        return chain_from_positions(
            logits, self.params, generator, self.drafter.options.confidence, stop_drafting
        )

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> MedusaTreeSession:
        self.params = params
        return MedusaTreeSession(None if self._state is None else self.head_logits(), params)


class MedusaTreeSession:
    """Medusa's tree: a node at depth ``d`` gets head ``d``'s candidates (``ROOT`` is
    depth 0, its children come from head 0); nodes deeper than the heads get none."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams) -> None:
        self.logits, self.params = logits, params
        self.depths: list[int] = []

    def add(self, parent: int, token: int) -> int:
        self.depths.append(0 if parent == ROOT else self.depths[parent] + 1)
        return len(self.depths) - 1

    def expand(self, nodes: Sequence[int], width: int):
        if self.logits is None:  # no target state yet
            return [Expansion([], [], None) for _ in nodes]
        heads = self.logits.shape[0]
        depth = [0 if n == ROOT else self.depths[n] + 1 for n in nodes]
        rows = torch.stack([self.logits[min(d, heads - 1)] for d in depth])
        out = expansions_from_logits(rows, self.params, width)
        for i, d in enumerate(depth):
            if d >= heads:  # no head guesses this far
                out[i] = Expansion([], [], None)
        return out

    def close(self) -> None:
        pass
