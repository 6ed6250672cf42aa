"""Parallel (block) drafting: a trained head proposes a whole block of tokens in one forward.

Sources: PARD (An et al. 2025, arXiv:2504.18583: mask tokens appended after the context
predict the following tokens in one forward of a causal draft) and DFlash (Chen et al.
2026, arXiv:2602.06036: a block of mask positions drafted in one forward, conditioned on
the target's hidden states). The head is :class:`specdec.heads.modules.ParallelHead`:
EAGLE-3's one-layer draft decoder with learned mask embeddings (its attention is causal
within the block, as PARD's; DFlash's is bidirectional).

How a sequence drafts:

* The target's hidden states arrive as for EAGLE (:mod:`.eagle`): the prompt's after
  prefill, each verification's accepted rows after it.
* ``propose`` runs *one* head forward over the rows not yet run (row ``j`` reads ``(f_j,
  t_{j+1})``; the last one reads the pending token) followed by ``k - 1`` mask rows: the
  pending row's output is draft position 1, mask row ``i``'s is position ``i + 1``. Only
  the verified rows stay in the head's cache. EAGLE needs ``k`` forwards for the same
  chain; the price is that a mask row does not see the drafts before it, so later
  positions are guessed as Medusa guesses them (but attending to the whole context).
* ``k`` is at most the head's ``block_size``.
* Token trees: any tree builder; a node at depth ``d`` is offered position ``d + 1``'s
  candidates whatever its ancestors (Medusa's tree of top-k products), so the tree costs
  the same one forward as a chain.
* Sampling draws each position from ``logits_to_probs`` of its logits spread over the
  target vocabulary (0 outside the draft vocabulary) and returns those distributions as
  ``draft_probs``; a position's distribution does not depend on the earlier drafts, which
  rejection sampling, SpecInfer and RSD accept as any draft distribution, so output stays
  lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DraftProposal
from specdec.drafters.eagle import EagleDrafter, EagleSequence
from specdec.drafters.head import chain_from_positions
from specdec.drafters.medusa import MedusaTreeSession


class ParallelDrafter(EagleDrafter):
    """Drafts a block per head forward with a trained parallel head (see the module
    docstring).

    Args:
        target: the target backend.
        head: a loaded :class:`~specdec.heads.modules.ParallelHead` for this target.
        options: :class:`~specdec.drafters.options.ParallelOptions`.

    Attributes:
        captures: the hidden-state indices the head reads (the engine captures them).
        block_size: the most draft tokens one forward proposes.
    """

    def __init__(self, target, head, options) -> None:
        super().__init__(target, head, options)
        self.block_size = self.max_draft_tokens = head.config.block_size

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> ParallelSequence:
        return ParallelSequence(self, params)


class ParallelSequence(EagleSequence):
    """One sequence's head cache, the target features not yet read and the last verified
    row (kept so a block can be drafted again without new features)."""

    def __init__(self, drafter: ParallelDrafter, params: SamplingParams) -> None:
        super().__init__(drafter, params)
        self._last_row: tuple[torch.Tensor, int] | None = None  # (fused feature, token)

    def observe_prefill(self, start: int, hidden: torch.Tensor) -> None:
        if start == 0:
            self._last_row = None
        super().observe_prefill(start, hidden)

    @torch.inference_mode()
    def block_logits(self, token_ids: Sequence[int], size: int) -> torch.Tensor:
        """``[size, V']`` draft-vocabulary logits of draft positions ``1 .. size`` after
        ``token_ids``, from one head forward (see the module docstring).

        Raises:
            ValueError: the target's states of some verified token never arrived.
        """
        n = len(token_ids)
        if self._known != n - 1:
            raise ValueError(
                f"the head knows the target's states of {self._known} tokens; the sequence "
                f"has {n} (every token but the pending one is needed)"
            )
        dtype = self.head.dtype
        if self._features:
            captured = torch.cat(self._features) if len(self._features) > 1 else self._features[0]
            self._features = []
            features = self.head.fuse(captured.to(dtype))
            start = self.cache.num_rows
            ids = torch.as_tensor(token_ids[start + 1 : n], dtype=torch.long)
        else:  # drafted again with no new state: run the last verified row again
            feature, token = self._last_row
            self.cache.truncate(self.cache.num_rows - 1)
            start, features, ids = self.cache.num_rows, feature, torch.tensor([token])
        fused = self.head.fused_layer()
        if fused is not None and features.device.type == "cpu":
            # the block's rows on the runtime's fused layer; the mask rows are dropped
            rows, row_ids = self.head.block_rows(features, ids, size)
            h = self.cache.run_fused(fused, rows, row_ids, keep=features.shape[0])
            logits = self.head.logits(h[features.shape[0] - 1 :])
        else:
            past = self.cache.past() if start else (None, None)
            logits, k, v = self.head.block(features, ids, start, *past, size)
            self.cache.append(k, v)
        self._last_row = (features[-1:], int(ids[-1]))
        return logits

    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        *,
        stop_drafting: Callable[[int, float], bool] | None = None,
    ) -> DraftProposal:
        """Up to ``min(num_tokens, block_size)`` draft tokens after ``token_ids`` from
        one head forward.

        Returns:
            the chain; ``draft_probs`` ``[k', V]`` float32 when sampling, else ``None``;
            ``confidence``: each position's top draft probability.
        """
        num_tokens = min(num_tokens, self.drafter.block_size)
        if num_tokens <= 0 or not self.ready(token_ids):
            return DraftProposal([])
        logits = self.block_logits(token_ids, num_tokens).float()
        return chain_from_positions(
            logits, self.params, generator, self.drafter.options.confidence, stop_drafting,
            vocab_map=self.drafter.vocab_map, full_logits=self.drafter.full_logits,
        )  # fmt: skip

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> MedusaTreeSession:
        """Medusa's tree over the block's positions (one head forward)."""
        self.params = params
        if not self.ready(token_ids):
            return MedusaTreeSession(None, params)
        logits = self.block_logits(token_ids, self.drafter.block_size)
        return MedusaTreeSession(self.drafter.full_logits(logits), params)
