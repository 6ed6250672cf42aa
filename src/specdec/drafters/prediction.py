"""OpenAI Predicted Outputs as a draft source: the client's expected output is looked up
like a prompt and its continuation proposed as the draft.

Source: OpenAI's ``prediction: {"type": "content", "content": ...}`` (2024), whose
documented use is regenerating a file with small edits; the drafting is prompt lookup
(Saxena 2023) over the predicted tokens instead of the context, aligned by the longest
suffix of the output that occurs in the prediction (preferring the first occurrence at or
after the previous alignment, so a prediction with repeated lines is followed in order).
Where nothing of the prediction matches (an inserted passage), prompt lookup over the
prompt and output drafts instead. Drafts are deterministic (``draft_probs=None``), so
greedy and sampled verification stay lossless: the prediction only changes speed.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal
from specdec.drafters.ngram import find_ngram_continuation


class PredictionDrafter(DrafterBase):
    """Drafts from one request's predicted output (one drafter per request).

    Args:
        prediction_ids: ``[P]`` the predicted output's token ids (P >= 1).
        max_n: longest output suffix matched against the prediction (>= 1).

    Attributes:
        prediction_ids: the prediction.

    Raises:
        ValueError: an empty prediction or ``max_n < 1``.
    """

    def __init__(self, prediction_ids: Sequence[int], max_n: int = 8) -> None:
        if not len(prediction_ids):
            raise ValueError("the prediction is empty")
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        self.prediction_ids = np.asarray(list(prediction_ids), dtype=np.int64)
        self.max_n = max_n

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> _PredictionSequence:
        return _PredictionSequence(self, len(prompt_ids))

    def usage(self, output_ids: Sequence[int]) -> tuple[int, int]:
        """OpenAI's ``accepted_prediction_tokens`` and ``rejected_prediction_tokens`` for
        the final output: the prediction's tokens that the output holds, in order (the
        matching blocks of :class:`difflib.SequenceMatcher` between the two token
        sequences), and the rest of the prediction. They add up to the prediction's
        length; an output equal to the prediction accepts all of it.

        Args:
            output_ids: the output's token ids (after stops).

        Returns:
            ``(accepted, rejected)``.
        """
        pred = self.prediction_ids.tolist()
        matcher = difflib.SequenceMatcher(None, pred, list(output_ids), autojunk=False)
        accepted = sum(block.size for block in matcher.get_matching_blocks())
        return accepted, len(pred) - accepted


class _PredictionSequence(DrafterBase):
    """One sequence's alignment with the prediction."""

    def __init__(self, drafter: PredictionDrafter, num_prompt: int) -> None:
        self.drafter = drafter
        self.num_prompt = num_prompt
        self.hint = 0  # where the previous draft started in the prediction

    def close(self) -> None:
        pass

    def _align(self, output: np.ndarray) -> int | None:
        """Where in the prediction the output continues (``None``: nowhere)."""
        if not output.size:
            return 0
        pred = self.drafter.prediction_ids
        for n in range(min(self.drafter.max_n, output.size, pred.size), 0, -1):
            windows = sliding_window_view(pred, n)
            hits = np.flatnonzero((windows == output[-n:]).all(axis=1)) + n
            hits = hits[hits < pred.size]
            if hits.size:
                ahead = hits[hits >= self.hint]
                return int(ahead[0] if ahead.size else hits[0])
        return None

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        ids = np.asarray(token_ids, dtype=np.int64)
        output = ids[self.num_prompt :]
        start = self._align(output) if num_tokens > 0 else None
        if start is None:  # nothing of the prediction matches: prompt lookup
            return DraftProposal(find_ngram_continuation(ids, 2, 4, num_tokens).tolist())
        self.hint = start
        return DraftProposal(self.drafter.prediction_ids[start : start + num_tokens].tolist())
