"""The native backend: specdec's own forward (:mod:`specdec.runtime`) for Llama-family
models, behind the backend protocol (:class:`~specdec.models.base.Backend`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.models.base import (
    BackendBase,
    BatchItem,
    ForwardOutput,
    HeadView,
    head_view_from_config,
)
from specdec.models.hf import HFModel
from specdec.runtime.cache import NativeKVCache
from specdec.runtime.kernels import kernel_available
from specdec.runtime.linear import KernelChoice
from specdec.runtime.model import NativeDecoder
from specdec.runtime.quant import (
    QUANTIZATIONS,
    available_quant_kernels,
    gguf_matrices,
    quantize,
)
from specdec.runtime.weights import UnsupportedModel, extract_weights

logger = logging.getLogger(__name__)


class NativeModel(BackendBase):
    """A Llama / Mistral / Qwen2 / Qwen3 model run by specdec's native runtime.

    The forward, the KV cache and the matrix-product kernels are specdec's own; the
    tokenizer and the transformers module (for the transformers baselines of
    ``specdec bench``) are those of the loaded :class:`HFModel`, whose forward is never
    called.

    Args:
        hf: the loaded model (its weights are shared, not copied, except the fused
            q/k/v and gate/up matrices).
        exact: batch-invariant mode (default on): a token's logits are bit-identical
            whether it is decoded alone, verified in a chain or a tree, or computed beside
            other sequences, so greedy speculative output equals plain decoding exactly.
        choices: kernel choices per product (tests); measured or read from the on-disk
            table when ``None``.
        quantization: weight-only quantized products (:mod:`specdec.runtime.quant`):
            ``"none"`` (dense, in the model's dtype), ``"gguf"`` (the GGUF file's own
            Q4_1 / Q8_0 blocks; other tensor types stay dense), ``"q8_0"`` (every product
            quantized to Q8_0 at load) or ``"q4_1"`` (the layers to Q4_1, the LM head to
            Q8_0, as llama.cpp's Q4_1 files do). A quantized model computes with the
            dequantized weights cast to the model's dtype: the same model as the dense
            copy of those weights.

    Raises:
        UnsupportedModel: (a ``ValueError``) the architecture or a feature is not
            implemented natively, or float16 weights on CPU; the message says which.
        ValueError: an unknown ``quantization``, ``gguf`` for a model not loaded from a
            GGUF file, or a quantization without the C++ kernels (no compiler) or off CPU.
    """

    backend = "native"

    def __init__(
        self,
        hf: HFModel,
        exact: bool = True,
        choices: dict[str, KernelChoice] | None = None,
        quantization: str = "none",
    ) -> None:
        first = next(hf.model.parameters())
        if first.dtype == torch.float16 and first.device.type == "cpu":
            raise UnsupportedModel(
                "float16 on CPU: PyTorch's float16 matrix products are slow on CPUs (timing "
                "them to choose kernels alone took over 100 s on a 2-core AMD Zen 4); "
                "bfloat16 takes the same memory and runs natively (--dtype bfloat16)"
            )
        self.hf = hf
        self.name = hf.name
        self.tokenizer = hf.tokenizer
        self.vocab_size = hf.vocab_size
        weights = extract_weights(hf.model, hf.max_context)
        weights.quantized = quantized_products(hf, weights, quantization)
        self.quantization = quantization
        self.decoder = NativeDecoder(weights, exact, choices)
        self._quantized_copies: dict[tuple[str, str | None], NativeModel] = {}
        self.max_context = self.decoder.config.max_context
        self.num_layers = len(self.decoder.layers)

    @property
    def model(self):
        """The transformers module the weights came from (for transformers baselines)."""
        return self.hf.model

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file the model was loaded from (``None`` if it was not), as
        :attr:`HFModel.gguf_path <specdec.models.hf.HFModel.gguf_path>`."""
        return self.hf.gguf_path

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    @property
    def exact(self) -> bool:
        """Whether forwards are batch-invariant (see the class docstring)."""
        return self.decoder.exact

    def new_cache(self, capacity: int = 256) -> NativeKVCache:
        """An empty :class:`~specdec.runtime.cache.NativeKVCache` for ``capacity`` tokens."""
        return self.decoder.new_cache(capacity)

    def forward(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: NativeKVCache,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same contract as :meth:`HFModel.forward` (tokens appended after the cursor,
        causal or tree attention, logits of the last ``num_logits`` rows)."""
        return self.forward_full(token_ids, cache, num_logits, positions, tree_mask).logits

    def forward_full(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        cache: NativeKVCache,
        num_logits: int = 0,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        capture: Sequence[int] = (),
        kv_window: tuple[int, ...] | None = None,
        lm_head=None,
    ) -> ForwardOutput:
        """:meth:`forward` with the hidden states, optionally over a subset of the layers
        (early exit / layer skip sharing this cache), over a window of the cached context
        (``kv_window``, see :attr:`~specdec.models.base.BatchItem.kv_window`), with
        another LM head (``lm_head``, e.g. over a draft vocabulary: see
        :attr:`~specdec.models.base.BatchItem.lm_head` and :meth:`vocab_head`), or
        capturing hidden states of every row; see
        :meth:`specdec.runtime.model.NativeDecoder.forward_full`.

        Raises:
            ValueError: a malformed ``kv_window`` (not ``(sinks >= 0, recent >= 1[,
                align >= 1])``), among the errors of ``forward_full``.
        """
        item = BatchItem(
            token_ids, cache, positions, tree_mask, num_logits, kv_window=kv_window,
            lm_head=lm_head,
        )  # fmt: skip
        return self.decoder.forward_full([item], layers=layers, capture=capture)[0]

    def vocab_head(self, ids: torch.Tensor):
        """An LM head over the vocabulary rows ``ids`` (see
        :meth:`specdec.runtime.model.NativeDecoder.vocab_head`)."""
        return self.decoder.vocab_head(ids)

    def forward_batch_full(
        self,
        items: Sequence[BatchItem],
        capture: Sequence[int] = (),
        layers: Sequence[int] | None = None,
    ) -> list[ForwardOutput]:
        """:meth:`forward_batch` with hidden states, in one pass (see
        :attr:`~specdec.models.base.ForwardOutput.captured`), optionally over a subset
        of the layers (as :meth:`forward_full`: self-drafts of several sequences)."""
        return self.decoder.forward_full(items, layers=layers, capture=capture)

    def head_view(self) -> HeadView:
        """The shape, embedding, LM head and final norm a draft head reads (the weights
        the runtime runs, shared)."""
        view = head_view_from_config(self.name, self.hf.model, self.num_layers)
        w = self.decoder.weights
        view.embed, view.lm_head, view.norm = w.embed, w.lm_head, w.norm
        return view

    def forward_batch(
        self, items: Sequence[BatchItem], exact: bool | None = None
    ) -> list[torch.Tensor]:
        """One forward over several sequences (a ragged batch); see
        :meth:`specdec.runtime.model.NativeDecoder.forward`."""
        return self.decoder.forward(items, exact)

    def available_quant_kernels(self) -> list[str]:
        """The quantized product kernels that run here for this model's activations
        (see :func:`specdec.runtime.quant.available_quant_kernels`; ``[]`` off CPU)."""
        if self.device.type != "cpu":
            return []
        return available_quant_kernels(self.dtype)

    def quantized_copy(self, quantization: str, kernel: str | None = None) -> NativeModel:
        """This model with its products quantized (or on another quantized kernel): a
        self-draft that runs on this model's KV caches (same architecture, dtype and
        cache layout; see :mod:`specdec.drafters.quantized`).

        The embedding, norms, biases and dense products are this model's own tensors
        (shared, not copied); only the quantized blocks and their kernel's layout of them
        are new (with ``quantization == "target"`` the blocks are this model's own and
        only the layout is made). Made once per ``(quantization, kernel)`` and kept:
        drafters built for several speculation configurations share it.

        Args:
            quantization: ``"q4_1"``, ``"q8_0"``, ``"gguf"`` (as :class:`NativeModel`'s,
                from this model's dense weights or its GGUF file), or ``"target"`` (this
                model's own blocks, for a model that is quantized already).
            kernel: the quantized product kernel of every product (one of
                :data:`~specdec.runtime.quant.QUANT_KERNELS` available here for this
                dtype); ``None`` measures as at load.

        Raises:
            ValueError: ``"target"`` on a dense model, another quantization on a quantized
                one, an unknown quantization, or a kernel that does not run here; and the
                errors of :class:`NativeModel`'s ``quantization``.
        """
        key = (quantization, kernel)
        if key not in self._quantized_copies:
            self._quantized_copies[key] = self._quantized_copy(quantization, kernel)
        return self._quantized_copies[key]

    def _quantized_copy(self, quantization: str, kernel: str | None) -> NativeModel:
        weights = self.decoder.weights
        if quantization == "target":
            if not weights.quantized:
                raise ValueError(f"{self.name} runs dense products: it has no blocks to share")
            blocks = weights.quantized
        elif weights.quantized:
            raise ValueError(
                f"{self.name} already runs quantized products ({self.quantization}): a "
                "quantized copy shares its blocks (quantization 'target')"
            )
        else:
            blocks = quantized_products(self.hf, weights, quantization)
            if blocks is None:
                raise ValueError("a quantized copy needs a quantization, not 'none'")
        kernels = None
        if kernel is not None:
            available = self.available_quant_kernels()
            if kernel not in available:
                dtype = str(self.dtype).replace("torch.", "")
                raise ValueError(
                    f"quantized kernel {kernel!r} does not run here for {dtype} activations; "
                    f"available: {', '.join(available) or 'none (no C++ kernels)'}"
                )
            kernels = dict.fromkeys(blocks, kernel)
        copy = object.__new__(NativeModel)
        copy.__dict__.update(self.__dict__)
        copy._quantized_copies = {}
        copy.quantization = quantization if quantization != "target" else self.quantization
        copy.decoder = NativeDecoder(
            dataclasses.replace(weights, quantized=blocks),
            self.exact,
            self.decoder.choices,
            quant_kernels=kernels,
        )
        return copy


def quantized_products(hf: HFModel, weights, quantization: str) -> dict | None:
    """The products that run quantized for ``quantization`` (see :class:`NativeModel`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return None
    if weights.embed.device.type != "cpu" or not kernel_available(weights.embed.device):
        raise ValueError(
            f"quantization {quantization!r} needs specdec's C++ kernels on CPU "
            "(a C++ compiler; not SPECDEC_ATTENTION=reference)"
        )
    cfg = weights.config
    if quantization == "gguf":
        if hf.gguf_path is None:
            raise ValueError(
                f"quantization 'gguf' needs a model loaded from a GGUF file; {hf.name} is not "
                "(use q8_0 or q4_1 to quantize it)"
            )
        found, dense = gguf_matrices(
            hf.gguf_path, len(weights.layers), cfg.num_heads, cfg.num_kv_heads,
            cache=hf.gguf_cache,
        )  # fmt: skip
        if dense:
            logger.warning(
                "%s: %s stay dense (their GGUF type is not Q4_1 or Q8_0)", hf.name, ", ".join(dense)
            )
        return found
    layer_kind = quantization
    dense_of = {
        "qkv": [w.qkv for w in weights.layers], "o": [w.o for w in weights.layers],
        "gate_up": [w.gate_up for w in weights.layers],
        "down": [w.down for w in weights.layers],
    }  # fmt: skip
    out = {name: [quantize(w, layer_kind) for w in ws] for name, ws in dense_of.items()}
    out["lm_head"] = [quantize(weights.lm_head, "q8_0")]
    return out
