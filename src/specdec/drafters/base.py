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
class Drafter(Protocol):
    """Proposes draft tokens; never decides how many (the engine passes ``num_tokens``)."""

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Begin a new sequence (reset state, optionally prefill)."""

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        """Propose up to ``num_tokens`` tokens to follow ``token_ids`` (prompt + output so far)."""


class NoDrafter:
    """Proposes nothing: every step is one plain autoregressive step of the target."""

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        pass

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        return DraftProposal([])
