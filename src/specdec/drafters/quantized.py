"""Quantized self-speculation: the target drafts for itself with quantized products.

Sources:

* ML-SpecQD (Georganas et al. 2025, arXiv:2503.13565): a BF16 target's weights cast to a
  4-bit format (MXFP4, weight-only) make a plug-and-play draft with no training and no
  second model to find; measured on CPUs, up to 2x over BF16 decoding (2.72x with a
  second, smaller draft drafting for the quantized one: here that level is prompt lookup,
  ``lookup=``, see :mod:`specdec.drafters.layer_skip`; a second draft *model* is not
  implemented).
* QSpec (Zhao et al. 2025, arXiv:2410.11305): a model already quantized weight-only (W4A16)
  drafts with its activations quantized too (W4A4) and verifies at W4A16, sharing the
  weights and the KV cache between the two phases.
* QuantSpec (Tiwari et al. 2025, arXiv:2502.10424): a self-draft with 4-bit weights and a
  4-bit KV cache sharing the target's architecture (its quantized KV cache is not
  implemented here: the draft reads the target's own cache).

What this module implements: :class:`QuantizedDrafter`, the target's own decoder with
its matrix products quantized (:meth:`~specdec.models.native.NativeModel.quantized_copy`),
drafting over the sequence's own KV cache exactly as layer skip does
(:mod:`specdec.drafters.layer_skip`, whose sequence state and tree session it reuses):
the draft forwards write the draft tokens' keys and values at the next slots, read the
target's keys and values of the verified prefix, and are rolled back; the verification
forward rewrites those slots with the target's own products. The draft keeps no cache and
runs no prefill of its own.

* **Dense target** (``--quantization none``): the draft's blocks are the target's
  weights quantized at load (``q4_1``: the layers to Q4_1 and the LM head to Q8_0, as
  llama.cpp's Q4_1 files; ``q8_0``; ``gguf``: the GGUF file the model came from), about
  a third (Q4_1: 5 bits per weight) of the bytes a 16-bit step reads, run on the ``q8``
  kernel below by default. This is ML-SpecQD's first level, with llama.cpp's block
  formats in place of MXFP4.
* **Quantized target** (a GGUF model on its own blocks, or ``--quantization q4_1``): the
  draft reuses the target's blocks (nothing is quantized again; the ``q8`` kernel reads
  them in its own interleaved layout, made once, about the blocks' size) and runs them on
  the ``q8`` kernel, whose activations are rounded to 8 bits per block of 32 with integer dot
  products (llama.cpp's arithmetic): QSpec's W4A8 draft of a W4A16 target.

Layers can also be skipped (``skip=``, as ``layer-skip:skip=``) for a cheaper draft.

Losslessness never depends on the draft's quantization: the drafter only proposes, and
sampled drafts carry their distributions for rejection sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from specdec.config import SamplingParams
from specdec.drafters.layer_skip import FixedSelfDrafter, LayerSkipSequence
from specdec.drafters.options import QuantizedOptions

logger = logging.getLogger(__name__)


class QuantizedDrafter(FixedSelfDrafter):
    """The target drafting with quantized products over its own KV cache (see the module
    docstring).

    Args:
        target: the target on the native backend, on CPU (the quantized kernels are
            specdec's C++ CPU kernels).
        options: :class:`~specdec.drafters.options.QuantizedOptions`.

    Attributes:
        draft_target: the target's quantized copy that runs the draft forwards.
        quantization: the draft's blocks: ``"q4_1"``, ``"q8_0"``, ``"gguf"`` or
            ``"target"`` (the target's own).
        kernels: the draft's quantized kernel per product.

    Raises:
        ValueError: the target is not on the native backend; a quantization other than
            ``auto`` / ``target`` for a target that is quantized already, or ``target``
            for a dense one; a draft that would be the target itself (its own blocks on
            its own kernels); a kernel that does not run here; ``skip`` naming layers
            outside the model or every layer; and the errors of
            :meth:`~specdec.models.native.NativeModel.quantized_copy`.
    """

    #: most first draft tokens are accepted: the draft is the target's own weights,
    #: rounded (measured on the embedded model's dense weights: 93-96%; a checkpoint
    #: trained in 16 bits loses more to 4-bit rounding), so the ``cost`` controller
    #: starts from 0.8 rather than its generic 0.3
    acceptance_prior = 0.8

    def __init__(self, target, options: QuantizedOptions | None = None) -> None:
        self.quantized_options = options = options or QuantizedOptions()
        why = "it runs the target's decoder on quantized products over the runtime's KV cache"
        super().__init__(
            target, "quantized", why, options.skip, options.confidence, options.lookup,
            options.vocab,
        )  # fmt: skip
        self.quantization, self.draft_target = quantized_draft(target, options, "quantized")
        self.kernels = dict(self.draft_target.decoder.quant_kernels)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> LayerSkipSequence:
        """A sequence's state; it drafts once the engine attaches its cache."""
        return LayerSkipSequence(self, params)


def quantized_draft(target, options, name: str):
    """``(quantization, draft_target)``: the target's quantized copy that drafts, per
    ``options``' ``quantization`` and ``kernel`` (:func:`draft_plan`); logged.

    Args:
        target: the target on the native backend.
        options: :class:`~specdec.drafters.options.QuantizedOptions` or
            :class:`~specdec.drafters.options.SparseKVOptions` (with a quantization).
        name: the drafter's registry name, for the messages.

    Raises:
        ValueError: as :class:`QuantizedDrafter` (a target off the CPU, blocks that do not
            suit it, a draft that would be the target itself, a kernel that does not run
            here).
    """
    if target.device.type != "cpu":
        raise ValueError(
            f"{name} drafts with quantized products on CPU only (specdec's quantized kernels "
            f"are CPU kernels); the target is on {target.device}"
        )
    quantization, kernel = draft_plan(target, options, name)
    own = set(target.decoder.quant_kernels.values())
    if quantization == "target" and own == {kernel}:
        others = [k for k in target.available_quant_kernels() if k != kernel]
        raise ValueError(
            f"a quantized self-draft on the target's own blocks and kernel ({kernel}) "
            f"is the target itself; choose another kernel ({name}:kernel="
            f"{' or '.join(others) or '...'}) or load the target dense "
            f"(quantization='none' / --quantization none)"
        )
    try:
        draft_target = target.quantized_copy(quantization, kernel)
    except ValueError as exc:
        if "does not run here" not in str(exc):
            raise
        dtype = ", or --dtype bfloat16" if kernel == "dpbf16" else ""
        raise ValueError(
            f"{name}:kernel={kernel}: {exc} (choose one of those{dtype}, or leave kernel= "
            f"out for the default, q8)"
        ) from exc
    logger.info(
        "%s: the draft runs %s blocks on the %s kernel",
        name,
        "the target's own" if quantization == "target" else quantization,
        kernel,
    )
    return quantization, draft_target


def draft_plan(target, options, name: str = "quantized") -> tuple[str, str]:
    """``(quantization, kernel)`` of the draft for ``target``; see
    :class:`~specdec.drafters.options.QuantizedOptions` for the ``auto`` rules.

    Raises:
        ValueError: a quantization that does not suit the target (see
            :class:`QuantizedDrafter`).
    """
    quantized = bool(target.decoder.weights.quantized)
    quantization = options.quantization
    if quantized:
        if quantization not in ("auto", "target", target.quantization):
            raise ValueError(
                f"{target.name} already runs quantized products ({target.quantization}): its "
                f"draft shares them ({name}:quantization=auto), not {quantization!r}; to "
                "draft with other blocks, load the target dense (quantization='none' / "
                "--quantization none)"
            )
        quantization = "target"
    elif quantization == "target":
        raise ValueError(
            f"{target.name} runs dense products: {name}:quantization=target has no "
            "blocks to share (use auto, q4_1, q8_0 or gguf)"
        )
    elif quantization == "auto":
        quantization = "gguf" if getattr(target, "gguf_path", None) else "q4_1"
    return quantization, "q8" if options.kernel == "auto" else options.kernel
