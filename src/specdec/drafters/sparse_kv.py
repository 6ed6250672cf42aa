"""Sparse-KV self-speculation: the target drafts for itself over a small window of its
own KV cache.

Sources:

* StreamingLLM (Xiao et al. 2024, arXiv:2309.17453): a model attending to only the first
  few tokens (the *attention sinks*) and a window of the most recent ones keeps
  predicting well far beyond the window.
* TriForce (Sun et al. 2024, arXiv:2404.11912) and MagicDec (Chen et al. 2025,
  arXiv:2408.11049): at long contexts a decoding step reads the KV cache as much as the
  weights, so the target itself, attending over a small KV budget (StreamingLLM's window,
  or retrieved blocks in TriForce), is a cheap draft that accepts well; MagicDec shows the
  gain grows with batch size, where KV reads dominate.

What this module implements: :class:`SparseKVDrafter`, the target with every layer (or
all but a fixed set, ``skip=``) drafting over the sequence's own KV cache, each draft
forward attending to the cache's first ``sinks`` and last ``recent`` slots plus the draft
tokens (:attr:`specdec.models.base.BatchItem.kv_window`). The window's keys are the full
cache's own slots, read in place: the draft keeps no cache of its own. Its recent part
starts on a 64-slot block after the sinks (``align``), so that the attention kernel reads
a long sequence's packed blocks (:meth:`~specdec.runtime.cache.NativeKVCache.pack_tiles`)
for it as they are instead of packing the window's keys and values on every draft
forward. Draft tokens' keys and values are written at the next slots and rolled back
after drafting (the verification forward rewrites them), exactly as layer skip does
(:mod:`specdec.drafters.layer_skip`, whose sequence state and tree session this drafter
reuses). Positions stay the tokens' true positions (the cached keys carry their rotary
phases), as in TriForce and MagicDec. Below ``min_context`` tokens the drafter proposes
nothing: the window then saves too little of a step.

With ``quantization=`` the draft forwards also run the target's weights on quantized
products (:func:`specdec.drafters.quantized.quantized_draft`, as the ``quantized`` drafter
does): the window saves a draft step's KV reads and the blocks its weight reads. QuantSpec
(Tiwari et al. 2025, arXiv:2502.10424) pairs 4-bit weights with a 4-bit KV cache the same
way; here the KV saving is the window.

The draft proposes from a subset of the vocabulary by default (``vocab=8192``: the 8192
lowest token ids and the sequence's own tokens, :mod:`specdec.drafters.vocab`; FR-Spec,
Zhao et al. 2025, arXiv:2502.14856), its LM head reading a sixth of the full one's rows.

Not implemented: TriForce's retrieval of the top-scoring KV blocks (the window is
StreamingLLM's fixed one) and its hierarchical second draft model.

Losslessness never depends on the window: the drafter only proposes, and sampled drafts
carry their distributions for rejection sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from specdec.config import SamplingParams
from specdec.drafters.layer_skip import FixedSelfDrafter, LayerSkipSequence
from specdec.drafters.options import SparseKVOptions
from specdec.drafters.quantized import quantized_draft
from specdec.trees.builders import Expansion

logger = logging.getLogger(__name__)


class SparseKVDrafter(FixedSelfDrafter):
    """The target drafting over a sinks + recent window of its own KV cache (see the
    module docstring).

    Args:
        target: the target on the native backend.
        options: :class:`~specdec.drafters.options.SparseKVOptions`.

    Attributes:
        kv_window: ``(sinks, recent, align)``.
        sparse_options: the options.
        quantization: the draft's blocks (``"none"``: the target's own products; else as
            :attr:`specdec.drafters.quantized.QuantizedDrafter.quantization`).
        draft_target: the model that runs the draft forwards (the target, or its quantized
            copy).
        kernels: the quantized draft's kernel per product (``None`` without one).

    Raises:
        ValueError: the target is not on the native backend, or ``skip`` names layers
            outside the model or skips every layer; with a ``quantization``, the errors of
            :class:`~specdec.drafters.quantized.QuantizedDrafter`.
    """

    #: most draft tokens are accepted: the draft is the target itself, over a window of
    #: its KV cache (measured at 8k tokens on the three documents of
    #: benchmarks/long_context_cpu, k = 5: mean acceptance lengths 4.1-5.8, about 0.87-0.98
    #: per draft token), so the ``cost`` controller starts from 0.8 rather than its generic
    #: 0.3 (from which it starts with drafting off and learns only from one-token probes,
    #: spaced 20 or more steps apart by their cost at 8k tokens: a few tests per answer)
    acceptance_prior = 0.8

    def __init__(self, target, options: SparseKVOptions | None = None) -> None:
        self.sparse_options = options = options or SparseKVOptions()
        why = "it attends over a window of the runtime's KV cache"
        super().__init__(
            target, "sparse-kv", why, options.skip, options.confidence, options.lookup,
            options.vocab,
        )  # fmt: skip
        self.kv_window = (options.sinks, options.recent, options.align)
        self.quantization = options.quantization
        self.kernels: dict[str, str] | None = None
        if options.quantization != "none":
            self.quantization, self.draft_target = quantized_draft(target, options, "sparse-kv")
            self.kernels = dict(self.draft_target.decoder.quant_kernels)
        self._told_short = False

    def below_min_context(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens is too short to draft; says so once per
        drafter (a warning naming ``min_context``), so a user who sees no speculation on a
        short prompt knows why."""
        limit = self.sparse_options.min_context
        if length >= limit:
            return False
        if not self._told_short:
            self._told_short = True
            logger.warning(
                "sparse-kv drafts nothing while a sequence is shorter than min_context=%d "
                "tokens (this one has %d): plain steps until then; to draft earlier set "
                "min_context=N in its options (sparse-kv:min_context=N; inside a hybrid, "
                "hybrid:model=sparse-kv;min_context=N)", limit, length,
            )  # fmt: skip
        return True

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> SparseKVSequence:
        """A sequence's state; it drafts once the engine attaches its cache."""
        return SparseKVSequence(self, params)


class SparseKVSequence(LayerSkipSequence):
    """One sequence's windowed self-drafting (below ``min_context`` tokens: nothing)."""

    def _no_draft(self, token_ids: Sequence[int]) -> bool:
        """No draft while the sequence is shorter than ``min_context``."""
        return self.drafter.below_min_context(len(token_ids))

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams):
        """A tree session over the KV window; below ``min_context`` one that offers no
        candidates (the step verifies the root alone)."""
        if self.drafter.below_min_context(len(token_ids)):
            self._used = None
            return _EmptyTreeSession()
        return super().tree_session(token_ids, params)


class _EmptyTreeSession:
    """A tree session with no candidates anywhere: a plain step."""

    def add(self, parent: int, token: int) -> int:  # pragma: no cover - never called
        raise ValueError("this tree session offers no candidates")

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        return [Expansion([], [], None) for _ in nodes]

    def close(self) -> None:
        pass
