"""Matrix products of the native runtime: the fastest formulation per shape, and an exact
(batch-invariant) mode.

Why: on CPU the same product ``y = x W^T`` runs at very different speeds depending on how
it is written (``F.linear``, ``W @ x^T`` or ``x @ W_t`` with a pre-transposed weight) and on
the number of rows M, and a row's result can change in its last bits with M, because the
BLAS library picks another kernel (a matrix-vector kernel for M = 1, other blockings for
larger M). Speculative decoding verifies k + 1 rows where plain decoding computes one, so
greedy identity with plain decoding is luck unless every row is computed the same way.

* **fast mode**: for each weight shape and row-count bucket, the fastest formulation,
  measured once per machine (dtype, device, thread count) and cached on disk.
* **exact mode**: one formulation and a row tile T per weight shape such that a row's
  result is bit-identical for every M (rows are processed in chunks of at most T; a
  chunk of one row is padded to two, so the matrix-vector path is never taken). The
  candidates are *checked* at calibration: each probe row, placed at several positions
  among 2..T rows, must give the bits it gives alone (padded). A formulation that passes
  for no tile falls back to one padded row at a time, which is invariant by construction
  (the same call on the same data). This is the fixed-reduction-order idea of batch-
  invariant inference (Thinking Machines, "Defeating Nondeterminism in LLM Inference",
  2025; vLLM/SGLang deterministic modes), applied to the row count of one sequence.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: Row-count buckets the fast mode measures (a product of M rows uses the first bucket >= M).
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: Formulations of ``y = x W^T``: name -> f(x, W, W_t).
FORMULATIONS = {
    "linear": lambda x, w, wt: F.linear(x, w),
    "w_xt": lambda x, w, wt: (w @ x.t()).t(),
    "x_wt": lambda x, w, wt: x @ wt,
}
#: Exact-mode tiles tried, largest first.
TILES = (64, 32, 16, 8, 4, 2)
#: Bump when the calibration procedure changes (invalidates cached choices).
_VERSION = 1


@dataclass
class KernelChoice:
    """What calibration chose for one weight shape.

    Attributes:
        fast: formulation per bucket in :data:`BUCKETS` order.
        exact: the exact-mode formulation.
        tile: exact-mode tile T (rows per product; 1 = one padded row at a time).
        times_ms: measured milliseconds, ``{formulation: [per bucket]}`` (for reports).
    """

    fast: list[str]
    exact: str
    tile: int
    times_ms: dict[str, list[float]] = field(default_factory=dict)


class Linear:
    """``y = x W^T + b`` with the calibrated formulation (see the module docstring).

    Args:
        weight: ``[N, K]`` in the compute dtype.
        bias: ``[N]`` or ``None``.
        choice: the :class:`KernelChoice` for this shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: KernelChoice):
        self.weight = weight.contiguous()
        self.bias = bias
        self.choice = choice
        uses_wt = "x_wt" in choice.fast or choice.exact == "x_wt"
        self.weight_t = self.weight.t().contiguous() if uses_wt else None

    def __call__(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """``x``: ``[M, K]``; returns ``[M, N]`` in ``x``'s dtype."""
        y = self._exact(x) if exact else self._fast(x)
        return y if self.bias is None else y + self.bias

    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        name = self.choice.fast[-1]
        for bucket, candidate in zip(BUCKETS, self.choice.fast, strict=True):
            if m <= bucket:
                name = candidate
                break
        return FORMULATIONS[name](x, self.weight, self.weight_t)

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        return exact_product(x, self.weight, self.weight_t, self.choice.exact, self.choice.tile)


def exact_product(x, weight, weight_t, name: str, tile: int) -> torch.Tensor:
    """Rows in chunks of at most ``tile`` (at least 2: one row is duplicated)."""
    f = FORMULATIONS[name]
    step = max(1, tile)
    chunks = []
    for start in range(0, x.shape[0], step):
        chunk = x[start : start + step]
        if chunk.shape[0] == 1:
            chunks.append(f(chunk.expand(2, -1).contiguous(), weight, weight_t)[:1])
        else:
            chunks.append(f(chunk.contiguous(), weight, weight_t))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


# ------------------------------------------------------------------ calibration


def calibrate(weight: torch.Tensor, repeats: int = 3) -> KernelChoice:
    """Measure every formulation per bucket and find the exact-mode formulation and tile.

    Args:
        weight: ``[N, K]`` a real weight of the shape (invariance is checked on it).
        repeats: timed runs per measurement (the median is kept).
    """
    wt = weight.t().contiguous()
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max(BUCKETS) + 8, weight.shape[1], generator=gen).to(weight)
    times = {
        name: [_time(f, x[:m], weight, wt, repeats) for m in BUCKETS]
        for name, f in FORMULATIONS.items()
    }
    fast = [min(times, key=lambda n, i=i: times[n][i]) for i in range(len(BUCKETS))]
    exact, tile = _exact_choice(weight, wt, x, times)
    return KernelChoice(fast, exact, tile, times)


def _time(f, x, w, wt, repeats: int) -> float:
    f(x, w, wt)  # warm
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(x, w, wt)
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def _exact_choice(weight, wt, x, times) -> tuple[str, int]:
    """The formulation (fastest for 2 rows among those invariant up to the largest tile)."""
    best: tuple[float, int, str] | None = None
    for name in FORMULATIONS:
        tile = next((t for t in TILES if is_row_invariant(x, weight, wt, name, t)), 1)
        score = (times[name][1], -tile, name)  # 2 rows = an exact decoding step
        if tile >= 16 and (best is None or score < best):
            best = score
    if best is not None:
        return best[2], -best[1]
    name = min(FORMULATIONS, key=lambda n: times[n][1])
    return name, 1


def is_row_invariant(x: torch.Tensor, weight, wt, name: str, tile: int) -> bool:
    """Does a row give the same bits alone (padded to 2) and at positions 0, middle and
    last among 2..``tile`` rows? (Checked for a spread of row counts, on ``x``'s rows.)"""
    f = FORMULATIONS[name]
    alone = [f(x[i : i + 1].expand(2, -1).contiguous(), weight, wt)[0] for i in range(3)]
    counts = sorted({2, 3, tile // 2, tile // 2 + 1, tile - 1, tile} & set(range(2, tile + 1)))
    for m in counts:
        for probe, position in enumerate({0, m // 2, m - 1}):
            rows = x[3 : 3 + m].clone()
            rows[position] = x[probe % 3]
            if not torch.equal(f(rows, weight, wt)[position], alone[probe % 3]):
                return False
    return True


# ------------------------------------------------------------------ the on-disk table


def kernel_table_path() -> Path:
    """Where calibration results are kept (``$SPECDEC_CACHE/kernels.json``)."""
    from specdec.models.loading import cache_root

    return cache_root() / "kernels.json"


def machine_key(dtype: torch.dtype, device: torch.device) -> str:
    """Identifies what a measurement depends on: CPU/GPU model, torch, threads, dtype."""
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    threads = torch.get_num_threads()
    return (
        f"v{_VERSION}|{hardware}|torch {torch.__version__}|{threads} threads|{dtype}|{device.type}"
    )


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
    weights: dict[str, torch.Tensor], refresh: bool = False
) -> dict[str, KernelChoice]:
    """A :class:`KernelChoice` per named weight, from the on-disk table or measured now.

    Args:
        weights: ``{name: [N, K] weight}``; shapes already measured on this machine (same
            dtype, device, torch and thread count) are read from the table.
        refresh: measure again even if the table has them.
    """
    some = next(iter(weights.values()))
    key = machine_key(some.dtype, some.device)
    path = kernel_table_path()
    table = _read_table(path)
    entries = table.setdefault(key, {})
    changed = False
    out = {}
    for name, weight in weights.items():
        shape = "x".join(map(str, weight.shape))
        if refresh or shape not in entries:
            logger.info("calibrating matrix products for %s %s", shape, weight.dtype)
            entries[shape] = vars(calibrate(weight))
            changed = True
        out[name] = KernelChoice(**entries[shape])
    if changed:
        _write_table(path, table)
    return out


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
