"""The backend protocol: what the engine, the drafters and :class:`~specdec.LLM` use of a
model. :class:`~specdec.models.hf.HFModel` (transformers) and
:class:`~specdec.models.native.NativeModel` (specdec's runtime) implement it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
        prefill: whether these rows are a prompt chunk (``None``: the sequence's first
            forward with a causal mask is one). The native backend's exact mode computes a
            prompt chunk's products as one product of its own (the same call whenever the
            same chunk comes, alone or in a batch) instead of the batch-invariant tiles
            that decoding and verification rows need; a chunk recomputing earlier *output*
            (after preemption) must say ``False`` to get its first bits again.
        kv_window: native backend only: ``(sinks, recent)`` or ``(sinks, recent,
            align)``: each row attends to only the first ``sinks`` slots and the last
            ``recent`` before it along its path (the context, then its ancestors among
            these rows as the mask says), and itself: StreamingLLM's attention sinks +
            rolling window (Xiao et al. 2024, arXiv:2309.17453), for sparse-KV
            self-drafting. With ``align`` (default 1) the recent part is extended back to
            the nearest path position ``sinks + m * align``, so that it holds whole KV
            blocks (see :class:`~specdec.drafters.options.SparseKVOptions`). A row sees the
            same slots whether it is forwarded alone or at depth d of a chain or tree.
            ``None`` = the whole context.
        lm_head: native backend only: a callable ``[n, hidden_size]`` -> ``[n, m]`` that
            replaces the model's LM head for this item's rows, e.g. a head over a subset of
            the vocabulary (:meth:`specdec.runtime.model.NativeDecoder.vocab_head`, for a
            self-draft's FR-Spec vocabulary); ``logits`` are then its ``m`` columns.
            ``None`` = the model's own head (``[n, vocab_size]``).
    """

    token_ids: Sequence[int] | torch.Tensor
    cache: KVCacheLike
    positions: Sequence[int] | torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    num_logits: int = 0
    prefill: bool | None = None
    kv_window: tuple[int, ...] | None = None
    lm_head: Callable[..., torch.Tensor] | None = None


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
        capture: Sequence[int] = (),
    ) -> ForwardOutput:
        """:meth:`forward` plus hidden states; ``layers`` (a subset of the decoder layers,
        for early exit / layer skip sharing the cache) only on the native backend;
        ``capture``: hidden-state indices to return for every row (see
        :attr:`ForwardOutput.captured`)."""

    def forward_batch_full(
        self, items: Sequence[BatchItem], capture: Sequence[int] = ()
    ) -> list[ForwardOutput]:
        """:meth:`forward_batch` with hidden states: per item a :class:`ForwardOutput`
        whose ``captured`` holds the ``capture`` indices for every row."""

    def head_view(self) -> HeadView:
        """What a draft head reads of the model: its shape, token embedding and LM head."""


@dataclass
class ForwardOutput:
    """A forward's logits and hidden states (``forward_full`` of either backend).

    Attributes:
        logits: ``[n, vocab_size]`` float32.
        hidden: ``[n, hidden_size]`` in the model dtype: the final-normed hidden states the
            LM head reads (transformers' last ``hidden_states``; the features draft heads
            such as EAGLE are trained on), for the ``n`` rows that have logits.
        captured: ``[T, len(capture) * hidden_size]`` in the model dtype, for **every**
            row of the forward (``T`` tokens, whatever ``num_logits``): the hidden states
            named by ``capture``, concatenated in that order; ``None`` without ``capture``.
            Indices follow transformers' ``hidden_states``: ``0`` is the token embedding,
            ``i`` the input of decoder layer ``i`` (the residual stream after layer
            ``i - 1``), ``num_layers`` the final-normed state. EAGLE-3 (Li et al. 2025,
            arXiv:2503.01840, Sec. 3.2) fuses a low, a middle and a high one; EAGLE-1/2
            and Medusa read ``num_layers``.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    captured: torch.Tensor | None = None


@dataclass
class HeadView:
    """A target as a draft head sees it (:meth:`Backend.head_view`).

    Attributes:
        name: the model's name.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size:
            its shape.
        vocab_size: width of its logits.
        rms_eps: its RMSNorm epsilon.
        rope_theta: its rotary base (a head's own attention uses the same rotation).
        embed: ``[vocab_size, hidden_size]`` token embedding (shared, not copied).
        lm_head: ``[vocab_size, hidden_size]`` LM head (the embedding when tied).
        norm: ``[hidden_size]`` the final RMSNorm weight.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor


def check_capture(capture: Sequence[int], num_layers: int) -> list[int]:
    """Validate hidden-state indices (``0 .. num_layers``, see
    :attr:`ForwardOutput.captured`).

    Raises:
        ValueError: an index outside ``[0, num_layers]``.
    """
    out = [int(i) for i in capture]
    bad = [i for i in out if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"hidden-state indices {bad} are outside 0..{num_layers} (0 = embedding, "
            f"{num_layers} = final-normed)"
        )
    return out


def head_view_from_config(name: str, module, num_layers: int) -> HeadView:
    """A :class:`HeadView` of a transformers causal LM (Llama-family config names).

    Raises:
        ValueError: the model is not Llama-like (no final ``norm``, no
            ``intermediate_size``), which draft heads need.
    """
    config = module.config
    inner = getattr(module, "model", module)
    if not hasattr(inner, "norm") or not hasattr(config, "intermediate_size"):
        raise ValueError(
            f"draft heads need a Llama-family target (Llama, Mistral, Qwen2, Qwen3); "
            f"{name} is a {getattr(config, 'model_type', type(module).__name__)}"
        )
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return HeadView(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(module.get_output_embeddings().weight.shape[0]),
        rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        embed=module.get_input_embeddings().weight.detach(),
        lm_head=module.get_output_embeddings().weight.detach(),
        norm=inner.norm.weight.detach(),
    )


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

    def forward_batch_full(
        self, items: Sequence[BatchItem], capture: Sequence[int] = ()
    ) -> list[ForwardOutput]:
        """A ragged batch as one :meth:`forward_full` per sequence (the native runtime
        overrides this with one pass).

        Returns:
            per item, a :class:`ForwardOutput` with ``captured`` ``[T, len(capture) *
            hidden_size]`` for every row (``None`` when ``capture`` is empty).
        """
        return [
            self.forward_full(
                item.token_ids,
                item.cache,
                item.num_logits,
                item.positions,
                item.tree_mask,
                capture=capture,
            )  # fmt: skip
            for item in items
        ]

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
        """Run throwaway forwards of the given lengths so first-call costs leave timings:
        each as a prompt (from an empty cache) and as a verification (rows after a cached
        token), the two paths a forward of that many rows can take. Without the second,
        the first 2-row verification of a run took 9.0 ms against 6.3 afterwards, and the
        cost controller read that as the price of one draft token (the native backend,
        2026-12-05)."""
        for n in num_tokens:
            cache = self.new_cache(n + 1)
            self.forward([0] * n, cache)  # a prompt
            cache.truncate(1)
            self.forward([0] * n, cache)  # rows after a cached token
