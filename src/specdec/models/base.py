"""The backend protocol: what the engine, the drafters and :class:`~specdec.LLM` use of a
model. :class:`~specdec.models.hf.HFModel` (transformers) and
:class:`~specdec.models.native.NativeModel` (specdec's runtime) implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.tokenizer import Tokenizer
from specdec.trees.tree import TokenTree


@runtime_checkable
class KVCacheLike(Protocol):
    """A sequence's KV cache with an explicit cursor (see the cursor rule)."""

    num_tokens: int

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` positions."""

    def compact(self, indices, start: int = 0) -> None:
        """Keep positions before ``start``, then exactly ``indices`` (a tree's path)."""


@dataclass
class BatchItem:
    """One sequence's part of a ragged forward (:meth:`Backend.forward_batch`).

    Attributes:
        token_ids: ``[T]`` new tokens (T >= 1).
        cache: the sequence's cache; the tokens go to slots ``cache.num_tokens ..`` and the
            cursor moves past them.
        positions: ``[T]`` absolute positions (default: the slots, i.e. causal order).
        tree_mask: ``[T, S]`` bool (S >= T): which of the last ``S`` slots (the ``S - T``
            tree tokens already cached, then these T) each row sees, besides every slot
            before them; ``None`` = causal.
        num_logits: logits for only the last ``num_logits`` rows (0 = all).
    """

    token_ids: Sequence[int] | torch.Tensor
    cache: KVCacheLike
    positions: Sequence[int] | torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    num_logits: int = 0


@runtime_checkable
class Backend(Protocol):
    """A causal LM as specdec drives it (target or draft).

    Attributes:
        name: label for logs and reports.
        backend: ``"hf"`` or ``"native"``.
        vocab_size: width of the logits.
        max_context: longest sequence (prompt + output), in tokens.
        tokenizer: the :class:`~specdec.tokenizer.Tokenizer` the model was loaded with
            (what :class:`~specdec.LLM` encodes and decodes with; the forward never uses it).
    """

    name: str
    backend: str
    vocab_size: int
    max_context: int
    tokenizer: Tokenizer

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

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """One forward over a ragged batch of sequences (each with its own cache); per
        item, ``[T or num_logits, V]`` float32 logits, equal to its own :meth:`forward`."""

    def forward_tree(self, root_token: int, tree: TokenTree, cache: KVCacheLike) -> torch.Tensor:
        """The pending token plus every node of ``tree`` with tree attention."""

    def forward_full(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: KVCacheLike,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
    ) -> ForwardOutput:
        """:meth:`forward` plus hidden states; ``layers`` (a subset of the decoder layers,
        for early exit / layer skip sharing the cache) only on the native backend."""


@dataclass
class ForwardOutput:
    """A forward's logits and hidden states (``forward_full`` of either backend).

    Attributes:
        logits: ``[n, vocab_size]`` float32.
        hidden: ``[n, hidden_size]`` in the model dtype: the final-normed hidden states the
            LM head reads (transformers' last ``hidden_states``; the features draft heads
            such as EAGLE are trained on).
    """

    logits: torch.Tensor
    hidden: torch.Tensor


class BackendBase:
    """What every backend derives from :meth:`Backend.forward` the same way."""

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """A ragged batch as one :meth:`forward` per sequence (a backend that computes
        the batch in one pass, like the native runtime, overrides this).

        Returns:
            per item, ``[T or num_logits, vocab_size]`` float32 logits.
        """
        outputs = []
        for item in items:
            if item.positions is None and item.tree_mask is None:  # the plain causal call
                outputs.append(self.forward(item.token_ids, item.cache, item.num_logits))
            else:
                outputs.append(
                    self.forward(
                        item.token_ids,
                        item.cache,
                        item.num_logits,
                        positions=item.positions,
                        tree_mask=item.tree_mask,
                    )
                )
        return outputs

    def forward_tree(self, root_token: int, tree: TokenTree, cache) -> torch.Tensor:
        """Tree attention pass: the pending (root) token plus every node of ``tree``.

        Root at position ``cache.num_tokens``, node ``i`` at that plus its depth, each
        seeing the cache, its ancestors and itself (:meth:`TokenTree.attention_mask`).

        Returns:
            ``[N + 1, vocab_size]`` float32 logits: row 0 after the root, row ``i + 1``
            after node ``i``'s root-to-node path.
        """
        return self.forward(
            [root_token, *tree.token_ids],
            cache,
            positions=cache.num_tokens + tree.position_offsets(),
            tree_mask=tree.attention_mask(),
        )

    @torch.inference_mode()
    def warmup(self, num_tokens: Sequence[int] = (1, 8)) -> None:
        """Run throwaway forwards of the given lengths so first-call costs leave timings."""
        for n in num_tokens:
            cache = self.new_cache(n)
            self.forward([0] * n, cache)
