"""Compiled kernels of the native runtime (a small C++ extension, built on first use).

:func:`ragged_attention` runs the attention of every row of a forward that reads a
sequence's KV cache (decoding, chains, token trees, later prefill chunks), for all the
sequences of the batch in one call per layer, instead of a Python loop over the
sequences with a dozen small PyTorch operations each. Its arithmetic per row is a fixed
loop over the row's own keys (``csrc/attention.cpp``), so it is batch-invariant by
construction: exact mode uses it when it is available.

The extension is compiled with the machine's C++ compiler the first time it is needed
(about a minute; cached by ``torch.utils.cpp_extension`` under
``~/.cache/torch_extensions``). Without a compiler, or with ``SPECDEC_ATTENTION=reference``,
the runtime uses the PyTorch reference (:func:`specdec.runtime.attention.attention_exact`)
and says so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "attention.cpp"
_module = None
_tried = False


def _load():
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("SPECDEC_ATTENTION", "").lower() == "reference":
        logger.info("SPECDEC_ATTENTION=reference: the PyTorch reference attention runs")
        return None
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]
        name = f"specdec_attention_{digest}"
        if not _built(name):
            logger.warning(
                "compiling specdec's attention kernel (first use on this machine only, about "
                "a minute)"
            )
        _module = load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: the reference path still works
        logger.warning(
            "specdec's attention kernel could not be built (%s); using the slower PyTorch "
            "reference attention",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        _module = None
    return _module


def _built(name: str) -> bool:
    """Whether the extension ``name`` is already compiled (torch's build folder)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private helper of torch: if it moves, just say nothing
        return True
    return any(folder.glob(f"{name}*.so"))


def _last_line(exc: Exception) -> str:
    """The last non-empty line of a build error (the compiler's own message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def kernel_available(device: torch.device | str = "cpu") -> bool:
    """Whether :func:`ragged_attention` can run on ``device`` (CPU only; builds the
    extension on first call)."""
    return torch.device(device).type == "cpu" and _load() is not None


def ragged_attention(
    q: torch.Tensor,
    caches: list[torch.Tensor],
    layer: int,
    row_seq: torch.Tensor,
    row_n: torch.Tensor,
    row_off: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of the rows of a ragged batch over their sequences' KV caches, written
    into ``out`` (one call for all sequences of a layer).

    For row t of sequence ``s = row_seq[t]`` with ``n = row_n[t]`` visible keys (slots
    ``0 .. n-1``, or ``slots[row_off[t] : row_off[t] + n]`` for a token tree row, in
    position order): ``softmax(scale * q_t K^T) V`` per head (grouped-query heads share
    their KV head), scores, softmax and the value sum in float32 in a fixed order (with
    AVX-512: 16-lane partial sums; ``exp`` by a Cephes polynomial, about 1 ulp).

    Args:
        q: ``[T, H, d]`` contiguous queries (rotary applied).
        caches: per sequence, its ``[L, 2, G, C, d]`` contiguous key/value buffer
            (:attr:`~specdec.runtime.cache.NativeKVCache.kv`) in ``q``'s dtype (float32,
            bfloat16 or float16).
        layer: the layer whose keys and values are read.
        row_seq: ``[T]`` int64 index into ``caches`` (``-1``: row not computed here).
        row_n: ``[T]`` int64 visible keys per row.
        row_off: ``[T]`` int64 offset into ``slots`` (``-1``: a prefix of the slots).
        slots: ``[S]`` int64 visible slots of the tree rows, concatenated.
        scale: softmax scale (``1 / sqrt(d)``).
        out: ``[T, H * d]`` contiguous, ``q``'s dtype.

    Raises:
        RuntimeError: the extension is not available (check :func:`kernel_available`),
            or tensors of the wrong shape, layout or dtype.
    """
    _module_or_raise().ragged_attention(
        q, caches, layer, row_seq, row_n, row_off, slots, float(scale), out
    )


def store_kv(
    kv_new: torch.Tensor,
    caches: list[torch.Tensor],
    layer: int,
    row_seq: torch.Tensor,
    row_slot: torch.Tensor,
) -> None:
    """Write row t's new key and value into slot ``row_slot[t]`` of sequence
    ``row_seq[t]``'s cache (one call per layer for the whole batch).

    Args:
        kv_new: ``[T, 2, G, d]`` contiguous new keys (index 0) and values (1).
        caches: per sequence, its ``[L, 2, G, C, d]`` contiguous buffer, ``kv_new``'s dtype.
        layer: the layer written.
        row_seq: ``[T]`` int64 index into ``caches``.
        row_slot: ``[T]`` int64 slot per row (``< C``).

    Raises:
        RuntimeError: the extension is not available, a slot outside its cache, or
            tensors of the wrong shape, layout or dtype.
    """
    _module_or_raise().store_kv(kv_new, caches, layer, row_seq, row_slot)


def _module_or_raise():
    module = _load()
    if module is None:
        raise RuntimeError("the attention kernel is not available (see kernel_available)")
    return module
