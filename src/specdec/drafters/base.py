"""The Drafter protocol: what the engine asks of every drafter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.config import SamplingParams


@dataclass
class DraftProposal:
    """Draft tokens for one verification step.

    Attributes:
        token_ids: ``[k']`` proposed token ids (``k'`` may be smaller than requested, even 0).
        draft_probs: ``[k', vocab_size]`` float32 distributions the tokens were sampled from,
            in the target's vocabulary; ``None`` for deterministic drafters, whose tokens are
            verified as point masses (still lossless).
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class SequenceDrafter(Protocol):
    """One sequence's drafter: all per-sequence state (e.g. a draft model's KV cache)
    lives here, so any number of sequences can be drafted for in any interleaving.

    Optionally also ``tree_session(token_ids, params)`` for token trees (see
    :class:`specdec.trees.builders.TreeSession`).
    """

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        """Propose up to ``num_tokens`` tokens to follow ``token_ids`` (prompt + output so far)."""

    def close(self) -> None:
        """Release the sequence's state (called once, when its generation ends or stops)."""


@runtime_checkable
class Drafter(Protocol):
    """Makes a :class:`SequenceDrafter` per sequence; never decides how many tokens to
    draft (the engine passes ``num_tokens``). Holds only what sequences share (a loaded
    draft model, settings); a stateless drafter may return itself from ``start``.

    A drafter whose sequences offer ``tree_session`` declares it with a class attribute
    ``supports_trees = True`` (the engine refuses token trees otherwise).
    """

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> SequenceDrafter:
        """Begin drafting for a new sequence (optionally prefilling its own state)."""


class NoDrafter:
    """Proposes nothing: every step is one plain autoregressive step of the target."""

    supports_trees = False

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> NoDrafter:
        return self

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        return DraftProposal([])

    def close(self) -> None:
        pass
