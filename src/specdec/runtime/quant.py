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
products. The product is row-invariant by construction (the dense float32 ``stream``
kernel's arithmetic on those values), so exact mode holds; :class:`QuantLinear` checks
that once per shape before exact mode uses it, as calibration checks every dense
formulation.

Sources of quantized matrices:

* :func:`gguf_matrices`: a GGUF file's own Q4_1 / Q8_0 tensors (llama.cpp's layout; the
  q and k rows un-permuted as transformers does when it dequantizes);
* :func:`quantize`: any dense matrix, with llama.cpp's reference quantizers (via gguf-py's
  ``quants``), for ``--quantization q8_0 | q4_1`` on a model that is not quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: Block formats the kernel runs: name -> (kernel code, bytes per block of 32 weights).
KINDS = {"q4_1": (0, 20), "q8_0": (1, 34)}
#: Weights per block.
BLOCK = 32
#: ``quantization`` values of the loader: ``none`` (dense), ``gguf`` (the file's own
#: blocks), or a format to quantize dense weights to.
QUANTIZATIONS = ("none", "gguf", "q8_0", "q4_1")
#: A prefill chunk of at least this many rows expands the whole matrix once and runs
#: PyTorch's (oneDNN's) dense product on it: prefill is compute-bound, where the
#: few-row kernel is not the right tool.
PREFILL_DENSE_ROWS = 16


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


_INVARIANT: dict[tuple[str, int, torch.dtype], bool] = {}


def check_row_invariance(kind: str, k: int, dtype: torch.dtype, most_rows: int = 64) -> bool:
    """Does a row of a quantized product give the bits it gives alone, for every row count
    up to ``most_rows`` and two windows of the input? (Checked once per process and
    ``(kind, K, dtype)`` on a random matrix of 40 rows: the kernel's arithmetic per output
    does not depend on N.)"""
    key = (kind, k, dtype)
    if key not in _INVARIANT:
        from specdec.runtime.kernels import quant_gemm

        gen = torch.Generator().manual_seed(0)
        blocks, code = kernel_layout(quantize(torch.randn(40, k, generator=gen), kind))
        x = torch.randn(most_rows + 7, k, generator=gen).to(dtype)
        alone = torch.cat([quant_gemm(x[i : i + 1], blocks, code) for i in range(len(x))])
        ok = all(
            torch.equal(quant_gemm(x[s : s + m], blocks, code), alone[s : s + m])
            for m in range(2, most_rows + 1)
            for s in (0, 7)
        )
        if not ok:
            logger.error(
                "the quantized product (%s, K=%d, %s) is not row-invariant here: exact mode "
                "runs it one row at a time",
                kind, k, dtype,
            )  # fmt: skip
        _INVARIANT[key] = ok
    return _INVARIANT[key]


class QuantLinear:
    """``y = x W^T + b`` with ``W`` a :class:`QuantizedMatrix` (the interface of
    :class:`specdec.runtime.linear.Linear`).

    Decoding and verification rows run :func:`~specdec.runtime.kernels.quant_gemm` in
    both modes; :meth:`prefill` runs a prompt chunk of at least
    :data:`PREFILL_DENSE_ROWS` rows as one dense product on the expanded matrix.

    Args:
        matrix: the quantized ``[N, K]`` weight.
        bias: ``[N]`` or ``None``.
        dtype: the compute dtype (activations and outputs).
    """

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None, dtype: torch.dtype):
        self.matrix = matrix
        self.bias = bias
        self.blocks, self.code = kernel_layout(matrix)
        self.tile = 64 if check_row_invariance(matrix.kind, matrix.shape[1], dtype) else 1

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``x``: ``[M, K]``; returns ``[M, N]`` in ``x``'s dtype."""
        from specdec.runtime.kernels import quant_gemm

        if exact and self.tile < x.shape[0]:
            y = torch.cat([quant_gemm(x[i : i + self.tile], self.blocks, self.code)
                           for i in range(0, x.shape[0], self.tile)])  # fmt: skip
        else:
            y = quant_gemm(x, self.blocks, self.code)
        return y if self.bias is None else y + self.bias

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """A prompt chunk's product (the same call for the same chunk, so the same bits)."""
        if x.shape[0] < PREFILL_DENSE_ROWS:
            return self(x)
        from specdec.runtime.kernels import dequantize_blocks

        dense = dequantize_blocks(self.blocks, self.code, self.matrix.shape[1], x.dtype)
        return F.linear(x, dense, self.bias)


# ------------------------------------------------------------------ GGUF files


#: GGUF tensor names of a Llama-family layer -> the runtime's fused products.
_LAYER_PARTS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def gguf_matrices(
    path: str | Path, num_layers: int, num_heads: int, num_kv_heads: int
) -> tuple[dict[str, list[QuantizedMatrix]], list[str]]:
    """The runtime's products (``qkv``, ``o``, ``gate_up``, ``down`` per layer, and
    ``lm_head``) as the GGUF file stores them, where every part is Q4_1 or Q8_0.

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
