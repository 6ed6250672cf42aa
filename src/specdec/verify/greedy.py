"""Greedy verification: keep the longest draft prefix equal to the target's argmax."""

from __future__ import annotations

import torch

from specdec.sampling import greedy_ids
from specdec.verify.result import VerifyResult


def verify_greedy(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Longest matching prefix plus the target's next token (bonus or correction).

    Args:
        draft_token_ids: ``[k]`` int64 draft tokens (k >= 0).
        target_logits: ``[k + 1, V]`` target logits; row i scores the token after the
            pending token and the first i draft tokens.

    Returns:
        :class:`VerifyResult`; its output equals what k+1 plain greedy steps of the target
        would produce up to the first disagreement.

    Example:
        >>> logits = torch.eye(4)[[1, 2, 3]]  # target argmax: 1, 2, 3
        >>> verify_greedy(torch.tensor([1, 0]), logits)
        VerifyResult(num_accepted=1, output_token_ids=[1, 2])
    """
    target_ids = greedy_ids(target_logits)
    k = draft_token_ids.numel()
    mismatch = (draft_token_ids != target_ids[:k]).nonzero()
    num_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return VerifyResult(num_accepted, target_ids[: num_accepted + 1].tolist())
