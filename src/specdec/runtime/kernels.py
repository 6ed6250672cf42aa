"""Compiled kernels of the native runtime (a small C++ extension, built on first use):
ragged attention, the fused per-layer operations, a matrix product for few rows, and a
bfloat16 matrix product on AMX tiles that is row-invariant for any number of rows.

:func:`ragged_attention` runs the attention of every row of a forward that reads a
sequence's KV cache (decoding, chains, token trees, later prefill chunks), for all the
sequences of the batch in one call per layer, instead of a Python loop over the
sequences with a dozen small PyTorch operations each. Its arithmetic per row is a fixed
loop over the row's own keys (``csrc/attention.cpp``), so it is batch-invariant by
construction: exact mode uses it when it is available.

The extension is compiled with the machine's C++ compiler the first time it is needed
(1-3 minutes, said on standard error; cached by ``torch.utils.cpp_extension`` under
``~/.cache/torch_extensions``, under a name that hashes the sources, the flags and the torch
version, and imported directly from there afterwards). Without a compiler, or with
``SPECDEC_ATTENTION=reference``, the runtime uses the PyTorch reference
(:func:`specdec.runtime.attention.attention_exact`) and says so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
#: The extension's sources (the build is named by a hash of them, ``common.h``, the flags and
#: the CPU's instruction sets).
_SOURCES = (
    _CSRC / "attention.cpp",
    _CSRC / "layer_ops.cpp",
    _CSRC / "gemm.cpp",
    _CSRC / "amx.cpp",
    _CSRC / "dpbf16.cpp",
    _CSRC / "tiles_f32.cpp",
    _CSRC / "q8.cpp",
    _CSRC / "prompt_attention.cpp",
)
#: Headers the sources include (part of the build's name too).
_HEADERS = (_CSRC / "common.h", _CSRC / "quant_tiles.h", _CSRC / "amx_tiles.h")
#: Compiler flags (part of the build's name). No FMA contraction: the fused ops round like
#: PyTorch's separate operations.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]
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

        digest = hashlib.sha256(
            b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
            + " ".join([*_CFLAGS, *_LDFLAGS, torch.__version__]).encode()
            + cpu_flags().encode()
        ).hexdigest()[:10]
        name = f"specdec_kernels_{digest}"
        library = _built(name)
        if library is not None:  # built before, from these very sources and flags
            _module = _import_library(library)
            return _module
        logger.warning(
            "compiling specdec's C++ kernels (first use on this machine only, 1-3 minutes)"
        )
        _clear_stale_lock(name)
        _module = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: the reference path still works
        logger.warning(
            "specdec's C++ kernels could not be built (%s); using the slower PyTorch "
            "reference path",
            _last_line(exc),
        )
        _module = None
    return _module


def cpu_flags(cpuinfo: str | None = None) -> str:
    """The CPU's instruction-set flags: the first ``flags`` (x86) or ``Features`` (Arm)
    line of a ``/proc/cpuinfo`` text (default: this machine's), sorted and space-separated;
    ``""`` without one. Part of the build's name, since ``-march=native`` compiles for this
    CPU only (a cached build from a VM with AVX-512 VNNI would fault on one without, and
    one built without it would leave it unused)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")) and ":" in line:
            return " ".join(sorted(line.split(":", 1)[1].split()))
    return ""


#: A build lock older than this (seconds) was left by an interrupted build: a build takes
#: 1-3 minutes.
STALE_LOCK_SECONDS = 15 * 60


def _clear_stale_lock(name: str, now: float | None = None) -> None:
    """Before building ``name``: torch's build waits, silently and for ever, while the build
    folder holds a ``lock`` file, and a build killed mid-way leaves one behind. Remove a
    lock older than :data:`STALE_LOCK_SECONDS` (logged); for a younger one, say that the
    build waits for it and how to clear it."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except Exception:  # no lock (the usual case), or torch's private helper moved
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing a stale build lock (%.0f minutes old): %s", age / 60, lock)
        lock.unlink(missing_ok=True)
    else:
        logger.warning(
            "waiting for another process building the kernels (lock %s); if none is, "
            "delete that file",
            lock,
        )


def _built(name: str) -> Path | None:
    """The compiled library of the extension ``name`` in torch's build folder, if any (the
    newest when torch versioned several)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private helper of torch: if it moves, build (and say so)
        return None
    libraries = sorted(folder.glob(f"{name}*.so"), key=lambda p: p.stat().st_mtime)
    return libraries[-1] if libraries else None


def _import_library(path: Path):
    """Import a built extension directly: its name is a hash of its sources, flags and torch
    version, so it is current. (``cpp_extension.load`` would run the build tool first, which
    rebuilds when the same sources sit in another checkout.)"""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _last_line(exc: Exception) -> str:
    """The compiler's own message in a build error: its first ``error:`` line, else the
    last non-empty line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return errors[0] if errors else lines[-1] if lines else type(exc).__name__


def kernel_available(device: torch.device | str = "cpu") -> bool:
    """Whether :func:`ragged_attention` can run on ``device`` (CPU only; builds the
    extension on first call)."""
    return torch.device(device).type == "cpu" and _load() is not None


def loaded() -> bool:
    """Whether the extension is loaded already (never builds or loads it): callers outside
    the native runtime use a kernel only where the runtime has paid for it."""
    return _module is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, exactly as ``x.argmax(-1)``: the first index of the maximum, a
    NaN counting as the maximum (the first NaN). A vectorised scan: on a 2-core Xeon with
    AVX-512, 6x faster than PyTorch's for one 49152-wide row, 10x for 64 rows.

    Args:
        x: ``[R, V]`` float32 on the CPU with contiguous rows, V >= 1.

    Returns:
        ``[R]`` int64.

    Raises:
        RuntimeError: the extension is not available, another dtype, or a bad layout.
    """
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _module_or_raise().argmax_rows(x, out)
    return out


def simd() -> str | None:
    """The instruction set the C++ kernels run on this machine: ``"avx512"``, ``"avx2"``
    (AVX2 + FMA, the AVX-512 arithmetic on two 8-lane registers: the same bits) or
    ``"portable"`` (plain C++ loops, several times slower); ``None`` without the kernels."""
    module = _load()
    return module.simd() if module is not None else None


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
    tiles: Sequence[torch.Tensor] = (),
    tiles_upto: torch.Tensor | None = None,
) -> None:
    """Attention of the rows of a ragged batch over their sequences' KV caches, written
    into ``out`` (one call for all sequences of a layer).

    For row t of sequence ``s = row_seq[t]`` with ``n = row_n[t]`` visible keys (slots
    ``0 .. n-1``, or ``slots[row_off[t] : row_off[t] + n]`` for a token tree row, in
    position order): ``softmax(scale * q_t K^T) V`` per head (grouped-query heads share
    their KV head), scores, softmax and the value sum in float32 in a fixed order (with
    AVX-512, or AVX2 with the same bits: 16-lane partial sums; ``exp`` by a Cephes
    polynomial, about 1 ulp). Over a bfloat16 cache on a CPU with AVX512-BF16 the scores
    and value sums run on pair dot products (VDPBF16PS), keys transposed into 16-key
    tiles, and the value sums take the probabilities rounded to bfloat16 (as PyTorch's
    bfloat16 flash kernel; the normalizer sums them in float32). Either way a row's bits
    depend only on its query and keys, not on the rows beside it.

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
        tiles: empty, or per sequence the blocks :func:`pack_kv_tiles` packed from its
            cache (a tensor of the cache's shape and dtype); the bfloat16 kernel with
            AVX512-BF16 reads them instead of packing those blocks again (the same bytes,
            so the same bits), other kernels ignore them.
        tiles_upto: ``[S]`` int64, per sequence the slots its ``tiles`` hold (a multiple
            of 64; 0: none); required with ``tiles``.

    Raises:
        RuntimeError: the extension is not available (check :func:`kernel_available`),
            or tensors of the wrong shape, layout or dtype.
    """
    _module_or_raise().ragged_attention(
        q, caches, layer, row_seq, row_n, row_off, slots, float(scale), out,
        *_tiles_args(tiles, tiles_upto),
    )  # fmt: skip


_NO_TILES = torch.empty(0, dtype=torch.long)


def _tiles_args(tiles, tiles_upto) -> tuple[list[torch.Tensor], torch.Tensor]:
    if not tiles:
        return [], _NO_TILES
    if tiles_upto is None:
        raise ValueError("tiles need tiles_upto (the slots each one holds)")
    return list(tiles), tiles_upto


def packed_kv_available() -> bool:
    """Whether :func:`pack_kv_tiles` runs here and :func:`ragged_attention` reads packed
    blocks: the C++ kernels built with AVX512-BF16 (Zen 4, Sapphire Rapids, Cooper Lake)."""
    module = _load()
    return module is not None and module.packed_kv_available()


def pack_kv_tiles(kv: torch.Tensor, tiles: torch.Tensor, start: int, end: int) -> None:
    """Pack slots ``[start, end)`` of a bfloat16 KV cache, every layer and KV head, into
    ``tiles`` as the attention kernel reads them: each block of 64 keys as 16-key tiles of
    pairs (d, d + 1) and its values as pairs of keys, at the block's own offset. The
    kernel packs every block it reads on every forward otherwise; with the packed blocks
    of a long sequence kept (:meth:`~specdec.runtime.cache.NativeKVCache.pack_tiles`), a
    decoding or verification forward reads them as they are.

    Args:
        kv: ``[L, 2, G, C, d]`` contiguous bfloat16 cache, ``d`` 64 or 128.
        tiles: a contiguous tensor of ``kv``'s shape and dtype, written in place.
        start, end: slots, multiples of 64, ``0 <= start <= end <= C``.

    Raises:
        RuntimeError: the extension is not available, the CPU lacks AVX512-BF16
            (:func:`packed_kv_available`), or tensors or slots outside those rules.
    """
    _module_or_raise().pack_kv_tiles(kv, tiles, int(start), int(end))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row (Zhang & Sennrich 2019): ``x / sqrt(mean(x**2) + eps) * weight``
    in float32, rounded once to ``x``'s dtype (as ``F.rms_norm``; the sum of squares runs
    in a fixed order of 16 partial sums, so a row's bits do not depend on the batch).

    Args:
        x: ``[T, D]`` with contiguous rows (float32, bfloat16 or float16).
        weight: ``[D]`` contiguous, ``x``'s dtype.
        eps: added to the mean square.

    Returns:
        ``[T, D]`` contiguous, ``x``'s dtype.

    Raises:
        RuntimeError: the extension is not available, or shapes, layouts or dtypes differ.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _module_or_raise().rms_norm(x, weight, float(eps), out)
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's step: ``s = x + delta`` (rounded to the dtype, the bits of
    ``x + delta``), then :func:`rms_norm` of ``s``, in one pass over each row.

    Args:
        x, delta: ``[T, D]`` with contiguous rows, one dtype.
        weight: ``[D]`` contiguous, that dtype.
        eps: added to the mean square.

    Returns:
        ``(s, rms_norm(s))``, both ``[T, D]`` contiguous.

    Raises:
        RuntimeError: the extension is not available, or shapes, layouts or dtypes differ.
    """
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    _module_or_raise().add_rms_norm(x, delta, weight, float(eps), total, out)
    return total, out


def rotary_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: list[torch.Tensor],
    layer: int,
    row_seq: torch.Tensor,
    row_slot: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34, in the rotate-half
    layout of Llama) of the queries and keys of a fused QKV product; the rotated keys and
    the values go straight into each sequence's KV cache.

    Per head ``x``: ``x * cos + swap(x) * sin``, ``swap`` exchanging the two halves and
    ``sin`` carrying rotate_half's sign (its first half negated); each product and the sum
    rounded to the dtype, the bits of those three PyTorch operations.

    Args:
        qkv: ``[T, (H + 2G) * d]`` with contiguous rows: H query heads, G key heads, G
            value heads.
        cos, sin: ``[T, d]`` with contiguous rows, ``qkv``'s dtype.
        caches: per sequence, its ``[L, 2, G, C, d]`` contiguous buffer, ``qkv``'s dtype.
        layer: the layer written.
        row_seq: ``[T]`` int64 index into ``caches``.
        row_slot: ``[T]`` int64 slot per row (``< C``).
        heads: H.

    Returns:
        the rotated queries, ``[T, H, d]`` contiguous.

    Raises:
        RuntimeError: the extension is not available, a row outside the caches or a slot
            outside its cache, or tensors of the wrong shape, layout or dtype.
    """
    d = caches[0].shape[-1] if caches else 0
    q = torch.empty((qkv.shape[0], heads, d), dtype=qkv.dtype, device=qkv.device)
    _module_or_raise().rotary_kv(qkv, cos, sin, caches, layer, row_seq, row_slot, heads, q)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating (Shazeer 2020, eq. 6): ``silu(gate) * up`` for ``gate_up = [gate,
    up]``; ``silu`` in float32 (``exp`` by a polynomial within about an ulp of PyTorch's),
    rounded to the dtype, then the product rounded, as the two PyTorch operations do.

    Args:
        gate_up: ``[T, 2F]`` with contiguous rows.

    Returns:
        ``[T, F]`` contiguous, ``gate_up``'s dtype.

    Raises:
        RuntimeError: the extension is not available, or an odd width or bad layout.
    """
    out = torch.empty(
        (gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device
    )
    _module_or_raise().silu_mul(gate_up, out)
    return out


def small_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y = x W^T`` streaming the weights once for all rows (a decoding step's or a
    verification's product; ``csrc/gemm.cpp``): each output is a sum over k in increasing
    order in 16 float32 lanes (with AVX512-BF16: 32 bfloat16 pairs), then one fixed
    horizontal sum, so a row's bits do not depend on how many rows come with it.

    Args:
        x: ``[M, K]`` with contiguous rows (float32, bfloat16 or float16).
        weight: ``[N, K]`` contiguous, ``x``'s dtype.

    Returns:
        ``[M, N]`` contiguous, ``x``'s dtype.

    Raises:
        RuntimeError: the extension is not available, or shapes, layouts or dtypes differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _module_or_raise().small_gemm(x, weight, out)
    return out


def quant_gemm(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """``y = x W^T`` with ``W`` in a GGUF block format (``csrc/gemm.cpp``), expanded block
    by block inside the product (in registers for up to 16 rows of ``x``, else to a small
    buffer per 4 rows of ``W``). The result equals
    ``small_gemm(x.float(), W).to(x.dtype)`` with ``W`` the float32 dequantized matrix, bit
    for bit, for any M: the file's weights exactly, float32 accumulation.

    Args:
        x: ``[M, K]`` with contiguous rows (float32, bfloat16 or float16), K a multiple of 32.
        blocks: ``[N, K / 32 * bytes per block]`` uint8 (see :mod:`specdec.runtime.quant`).
        kind: 0 = Q4_1 (20 bytes per block of 32 weights), 1 = Q8_0 (34 bytes), 2 = Q4_1
            in the kernel's own layout (24 bytes; :func:`specdec.runtime.quant.kernel_layout`).

    Returns:
        ``[M, N]`` contiguous, ``x``'s dtype.

    Raises:
        RuntimeError: the extension is not available, or shapes, kinds or dtypes differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], blocks.shape[0]), dtype=x.dtype, device=x.device)
    _module_or_raise().quant_gemm(x, blocks, kind, out)
    return out


def decode_layer(
    x: torch.Tensor,
    normed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: list[torch.Tensor],
    layer: int,
    store_seq: torch.Tensor,
    store_slot: torch.Tensor,
    row_seq: torch.Tensor,
    row_n: torch.Tensor,
    row_off: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    heads: int,
    blocks: list[torch.Tensor],
    codes: list[int],
    kernels: list[int],
    mlp_norm: torch.Tensor,
    eps: float,
    tiles: Sequence[torch.Tensor] = (),
    tiles_upto: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of decoding / verification rows whose products run on specdec's
    own kernels (quantized, or dense on tiles), in one call: the fused QKV product,
    :func:`rotary_kv`, :func:`ragged_attention`, the output product, :func:`add_rms_norm`,
    the gate/up product, :func:`silu_mul` and the down product, each as its own function
    computes it (so the same bits as those calls made one by one).

    Args:
        x, normed: ``[T, D]`` the residual stream and its attention norm, contiguous.
        cos, sin, caches, layer, store_seq, store_slot: as :func:`rotary_kv` takes them.
        row_seq, row_n, row_off, slots, scale, tiles, tiles_upto: as
            :func:`ragged_attention` takes them.
        heads: query heads H.
        blocks, codes, kernels: per product (qkv, o, gate_up, down) its blocks, their kind
            and its kernel: 0 for :func:`quant_gemm`, 1 for :func:`q8_gemm`, 2 for
            :func:`dpbf16_quant_gemm` (GGUF tiles, or dense bfloat16 tiles: kind 2), 3 for
            :func:`f32_tile_gemm` (dense float32 tiles; kind unused); tiles then hold N, a
            multiple of 16, outputs.
        mlp_norm, eps: the MLP norm's weight and epsilon.

    Returns:
        ``(x + attention output, MLP output)``, both ``[T, D]``, ``x``'s dtype.

    Raises:
        RuntimeError: the extension is not available, or any of the calls refuses its
            inputs.
    """
    out = _module_or_raise().decode_layer(
        x, normed, cos, sin, caches, layer, store_seq, store_slot, row_seq, row_n, row_off,
        slots, float(scale), heads, blocks, codes, kernels, mlp_norm, float(eps),
        *_tiles_args(tiles, tiles_upto),
    )  # fmt: skip
    return out[0], out[1]


def decode_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: list[torch.Tensor],
    layers: list[int],
    store_seq: torch.Tensor,
    store_slot: torch.Tensor,
    row_seq: torch.Tensor,
    row_n: torch.Tensor,
    row_off: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    heads: int,
    blocks: list[torch.Tensor],
    codes: list[int],
    kernels: list[int],
    attn_norms: list[torch.Tensor],
    mlp_norms: list[torch.Tensor],
    eps: float,
    tiles: Sequence[torch.Tensor] = (),
    tiles_upto: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_layer` over ``layers`` in order in one call, each after its attention
    norm (:func:`rms_norm` of ``x`` for the first, then :func:`add_rms_norm` of the
    residual and the previous layer's MLP output): the calls a forward makes layer by
    layer, so the same bits.

    Args:
        x: ``[T, D]`` the embeddings (contiguous).
        layers: the layer indices (into the caches), in order.
        blocks, codes, kernels: four per layer (qkv, o, gate_up, down), as
            :func:`decode_layer`.
        attn_norms, mlp_norms: one per layer.
        the rest: as :func:`decode_layer`.

    Returns:
        ``(x after the last layer's attention, the last layer's MLP output)``: their sum
        is the last layer's output.

    Raises:
        RuntimeError: the extension is not available, the lists' lengths do not match, or
            any of the calls refuses its inputs.
    """
    out = _module_or_raise().decode_layers(
        x, cos, sin, caches, layers, store_seq, store_slot, row_seq, row_n, row_off, slots,
        float(scale), heads, blocks, codes, kernels, attn_norms, mlp_norms, float(eps),
        *_tiles_args(tiles, tiles_upto),
    )  # fmt: skip
    return out[0], out[1]


def q8_gemm(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """``y ~ x W^T`` with ``x`` quantized to 8 bits per block of 32 activations and
    integer dot products with GGUF's own Q4_1 / Q8_0 blocks: llama.cpp's arithmetic
    (``ggml_vec_dot_q4_1_q8_1`` / ``ggml_vec_dot_q8_0_q8_0``), in one fixed order of
    float operations (``csrc/q8.cpp``), so a row's bits do not depend on M, the threads
    or the x86 CPU (AVX2 code on AVX-512 CPUs too).

    Per row and block of 32: ``d = max|x| / 127``, ``a = round(x / d)`` (int8, nearest
    even), ``s = d * sum(a)``; per output, one float32 accumulator takes, block after
    block, ``fma(float(p), d_w * d, acc)`` with ``p`` the exact integer ``sum(q a)``, then
    (Q4_1, ``w = d_w q + m_w``) ``fma(m_w, s, acc)``. Not the float32 product: the
    activations are rounded to 8 bits (relative error about 1e-2 per output).

    Args:
        x: ``[M, K]`` with contiguous rows (float32, bfloat16 or float16), K a multiple of 32.
        blocks: ``[N, K / 32 * bytes per block]`` uint8: the file's blocks as they are
            (kinds 0 and 1, plain C++), or groups of 8 outputs interleaved by
            :func:`specdec.runtime.quant.q8_layout` (kinds 4 and 5, N a multiple of 8; the
            AVX2 code: one ``vpmaddubsw`` multiplies 4 activations with 8 outputs' weights;
            with AVX-512 VNNI one 256-bit ``vpdpbusd``, the same exact integers).
        kind: 0 = Q4_1 (20 bytes per block of 32 weights), 1 = Q8_0 (34 bytes), 4 / 5 =
            the same blocks interleaved in groups of 8. Every kind gives the same bits.

    Returns:
        ``[M, N]`` contiguous, ``x``'s dtype (the float32 result rounded to it).

    Raises:
        RuntimeError: the extension is not available, or shapes, kinds or dtypes differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], blocks.shape[0]), dtype=x.dtype, device=x.device)
    _module_or_raise().q8_gemm(x, blocks, kind, out)
    return out


def dequantize_blocks(
    blocks: torch.Tensor, kind: int, k: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dense ``[N, K]`` matrix of GGUF blocks (see :func:`quant_gemm`) in ``dtype``
    (float32, bfloat16 or float16).

    Raises:
        RuntimeError: the extension is not available, or the shapes do not match.
    """
    out = torch.empty((blocks.shape[0], k), dtype=dtype, device=blocks.device)
    _module_or_raise().dequantize(blocks, kind, out)
    return out


#: Rows of ``x`` per AMX tile, and values of K per tile (see :func:`amx_pack`).
AMX_TILE_ROWS, AMX_TILE_K = 16, 32


def amx_available() -> bool:
    """Whether :func:`amx_gemm` runs here: the extension builds, the CPU has AMX-BF16
    (Sapphire Rapids and later) and Linux lets this process use the tile state."""
    module = _load()
    return module is not None and bool(module.amx_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` bfloat16 in the layout :func:`amx_gemm` reads: blocks of 16
    outputs x 32 k, each one AMX B tile with consecutive k paired ("VNNI" layout),
    ``packed[nb, kb, p, j, e] = W[16 nb + j, 32 kb + 2 p + e]``, zero-padded to whole
    blocks. Made once per weight (a copy of its size, rounded up to whole blocks).

    Returns:
        ``[ceil(N / 16), ceil(K / 32), 16, 16, 2]`` bfloat16, contiguous.

    Raises:
        ValueError: ``weight`` is not a 2-D bfloat16 tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16:
        raise ValueError(
            f"amx_pack needs a [N, K] bfloat16 weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    n, k = weight.shape
    nb, kb = -(-n // AMX_TILE_ROWS), -(-k // AMX_TILE_K)
    padded = weight.new_zeros((nb * AMX_TILE_ROWS, kb * AMX_TILE_K))
    padded[:n, :k] = weight
    return padded.view(nb, AMX_TILE_ROWS, kb, AMX_TILE_ROWS, 2).permute(0, 2, 3, 1, 4).contiguous()


def amx_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``y = x W^T`` in bfloat16 on AMX tiles (``csrc/amx.cpp``), ``W`` packed by
    :func:`amx_pack`. Each output is a float32 accumulator that TDPBF16PS steps add 32
    products to, k block by k block in increasing order, then one rounding to bfloat16
    (nearest even): a row's bits do not depend on how many rows come with it, for any M
    (Intel SDM vol. 2, TDPBF16PS: an element of C reads one row of A and one column of B).
    The weights stream once for all rows: one row costs what a bandwidth-bound matrix-vector
    product costs, 64 rows about twice that on a 2-core Xeon (measured).

    Args:
        x: ``[M, K]`` bfloat16 with contiguous rows.
        packed: the packed ``[N, K]`` weight.
        n: N (the packed weight is padded to a multiple of 16 outputs).

    Returns:
        ``[M, N]`` bfloat16, contiguous.

    Raises:
        RuntimeError: AMX is not available, or shapes, layouts or dtypes differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _module_or_raise().amx_gemm(x, packed, out)
    return out


def amx_quant_gemm(x: torch.Tensor, tiles: torch.Tensor, kind: int, n: int) -> torch.Tensor:
    """``y = x W^T`` in bfloat16 on AMX tiles with ``W`` in GGUF blocks laid out as tiles
    (:func:`specdec.runtime.quant.amx_layout`, ``csrc/amx.cpp``), the file's weights
    exactly: per block of 32 k, one TDPBF16PS dots the rows with the block's integers
    ``q`` (exact in bfloat16), and the float32 accumulator takes ``acc = fma(x.q, d, acc)``
    then (Q4_1) ``acc = fma(S(x), m, acc)``, blocks in increasing order, then one rounding
    to bfloat16. Row-invariant for any M by construction.

    Args:
        x: ``[M, K]`` bfloat16 with contiguous rows.
        tiles: ``[ceil(N / 16), K / 32, 384]`` (Q4_1) or ``[.., .., 576]`` (Q8_0) uint8.
        kind: 0 = Q4_1, 1 = Q8_0.
        n: N.

    Returns:
        ``[M, N]`` bfloat16, contiguous.

    Raises:
        RuntimeError: AMX is not available, or shapes, kinds, layouts or dtypes differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _module_or_raise().amx_quant_gemm(x, tiles, kind, out)
    return out


def dpbf16_available() -> bool:
    """Whether :func:`dpbf16_quant_gemm` runs here: the extension builds for a CPU with
    AVX512-BF16 and AVX512-VBMI (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids
    and later)."""
    module = _load()
    return module is not None and bool(module.dpbf16_available())


def dpbf16_quant_gemm(x: torch.Tensor, tiles: torch.Tensor, kind: int, n: int) -> torch.Tensor:
    """``y = x W^T`` with ``x`` bfloat16 and ``W`` in GGUF blocks laid out as tiles
    (:func:`specdec.runtime.quant.dpbf16_layout`), on AVX512-BF16's pair dot products
    (``csrc/dpbf16.cpp``): :func:`amx_quant_gemm`'s formula without AMX. Per output,
    block by block in increasing order, ``acc = fma(x_b . q_b, d_b, acc)`` then (Q4_1)
    ``acc = fma(S_b(x), m_b, acc)``, with ``x_b . q_b`` the exact integers of the file's
    block dotted with the row's 32 activations (16 VDPBF16PS pair steps in order, float32;
    Intel SDM vol. 2, VDPBF16PS) and ``S_b`` their float32 sum; then one rounding to
    bfloat16. Each output reads its own row and weights only: row-invariant for any M.
    A lane of the instruction is an output, so a tile row of integers expands once for all
    rows: verifying several tokens costs little more than one.

    Kind 2 is a dense bfloat16 matrix (:func:`specdec.runtime.linear.dpbf16_dense_layout`,
    the ``dpbf16`` formulation of dense products): one float32 accumulator per output
    takes every pair step, k increasing, then one rounding to bfloat16.

    Args:
        x: ``[M, K]`` bfloat16 with contiguous rows.
        tiles: ``[ceil(N / 16), K / 32, 320]`` (Q4_1), ``[.., .., 544]`` (Q8_0) or
            ``[.., .., 1024]`` (dense) uint8.
        kind: 0 = Q4_1, 1 = Q8_0, 2 = dense bfloat16.
        n: N.

    Returns:
        ``[M, N]`` bfloat16, contiguous.

    Raises:
        RuntimeError: the CPU has no AVX512-BF16, or shapes, kinds, layouts or dtypes
            differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _module_or_raise().dpbf16_quant_gemm(x, tiles, kind, out)
    return out


def f32_tiles_available() -> bool:
    """Whether :func:`f32_tile_gemm` runs here: the extension builds for a CPU with AVX-512."""
    module = _load()
    return module is not None and bool(module.f32_tiles_available())


def f32_tile_gemm(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """``y = x W^T`` in float32 with ``W`` in tiles of 16 outputs
    (:func:`specdec.runtime.linear.f32_tile_layout`; ``csrc/tiles_f32.cpp``): per output
    one float32 accumulator, ``acc = fma(x[k], w[k], acc)`` for k in increasing order (a
    register lane per output: no horizontal sums, one weight load shared by every row).
    Each output reads its own row and weights only: row-invariant for any M.

    Args:
        x: ``[M, K]`` float32 with contiguous rows.
        tiles: ``[ceil(N / 16), K, 16]`` float32.
        n: N.

    Returns:
        ``[M, N]`` float32, contiguous.

    Raises:
        RuntimeError: the CPU has no AVX-512, or shapes or dtypes differ.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _module_or_raise().f32_tile_gemm(x, tiles, out)
    return out


def prompt_attention_available() -> bool:
    """Whether :func:`prompt_attention` runs here: the extension builds for a CPU with
    AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later)."""
    module = _load()
    return module is not None and bool(module.prompt_attention_available())


def prompt_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: int, start: int, scale: float, amx: bool = False
) -> torch.Tensor:
    """Causal attention of a prompt chunk over a bfloat16 KV cache, in blocks of 64 keys on
    AVX512-BF16 pair dot products, or with ``amx`` on AMX tiles
    (``csrc/prompt_attention.cpp``).

    Row ``i`` (position ``start + i``) sees slots ``0 .. start + i``. Per row and head:
    FlashAttention's online softmax (Dao et al. 2022, Algorithm 1) over blocks of 64 keys
    aligned to slot 0: scores as VDPBF16PS pair sums in float32 (Intel SDM vol. 2), times
    ``scale``; ``exp`` by the kernels' Cephes polynomial; the probabilities rounded to
    bfloat16 for the value sum (as PyTorch's CPU ``scaled_dot_product_attention`` does for
    bfloat16 inputs) and summed in float32 for the normalizer. A row reads only its own
    query and keys, in blocks fixed by its position, so its bits do not depend on the
    chunk, the other rows or the threads.

    With ``amx``, both products run on AMX tiles (TDPBF16PS, Intel SDM vol. 2): the scores
    of 16 rows x 64 keys and the value sums of 16 rows x 64 dimensions per block, the same
    online softmax between them on AVX-512. The instruction sums its pairs in its own order,
    so the bits differ from the pair-dot-product path's, but they too depend only on the
    row's query and keys (1.5-3x faster than the pair variant on a 2-core Xeon with AMX;
    :mod:`specdec.runtime.prefill`'s plan measures both and chooses).

    Args:
        q: ``[T, H, d]`` bfloat16 contiguous queries (rotary applied), d = 64 or 128.
        kv: the sequence's ``[L, 2, G, C, d]`` bfloat16 contiguous cache
            (:attr:`~specdec.runtime.cache.NativeKVCache.kv`), the chunk's keys and values
            already at slots ``start .. start + T - 1``.
        layer: the layer whose keys and values are read.
        start: slots before the chunk (the cached prefix).
        scale: softmax scale (``1 / sqrt(d)``).
        amx: run on AMX tiles (check :func:`amx_available`).

    Returns:
        ``[T, H * d]`` bfloat16.

    Raises:
        RuntimeError: the extension or AVX512-BF16 is not available here (check
            :func:`prompt_attention_available`), ``amx`` without AMX (check
            :func:`amx_available`), or shapes, dtypes or layouts differ (``H`` not a
            multiple of ``G``, the chunk past the cache's capacity).
    """
    out = torch.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)
    _module_or_raise().prompt_attention(q, kv, layer, start, float(scale), out, bool(amx))
    return out


def _module_or_raise():
    module = _load()
    if module is None:
        raise RuntimeError("specdec's C++ kernels are not available (see kernel_available)")
    return module
