"""Kernel choice of the native runtime's matrix products: padding to a faster bucket,
exact-mode choice by score, the on-disk table, and padded products computing the same
rows as unpadded ones."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime import linear
from specdec.runtime.linear import BUCKETS, KernelChoice, Linear, _exact_choice, _fast_choice


def times(**per_formulation):
    """``{name: [ms per bucket]}`` from a value per bucket (a list of 7)."""
    return {name: list(ms) for name, ms in per_formulation.items()}


def test_fast_choice_pads_to_the_next_bucket_only_when_clearly_faster():
    t = times(a=[1.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], b=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    fast, rows = _fast_choice(t)
    assert fast[0] == "a" and rows[0] == 2  # 0.5 at two rows beats 0.9 at one
    assert fast[1] == "a" and rows[1] == 0  # next bucket (0.6) is slower
    assert fast[-1] == "b" and rows[-1] == 0  # the last bucket never pads
    # a 2% gain is not worth padding
    fast, rows = _fast_choice(times(a=[1.0, 0.98, 2, 2, 2, 2, 2]))
    assert rows[0] == 0


def test_padded_fast_product_equals_unpadded():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen)
    choice = KernelChoice(
        fast=["linear"] * len(BUCKETS), exact="linear", tile=16, min_rows=2,
        fast_rows=[2, 4, 8, 0, 0, 0, 0],
    )  # fmt: skip
    lin = Linear(weight, bias, choice)
    for m in (1, 2, 3, 5, 9):
        x = torch.randn(m, 32, generator=gen)
        y = lin(x)
        assert y.shape == (m, 48)
        torch.testing.assert_close(y, F.linear(x, weight, bias))


def test_old_table_entries_without_padding_still_load():
    choice = KernelChoice(fast=["linear"] * len(BUCKETS), exact="linear", tile=16)
    lin = Linear(torch.eye(4), None, choice)
    torch.testing.assert_close(lin(torch.ones(3, 4)), torch.ones(3, 4))


def test_exact_choice_prefers_padding_when_it_is_faster(monkeypatch):
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(80, 32, generator=torch.Generator().manual_seed(2))
    slow_one_row = {"x_wt": [1.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}
    with monkeypatch.context() as m:  # both candidates exact: the faster (padded) one wins
        m.setattr(linear, "is_row_invariant", lambda *args: True)
        name, tile, min_rows = _exact_choice(weight, x, slow_one_row)
    assert (name, min_rows) == ("x_wt", 2) and tile >= 16
    # on this machine: padded whenever the BLAS product is exact padded (MKL on an
    # AVX2-only AMD EPYC gives other bits from 2 to 16 rows even padded: tile 1)
    name, tile, min_rows = _exact_choice(weight, x, slow_one_row)
    if linear.is_row_invariant(x, weight.t().contiguous(), "x_wt", 16, 2):
        assert (name, min_rows) == ("x_wt", 2) and tile >= 16
    fast_one_row = {"x_wt": [0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}
    name, tile, min_rows = _exact_choice(weight, x, fast_one_row)
    # one row unpadded only if the one-row kernel is bit-compatible with the others
    if linear.is_row_invariant(x, weight.t().contiguous(), "x_wt", 16, 1):
        assert min_rows == 1


def test_kernel_table_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    real = linear.calibrate

    def counting(products, repeats=1):
        calls.append(1)
        return real(products, repeats=1)

    monkeypatch.setattr(linear, "calibrate", counting)
    gen = torch.Generator().manual_seed(0)
    products = {"p": [torch.randn(16, 8, generator=gen) for _ in range(2)]}
    first = linear.kernel_choices(products)
    second = linear.kernel_choices(products)
    assert len(calls) == 1 and first == second
    assert (tmp_path / "kernels.json").exists()
    linear.kernel_choices(products, refresh=True)
    assert len(calls) == 2
    assert len(first["p"].fast_rows) == len(BUCKETS)


def test_a_calibration_on_a_busy_machine_is_not_kept(tmp_path, monkeypatch, caplog):
    """Timings taken while other processes kept the cores busy choose kernels from their
    time slices: used by this process only (measured once), never written to disk, and
    measured again by the next process; on an idle machine the table keeps them."""
    from specdec import machine

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(linear, "_PROCESS_ONLY", {})
    calls = []
    monkeypatch.setattr(linear, "calibrate", lambda products: calls.append(1) or {})
    busy = {"cores": 1.5}

    def exit_(self, *exc):
        self.cores_busy = busy["cores"]

    monkeypatch.setattr(machine.OthersLoad, "__exit__", exit_)
    products = {"p": [torch.randn(16, 8)]}
    with caplog.at_level("WARNING", logger="specdec.runtime.linear"):
        linear.kernel_choices(products)
    assert "1.5 cores busy" in caplog.text and "measured again next time" in caplog.text
    linear.kernel_choices(products)
    assert len(calls) == 1 and not (tmp_path / "kernels.json").exists()
    monkeypatch.setattr(linear, "_PROCESS_ONLY", {})  # the next process
    busy["cores"] = 0.1
    linear.kernel_choices(products)
    assert len(calls) == 2 and (tmp_path / "kernels.json").exists()
    monkeypatch.setattr(linear, "_PROCESS_ONLY", {})
    linear.kernel_choices(products)
    assert len(calls) == 2  # read back from disk


def test_others_load_counts_other_processes_busy_time(monkeypatch):
    """``/proc/stat``'s busy time minus this process's CPU time, over the wall time; a
    block too short to judge says nothing."""
    from specdec import machine

    with machine.OthersLoad() as quick:
        pass
    assert quick.cores_busy is None
    monkeypatch.setattr(machine.OthersLoad, "MIN_JUDGED_S", 0.0)
    ticks = iter([(1000, 5000), (1000 + 3 * os.sysconf("SC_CLK_TCK"), 9000)])
    monkeypatch.setattr(machine, "_cpu_ticks", lambda: next(ticks))
    with machine.OthersLoad() as load:
        time.sleep(0.05)
    assert load.cores_busy > 10  # 3 s of other processes' work within about 0.05 s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_product_is_row_invariant_for_the_chosen_tile(dtype):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 48, generator=gen).to(dtype)
    x = torch.randn(80, 48, generator=gen).to(dtype)
    t = {name: [1.0] * len(BUCKETS) for name in linear.available_formulations(weight)}
    name, tile, min_rows = _exact_choice(weight, x, t)
    prepared = linear.FORMULATIONS[name].prepare(weight)
    alone = linear.exact_product(x[:1], prepared, name, tile, min_rows)
    for m in (1, 2, 7, 16, 33):
        rows = torch.cat([x[:1], x[1:m]])
        assert torch.equal(linear.exact_product(rows, prepared, name, tile, min_rows)[:1], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stream_formulation_is_row_invariant_by_construction(dtype):
    """specdec's own few-row product (``stream``): every row gives its bits alone, for
    every row count up to the largest tile, without padding; calibration can choose it."""
    from specdec.runtime.kernels import kernel_available

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(72, 64, generator=gen).to(dtype)
    if not kernel_available():
        assert "stream" not in linear.available_formulations(weight)
        pytest.skip("the C++ extension is not available here")
    assert "stream" in linear.available_formulations(weight)
    x = torch.randn(max(linear.TILES) + 8, 64, generator=gen).to(dtype)
    prepared = linear.FORMULATIONS["stream"].prepare(weight)
    assert linear.is_row_invariant(x, prepared, "stream", max(linear.TILES), 1)
    torch.testing.assert_close(
        linear.FORMULATIONS["stream"].apply(x, prepared).float(),
        (x.float() @ weight.float().t()),
        atol=0.05 if dtype == torch.bfloat16 else 1e-4,
        rtol=0.02 if dtype == torch.bfloat16 else 1e-5,
    )


def test_onednn_is_left_out_where_its_packed_product_raises(monkeypatch):
    """oneDNN's packed bfloat16 product raises on CPUs without AVX-512 (an AMD EPYC with
    AVX2, say): calibration then measures the other formulations instead of failing, and
    the dtypes where it runs keep it."""

    def refuses(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")
        return real(weight, *args)

    real = torch.ops.mkldnn._reorder_linear_weight
    linear._onednn_runs.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuses)
    try:
        weight = torch.randn(72, 64)
        assert "onednn" not in linear.available_formulations(weight.bfloat16())
        if torch.backends.mkldnn.is_available():
            assert "onednn" in linear.available_formulations(weight)
        choices = linear.calibrate({"proj": [weight.bfloat16()]}, repeats=1)
        assert "onednn" not in choices["proj"].times_ms
    finally:
        linear._onednn_runs.cache_clear()


def test_the_amx_formulation_runs_any_row_count_as_one_exact_product():
    """``amx`` (bfloat16 on AMX tiles): available only for bfloat16 where the CPU has
    AMX-BF16; chosen as exact, it passes the check at the largest tile and then gets
    ``ANY_ROWS``: 200 rows in one product, each with the bits it has alone."""
    from specdec.runtime.kernels import amx_available

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(72, 64, generator=gen).bfloat16()
    assert "amx" not in linear.available_formulations(weight.float())
    if not amx_available():
        assert "amx" not in linear.available_formulations(weight)
        pytest.skip("no AMX-BF16 here")
    x = torch.randn(max(linear.TILES) + 8, 64, generator=gen).bfloat16()
    only_amx = {"amx": [1.0] * len(BUCKETS)}
    name, tile, min_rows = _exact_choice(weight, x, only_amx)
    assert (name, tile, min_rows) == ("amx", linear.ANY_ROWS, 1)
    prepared = linear.FORMULATIONS["amx"].prepare(weight)
    many = torch.randn(200, 64, generator=gen).bfloat16()
    y = linear.exact_product(many, prepared, name, tile, min_rows)
    for i in (0, 17, 199):
        one = linear.exact_product(many[i : i + 1], prepared, name, tile, 1)
        assert torch.equal(one, y[i : i + 1])
    torch.testing.assert_close(y.float(), many.float() @ weight.float().t(), atol=0.05, rtol=0.02)


def test_an_any_rows_formulation_is_never_padded_in_exact_mode(monkeypatch):
    """Padding one row to two only adds work where a kernel computes every row alike
    (``any_rows``): even when the padded time measured lower (noise), exact mode keeps one
    row unpadded, which is also what the fused decoding layers need."""
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(80, 32, generator=torch.Generator().manual_seed(2))
    noisy = {"stream": [1.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}
    monkeypatch.setattr(linear, "is_row_invariant", lambda *args: True)
    assert _exact_choice(weight, x, noisy) == ("stream", linear.ANY_ROWS, 1)


#: specdec's own dense tile formulations: (name, dtype, layout, the kernel's availability)
TILE_FORMULATIONS = [("dpbf16", torch.bfloat16), ("f32_tiles", torch.float32)]


def _tiles_or_skip(name, weight):
    from specdec.runtime import kernels

    available = {"dpbf16": kernels.dpbf16_available, "f32_tiles": kernels.f32_tiles_available}
    if not available[name]():
        assert name not in linear.available_formulations(weight)
        pytest.skip(f"{name} is not built for this CPU")
    return linear.FORMULATIONS[name].prepare(weight)


def _within_rounding(y, x, weight, dtype) -> torch.Tensor:
    """Whether ``y`` is ``x W^T`` up to float32 accumulation (the standard bound of a K-term
    dot product, K u sum |x w|) and, in bfloat16, the result's one rounding."""
    ref = x.double() @ weight.double().t()
    accumulation = x.shape[1] * 2**-24 * (x.double().abs() @ weight.double().abs().t())
    rounding = 2**-8 * ref.abs() if dtype == torch.bfloat16 else 0
    return ((y.double() - ref).abs() <= accumulation + rounding + 1e-30).all()


@pytest.mark.parametrize(("name", "dtype"), TILE_FORMULATIONS)
@pytest.mark.parametrize(("n", "k"), [(72, 64), (48, 576), (300, 96)])
def test_a_tile_formulation_is_the_weights_product_for_any_row_count(name, dtype, n, k):
    """``dpbf16`` (bfloat16 weights on AVX512-BF16 pair dot products) and ``f32_tiles``
    (float32 weights, one FMA per k and output): within float32 accumulation (and bfloat16
    output rounding) of the float64 product of the same values, N not a multiple of 16
    included (padded outputs dropped), and every row of 1..80-row products, at two places,
    bit-identical to that row alone; as exact formulation each runs any row count as one
    product (``ANY_ROWS``, unpadded)."""
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert name not in linear.available_formulations(weight.to(other))
    if name == "dpbf16":
        assert name not in linear.available_formulations(weight[:, :40])  # K % 32 != 0
    tiles = _tiles_or_skip(name, weight)
    assert name in linear.available_formulations(weight)
    assert tiles.n == n and tiles.tiles.shape[0] == -(-n // 16)
    apply = linear.FORMULATIONS[name].apply
    x = torch.randn(90, k, generator=gen).to(dtype)
    y = apply(x, tiles)
    assert y.shape == (90, n) and y.dtype == dtype and y.is_contiguous()
    assert _within_rounding(y, x, weight, dtype)
    alone = torch.cat([apply(x[i : i + 1], tiles) for i in range(90)])
    assert torch.equal(alone, y)
    for m in range(2, 81):
        for start in (0, 9):
            assert torch.equal(apply(x[start : start + m], tiles), y[start : start + m])
    only = {name: [1.0] * len(BUCKETS)}
    assert _exact_choice(weight, x, only) == (name, linear.ANY_ROWS, 1)


@pytest.mark.parametrize(("name", "dtype"), TILE_FORMULATIONS)
def test_the_tile_oracle_catches_a_wrong_order_of_k(name, dtype):
    """The accuracy check above fails for a layout with each pair of k swapped (the
    mistake a tile layout invites): the oracle can fail."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    _tiles_or_skip(name, weight)
    swapped = weight.view(48, 32, 2).flip(-1).reshape(48, 64).contiguous()
    x = torch.randn(9, 64, generator=gen).to(dtype)
    formulation = linear.FORMULATIONS[name]
    y = formulation.apply(x, formulation.prepare(swapped))
    assert not _within_rounding(y, x, weight, dtype)


def test_the_dpbf16_dense_layout_refuses_what_it_cannot_hold():
    from specdec.runtime import kernels

    with pytest.raises(ValueError, match="bfloat16 \\[N, K\\] matrix with K a multiple of 32"):
        linear.dpbf16_dense_layout(torch.zeros(16, 64))
    with pytest.raises(ValueError, match="K a multiple of 32, got torch.bfloat16 \\[16, 48\\]"):
        linear.dpbf16_dense_layout(torch.zeros(16, 48, dtype=torch.bfloat16))
    tiles = _tiles_or_skip("dpbf16", torch.zeros(32, 64, dtype=torch.bfloat16))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K/32, 320\\]"):  # dense tiles read as Q4_1
        kernels.dpbf16_quant_gemm(x, tiles.tiles, 0, 32)
    with pytest.raises(RuntimeError, match="unknown tile kind 3"):
        kernels.dpbf16_quant_gemm(x, tiles.tiles, 3, 32)
    with pytest.raises(RuntimeError, match="x has K = 32"):
        kernels.dpbf16_quant_gemm(x[:, :32].contiguous(), tiles.tiles, 2, 32)


def test_the_f32_tile_layout_refuses_what_it_cannot_hold():
    from specdec.runtime import kernels

    with pytest.raises(ValueError, match="float32 \\[N, K\\] matrix, got torch.bfloat16"):
        linear.f32_tile_layout(torch.zeros(16, 64, dtype=torch.bfloat16))
    tiles = _tiles_or_skip("f32_tiles", torch.zeros(32, 64))
    assert tiles.tiles.shape == (2, 64, 16)
    with pytest.raises(RuntimeError, match="x has K = 32 but the tiles hold 64"):
        kernels.f32_tile_gemm(torch.zeros(2, 32), tiles.tiles, 32)
    with pytest.raises(RuntimeError, match="x must be a float32"):
        kernels.f32_tile_gemm(torch.zeros(2, 64, dtype=torch.bfloat16), tiles.tiles, 32)
    with pytest.raises(RuntimeError, match="matching the tiles' N"):
        kernels.f32_tile_gemm(torch.zeros(2, 64), tiles.tiles, 8)


def test_measurements_are_kept_per_cpu_model_and_features():
    """Two VMs may report the same CPU model with other instruction sets (AMX or not): the
    flags digest tells them apart, whatever the flags' order."""
    amx = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n"
    same = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: amx_tile fpu amx_bf16 avx512f\n"
    no_amx = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx512f avx512_bf16\n"
    assert linear.flags_digest(amx) == linear.flags_digest(same) != ""
    assert linear.flags_digest(amx) != linear.flags_digest(no_amx)
    assert linear.flags_digest("processor : 0\n") == ""
    assert linear.cpu_identity().startswith(linear.cpu_name())
    assert linear.cpu_identity() in linear.machine_key(torch.float32, torch.device("cpu"))
