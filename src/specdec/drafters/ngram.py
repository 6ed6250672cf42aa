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
from specdec.drafters.base import DraftProposal


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


class NgramDrafter:
    """Prompt lookup over prompt + generated text; deterministic (``draft_probs=None``).

    Args:
        min_n, max_n: n-gram sizes to match, longest first.
    """

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        pass

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        ids = np.asarray(token_ids, dtype=np.int64)
        found = find_ngram_continuation(ids, self.min_n, self.max_n, num_tokens)
        return DraftProposal(found.tolist())
