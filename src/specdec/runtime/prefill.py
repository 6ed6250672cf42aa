"""Prompt chunks of a 16-bit model computed in float32 where that is faster here.

A prompt chunk's products and attention are compute-bound, and which arithmetic is
fastest depends on the CPU: with AMX, PyTorch's bfloat16 products run about four times
faster than its float32 ones; without it (AVX512-BF16 only), the float32 products and
``scaled_dot_product_attention`` are the faster ones (measured on a 2-core Xeon without
AMX: a 1024 x 576 x 1536 product at 237 GFLOP/s in float32 against 144 in bfloat16, causal
attention over 1024 tokens 1.5x faster in float32). So the choice is measured once per
machine, dtype and model (:func:`prefill_plan`), like the products' kernels
(:mod:`specdec.runtime.linear`), and kept in the same on-disk table.

What an upcast chunk computes: its inputs converted to float32 (exactly), the weights in
float32 (a 16-bit weight exactly; a GGUF weight dequantized without the rounding to 16
bits, the values the decoding kernels use), float32 accumulation, and one rounding of the
outputs to the model's dtype. That is at least as accurate as the 16-bit product, and it
is the same call for the same chunk, so exact mode's promise holds: a prompt chunk's rows
are only ever computed as that chunk (see :func:`specdec.runtime.model._product`), so a
sequence gets the same bits alone or in any batch, and greedy speculative decoding still
equals plain decoding token for token (both prefill the same way).

A model on quantized weights (a GGUF's own blocks) has one more choice: its prompt
chunks as one dense product on the weights expanded to the model's dtype, or on the
quantized kernel itself, the product its decoding rows use. The kernel's speed is flat in
the rows (tiles of a few rows), the dense product's rises with them, and expanding the
weights costs a pass over them per chunk, unless the expansion is kept between chunks
(:class:`specdec.runtime.quant.DenseKeeper`, the default where memory allows; the plan is
then timed on kept expansions): measured on a 2-core AMD EPYC Zen 4, one SmolLM2-135M
layer's four products on the ``dpbf16`` kernel against the dense bfloat16 product, the
expansion included, 0.83 against 1.51 ms at 32 rows, 3.3 against 4.4 at 128, even at 256, 24.4
against 20.8 at 1024. The kernel also reads the file's weights exactly where the dense
product rounds them to the model's dtype (``q8``, the opt-in kernel, rounds the
activations to 8 bits instead, as llama.cpp computes a prompt). So it is measured
(:attr:`PrefillPlan.quantized_to`): chunks up to the largest size where the kernel wins
run on it. Either way it is one call per chunk, chosen by the chunk's length: the same
bits alone or in any batch.

A chunk's attention has one more candidate, in every dtype: the runtime's own attention
kernel (:func:`specdec.runtime.kernels.ragged_attention`, the arithmetic of decoding rows:
each row over its visible keys in position order), in place of
``scaled_dot_product_attention``. It skips the library's per-call setup and the causal
mask's padding, so it wins on short and medium chunks and loses on long ones (measured on
the Zen 4: 0.65 against 1.07 ms at 256 rows, 9.8 against 12.6 ms at 1024, 44 against
40 ms at 2048, bfloat16). :attr:`PrefillPlan.kernel_attention_to` is the largest measured
size up to which it wins.

A bfloat16 chunk's attention has a third candidate on CPUs with AVX512-BF16: the blocked
prompt kernel (:func:`specdec.runtime.kernels.prompt_attention`), FlashAttention's online
softmax over blocks of 64 keys on pair dot products, the probabilities rounded to bfloat16
for the value sum as the library's bfloat16 attention rounds them. It wins on long chunks,
where the others are compute-bound (measured on the Zen 4, 9 heads over 3 KV heads of 64:
a 1024-token prompt 5.0 against 12.3 ms, a 2048-token chunk after 6144 cached tokens 135
against 299 ms, about 250 against 115 GFLOP/s). :attr:`PrefillPlan.blocked_attention_from`
is the smallest measured size from which it wins against the best other candidate. Its
rows, too, read only their own keys in blocks fixed by their positions: one call per
chunk, the same bits alone or in any batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.option import env_switch

logger = logging.getLogger(__name__)

#: Chunk sizes (rows) the candidates are timed at.
PREFILL_ROWS = (64, 128, 256, 512, 1024)
#: float32 must save at least this fraction of the time to be chosen.
UPCAST_GAIN = 0.05
#: Head dims the blocked prompt kernel is built for.
BLOCKED_HEAD_DIMS = (64, 128)
#: The environment variable that forces the choice (``on`` / ``off``; unset or ``auto``:
#: measured).
ENV = "SPECDEC_PREFILL_FLOAT32"


@dataclass(frozen=True)
class PrefillPlan:
    """When a prompt chunk of a 16-bit model runs in float32, when a model on quantized
    weights runs a prompt chunk's products on its quantized kernel, and which kernel
    computes a chunk's attention.

    Attributes:
        products_from: chunks of at least this many rows compute their matrix products
            in float32 (``None``: never).
        attention_from: the same for the chunk's attention.
        quantized_to: a quantized model's chunks of at most this many rows compute their
            products on the quantized kernel (the product of decoding rows), not as one
            dense product on the expanded weights: the largest :data:`PREFILL_ROWS` size at
            which, and at every smaller one, the kernel was measured faster than the chosen
            dense arithmetic by :data:`UPCAST_GAIN`; the largest size itself means every
            chunk (the kernel's speed is flat in the rows, the dense product's rises with
            them). ``None``: only chunks below
            :data:`~specdec.runtime.quant.PREFILL_DENSE_ROWS` rows.
        times_ms: what was measured, ``{"products" | "attention": {"native" | "float32"
            (| "quantized" | "kernel"): [ms per PREFILL_ROWS entry]}}`` (for reports;
            empty when forced).
        kernel_attention_to: chunks of at most this many rows compute their attention on
            the runtime's attention kernel (:func:`~specdec.runtime.kernels.ragged_attention`,
            each row over its keys as a decoding row is) instead of
            ``scaled_dot_product_attention``: the largest :data:`PREFILL_ROWS` size at
            which, and at every smaller one, the kernel was measured faster than the
            chosen arithmetic by :data:`UPCAST_GAIN` (``None``: never; only where the
            kernels are compiled).
        blocked_attention_from: bfloat16 chunks of at least this many rows compute their
            causal attention on the blocked prompt kernel
            (:func:`~specdec.runtime.kernels.prompt_attention`): the smallest
            :data:`PREFILL_ROWS` size from which, at it and every larger one, it beat the
            best other candidate by :data:`UPCAST_GAIN` (``None``: never; only on CPUs with
            AVX512-BF16). Takes precedence over :attr:`kernel_attention_to`.
        blocked_amx: the blocked prompt kernel runs its two products on AMX tiles
            (``prompt_attention(..., amx=True)``), measured faster than its pair dot products
            in total over :data:`PREFILL_ROWS` (only on CPUs with AMX-BF16).
    """

    products_from: int | None = None
    attention_from: int | None = None
    times_ms: dict = field(default_factory=dict)
    quantized_to: int | None = None
    kernel_attention_to: int | None = None
    blocked_attention_from: int | None = None
    blocked_amx: bool = False

    def products(self, rows: int) -> bool:
        """Whether a chunk of ``rows`` rows computes its products in float32."""
        return self.products_from is not None and rows >= self.products_from

    def attention(self, rows: int) -> bool:
        """Whether a chunk of ``rows`` rows computes its attention in float32."""
        return self.attention_from is not None and rows >= self.attention_from

    def quantized(self, rows: int) -> bool:
        """Whether a quantized model's chunk of ``rows`` rows computes its products on the
        quantized kernel (below ``PREFILL_DENSE_ROWS`` rows it always does)."""
        q = self.quantized_to
        return q is not None and (rows <= q or q >= PREFILL_ROWS[-1])

    def kernel_attention(self, rows: int) -> bool:
        """Whether a chunk of ``rows`` rows computes its attention on the runtime's kernel."""
        return (
            self.kernel_attention_to is not None
            and rows <= self.kernel_attention_to
            and not self.blocked_attention(rows)
        )

    def blocked_attention(self, rows: int) -> bool:
        """Whether a bfloat16 chunk of ``rows`` rows with a causal view of its cache computes
        its attention on the blocked prompt kernel."""
        return self.blocked_attention_from is not None and rows >= self.blocked_attention_from


#: Never upcast (float32 models, GPUs, ``SPECDEC_PREFILL_FLOAT32=off``).
NEVER = PrefillPlan()
#: Always upcast (``SPECDEC_PREFILL_FLOAT32=on``; tests).
ALWAYS = PrefillPlan(1, 1)


def threshold(native: list[float], upcast: list[float], rows=PREFILL_ROWS) -> int | None:
    """The smallest measured row count from which float32 wins by at least
    :data:`UPCAST_GAIN` at it and at every larger measured count (``None``: it does not
    win at the largest).

    Args:
        native: milliseconds in the model's dtype, one per ``rows`` entry.
        upcast: milliseconds in float32, one per ``rows`` entry.
    """
    return _winning_run(reversed(list(zip(rows, native, upcast, strict=True))))


def _winning_run(sizes) -> int | None:
    """The last size of the leading run of ``(size, slower ms, faster ms)`` where the
    faster one wins by at least :data:`UPCAST_GAIN` (``None``: not at the first)."""
    last = None
    for r, a, b in sizes:
        if b < (1.0 - UPCAST_GAIN) * a:
            last = r
        else:
            break
    return last


def _chosen(times: dict[str, list[float]], upcast_from: int | None) -> list[float]:
    """Per :data:`PREFILL_ROWS` size, the time of the arithmetic a threshold chose there
    (float32 from ``upcast_from`` rows on, else the model's dtype)."""
    return [
        times["float32"][i] if upcast_from is not None and r >= upcast_from else n
        for i, (r, n) in enumerate(zip(PREFILL_ROWS, times["native"], strict=True))
    ]


def kernel_threshold(library: list[float], kernel: list[float], rows=PREFILL_ROWS) -> int | None:
    """The largest measured row count at which, and at every smaller measured count, the
    kernel beats the library by at least :data:`UPCAST_GAIN` (``None``: not even at the
    smallest): the runtime's attention kernel against ``scaled_dot_product_attention``, or
    a quantized kernel's products against the dense product.

    Args:
        library: milliseconds of the library's call in the arithmetic the plan chose for
            that size, one per ``rows`` entry.
        kernel: milliseconds of the kernel, one per ``rows`` entry.
    """
    return _winning_run(zip(rows, library, kernel, strict=True))


def forced_plan() -> PrefillPlan | None:
    """:data:`ALWAYS` / :data:`NEVER` when ``SPECDEC_PREFILL_FLOAT32`` is ``on`` / ``off``
    (or ``1`` / ``0``, ``true`` / ``false``; any case); ``None`` when unset, empty or
    ``auto``.

    Raises:
        ValueError: another value.
    """
    forced = env_switch(ENV, "measured")
    return None if forced is None else ALWAYS if forced else NEVER


def _fastest(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        run()
        if i:
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def _run_products(products, inputs, upcast: bool) -> None:
    for (prefill, _), x in zip(products, inputs, strict=True):
        prefill(x, upcast)


def _run_attention(q: torch.Tensor, kv: torch.Tensor, upcast: bool) -> None:
    """The runtime's own prompt attention (causal, grouped heads) in either arithmetic."""
    from specdec.runtime.attention import CAUSAL, attention_fast

    scale = q.shape[-1] ** -0.5
    if upcast:
        attention_fast(q.float(), kv[0].float(), kv[1].float(), CAUSAL, scale).to(q.dtype)
    else:
        attention_fast(q, kv[0], kv[1], CAUSAL, scale)


def _blocked_available() -> bool:
    from specdec.runtime.kernels import prompt_attention_available

    return prompt_attention_available()


def _amx_available() -> bool:
    from specdec.runtime.kernels import amx_available

    return amx_available()


def _run_blocked_attention(q: torch.Tensor, cache: torch.Tensor, amx: bool = False) -> None:
    """The blocked prompt kernel over a prompt from an empty cache."""
    from specdec.runtime.kernels import prompt_attention

    prompt_attention(q, cache, 0, 0, q.shape[-1] ** -0.5, amx)


def _run_kernel_attention(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> None:
    """The runtime's attention kernel over a prompt from an empty cache (row i sees slots
    0 .. i), as :meth:`~specdec.runtime.model.NativeDecoder.forward_full` calls it."""
    from specdec.runtime.kernels import ragged_attention

    rows = q.shape[0]
    ragged_attention(
        q, [cache], 0, torch.zeros(rows, dtype=torch.long), torch.arange(1, rows + 1),
        torch.full((rows,), -1, dtype=torch.long), torch.empty(0, dtype=torch.long),
        q.shape[-1] ** -0.5, out,
    )  # fmt: skip


def measure(
    products: list[tuple[Callable[[torch.Tensor, bool], torch.Tensor], int]],
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    repeats: int = 2,
    quantized: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
    kernel: bool = False,
) -> PrefillPlan:
    """Time one layer's products and a causal attention at :data:`PREFILL_ROWS` rows, in
    ``dtype`` and in float32 (16-bit models), and choose the thresholds
    (:func:`threshold`); with ``quantized``, also the products on the quantized kernel,
    chosen up to the largest size at which, and at every smaller one, they beat the chosen
    dense arithmetic by :data:`UPCAST_GAIN` (:attr:`PrefillPlan.quantized_to`); with
    ``kernel``, also the attention on the runtime's kernel (:func:`kernel_threshold`
    against the chosen arithmetic) and, for bfloat16 on a
    CPU with AVX512-BF16, on the blocked prompt kernel (:func:`threshold` against the best
    of the others at each size; on a CPU with AMX-BF16, its pair-dot-product and AMX
    variants are both timed and the faster in total is the one chosen).

    Args:
        products: ``(prefill, in_features)`` per product of one layer; ``prefill(x,
            upcast)`` computes the chunk's product (upcast: in float32).
        heads: ``(query heads, key-value heads, head dim)``.
        dtype: the model's dtype.
        quantized: per product (same order), the quantized kernel's product ``f(x)``.
        kernel: the compiled kernels are available here (:func:`~specdec.runtime.kernels.
            kernel_available`).
    """
    gen = torch.Generator().manual_seed(0)
    h, g, d = heads
    sixteen = dtype in (torch.bfloat16, torch.float16)
    arithmetics = (("native", False), ("float32", True)) if sixteen else (("native", False),)
    times: dict[str, dict[str, list[float]]] = {
        "products": {name: [] for name, _ in arithmetics},
        "attention": {name: [] for name, _ in arithmetics},
    }
    if quantized:
        times["products"]["quantized"] = []
    if kernel:
        times["attention"]["kernel"] = []
    blocked = kernel and dtype == torch.bfloat16 and d in BLOCKED_HEAD_DIMS and _blocked_available()
    if blocked:
        times["attention"]["blocked"] = []
    time_amx = blocked and _amx_available()  # the kernel's AMX variant is a candidate
    if time_amx:
        times["attention"]["blocked_amx"] = []
    for rows in PREFILL_ROWS:
        inputs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in products]
        q = torch.randn(rows, h, d, generator=gen).to(dtype)
        kv = torch.randn(2, g, rows, d, generator=gen).to(dtype)
        for name, upcast in arithmetics:
            times["products"][name].append(
                _fastest(lambda u=upcast, i=inputs: _run_products(products, i, u), repeats)
            )
            times["attention"][name].append(
                _fastest(lambda u=upcast, q=q, kv=kv: _run_attention(q, kv, u), repeats)
            )
        if kernel:
            cache = torch.zeros(1, 2, g, -(-rows // 64) * 64, d, dtype=dtype)
            cache[0, :, :, :rows] = kv
            out = torch.empty(rows, h * d, dtype=dtype)
            times["attention"]["kernel"].append(
                _fastest(lambda q=q, c=cache, o=out: _run_kernel_attention(q, c, o), repeats)
            )
            if blocked:
                times["attention"]["blocked"].append(
                    _fastest(lambda q=q, c=cache: _run_blocked_attention(q, c), repeats)
                )
            if time_amx:
                times["attention"]["blocked_amx"].append(
                    _fastest(lambda q=q, c=cache: _run_blocked_attention(q, c, True), repeats)
                )
        if quantized:
            times["products"]["quantized"].append(
                _fastest(
                    lambda i=inputs: [f(x) for f, x in zip(quantized, i, strict=True)], repeats
                )
            )
    t = times["products"]
    products_from = threshold(t["native"], t["float32"]) if sixteen else None
    attention_from = (
        threshold(times["attention"]["native"], times["attention"]["float32"]) if sixteen else None
    )
    quantized_to = None
    if quantized:
        quantized_to = kernel_threshold(_chosen(t, products_from), t["quantized"])
    kernel_attention_to = None
    if kernel:
        a = times["attention"]
        kernel_attention_to = kernel_threshold(_chosen(a, attention_from), a["kernel"])
    blocked_attention_from, blocked_amx = None, False
    if blocked:
        a = times["attention"]
        blocked_amx = time_amx and sum(a["blocked_amx"]) < sum(a["blocked"])
        others = [min(x, y) for x, y in zip(_chosen(a, attention_from), a["kernel"], strict=True)]
        chosen = a["blocked_amx"] if blocked_amx else a["blocked"]
        blocked_attention_from = threshold(others, chosen)
    return PrefillPlan(
        products_from, attention_from, times, quantized_to, kernel_attention_to,
        blocked_attention_from, blocked_amx,
    )  # fmt: skip


def prefill_plan(
    products: list[tuple[Callable[[torch.Tensor, bool], torch.Tensor], int]],
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    model_key: str,
    quantized: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
    kernel: bool = False,
) -> PrefillPlan:
    """The :class:`PrefillPlan` for a model: forced by ``SPECDEC_PREFILL_FLOAT32`` (a
    forced plan keeps prompt attention on ``scaled_dot_product_attention``), :data:`NEVER`
    off CPU and for float32 models with neither ``quantized`` nor ``kernel``, else read
    from the kernel table (:func:`specdec.runtime.linear.kernel_table_path`) or measured
    now (:func:`measure`, about a second for SmolLM2-135M) and kept there.

    Args:
        products: as for :func:`measure` (one layer's).
        heads: ``(query heads, key-value heads, head dim)``.
        dtype: the model's dtype.
        device: where it runs.
        model_key: names the model's shapes (and kernels) in the table.
        quantized: as for :func:`measure` (a quantized model's products), or ``None``.
        kernel: as for :func:`measure`.

    Raises:
        ValueError: a bad ``SPECDEC_PREFILL_FLOAT32``.
    """
    from specdec.runtime import linear

    forced = forced_plan()
    if forced is not None:
        return forced
    sixteen = dtype in (torch.bfloat16, torch.float16)
    if device.type != "cpu" or not (sixteen or quantized or kernel):
        return NEVER
    # prefill5: plans that choose the quantized kernel up to a size, for every quantized
    # kernel, at five sizes; a quantized model's dense product timed as it then runs, on
    # expansions kept between chunks or expanded per chunk (quant.DENSE_KEEPER); prefill6:
    # the blocked prompt kernel's AMX variant timed too
    key = f"prefill6|{linear.machine_key(dtype, device)}"
    if quantized:
        from specdec.runtime.quant import keep_dense_budget

        key += "|dense-kept" if keep_dense_budget() > 0 else "|dense-expanded"

    def timed() -> dict:
        logger.info("timing prompt chunks in %s and float32 (%s)", dtype, model_key)
        return vars(measure(products, heads, dtype, quantized=quantized, kernel=kernel))

    return PrefillPlan(**linear.measured_entry(key, model_key, timed, "prompt chunk timing"))
