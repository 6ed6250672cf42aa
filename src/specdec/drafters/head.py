"""What the draft-head drafters (:mod:`.eagle`, :mod:`.medusa`, :mod:`.parallel`) share:
the loaded head, the hidden-state indices it reads and the map from its draft vocabulary
back to the target's."""

from __future__ import annotations

import torch

from specdec.drafters.base import DrafterBase
from specdec.heads.modules import spread_logits


class HeadDrafterBase(DrafterBase):
    """A drafter around a trained head (shared by every sequence).

    Args:
        target: the target backend.
        head: a loaded head for this target (:func:`specdec.heads.format.load_head`).
        options: the drafter's options.

    Attributes:
        captures: the hidden-state indices the head reads (the engine captures them).
    """

    supports_trees = True
    observes = True
    confidence_stop = True

    def __init__(self, target, head, options) -> None:
        self.target = target
        self.head = head
        self.options = options
        self.captures = tuple(head.config.capture)
        self.vocab_size = target.vocab_size
        self.vocab_map = head.vocab_map.to(torch.long)

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """``[N, V']`` draft-vocabulary logits -> ``[N, V]`` float32 target-vocabulary
        logits, ``-inf`` outside the draft vocabulary (:func:`spread_logits`)."""
        return spread_logits(draft_logits, self.vocab_map, self.vocab_size)
