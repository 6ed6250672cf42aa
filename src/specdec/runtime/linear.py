"""Matrix products of the native runtime: the fastest formulation per shape, and an exact
(batch-invariant) mode.

Why: on CPU the same product ``y = x W^T`` runs at very different speeds depending on how
it is written (``F.linear``, ``W @ x^T``, ``x @ W_t`` with a pre-transposed weight, or
oneDNN's inner product on a packed weight) and on the number of rows M, and a row's
result can change in its last bits with M, because the library picks another kernel (a
matrix-vector kernel for M = 1, other blockings for larger M). Speculative decoding
verifies k + 1 rows where plain decoding computes one, so greedy identity with plain
decoding is luck unless every row is computed the same way.

* **fast mode**: for each product and row-count bucket, the fastest formulation, measured
  once per machine (dtype, device, thread count) and model, and cached on disk. A product
  may be padded to the next bucket when that is faster (on some CPUs a one-row bf16
  product runs a slower matrix-vector kernel than a two-row one).
* **exact mode**: one formulation, a row tile T and a minimum row count (1, or 2 when the
  one-row kernel gives other bits) per product, such that a row's result is bit-identical
  for every M: rows go in chunks of at most T, and a chunk below the minimum is padded.
  The candidates are *checked* at calibration: each probe row, placed at several positions
  among the allowed row counts, must give the bits it gives alone. If no formulation passes
  for a tile of at least 16, rows go one at a time (padded to two), which is invariant by
  construction (the same call on the same data). This is the fixed-reduction-order idea of
  batch-invariant inference (Thinking Machines, "Defeating Nondeterminism in LLM
  Inference", 2025; vLLM's and SGLang's deterministic modes), applied to the row count of
  one sequence.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: Row-count buckets the fast mode measures (a product of M rows uses the first bucket >= M).
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: Exact-mode tiles tried, largest first.
TILES = (64, 32, 16, 8, 4, 2)
#: Bump when the calibration procedure changes (invalidates cached choices).
_VERSION = 8


@dataclass(frozen=True)
class Formulation:
    """One way to compute ``y = x W^T``: ``prepare(W)`` once (a transposed or packed copy,
    or ``W`` itself), then ``apply(x, prepared)`` per call.

    ``any_rows``: the kernel computes each row in a fixed order whatever M (specdec's own
    kernels). Calibration still checks it up to the largest tile; exact mode then runs any
    number of rows as one product (one pass over the weights) instead of tiles.
    """

    prepare: Callable[[torch.Tensor], object]
    apply: Callable[[torch.Tensor, object], torch.Tensor]
    any_rows: bool = False


def _onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _onednn_runs(weight.dtype)
    )


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed product runs for ``dtype`` on this CPU: its bfloat16 path
    needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on other CPUs (an AVX2-only
    AMD EPYC, say), so it is tried once on a small matrix instead of assumed."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 32, dtype=dtype), packed, None, "none", [], ""
        )
    except RuntimeError as exc:
        logger.info("oneDNN's packed product does not run for %s here: %s", dtype, exc)
        return False
    return True


def _stream_available(weight: torch.Tensor) -> bool:
    from specdec.runtime.kernels import kernel_available

    return weight.device.type == "cpu" and kernel_available(weight.device)


def _stream(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from specdec.runtime.kernels import small_gemm

    return small_gemm(x, weight)


def _amx_available(weight: torch.Tensor) -> bool:
    from specdec.runtime.kernels import amx_available

    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and amx_available()


@dataclass(frozen=True)
class _AmxWeight:
    packed: torch.Tensor
    n: int


def _amx_prepare(weight: torch.Tensor) -> _AmxWeight:
    from specdec.runtime.kernels import amx_pack

    return _AmxWeight(amx_pack(weight), weight.shape[0])


def _amx(x: torch.Tensor, weight: _AmxWeight) -> torch.Tensor:
    from specdec.runtime.kernels import amx_gemm

    return amx_gemm(x, weight.packed, weight.n)


def _dpbf16_available(weight: torch.Tensor) -> bool:
    from specdec.runtime.kernels import dpbf16_available

    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 32 == 0
        and dpbf16_available()
    )


@dataclass(frozen=True)
class DenseTiles:
    """A dense weight in tiles of 16 outputs: :func:`dpbf16_dense_layout` (``tiles``
    ``[ceil(N / 16), K / 32, 1024]`` uint8) or :func:`f32_tile_layout` (``[ceil(N / 16),
    K, 16]`` float32); ``n`` = N."""

    tiles: torch.Tensor
    n: int


def dpbf16_dense_layout(weight: torch.Tensor) -> DenseTiles:
    """``weight`` ``[N, K]`` bfloat16 (K a multiple of 32) as tiles of 16 outputs x 32 k,
    each 16 rows p of 64 bytes holding output j's ``w[2p], w[2p + 1]`` at bfloat16 words
    ``2j, 2j + 1`` (the pair order of AVX512-BF16's VDPBF16PS), tiles after tiles along k;
    N padded with zero outputs to a multiple of 16. The same values, made once at load
    (the weight's bytes again: the formulation keeps this copy only).

    Raises:
        ValueError: not a bfloat16 matrix, or K not a multiple of 32.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % 32:
        raise ValueError(
            f"the dpbf16 dense layout takes a bfloat16 [N, K] matrix with K a multiple of 32, "
            f"got {weight.dtype} {list(weight.shape)}"
        )
    n, k = weight.shape
    weight = _pad_outputs(weight)
    tiles = weight.reshape(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return DenseTiles(tiles.view(torch.uint8).view(-1, k // 32, 1024), n)


def _pad_outputs(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with zero rows (outputs) appended up to a multiple of 16."""
    n, k = weight.shape
    missing = -n % 16
    return torch.cat([weight, weight.new_zeros(missing, k)]) if missing else weight


def _dpbf16(x: torch.Tensor, weight: DenseTiles) -> torch.Tensor:
    from specdec.runtime.kernels import dpbf16_quant_gemm

    return dpbf16_quant_gemm(x, weight.tiles, 2, weight.n)


def _f32_tiles_available(weight: torch.Tensor) -> bool:
    from specdec.runtime.kernels import f32_tiles_available

    return weight.device.type == "cpu" and weight.dtype == torch.float32 and f32_tiles_available()


def f32_tile_layout(weight: torch.Tensor) -> DenseTiles:
    """``weight`` ``[N, K]`` float32 as tiles of 16 outputs, ``[ceil(N / 16), K, 16]``: row
    k of tile t holds ``w[16 t + j, k]`` for j = 0..15 (one 64-byte load per k for 16
    outputs), N padded with zero outputs. The same values, made once at load.

    Raises:
        ValueError: not a float32 matrix.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(
            f"the float32 tile layout takes a float32 [N, K] matrix, "
            f"got {weight.dtype} {list(weight.shape)}"
        )
    n, k = weight.shape
    return DenseTiles(_pad_outputs(weight).reshape(-1, 16, k).transpose(1, 2).contiguous(), n)


def _f32_tiles(x: torch.Tensor, weight: DenseTiles) -> torch.Tensor:
    from specdec.runtime.kernels import f32_tile_gemm

    return f32_tile_gemm(x, weight.tiles, weight.n)


#: The formulations calibration chooses from (``onednn``: oneDNN's inner product on a
#: weight packed once, CPU only; ``stream``: specdec's own product for few rows,
#: :func:`specdec.runtime.kernels.small_gemm`, CPU only, where the extension builds;
#: ``amx``: specdec's own bfloat16 product on AMX tiles, :func:`specdec.runtime.kernels.
#: amx_gemm`, bfloat16 on CPUs with AMX-BF16 only; ``dpbf16``: specdec's own bfloat16
#: product on AVX512-BF16's pair dot products, :func:`specdec.runtime.kernels.
#: dpbf16_quant_gemm` on :func:`dpbf16_dense_layout`, bfloat16 on CPUs with AVX512-BF16;
#: ``f32_tiles``: specdec's own float32 product on tiles of 16 outputs, :func:`specdec.
#: runtime.kernels.f32_tile_gemm` on :func:`f32_tile_layout`, float32 on CPUs with AVX-512).
FORMULATIONS = {
    "linear": Formulation(lambda w: w, lambda x, w: F.linear(x, w)),
    "w_xt": Formulation(lambda w: w, lambda x, w: (w @ x.t()).t()),
    "x_wt": Formulation(lambda w: w.t().contiguous(), lambda x, wt: x @ wt),
    "onednn": Formulation(
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        lambda x, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    ),
    "stream": Formulation(lambda w: w.contiguous(), _stream, any_rows=True),
    "amx": Formulation(_amx_prepare, _amx, any_rows=True),
    "dpbf16": Formulation(dpbf16_dense_layout, _dpbf16, any_rows=True),
    "f32_tiles": Formulation(f32_tile_layout, _f32_tiles, any_rows=True),
}
#: The exact tile of an ``any_rows`` formulation that passed the check at the largest tile:
#: every row count in one product.
ANY_ROWS = 1 << 30


def available_formulations(weight: torch.Tensor) -> list[str]:
    """Formulation names usable for ``weight`` on its device."""
    usable = {
        "onednn": _onednn_available, "stream": _stream_available, "amx": _amx_available,
        "dpbf16": _dpbf16_available, "f32_tiles": _f32_tiles_available,
    }  # fmt: skip
    return [n for n in FORMULATIONS if n not in usable or usable[n](weight)]


@dataclass
class KernelChoice:
    """What calibration chose for one weight shape.

    Attributes:
        fast: formulation per bucket in :data:`BUCKETS` order.
        fast_rows: per bucket, the row count a product is padded to (0: not padded;
            the next bucket's size when its measured time is lower).
        exact: the exact-mode formulation.
        tile: exact-mode tile T (most rows per product; 1 = one row at a time;
            :data:`ANY_ROWS` = all rows in one product, for an ``any_rows`` formulation).
        min_rows: exact mode pads a product of fewer rows up to this many (1 or 2): 2 when
            the formulation's one-row path gives other bits than its multi-row path.
        times_ms: measured milliseconds, ``{formulation: [per bucket]}`` (for reports).
    """

    fast: list[str]
    exact: str
    tile: int
    min_rows: int = 2
    times_ms: dict[str, list[float]] = field(default_factory=dict)
    fast_rows: list[int] = field(default_factory=list)


class Linear:
    """``y = x W^T + b`` with the calibrated formulation (see the module docstring).

    Args:
        weight: ``[N, K]`` in the compute dtype.
        bias: ``[N]`` or ``None``.
        choice: the :class:`KernelChoice` for this shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: KernelChoice):
        self.weight = weight
        self.bias = bias
        self.choice = choice
        names = {*choice.fast, choice.exact}
        self.prepared = {name: FORMULATIONS[name].prepare(weight) for name in names}
        rows = choice.fast_rows or [0] * len(BUCKETS)
        self._by_bucket = [
            (bucket, FORMULATIONS[name].apply, self.prepared[name], pad)
            for bucket, name, pad in zip(BUCKETS, choice.fast, rows, strict=True)
        ]

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``x``: ``[M, K]``; returns ``[M, N]`` in ``x``'s dtype."""
        y = self._exact(x) if exact else self._fast(x)
        return y if self.bias is None else y + self.bias

    def prefill(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        """A prompt chunk's product: the fast formulation for its row count, or with
        ``upcast`` one float32 product (the weight converted per call, the result rounded
        once to ``x``'s dtype; see :mod:`specdec.runtime.prefill`). Exact mode computes a
        chunk's rows only as that chunk (see :func:`specdec.runtime.model._product`)."""
        if upcast:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        y = self._fast(x)
        return y if self.bias is None else y + self.bias

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        for bucket, apply, prepared, pad in self._by_bucket:
            if m <= bucket:
                if pad > m:
                    return apply(torch.cat([x, x[:1].expand(pad - m, -1)]), prepared)[:m]
                return apply(x, prepared)
        return apply(x, prepared)

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        c = self.choice
        return exact_product(x, self.prepared[c.exact], c.exact, c.tile, c.min_rows)


def exact_product(x, prepared, name: str, tile: int, min_rows: int) -> torch.Tensor:
    """Rows in chunks of at most ``tile``; a chunk of fewer than ``min_rows`` rows is padded
    by repeating its first row (and the padding dropped).

    The result is always contiguous (row-major). ``w_xt`` returns a transposed view for one
    chunk but a row-major ``cat`` for several, and what comes downstream keeps that layout
    (rotary, the cache's queries); PyTorch's CPU ``scaled_dot_product_attention`` gives
    other bits for the same values in another layout when it runs on 2 threads, so a prompt
    prefilled alone (one chunk) and in a batch (several) differed (measured: SmolLM2 bf16,
    the first layer's attention off by 0.25).
    """
    apply = FORMULATIONS[name].apply
    chunks = []
    for start in range(0, x.shape[0], max(1, tile)):
        chunk = x[start : start + max(1, tile)]
        m = chunk.shape[0]
        if m < min_rows:
            pad = chunk[:1].expand(min_rows - m, -1)
            chunks.append(apply(torch.cat([chunk, pad]).contiguous(), prepared)[:m])
        else:
            chunks.append(apply(chunk.contiguous(), prepared))
    return chunks[0].contiguous() if len(chunks) == 1 else torch.cat(chunks)


# ------------------------------------------------------------------ calibration


def calibrate(products: dict[str, list[torch.Tensor]], repeats: int = 3) -> dict[str, KernelChoice]:
    """Measure every formulation per product and bucket, and find each product's exact-mode
    formulation and tile.

    Timings come from passes that run the products layer by layer, interleaved as a forward
    runs them, over (up to 1 GiB of) the real weights: they stream from memory as they do
    in a forward, where a warm cache would flatter small products. Each call is timed on
    its own inside the pass.

    Args:
        products: ``{name: [N, K] weights, one per layer}`` (an LM head: a list of one).
        repeats: passes per formulation and bucket (the fastest is kept: interference
            from other processes only ever adds time).
    """
    first = next(iter(products.values()))[0]
    names = available_formulations(first)
    layers = _layers_to_time(products)
    times: dict[str, dict[str, list[float]]] = {p: {} for p in products}
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = {
        p: torch.randn(max(BUCKETS) + 8, w[0].shape[1], generator=gen).to(first)
        for p, w in products.items()
    }
    for name in names:
        f = FORMULATIONS[name]
        prepared = {p: [f.prepare(w) for w in ws[:layers]] for p, ws in products.items()}
        for p in products:
            times[p][name] = []
        for m in BUCKETS:
            per_product = _time_passes(f.apply, prepared, inputs, m, repeats)
            for p, t in per_product.items():
                times[p][name].append(t)
        del prepared
    out = {}
    for p, ws in products.items():
        t = times[p]
        fast, fast_rows = _fast_choice(t)
        exact, tile, min_rows = _exact_choice(ws[0], inputs[p], t)
        out[p] = KernelChoice(fast, exact, tile, min_rows, t, fast_rows)
    return out


def _layers_to_time(products: dict[str, list[torch.Tensor]], budget: int = 1 << 30) -> int:
    """How many layers a pass covers: all of them, or as many as fit in ``budget`` bytes."""
    per_layer = sum(ws[0].numel() * ws[0].element_size() for ws in products.values() if len(ws) > 1)
    most = max(len(ws) for ws in products.values())
    return max(1, min(most, budget // max(per_layer, 1)))


def _time_passes(apply, prepared, inputs, m: int, repeats: int) -> dict[str, float]:
    """Fastest milliseconds per call of each product over ``repeats`` interleaved passes."""
    samples: dict[str, list[float]] = {p: [] for p in prepared}
    depth = max(len(ws) for ws in prepared.values())
    for repeat in range(repeats + 1):  # the first pass warms up and is not kept
        totals = dict.fromkeys(prepared, 0.0)
        counts = dict.fromkeys(prepared, 0)
        for layer in range(depth):
            for p, ws in prepared.items():
                if layer < len(ws):
                    x = inputs[p][:m]
                    start = time.perf_counter()
                    apply(x, ws[layer])
                    totals[p] += time.perf_counter() - start
                    counts[p] += 1
        if repeat:
            for p in prepared:
                samples[p].append(totals[p] * 1e3 / counts[p])
    return {p: min(v) for p, v in samples.items()}


#: Padding to the next bucket must save at least this fraction of the time.
PAD_GAIN = 0.05


def _fast_choice(times: dict[str, list[float]]) -> tuple[list[str], list[int]]:
    """Per bucket: the fastest formulation at that bucket, or at the next bucket (padded to
    its size) when that is faster by at least :data:`PAD_GAIN`."""
    fast, rows = [], []
    for i in range(len(BUCKETS)):
        here = min(times, key=lambda n: times[n][i])
        best, pad = here, 0
        if i + 1 < len(BUCKETS):
            up = min(times, key=lambda n: times[n][i + 1])
            if times[up][i + 1] < (1 - PAD_GAIN) * times[here][i]:
                best, pad = up, BUCKETS[i + 1]
        fast.append(best)
        rows.append(pad)
    return fast, rows


def _exact_choice(weight, x, times) -> tuple[str, int, int]:
    """The exact formulation: the candidate (formulation, one row padded or not) with the
    best decoding step (one row, or two when padded) plus a quarter of its 16-row time
    (verification) plus a quarter of its 64-row time (a batch of sequences, and prefill
    chunks: exact mode runs every row through this one formulation, so one that is fast for
    one row but compute-bound for many would starve batches) among those invariant up to a
    tile >= 16 (an ``any_rows`` formulation invariant up to the largest tile gets
    :data:`ANY_ROWS`); padding is required when the one-row kernel gives other bits, and chosen
    when it is faster (never for an ``any_rows`` formulation)."""
    candidates = []
    for name in times:
        # an any_rows kernel computes one row as it computes many: padding only adds work
        for min_rows in (1,) if FORMULATIONS[name].any_rows else (1, 2):
            score = (
                times[name][min_rows - 1]
                + 0.25 * times[name][BUCKETS.index(16)]
                + 0.25 * times[name][BUCKETS.index(64)]
            )
            if min_rows == 2:
                score += PAD_GAIN * times[name][0]  # a padded choice must win clearly
            candidates.append((score, name, min_rows))
    for _, name, min_rows in sorted(candidates):
        prepared = FORMULATIONS[name].prepare(weight)
        tile = next((t for t in TILES if is_row_invariant(x, prepared, name, t, min_rows)), 1)
        if tile == TILES[0] and FORMULATIONS[name].any_rows:
            tile = ANY_ROWS
        if tile >= 16:
            return name, tile, min_rows
    name = min(times, key=lambda n: times[n][1])
    return name, 1, 2


def is_row_invariant(x: torch.Tensor, prepared, name: str, tile: int, min_rows: int) -> bool:
    """Does every row give the bits it gives alone (padded to ``min_rows``), for every row
    count from ``min_rows`` to ``tile`` and two windows of ``x`` (``x`` needs
    ``tile + 8`` rows)?

    Every row of every count is compared, not a few probes: in a 16-bit dtype a kernel
    that accumulates in another order changes the rounded result of only some rows (seen
    with oneDNN's bf16 product at 33-36 rows, where one probe in three passed).
    """
    apply = FORMULATIONS[name].apply
    windows = (0, 7)
    needed = tile + max(windows)
    if x.shape[0] < needed:
        raise ValueError(f"is_row_invariant needs {needed} rows, got {x.shape[0]}")
    alone = torch.cat(
        [exact_product(x[i : i + 1], prepared, name, tile, min_rows) for i in range(needed)]
    )
    for m in range(max(2, min_rows), tile + 1):
        for start in windows:
            rows = x[start : start + m].contiguous()
            if not torch.equal(apply(rows, prepared), alone[start : start + m]):
                return False
    return True


# ------------------------------------------------------------------ the on-disk table


def kernel_table_path() -> Path:
    """Where calibration results are kept (``$SPECDEC_CACHE/kernels.json``)."""
    from specdec.paths import cache_root

    return cache_root() / "kernels.json"


def machine_key(dtype: torch.dtype, device: torch.device) -> str:
    """Identifies what a measurement depends on: CPU model and features (or GPU model),
    torch, threads, dtype."""
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_identity()
    threads = torch.get_num_threads()
    return (
        f"v{_VERSION}|{hardware}|torch {torch.__version__}|{threads} threads|{dtype}|{device.type}"
    )


def cpu_identity() -> str:
    """:func:`cpu_name` plus a digest of the CPU's feature flags (``/proc/cpuinfo``): two
    virtual machines can report the same model name with different instruction sets (with
    and without AMX, measured on this project's VMs), and every measurement kept on disk
    depends on them."""
    try:
        digest = flags_digest(Path("/proc/cpuinfo").read_text())
    except OSError:
        digest = ""
    return f"{cpu_name()} [{digest}]" if digest else cpu_name()


def flags_digest(cpuinfo: str) -> str:
    """12 hex digits identifying the first ``flags`` (x86) or ``Features`` (Arm) line of a
    ``/proc/cpuinfo`` text, whatever the flags' order; ``""`` without one."""
    import hashlib

    from specdec.runtime.kernels import cpu_flags

    flags = cpu_flags(cpuinfo)
    return hashlib.sha256(flags.encode()).hexdigest()[:12] if flags else ""


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def kernel_choices(
    products: dict[str, list[torch.Tensor]], refresh: bool = False
) -> dict[str, KernelChoice]:
    """A :class:`KernelChoice` per named product, from the on-disk table or measured now.

    The table is keyed by the machine (:func:`machine_key`), the formulations available
    here and the model's product shapes together (timings depend on what streams around
    each product).

    Args:
        products: ``{name: [N, K] weights, one per layer}``.
        refresh: measure again even if the table has this model's shapes.
    """
    some = next(iter(products.values()))[0]
    # the formulations usable here are part of the key: a process without the C++
    # extension (no compiler, SPECDEC_ATTENTION=reference) must not read a choice of
    # ``stream`` measured by one that had it
    key = f"{machine_key(some.dtype, some.device)}|{','.join(available_formulations(some))}"
    model_key = ";".join(
        f"{name}={'x'.join(map(str, ws[0].shape))}*{len(ws)}" for name, ws in products.items()
    )

    def measure() -> dict:
        logger.info("calibrating matrix products (%s, %s)", model_key, some.dtype)
        return {p: vars(c) for p, c in calibrate(products).items()}

    entry = measured_entry(key, model_key, measure, "matrix product calibration", refresh)
    return {p: KernelChoice(**c) for p, c in entry.items()}


#: A measurement is kept on disk only if other processes kept fewer cores than this busy
#: while it ran (:class:`specdec.machine.OthersLoad`).
MAX_OTHERS_BUSY = 0.5
_PROCESS_ONLY: dict[tuple[str, str], dict] = {}  # measurements on a busy machine


def measured_entry(
    key: str, model_key: str, measure: Callable[[], dict], what: str, refresh: bool = False
) -> dict:
    """The kernel table's entry ``[key][model_key]``: read from disk, else measured now.

    A measurement taken while other processes kept :data:`MAX_OTHERS_BUSY` cores or more
    busy is not kept on disk, only for this process (with a warning), and is taken again
    next time: a table written under load would choose kernels from the other processes'
    time slices for good (seen on a 2-core VM during a test run: every product of the
    embedded model timed at about 7.6 ms, whatever its kind, and dense decoding then ran
    on the slowest products at half its speed).

    Args:
        key: the machine part of the key (:func:`machine_key` and what it adds).
        model_key: the model's shapes.
        measure: takes the measurement; returns a JSON-ready dict.
        what: names the measurement in the warning.
        refresh: measure again even if the table has it.
    """
    from specdec.machine import OthersLoad

    path = kernel_table_path()
    if not refresh:
        entry = _read_table(path).get(key, {}).get(model_key)
        if entry is None:
            entry = _PROCESS_ONLY.get((key, model_key))
        if entry is not None:
            return entry
    with OthersLoad() as load:
        entry = measure()
    if load.cores_busy is not None and load.cores_busy >= MAX_OTHERS_BUSY:
        logger.warning(
            "%s: other processes kept %.1f cores busy while it ran, so its result is used "
            "by this process only and measured again next time (on an idle machine, kernel "
            "choices are kept in %s)", what, load.cores_busy, path,
        )  # fmt: skip
        _PROCESS_ONLY[(key, model_key)] = entry
        return entry
    table = _read_table(path)  # again: another process may have written meanwhile
    table.setdefault(key, {})[model_key] = entry
    _write_table(path, table)
    return entry


def _read_table(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_table(path: Path, table: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError as error:  # a read-only cache only costs a re-measurement next time
        logger.warning("could not save the kernel table to %s: %s", path, error)
