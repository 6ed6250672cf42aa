"""The backend protocol: what the engine, the drafters and :class:`~specdec.LLM` use of a
model. :class:`~specdec.models.hf.HFModel` (transformers) and
:class:`~specdec.models.native.NativeModel` (specdec's runtime) implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from specdec.trees.tree import TokenTree


@runtime_checkable
class KVCacheLike(Protocol):
    """A sequence's KV cache with an explicit cursor (see the cursor rule)."""

    num_tokens: int

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions."""

    def compact(self, indices, start: int = 0) -> None:
        """Keep positions before ``start``, then exactly ``indices`` (a tree's path)."""


@runtime_checkable
class Backend(Protocol):
    """A causal LM as specdec drives it (target or draft).

    Attributes:
        name: label for logs and reports.
        backend: ``"hf"`` or ``"native"``.
        vocab_size: width of the logits.
        max_context: longest sequence (prompt + output), in tokens.
        eos_token_ids: ids that end generation (EOS, chat end-of-turn).
        tokenizer: the Hugging Face tokenizer (shared by a target and its draft).
    """

    name: str
    backend: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]

    def new_cache(self, capacity: int = 256) -> KVCacheLike:
        """An empty cache for one sequence."""

    def forward(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: KVCacheLike,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``token_ids`` after the cursor; ``[T or num_logits, V]`` float32 logits."""

    def forward_tree(self, root_token: int, tree: TokenTree, cache: KVCacheLike) -> torch.Tensor:
        """The pending token plus every node of ``tree`` with tree attention."""

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """Prompt (text or chat messages) -> token ids."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text (special tokens dropped)."""
