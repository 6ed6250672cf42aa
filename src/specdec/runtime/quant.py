"""Weight-only quantized matrices in llama.cpp's GGUF block formats (Q4_1, Q8_0).

Why: a decoding step streams every weight from memory once, so its time is the weights'
bytes over the memory bandwidth. llama.cpp runs the embedded SmolLM2 from its 4-bit GGUF
(Q4_1: 5.0 bits per weight; the tied embedding / LM head in Q8_0: 8.5 bits), about 3.4x
fewer bytes than bfloat16. The native runtime can keep those blocks as they are and
expand them block by block inside its own product kernel (``csrc/gemm.cpp``,
:func:`specdec.runtime.kernels.quant_gemm`).

What a quantized product computes: ``y = x W^T`` in float32 arithmetic, with ``W`` the
dequantized matrix exactly (Q4_1: ``w = d q + m``; Q8_0: ``w = d q``; ``d``, ``m`` float16
per 32 weights, computed in float32 as gguf-py and ggml dequantize) and ``x`` converted to
float32, the result cast to the model's dtype. So a float32 quantized model is *the same
model* as the dense float32 copy transformers loads from the same GGUF, not an
approximation of it; a bfloat16 one keeps the file's weights exactly (the dense bfloat16
copy rounds them to 8 bits of mantissa) and rounds activations to bfloat16 between
products (that is the default ``fma`` kernel; the opt-in ``q8`` kernel instead rounds the
activations to 8 bits per block, as llama.cpp does: see :data:`QUANT_KERNELS`). The
product is row-invariant by construction (the dense float32 ``stream`` kernel's arithmetic
on those values), so exact mode holds; :class:`QuantLinear` checks
that once per shape before exact mode uses it, as calibration checks every dense
formulation.

With bfloat16 activations on a CPU with AMX-BF16 there is a second kernel, ``amx``
(:func:`~specdec.runtime.kernels.amx_quant_gemm`): ``y = sum over blocks of d (x . q) +
m S(x)`` with the integers ``q`` on AMX tiles (exact in bfloat16: still the file's weights
exactly), float32 accumulation. It reads the same bytes, costs about 1.1-1.4x the float32
kernel for one row but about the same from 4 rows and 2.3x / 2.8x less for 16 / 64 rows
(measured on a 2-core Xeon), so verification and batches get cheap. On a CPU with
AVX512-BF16 but no AMX (AMD Zen 4) the same arithmetic runs as ``dpbf16``
(:func:`~specdec.runtime.kernels.dpbf16_quant_gemm`): one VDPBF16PS lane per output, so a
tile row's integers expand once for every row and no horizontal sums remain; measured on
a 2-core Zen 4 over SmolLM2's products it is 1.3-1.7x faster than ``fma`` for one row and
2-2.6x for five. The kernels round differently, so a model runs one of them per product,
for every row count: :func:`quant_kernel_choices` measures those available once per
machine and model and keeps the best exact-mode score (one row, plus a quarter of 16 and
of 64 rows, as for dense products); ``SPECDEC_QUANT_KERNEL=fma|amx|dpbf16`` forces one.

Sources of quantized matrices:

* :func:`gguf_matrices`: a GGUF file's own Q4_1 / Q8_0 tensors (llama.cpp's layout; the
  q and k rows un-permuted as transformers does when it dequantizes);
* :func:`quantize`: any dense matrix, with llama.cpp's reference quantizers (via gguf-py's
  ``quants``), for ``--quantization q8_0 | q4_1`` on a model that is not quantized.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.option import env_switch

logger = logging.getLogger(__name__)

#: Block formats the kernel runs: name -> (kernel code, bytes per block of 32 weights).
KINDS = {"q4_1": (0, 20), "q8_0": (1, 34)}
#: Weights per block.
BLOCK = 32
#: ``quantization`` values of the loader: ``none`` (dense), ``gguf`` (the file's own
#: blocks), or a format to quantize dense weights to.
QUANTIZATIONS = ("none", "gguf", "q8_0", "q4_1")
#: A prefill chunk below this many rows always runs on the quantized kernel; from it on,
#: the prefill plan (:attr:`specdec.runtime.prefill.PrefillPlan.quantized_to`, measured)
#: chooses between the kernel and expanding the whole matrix for PyTorch's (oneDNN's)
#: dense product, which wins on long, compute-bound chunks.
PREFILL_DENSE_ROWS = 16
#: Whether prompt chunks keep a matrix's dense expansion between chunks: ``auto`` (unset:
#: up to :data:`KEEP_DENSE_SHARE` of the memory available when the first one is kept),
#: ``on`` (all of them) or ``off`` (expand per chunk). See :class:`DenseKeeper`.
KEEP_DENSE_ENV = "SPECDEC_KEEP_DENSE"
#: ``auto``'s budget: this fraction of the memory available (Linux ``MemAvailable``).
KEEP_DENSE_SHARE = 0.25


@dataclass
class QuantizedMatrix:
    """A ``[N, K]`` matrix in a GGUF block format.

    Attributes:
        kind: ``"q4_1"`` or ``"q8_0"``.
        blocks: ``[N, K / 32 * bytes per block]`` uint8, ggml's block layout, row-major.
        shape: ``(N, K)``.
    """

    kind: str
    blocks: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown block format {self.kind!r}; known: {', '.join(KINDS)}")
        n, k = self.shape
        per_block = KINDS[self.kind][1]
        if k % BLOCK or tuple(self.blocks.shape) != (n, k // BLOCK * per_block):
            raise ValueError(
                f"{self.kind} blocks of shape {tuple(self.blocks.shape)} do not hold a "
                f"[{n}, {k}] matrix (K a multiple of {BLOCK}, {per_block} bytes per block)"
            )
        if self.blocks.dtype != torch.uint8:
            raise ValueError(f"blocks must be uint8, got {self.blocks.dtype}")

    @property
    def nbytes(self) -> int:
        """Bytes a product streams."""
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> QuantizedMatrix:
        """The matrix of the rows ``index`` (blocks are per row, so rows reorder freely)."""
        blocks = self.blocks[index].contiguous()
        return QuantizedMatrix(self.kind, blocks, (index.numel(), self.shape[1]))


def concat(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """Row-wise concatenation (e.g. q, k, v into one fused matrix).

    Raises:
        ValueError: the parts differ in format or K.
    """
    kinds = {p.kind for p in parts}
    widths = {p.shape[1] for p in parts}
    if len(kinds) != 1 or len(widths) != 1:
        raise ValueError(f"cannot fuse matrices of formats {kinds} and widths {widths}")
    blocks = torch.cat([p.blocks for p in parts])
    return QuantizedMatrix(parts[0].kind, blocks, (blocks.shape[0], widths.pop()))


def _ggml_type(kind: str):
    from gguf import GGMLQuantizationType

    return {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[kind]


def quantize(weight: torch.Tensor, kind: str) -> QuantizedMatrix:
    """``weight`` ``[N, K]`` (any float dtype; K a multiple of 32) in block format ``kind``,
    rounded as llama.cpp's reference quantizers do (gguf-py's ``quants``).

    Raises:
        ValueError: an unknown format, or K not a multiple of 32.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown block format {kind!r}; known: {', '.join(KINDS)}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{kind} needs K a multiple of {BLOCK}, got a [{n}, {k}] matrix")
    from gguf import quants

    data = quants.quantize(weight.detach().float().cpu().numpy(), _ggml_type(kind))
    return QuantizedMatrix(kind, torch.from_numpy(np.ascontiguousarray(data)), (n, k))


def dequantize(matrix: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[N, K]`` matrix in ``dtype`` (float32 values as gguf-py computes them,
    then cast, e.g. for a prompt chunk's one dense product): the kernel's expansion when the
    C++ extension is available, else gguf-py's reference (the same values; tested)."""
    from specdec.runtime.kernels import kernel_available

    if kernel_available(matrix.blocks.device) and dtype in (
        torch.float32, torch.bfloat16, torch.float16,
    ):  # fmt: skip
        from specdec.runtime.kernels import dequantize_blocks

        return dequantize_blocks(matrix.blocks, KINDS[matrix.kind][0], matrix.shape[1], dtype)
    return reference_dequantize(matrix).to(dtype)


def reference_dequantize(matrix: QuantizedMatrix) -> torch.Tensor:
    """float32 ``[N, K]`` by gguf-py's dequantizer (the oracle for the kernel)."""
    from gguf import quants

    data = matrix.blocks.cpu().numpy()
    return torch.from_numpy(quants.dequantize(data, _ggml_type(matrix.kind)).copy())


# ------------------------------------------------------------------ the product

#: Kernel code of Q4_1 in the kernel's own layout (``csrc/gemm.cpp``, ``Q4_1K``).
Q4_1_KERNEL_LAYOUT = 2
# The 16 nibble bytes of a Q4_1 block as a transposed 4 x 4 array: byte 4c + i of the
# kernel's layout is byte c + 4i of ggml's.
_TRANSPOSE_16 = torch.tensor([b // 4 + 4 * (b % 4) for b in range(16)])


def kernel_layout(matrix: QuantizedMatrix) -> tuple[torch.Tensor, int]:
    """The blocks as the product kernel reads them fastest, and their kernel code.

    Q4_1 blocks are rewritten once (24 bytes per 32 weights instead of 20): ``d`` and
    ``m`` as float32 (exact: every float16 is a float32) and the 16 nibble bytes in the
    order that lets the kernel expand a block with a broadcast, two shifts and two
    permutes (see ``csrc/gemm.cpp``). The weights they stand for are the same bits, so the
    product's result is too (tested). Q8_0 blocks are used as they are.

    Returns:
        ``(blocks, code)``: ``[N, K / 32 * bytes per block]`` uint8 and the ``kind`` for
        :func:`~specdec.runtime.kernels.quant_gemm`.
    """
    if matrix.kind != "q4_1":
        return matrix.blocks, KINDS[matrix.kind][0]
    n, k = matrix.shape
    raw = matrix.blocks.reshape(n, k // BLOCK, 20)
    d = raw[..., 0:2].contiguous().view(torch.float16).float().view(torch.uint8)
    m = raw[..., 2:4].contiguous().view(torch.float16).float().view(torch.uint8)
    nibbles = raw[..., 4:20][..., _TRANSPOSE_16]
    packed = torch.cat([d, m, nibbles], dim=-1).reshape(n, k // BLOCK * 24).contiguous()
    return packed, Q4_1_KERNEL_LAYOUT


#: The q8 kernel's codes for Q4_1 / Q8_0 rows interleaved in groups of 8 (:func:`q8_layout`).
Q8_GROUP_KINDS = {"q4_1": 4, "q8_0": 5}


def q8_layout(matrix: QuantizedMatrix) -> tuple[torch.Tensor, int]:
    """The blocks as the ``q8`` kernel (:func:`~specdec.runtime.kernels.q8_gemm`) reads
    them fastest, and their kernel code.

    N a multiple of 8: the rows interleaved in groups of 8 outputs, per group and block of
    32 k one record of the 8 outputs' float16 ``d`` (then, Q4_1, their 8 ``m``), then
    their integers 4 k at a time per output (Q4_1: vector ``t`` byte ``4j + r`` is output
    ``j``'s file byte ``4t + r``, holding ``q_{4t+r}`` and ``q_{16+4t+r}``; Q8_0: vector
    ``t`` byte ``4j + r`` is ``q_{4t+r}``), so one multiply-add serves 8 outputs (see
    ``csrc/q8.cpp``). The same bytes per weight as the file, made once at load. Other N:
    the file's rows as they are (the same arithmetic, read by slower code).

    Returns:
        ``(blocks, code)``: ``[N, K / 32 * bytes per block]`` uint8 and the ``kind`` for
        ``q8_gemm``.
    """
    n, k = matrix.shape
    if n % 8:
        return matrix.blocks, KINDS[matrix.kind][0]
    nb, size = k // BLOCK, KINDS[matrix.kind][1]
    raw = matrix.blocks.reshape(n // 8, 8, nb, size).transpose(1, 2)  # [group, block, j, bytes]
    parts = [raw[..., 0:2].reshape(n // 8, nb, 16)]  # the 8 d
    if matrix.kind == "q4_1":
        parts.append(raw[..., 2:4].reshape(n // 8, nb, 16))  # the 8 m
        ints = raw[..., 4:20].reshape(n // 8, nb, 8, 4, 4)  # [.., j, t, r]: file byte 4t + r
    else:
        ints = raw[..., 2:34].reshape(n // 8, nb, 8, 8, 4)  # [.., j, t, r]: q_{4t + r}
    parts.append(ints.transpose(2, 3).reshape(n // 8, nb, -1))  # [.., t, j, r]
    blocks = torch.cat(parts, dim=-1).reshape(n, nb * size).contiguous()
    return blocks, Q8_GROUP_KINDS[matrix.kind]


#: Tile kinds of :func:`amx_layout` (``csrc/amx.cpp``) and bytes per tile of 16 x 32 weights.
AMX_KINDS = {"q4_1": (0, 384), "q8_0": (1, 576)}


# Q4_1 tiles store output j's byte of a row at position pos(j): outputs 0, 1, 4, 5, 8, 9,
# 12, 13, then 2, 3, 6, 7, 10, 11, 14, 15 (so one byte-shuffle instruction expands a row;
# see csrc/amx.cpp). Position i holds output _AMX_NIBBLE_ORDER[i].
_AMX_NIBBLE_ORDER = torch.tensor([0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15])


def amx_layout(matrix: QuantizedMatrix) -> tuple[torch.Tensor, int]:
    """The blocks as AMX tiles of 16 outputs x 32 k (:func:`~specdec.runtime.kernels.
    amx_quant_gemm`): per tile the 16 outputs' ``d`` (and ``m`` for Q4_1) as float32
    (exact: every float16 is a float32), then 16 rows, row ``p`` holding each output's
    ``q[2p]``, ``q[2p + 1]`` (Q4_1: as the low and high nibble of one byte, the 16 bytes
    in the order of ``_AMX_NIBBLE_ORDER``; Q8_0: two int8). The weights are the same
    values; N is padded with zero weights to a multiple of 16. Made once per matrix at
    load (Q4_1: 6 bits per weight, Q8_0: 9).

    Returns:
        ``(tiles, kind)``: ``[ceil(N / 16), K / 32, bytes per tile]`` uint8 and the kind.
    """
    n, k = matrix.shape
    nb, kb = -(-n // 16), k // BLOCK
    code, _ = AMX_KINDS[matrix.kind]
    raw = matrix.blocks.reshape(n, kb, KINDS[matrix.kind][1])
    if nb * 16 != n:
        raw = torch.cat([raw, raw.new_zeros((nb * 16 - n, kb, raw.shape[-1]))])

    def scales(lo: int) -> torch.Tensor:  # [nb, kb, 16] float32 as bytes
        v = raw[..., lo : lo + 2].contiguous().view(torch.float16).float().reshape(nb, 16, kb)
        return v.transpose(1, 2).contiguous().view(torch.uint8).reshape(nb, kb, 64)

    if matrix.kind == "q4_1":
        nibbles = raw[..., 4:20]  # byte i: q_i (low nibble), q_{i + 16} (high)
        even, odd = nibbles[..., 0::2], nibbles[..., 1::2]  # bytes 2i, 2i + 1
        # the byte of row p: q[2p] | q[2p + 1] << 4; rows 0-7 from the low nibbles of
        # bytes 2p, 2p + 1, rows 8-15 from the high nibbles of bytes 2p - 16, 2p - 15
        per_row = torch.cat([(even & 15) | ((odd & 15) << 4), (even >> 4) | (odd & 0xF0)], -1)
        rows = per_row.reshape(nb, 16, kb, 16)[:, _AMX_NIBBLE_ORDER]  # [nb, j, kb, p]
        rows = rows.permute(0, 2, 3, 1).reshape(nb, kb, 256)  # [nb, kb, p, j]
        parts = [scales(0), scales(2), rows]
    else:
        q = raw[..., 2:34].reshape(nb, 16, kb, 16, 2).permute(0, 2, 3, 1, 4)
        parts = [scales(0), q.reshape(nb, kb, 512)]
    return torch.cat(parts, dim=-1).contiguous(), code


def dpbf16_layout(matrix: QuantizedMatrix) -> tuple[torch.Tensor, int]:
    """The blocks as the ``dpbf16`` kernel reads them (:func:`~specdec.runtime.kernels.
    dpbf16_quant_gemm`): :func:`amx_layout`'s tiles of 16 outputs x 32 k with the scales
    kept in float16, as in the file (Q4_1: ``d[16]``, ``m[16]``, then the 16 nibble rows,
    320 bytes per tile: 5 bits per weight; Q8_0: ``d[16]`` then the 16 int8 rows, 544
    bytes). The same weights; made once per matrix at load.

    Returns:
        ``(tiles, kind)``: ``[ceil(N / 16), K / 32, bytes per tile]`` uint8 and the kind
        (0 = Q4_1, 1 = Q8_0).
    """
    tiles, code = amx_layout(matrix)
    n_scales = 2 if matrix.kind == "q4_1" else 1
    scales = tiles[..., : 64 * n_scales].contiguous().view(torch.float32)
    half = scales.to(torch.float16).view(torch.uint8)  # exact: they were float16
    return torch.cat([half, tiles[..., 64 * n_scales :]], dim=-1).contiguous(), code


#: The quantized product kernels: ``fma`` (:func:`~specdec.runtime.kernels.quant_gemm`,
#: float32 FMAs on the dequantized weights, any dtype), ``amx`` (:func:`~specdec.
#: runtime.kernels.amx_quant_gemm`, integer weights on AMX tiles, bfloat16 on CPUs with
#: AMX-BF16), ``dpbf16`` (:func:`~specdec.runtime.kernels.dpbf16_quant_gemm`, the amx
#: kernel's arithmetic on AVX512-BF16's pair dot products, bfloat16 on CPUs with
#: AVX512-BF16 such as AMD Zen 4) and ``q8`` (:func:`~specdec.runtime.kernels.q8_gemm`,
#: activations rounded to 8 bits per block of 32 and integer dot products: llama.cpp's
#: arithmetic, any dtype).
#: All are row-invariant for any M; they round differently, so one model runs one kernel
#: per product. ``q8`` changes the activations, so it runs only when asked for
#: (``SPECDEC_QUANT_KERNEL=q8``), never by measurement (:data:`MEASURED_QUANT_KERNELS`).
QUANT_KERNELS = ("fma", "amx", "dpbf16", "q8")
#: The kernels :func:`quant_kernel_choices` times and picks from (all keep the activations).
MEASURED_QUANT_KERNELS = ("fma", "amx", "dpbf16")

_INVARIANT: dict[tuple[str, str, int, torch.dtype], bool] = {}


def _quant_runner(kernel: str, matrix: QuantizedMatrix):
    """``(layout, apply)`` for ``kernel`` on ``matrix``: the blocks in that kernel's layout
    and ``apply(x, layout) -> y``."""
    from specdec.runtime import kernels

    n = matrix.shape[0]
    if kernel == "amx":
        return amx_layout(matrix), lambda x, t: kernels.amx_quant_gemm(x, t[0], t[1], n)
    if kernel == "dpbf16":
        return dpbf16_layout(matrix), lambda x, t: kernels.dpbf16_quant_gemm(x, t[0], t[1], n)
    if kernel == "q8":
        return q8_layout(matrix), lambda x, t: kernels.q8_gemm(x, t[0], t[1])
    return kernel_layout(matrix), lambda x, t: kernels.quant_gemm(x, t[0], t[1])


def check_row_invariance(
    kind: str, k: int, dtype: torch.dtype, most_rows: int = 64, kernel: str = "fma"
) -> bool:
    """Does a row of a quantized product give the bits it gives alone, for every row count
    up to ``most_rows`` and two windows of the input? (Checked once per process and
    ``(kernel, kind, K, dtype)`` on a random matrix of 40 rows: the kernels' arithmetic
    per output does not depend on N.)"""
    key = (kernel, kind, k, dtype)
    if key not in _INVARIANT:
        gen = torch.Generator().manual_seed(0)
        layout, apply = _quant_runner(kernel, quantize(torch.randn(40, k, generator=gen), kind))
        x = torch.randn(most_rows + 7, k, generator=gen).to(dtype)
        alone = torch.cat([apply(x[i : i + 1], layout) for i in range(len(x))])
        ok = all(
            torch.equal(apply(x[s : s + m], layout), alone[s : s + m])
            for m in range(2, most_rows + 1)
            for s in (0, 7)
        )
        if not ok:
            logger.error(
                "the quantized product (%s, %s, K=%d, %s) is not row-invariant here: exact "
                "mode runs it one row at a time",
                kernel, kind, k, dtype,
            )  # fmt: skip
        _INVARIANT[key] = ok
    return _INVARIANT[key]


def forced_quant_kernel() -> str | None:
    """The kernel ``SPECDEC_QUANT_KERNEL`` forces (one of :data:`QUANT_KERNELS`, any case),
    or ``None`` when it is unset, empty or ``auto``.

    Raises:
        ValueError: another value (checked before any model loads: see
            :func:`specdec.models.loading.check_quantization`).
    """
    import os

    forced = os.environ.get("SPECDEC_QUANT_KERNEL", "").strip().lower()
    if forced == "auto":
        return None
    if forced and forced not in QUANT_KERNELS:
        raise ValueError(
            f"SPECDEC_QUANT_KERNEL={forced!r}: expected one of {', '.join(QUANT_KERNELS)} "
            f"or auto (the default: measure {', '.join(MEASURED_QUANT_KERNELS)} where "
            "available and keep the fastest)"
        )
    return forced or None


def available_quant_kernels(dtype: torch.dtype) -> list[str]:
    """The quantized product kernels usable for activations of ``dtype`` here (``q8``
    included: see :data:`QUANT_KERNELS`)."""
    from specdec.runtime.kernels import amx_available, dpbf16_available, kernel_available

    if not kernel_available():
        return []
    if dtype != torch.bfloat16:
        return ["fma", "q8"]
    return ["fma", *["amx"] * amx_available(), *["dpbf16"] * dpbf16_available(), "q8"]


#: Row counts a quantized kernel is timed at: a decoding step, a verification, a batch.
QUANT_ROWS = (1, 16, 64)


def choose_quant_kernel(times: dict[str, list[float]]) -> str:
    """The kernel with the best exact-mode score, as :func:`specdec.runtime.linear.
    _exact_choice` scores dense formulations: its one-row time plus a quarter of its
    16-row time (verification) plus a quarter of its 64-row time (batches).

    Args:
        times: ``{kernel: [ms at each of QUANT_ROWS]}``.
    """
    return min(times, key=lambda k: times[k][0] + 0.25 * times[k][1] + 0.25 * times[k][2])


def quant_kernel_choices(
    quantized: dict[str, list[QuantizedMatrix]], dtype: torch.dtype, repeats: int = 2
) -> dict[str, str]:
    """The kernel each quantized product runs: measured once per machine, dtype and model
    (all layers' matrices, one pass per kernel and row count, the fastest of ``repeats``
    passes kept) and cached in the kernel table beside the dense choices
    (:func:`specdec.runtime.linear.kernel_table_path`); ``SPECDEC_QUANT_KERNEL=fma|amx|dpbf16|q8``
    forces one where it is available (``q8`` runs only so).

    Returns:
        ``{product: "fma" | "amx" | "dpbf16" | "q8"}``.
    """
    import time

    from specdec.runtime import linear

    available = available_quant_kernels(dtype)
    forced = forced_quant_kernel()
    if forced in available:
        return dict.fromkeys(quantized, forced)
    usable = [k for k in available if k in MEASURED_QUANT_KERNELS]
    if forced:
        why = (
            ("this CPU has no AMX-BF16 (or the OS refuses its tile state)"
             if forced == "amx" else "this CPU has no AVX512-BF16 with VBMI")
            if dtype == torch.bfloat16
            else f"{str(dtype).replace('torch.', '')} activations; {forced} computes in bfloat16"
        )  # fmt: skip
        logger.warning(
            "SPECDEC_QUANT_KERNEL=%s is not available here (%s): the kernel measurement "
            "picks runs instead (%s)",
            forced, why, " or ".join(usable) if len(usable) > 1 else "fma",
        )  # fmt: skip
    if len(usable) < 2:
        return dict.fromkeys(quantized, "fma")
    key = f"quant|{linear.machine_key(dtype, torch.device('cpu'))}|{','.join(usable)}"
    model_key = ";".join(
        f"{name}={m[0].kind}:{'x'.join(map(str, m[0].shape))}*{len(m)}"
        for name, m in quantized.items()
    )

    def measure() -> dict:
        logger.info("timing the quantized product kernels (%s)", model_key)
        gen = torch.Generator().manual_seed(0)
        chosen = {}
        for name, matrices in quantized.items():
            k = matrices[0].shape[1]
            x = torch.randn(max(QUANT_ROWS), k, generator=gen).to(dtype)
            times = {}
            for kernel in usable:
                runs = [_quant_runner(kernel, m) for m in matrices]
                times[kernel] = []
                for rows in QUANT_ROWS:
                    best = float("inf")
                    for _ in range(repeats + 1):  # the first pass warms up
                        start = time.perf_counter()
                        for layout, apply in runs:
                            apply(x[:rows], layout)
                        best = min(best, time.perf_counter() - start)
                    times[kernel].append(best * 1e3 / len(runs))
                del runs
            ok = [kn for kn in times if check_row_invariance(matrices[0].kind, k, dtype, kernel=kn)]
            chosen[name] = {"kernel": choose_quant_kernel({kn: times[kn] for kn in ok} or times),
                            "times_ms": times}  # fmt: skip
        return chosen

    entries = linear.measured_entry(key, model_key, measure, "quantized kernel timing")
    return {name: entry["kernel"] for name, entry in entries.items()}


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``, else the free
    physical pages), or ``None`` where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def keep_dense_budget(value: str | None = None) -> float:
    """Bytes of dense expansions prompt chunks may keep, from ``value`` (default: the
    environment's :data:`KEEP_DENSE_ENV`): ``on`` (or ``1`` / ``true``) unlimited, ``off``
    (``0`` / ``false``) none, ``auto`` / unset :data:`KEEP_DENSE_SHARE` of
    :func:`available_memory` (none where that is unknown); any case, spaces ignored.
    Checked before a model loads, with any backend (:func:`specdec.models.loading`).

    Raises:
        ValueError: another value.
    """
    keep = env_switch(KEEP_DENSE_ENV, "a quarter of the memory available", value)
    if keep is not None:
        return math.inf if keep else 0.0
    available = available_memory()
    return 0.0 if available is None else KEEP_DENSE_SHARE * available


class DenseKeeper:
    """Admits dense expansions of quantized matrices for keeping, within a byte budget.

    Why: a prompt chunk of a quantized model from :data:`PREFILL_DENSE_ROWS` rows may run as
    one dense product on the matrix expanded to the model's dtype (the prefill plan's
    choice). Expanding per chunk costs a pass over the blocks and a fresh ``[N, K]``
    allocation each time; measured on a 2-core AMD EPYC Zen 4 with 32 Spec-Bench prompts
    at once (the embedded GGUF, 48 new tokens each, 14 pairs of runs alternated in one
    process), keeping the expansions raised throughput by a median 3.5% (12 pairs of 14
    faster), for 212 MB of bfloat16 copies of the 30 layers' products; one prompt at a
    time showed no difference beyond the machine's drift. The kept values are the
    expansion's exactly, so outputs do not change.

    Matrices are admitted first come, first served until ``budget`` bytes are kept (a
    model too large for it keeps its first layers' and expands the rest per chunk); a
    :class:`QuantLinear` gives its bytes back when it is collected (another model loaded
    later in the same process finds the budget free again).

    Args:
        budget: bytes, or ``None`` to resolve :func:`keep_dense_budget` at the first
            request (so the environment is read when a model first prefills).
    """

    def __init__(self, budget: float | None = None) -> None:
        self.budget = budget
        self.kept = 0
        self._lock = threading.Lock()
        self._told = False

    def admit(self, nbytes: int) -> bool:
        """Whether a dense matrix of ``nbytes`` may be kept (and counts it if so).

        Raises:
            ValueError: a bad :data:`KEEP_DENSE_ENV` (at the first request).
        """
        with self._lock:
            if self.budget is None:
                self.budget = keep_dense_budget()
            if self.kept + nbytes > self.budget:
                if not self._told and self.budget > 0:
                    self._told = True
                    logger.info(
                        "keeping %.0f MB of dense weights for prompt chunks (the budget); "
                        "the other matrices expand per chunk (%s=on keeps all)",
                        self.kept / 1e6, KEEP_DENSE_ENV,
                    )  # fmt: skip
                return False
            if not self.kept:
                logger.info(
                    "keeping dense copies of quantized matrices for prompt chunks (up to %s; "
                    "%s=off expands them per chunk instead)",
                    "all" if math.isinf(self.budget) else f"{self.budget / 1e6:.0f} MB",
                    KEEP_DENSE_ENV,
                )  # fmt: skip
            self.kept += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` admitted before (their matrix is gone)."""
        with self._lock:
            self.kept = max(0, self.kept - nbytes)


#: The keeper every :class:`QuantLinear` asks.
DENSE_KEEPER = DenseKeeper()


class QuantLinear:
    """``y = x W^T + b`` with ``W`` a :class:`QuantizedMatrix` (the interface of
    :class:`specdec.runtime.linear.Linear`).

    Decoding and verification rows run the chosen kernel (:data:`QUANT_KERNELS`) in both
    modes; :meth:`prefill` runs a prompt chunk on the kernel too or, where the prefill plan
    measured that faster for its length, as one dense product on the expanded matrix
    (kept for the next chunks where :data:`DENSE_KEEPER` admits it).

    Args:
        matrix: the quantized ``[N, K]`` weight.
        bias: ``[N]`` or ``None``.
        dtype: the compute dtype (activations and outputs).
        kernel: ``"fma"``, ``"amx"`` or ``"dpbf16"`` (bfloat16 only) or ``"q8"`` (see
            :func:`quant_kernel_choices`).

    Raises:
        ValueError: an unknown kernel, or ``amx`` / ``dpbf16`` for another dtype than
            bfloat16.
    """

    def __init__(
        self,
        matrix: QuantizedMatrix,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: str = "fma",
    ):
        if kernel not in QUANT_KERNELS:
            raise ValueError(f"unknown quantized kernel {kernel!r}; known: {QUANT_KERNELS}")
        if kernel in ("amx", "dpbf16") and dtype != torch.bfloat16:
            raise ValueError(f"the {kernel} quantized kernel computes in bfloat16, not {dtype}")
        self.matrix = matrix
        self.bias = bias
        self.kernel = kernel
        self.layout, self._apply = _quant_runner(kernel, matrix)
        invariant = check_row_invariance(matrix.kind, matrix.shape[1], dtype, kernel=kernel)
        self.tile = 64 if invariant else 1
        self._dense: dict[torch.dtype, torch.Tensor] = {}  # kept expansions (see dense)

    @property
    def streamed_bytes(self) -> int:
        """Bytes a product reads from memory: the blocks in the chosen kernel's layout
        (Q4_1: 24 bytes per 32 weights for ``fma``, 6 bits per weight for ``amx``, the
        file's 20 bytes per 32 for ``q8``)."""
        return self.layout[0].numel() * self.layout[0].element_size()

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``x``: ``[M, K]``; returns ``[M, N]`` in ``x``'s dtype."""
        if exact and self.tile < x.shape[0]:
            y = torch.cat([self._apply(x[i : i + self.tile], self.layout)
                           for i in range(0, x.shape[0], self.tile)])  # fmt: skip
        else:
            y = self._apply(x, self.layout)
        return y if self.bias is None else y + self.bias

    def prefill(
        self, x: torch.Tensor, upcast: bool = False, quantized: bool = False
    ) -> torch.Tensor:
        """A prompt chunk's product (the same call for the same chunk, so the same bits):
        below :data:`PREFILL_DENSE_ROWS` rows, or with ``quantized`` (the prefill plan's
        choice for a chunk of this length), the quantized kernel; else one dense product on
        the dequantized matrix, in ``x``'s dtype or, with ``upcast``, in float32 (the
        dequantized values unrounded, the result rounded once to ``x``'s dtype; see
        :mod:`specdec.runtime.prefill`)."""
        if quantized or x.shape[0] < PREFILL_DENSE_ROWS:
            return self(x)
        if upcast:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.dense(torch.float32), bias).to(x.dtype)
        return F.linear(x, self.dense(x.dtype), self.bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized ``[N, K]`` matrix in ``dtype``: expanded by the extension from the
        ``fma`` kernel's own layout or, for the others, the file's blocks, and kept for the
        next call where :data:`DENSE_KEEPER` admits it (the same values either way). Read
        it only: a kept matrix is shared between calls.

        Raises:
            ValueError: a bad ``SPECDEC_KEEP_DENSE`` (at the first expansion).
        """
        kept = self._dense.get(dtype)
        if kept is not None:
            return kept
        if self.kernel in ("fma", "q8"):
            from specdec.runtime.kernels import dequantize_blocks

            if self.kernel == "fma":
                blocks, code = self.layout
            else:
                blocks, code = self.matrix.blocks, KINDS[self.matrix.kind][0]
            weight = dequantize_blocks(blocks, code, self.matrix.shape[1], dtype)
        else:
            weight = dequantize(self.matrix, dtype)
        keeper, nbytes = DENSE_KEEPER, weight.numel() * weight.element_size()
        if keeper.admit(nbytes):
            self._dense[dtype] = weight
            weakref.finalize(self, keeper.release, nbytes)
        return weight


# ------------------------------------------------------------------ GGUF files


#: GGUF tensor names of a Llama-family layer -> the runtime's fused products.
_LAYER_PARTS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


#: Version of the block files :func:`gguf_matrices` keeps (a new layout: a new name).
_BLOCKS_VERSION = 1


def gguf_matrices(
    path: str | Path,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    cache: str | Path | None = None,
) -> tuple[dict[str, list[QuantizedMatrix]], list[str]]:
    """The runtime's products (``qkv``, ``o``, ``gate_up``, ``down`` per layer, and
    ``lm_head``) as the GGUF file stores them, where every part is Q4_1 or Q8_0.

    With ``cache`` (a folder that belongs to this file, made if needed; not a model folder,
    whose safetensors other tools load as weights), the result is kept there as
    safetensors after the first read and read back from it afterwards: gguf-py's reader
    parses every metadata field (the embedded model's 49,152 tokenizer strings included),
    2.4 s of each load of that model against
    under 0.01 s for the kept blocks (2-core Zen 4, 2026-12-05). An unreadable kept file
    is read from the GGUF again and rewritten.

    llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` (for its rotary
    layout); they are permuted back here, as transformers does when it dequantizes (rows
    are independent blocks, so this is a reorder). The LM head is ``output.weight``, or
    the tied ``token_embd.weight``.

    Returns:
        ``(matrices, dense)``: the products found in a supported format, and the names of
        those left dense (another tensor type), for the log.

    Raises:
        ValueError: the file's tensors do not match the model (missing or wrong shape).
    """
    kept = None
    if cache is not None:
        name = f"gguf-blocks-v{_BLOCKS_VERSION}-{num_layers}x{num_heads}x{num_kv_heads}"
        kept = Path(cache) / f"{name}.safetensors"
        loaded = _read_blocks(kept)
        if loaded is not None:
            return loaded
    found, dense = _read_gguf_matrices(path, num_layers, num_heads, num_kv_heads)
    if kept is not None:
        _write_blocks(kept, found, dense)
    return found, dense


def _read_blocks(file: Path):
    """:func:`gguf_matrices`' result kept in ``file`` (``None``: absent or unreadable)."""
    if not file.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            index = json.loads(f.metadata()["index"])
            found = {
                product: [
                    QuantizedMatrix(kind, f.get_tensor(f"{product}.{i}"), (n, k))
                    for i, (kind, n, k) in enumerate(entries)
                ]
                for product, entries in index["found"].items()
            }
        return found, list(index["dense"])
    except Exception as error:  # a damaged or foreign file: read the GGUF again
        logger.warning("ignoring the kept GGUF blocks %s (%s)", file, error)
        return None


def _write_blocks(file: Path, found: dict[str, list[QuantizedMatrix]], dense: list[str]) -> None:
    """Keep :func:`gguf_matrices`' result in ``file`` (written whole, then renamed into place;
    a cache that cannot be written is only logged)."""
    from safetensors.torch import save_file

    tensors = {
        f"{p}.{i}": m.blocks.contiguous() for p, ms in found.items() for i, m in enumerate(ms)
    }
    index = {
        "found": {p: [(m.kind, *m.shape) for m in ms] for p, ms in found.items()},
        "dense": dense,
    }
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"index": json.dumps(index)})
        os.replace(tmp, file)
    except OSError as error:
        logger.warning("cannot keep the GGUF blocks in %s (%s)", file, error)
        tmp.unlink(missing_ok=True)


def _read_gguf_matrices(path, num_layers: int, num_heads: int, num_kv_heads: int):
    """:func:`gguf_matrices` from the file itself."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def matrix(name: str, heads: int | None = None) -> QuantizedMatrix | None:
        if name not in tensors:
            raise ValueError(f"{Path(path).name} has no tensor {name}")
        t = tensors[name]
        kind = t.tensor_type.name.lower()
        if kind not in KINDS:
            return None
        k, n = (int(v) for v in t.shape)  # GGUF lists dimensions innermost first
        blocks = torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8).reshape(n, -1)
        out = QuantizedMatrix(kind, blocks, (n, k))
        if heads is not None:  # undo llama.cpp's q/k permutation (rows only)
            order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
            out = out.rows(order)
        return out

    found: dict[str, list[QuantizedMatrix]] = {}
    dense: list[str] = []
    heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
    for product, parts in _LAYER_PARTS.items():
        per_layer = []
        for i in range(num_layers):
            got = [matrix(f"blk.{i}.{p}.weight", heads.get(p)) for p in parts]
            if any(g is None for g in got) or len({g.kind for g in got}) != 1:
                per_layer = []
                break
            per_layer.append(got[0] if len(got) == 1 else concat(got))
        if per_layer:
            found[product] = per_layer
        else:
            dense.append(product)
    head = matrix("output.weight" if "output.weight" in tensors else "token_embd.weight")
    if head is None:
        dense.append("lm_head")
    else:
        found["lm_head"] = [head]
    return found, dense
