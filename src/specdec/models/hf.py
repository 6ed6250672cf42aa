"""Backend for any transformers causal LM: forward with explicit positions into a KVCache."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.kv_cache import KVCache
from specdec.models.base import (
    BackendBase,
    ForwardOutput,
    HeadView,
    check_capture,
    head_view_from_config,
)
from specdec.tokenizer import Tokenizer, model_eos_token_ids
from specdec.trees.tree import tree_attention_bias


class HFModel(BackendBase):
    """A transformers causal LM as specdec drives it (target or draft), and the tokenizer it
    was loaded with.

    Args:
        model: a ``transformers`` causal LM (``PreTrainedModel``) in eval mode.
        tokenizer: its tokenizer (``PreTrainedTokenizerBase``, or a
            :class:`~specdec.tokenizer.Tokenizer`).
        name: a label for logs and reports.

    Attributes:
        tokenizer: the :class:`~specdec.tokenizer.Tokenizer` (its EOS ids include the
            model's configured ``eos_token_id``); not used by the forward.
        vocab_size: width of the logits (may exceed ``len(tokenizer)`` when the embedding
            matrix is padded).
        max_context: maximum sequence length (prompt + output), in tokens.
        device, dtype: where the weights live and their dtype.
    """

    #: Who runs the forward (``"native"`` for :class:`~specdec.models.native.NativeModel`).
    backend = "hf"

    def __init__(self, model, tokenizer, name: str = "model") -> None:
        self.model = model.eval()
        self.name = name
        #: the GGUF file the weights were dequantized from (the native backend can run its
        #: quantized blocks as they are), else ``None``
        self.gguf_path = None
        #: a folder where the native backend may keep that file's quantized blocks once
        #: read (beside the GGUF's converted copy in the model cache), else ``None``
        self.gguf_cache: Path | None = None
        self.tokenizer = Tokenizer.of(tokenizer, model_eos_token_ids(model), name)
        config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = _max_context(config, self.tokenizer.hf)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty :class:`KVCache` sized for ``capacity`` tokens."""
        return KVCache(self.num_layers, capacity)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: KVCache,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids`` and append their keys/values to ``cache`` (after its cursor).

        Causal by default: token ``j`` sits at position ``cache.num_tokens + j`` and sees
        everything before it. With ``tree_mask`` this is tree attention (SpecInfer, Miao
        et al. 2024, §3.2): each new token sees every cached position before the tree and,
        within the tree, only the positions its mask row allows (its ancestors and itself).

        Args:
            token_ids: ``[T]`` int token ids (T >= 1).
            cache: the sequence's cache.
            num_logits: return logits for only the last ``num_logits`` positions
                (0 = all T). Prefill uses 1 to skip the LM head on the prompt.
            positions: ``[T]`` absolute int positions (rotary embeddings); default
                ``cache.num_tokens + arange(T)``. Tree nodes use prefix length + depth.
            tree_mask: ``[T, S]`` bool, ``S >= T``: which of the last ``S`` key positions
                (the ``S - T`` tree tokens already cached, then these ``T``) each new token
                attends to. Converted to an additive float mask.

        Returns:
            ``[T or num_logits, vocab_size]`` float32 logits on the model's device.

        Raises:
            ValueError: ``tree_mask`` or ``positions`` has the wrong shape.
        """
        return self._forward(token_ids, cache, num_logits, positions, tree_mask, False)[0]

    @torch.inference_mode()
    def _forward(self, token_ids, cache, num_logits, positions, tree_mask, hidden, capture=()):
        """``(logits, final-normed hidden states or None, captured or None)`` (see
        :meth:`forward` and :meth:`forward_full`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        num_new = ids.shape[1]
        start = cache.num_tokens
        if positions is None:
            pos = torch.arange(start, start + num_new, device=self.device).view(1, -1)
        else:
            pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).view(1, -1)
            if pos.shape[1] != num_new:
                raise ValueError(f"{pos.shape[1]} positions for {num_new} tokens")
        extra = {}
        if tree_mask is not None:
            if (
                tree_mask.dim() != 2
                or tree_mask.shape[0] != num_new
                or not (num_new <= tree_mask.shape[1] <= start + num_new)
            ):
                raise ValueError(
                    f"tree_mask must be [{num_new}, S] with {num_new} <= S <= "
                    f"{start + num_new}, got {tuple(tree_mask.shape)}"
                )
            past_len = start + num_new - tree_mask.shape[1]
            extra["attention_mask"] = tree_attention_bias(
                tree_mask, past_len, self.dtype, self.device
            )
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=num_logits,
            output_hidden_states=hidden,
            **{self._cache_kwarg: cache},
            **extra,
        )
        logits = out.logits[0].float()
        if not hidden:
            return logits, None, None
        states = out.hidden_states
        captured = torch.cat([states[i][0] for i in capture], -1) if capture else None
        return logits, states[-1][0, num_new - logits.shape[0] :], captured

    def forward_full(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: KVCache,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        capture: Sequence[int] = (),
    ) -> ForwardOutput:
        """:meth:`forward` with the final-normed hidden states the LM head reads
        (transformers' last ``hidden_states``), ``[n, hidden_size]``, and the
        ``capture`` indices of ``hidden_states`` for every row (see
        :attr:`~specdec.models.base.ForwardOutput.captured`).

        Raises:
            ValueError: ``layers`` given (running a subset of the layers needs the native
                backend), or a capture index outside ``0..num_layers``.
        """
        if layers is not None:
            raise ValueError("running a subset of the layers needs the native backend")
        capture = check_capture(capture, self.num_layers)
        return ForwardOutput(
            *self._forward(token_ids, cache, num_logits, positions, tree_mask, True, capture)
        )

    def head_view(self) -> HeadView:
        """The shape, embedding, LM head and final norm a draft head reads (shared)."""
        return head_view_from_config(self.name, self.model, self.num_layers)


def _max_context(config, tokenizer) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**7:
        return value
    return 2048
