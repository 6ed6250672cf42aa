"""The native runtime's compiled kernels (``specdec.runtime.kernels``) against the PyTorch
reference: ragged attention over several sequences' KV caches (prefix rows, token tree
rows, both code paths: AVX-512 or AVX2 for head_dim 64/128, portable otherwise), the fused layer
ops (RMSNorm with the residual sum, rotary with the KV store, SiLU x up; lane-sized and
odd widths), the few-row matrix product, batch invariance bit for bit, and clear
errors."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from conftest import torch_threads
from specdec.runtime import kernels
from specdec.runtime.attention import attention_exact, key_groups

pytestmark = pytest.mark.skipif(
    os.environ.get("SPECDEC_ATTENTION", "").lower() == "reference",
    reason="SPECDEC_ATTENTION=reference turns the kernels off",
)

L, G, H = 2, 2, 6  # layers, KV heads, query heads (3 per KV head)


def test_the_kernels_build_on_this_machine():
    assert kernels.kernel_available(), "the C++ attention kernel did not build (see the log)"


def test_the_kernels_say_which_instruction_set_they_run():
    """AVX-512 or AVX2 + FMA where the CPU has them (the flags /proc/cpuinfo lists), the
    portable loops only on a CPU with neither."""
    flags = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not flags:
        pytest.skip("no /proc/cpuinfo here")
    expected = (
        "avx512" if "avx512f" in flags
        else "avx2" if {"avx2", "fma", "f16c"} <= flags
        else "portable"
    )  # fmt: skip
    assert kernels.simd() == expected


def _caches(dtype, d, capacities, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(L, 2, G, c, d, generator=gen).to(dtype) for c in capacities]


def _attention_tol(dtype) -> dict:
    """Tolerance against the float32 reference: float32 to rounding; bfloat16 a bfloat16
    ulp of the output (assert_close's default rtol) plus 2e-3 absolute, since over a
    bfloat16 cache with AVX512-BF16 the value sums take the probabilities rounded to
    bfloat16 (relative error 2^-9 each, as PyTorch's bfloat16 flash kernel); float16:
    assert_close's defaults."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.bfloat16:
        return dict(atol=2e-3, rtol=1.6e-2)
    return {}


def _tree_slots(n_prefix, picks):
    return torch.cat([torch.arange(n_prefix), torch.tensor(picks)])


@pytest.mark.parametrize("d", [8, 64, 128])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_ragged_attention_equals_the_reference(dtype, d):
    caches = _caches(dtype, d, [64, 128, 192])
    # per sequence: its rows' visibility (a prefix length, or the slots of a tree row)
    visible = [
        [37],  # decoding
        [90, 91, 92, 93],  # a chain
        [100, _tree_slots(100, [100, 102]), _tree_slots(100, [101, 103, 150])],  # a tree
    ]
    rows = sum(len(v) for v in visible)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(rows, H, d, generator=gen).to(dtype)
    scale = d**-0.5
    for layer in range(L):
        seq, n, off, slots, used = [], [], [], [], 0
        for s, vis in enumerate(visible):
            for v in vis:
                seq.append(s)
                if isinstance(v, int):
                    n.append(v)
                    off.append(-1)
                else:
                    n.append(v.numel())
                    off.append(used)
                    slots.append(v)
                    used += v.numel()
        out = torch.full((rows, H * d), 7.0, dtype=dtype)
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        kernels.ragged_attention(
            q, caches, layer, t(seq), t(n), t(off), torch.cat(slots), scale, out
        )
        row = 0
        for s, vis in enumerate(visible):
            kv = caches[s][layer]
            ref = attention_exact(
                q[row : row + len(vis)], kv[0], kv[1], key_groups(vis, "cpu"), scale
            )
            torch.testing.assert_close(out[row : row + len(vis)], ref, **_attention_tol(dtype))
            row += len(vis)


@pytest.mark.parametrize("d", [8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(dtype, d):
    """Batch invariance by construction: one decoding row alone, then among 63 rows of
    other sequences (chains and trees around it), then as a tree row that sees the same
    slots."""
    caches = _caches(dtype, d, [256] * 8, seed=2)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(64, H, d, generator=gen).to(dtype)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    empty = torch.empty(0, dtype=torch.long)
    alone = torch.empty(1, H * d, dtype=dtype)
    kernels.ragged_attention(q[:1], caches[3:4], 1, t([0]), t([150]), t([-1]), empty, 0.1, alone)
    seq = [i % 8 for i in range(64)]
    seq[40] = 3
    n = [50 + 3 * i for i in range(64)]
    n[40] = 150
    qb = q.clone()
    qb[40] = q[0]
    out = torch.empty(64, H * d, dtype=dtype)
    kernels.ragged_attention(qb, caches, 1, t(seq), t(n), t([-1] * 64), empty, 0.1, out)
    assert torch.equal(out[40], alone[0])
    tree = torch.empty(1, H * d, dtype=dtype)
    kernels.ragged_attention(
        q[:1], caches[3:4], 1, t([0]), t([150]), t([0]), torch.arange(150), 0.1, tree
    )
    assert torch.equal(tree, alone)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_sharing_key_reads_get_the_bits_they_get_alone(dtype, d):
    """Rows of one sequence share their key and value reads (groups of up to 16 rows, key
    blocks of 64): 37 rows of one sequence -- chain rows crossing key-block boundaries,
    tree rows gathering slots, a row of another sequence in the middle -- each get the
    bits they get alone."""
    caches = _caches(dtype, d, [400, 300], seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(38, H, d, generator=gen).to(dtype)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    seq, n, off, slots, used = [], [], [], [], 0
    for i in range(38):
        if i == 20:  # another sequence between two runs of the first
            seq.append(1), n.append(77), off.append(-1)
        elif i % 3 == 2:  # a tree row: the prefix, then scattered slots
            picks = _tree_slots(120 + i, [300 + i, 310 + i, 399 - i])
            seq.append(0), n.append(picks.numel()), off.append(used)
            slots.append(picks)
            used += picks.numel()
        else:
            seq.append(0), n.append(60 + 7 * i), off.append(-1)
    out = torch.empty(38, H * d, dtype=dtype)
    kernels.ragged_attention(q, caches, 1, t(seq), t(n), t(off), torch.cat(slots), 0.1, out)
    for i in range(38):
        alone = torch.empty(1, H * d, dtype=dtype)
        sl = torch.cat(slots)[off[i] : off[i] + n[i]] if off[i] >= 0 else torch.empty(0).long()
        kernels.ragged_attention(
            q[i : i + 1], caches[seq[i] : seq[i] + 1], 1, t([0]), t([n[i]]),
            t([0 if off[i] >= 0 else -1]), sl, 0.1, alone,
        )  # fmt: skip
        assert torch.equal(out[i], alone[0]), i


def test_a_kernel_lets_other_python_threads_run_while_it_computes():
    """The kernels release the interpreter lock, as PyTorch's operations do. With the
    interpreter's switch interval at 100 s a thread that holds the lock keeps it; so the
    main thread, waiting for a kernel that another thread started, gets to run before that
    kernel ends only if the kernel let go of the lock. Its result is the one it gets
    without another thread about."""
    import sys
    import threading

    gen = torch.Generator().manual_seed(10)
    x = torch.randn(16, 4096, generator=gen)
    w = torch.randn(16384, 4096, generator=gen)  # 256 MB of float32: many milliseconds
    y = torch.empty(16, 16384)
    small_gemm = kernels._module_or_raise().small_gemm  # no PyTorch call (they let go too)
    started, done = threading.Event(), threading.Event()

    def work():
        started.set()
        small_gemm(x, w, y)
        done.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        started.wait()
        ran_during = not done.is_set()  # the main thread holds the lock again here
        thread.join()
    finally:
        sys.setswitchinterval(before)
    assert ran_during, "the kernel held the interpreter lock for its whole run"
    assert torch.equal(y, kernels.small_gemm(x, w))


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_verified_chain_split_over_the_threads_keeps_each_rows_bits(dtype, threads):
    """One sequence verifying a chain alone is one task per KV head, fewer than the
    threads can share: its rows are split into smaller groups (each packing the keys for
    itself) until there are twice as many tasks as threads. Each row still gets the bits
    it gets alone on one thread, in chains of 2 to 16 rows, and next to a tree."""
    caches = _caches(dtype, 64, [300], seed=8)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(17, H, 64, generator=gen).to(dtype)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    empty = torch.empty(0, dtype=torch.long)
    alone = []
    with torch_threads(1):
        for i in range(16):
            out = torch.empty(1, H * 64, dtype=dtype)
            kernels.ragged_attention(
                q[i : i + 1], caches, 0, t([0]), t([129 + i]), t([-1]), empty, 0.125, out
            )
            alone.append(out[0])
    with torch_threads(threads):
        for rows in (2, 5, 16):
            out = torch.empty(rows, H * 64, dtype=dtype)
            kernels.ragged_attention(
                q[:rows], caches, 0, t([0] * rows), t(range(129, 129 + rows)),
                t([-1] * rows), empty, 0.125, out,
            )  # fmt: skip
            for i in range(rows):
                assert torch.equal(out[i], alone[i]), (rows, i)
        slots = _tree_slots(129, [140, 200])  # a tree row after the chain's 16
        out = torch.empty(17, H * 64, dtype=dtype)
        kernels.ragged_attention(
            q, caches, 0, t([0] * 17), t(list(range(129, 145)) + [slots.numel()]),
            t([-1] * 16 + [0]), slots, 0.125, out,
        )  # fmt: skip
    for i in range(16):
        assert torch.equal(out[i], alone[i]), i
    with torch_threads(1):
        tree = torch.empty(1, H * 64, dtype=dtype)
        kernels.ragged_attention(
            q[16:], caches, 0, t([0]), t([slots.numel()]), t([0]), slots, 0.125, tree
        )
    assert torch.equal(out[16], tree[0])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_rows_split_into_chunks_equal_the_reference_and_get_their_bits_alone(dtype, d):
    """A row that sees 2,048 keys or more runs as several tasks (chunks of 1,024
    positions, the last one to the row's end, merged in order): it equals the reference to
    rounding, and gets the same bits alone as in a chain crossing a chunk boundary (1 to 4
    chunks), in a tree, and beside a short sequence."""
    caches = _caches(dtype, d, [4200, 300], seed=6)
    gen = torch.Generator().manual_seed(7)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    lengths = [1000, 1024, 1025, 1030, 2047, 2048, 2049, 3071, 4100]
    seq, n, off, slots = [0] * len(lengths), list(lengths), [-1] * len(lengths), []
    tree = _tree_slots(1500, [2400, 2550, 1600])  # a tree row: long prefix, far slots
    seq.append(0), n.append(tree.numel()), off.append(0)
    slots.append(tree)
    seq.append(1), n.append(200), off.append(-1)  # a short sequence beside them
    rows = len(seq)
    q = torch.randn(rows, H, d, generator=gen).to(dtype)
    out = torch.empty(rows, H * d, dtype=dtype)
    kernels.ragged_attention(q, caches, 1, t(seq), t(n), t(off), torch.cat(slots), 0.1, out)
    for i in range(rows):
        sl = torch.cat(slots)[off[i] : off[i] + n[i]] if off[i] >= 0 else torch.empty(0).long()
        alone = torch.empty(1, H * d, dtype=dtype)
        kernels.ragged_attention(
            q[i : i + 1], caches[seq[i] : seq[i] + 1], 1, t([0]), t([n[i]]),
            t([0 if off[i] >= 0 else -1]), sl, 0.1, alone,
        )  # fmt: skip
        assert torch.equal(out[i], alone[0]), i
        kv = caches[seq[i]][1]
        vis = [sl] if off[i] >= 0 else [n[i]]
        ref = attention_exact(q[i : i + 1], kv[0], kv[1], key_groups(vis, "cpu"), 0.1)
        torch.testing.assert_close(alone, ref, **_attention_tol(dtype))


def test_rows_outside_the_kernel_are_left_alone():
    caches = _caches(torch.float32, 8, [64])
    q = torch.randn(3, H, 8)
    out = torch.full((3, H * 8), 7.0)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    empty = torch.empty(0, dtype=torch.long)
    kernels.ragged_attention(
        q, caches, 0, t([-1, 0, -1]), t([5, 6, 7]), t([-1] * 3), empty, 1.0, out
    )
    assert (out[0] == 7).all() and (out[2] == 7).all() and not (out[1] == 7).all()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def _ulps(dtype):
    """Tolerance of one rounding in ``dtype`` on values of order 1-10 (the norm's sum of
    squares and SiLU's exp run in another order or polynomial than PyTorch's)."""
    return {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
        torch.float16: dict(atol=1e-3, rtol=1e-3),
    }[dtype]


@pytest.mark.parametrize("width", [576, 40])  # 40: not a multiple of the 16 lanes
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_and_residual_sum_equal_pytorch(dtype, width):
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(33, width, generator=gen)).to(dtype)
    delta = torch.randn(33, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    ref = torch.nn.functional.rms_norm(x, (width,), w, 1e-5)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), ref, **_ulps(dtype))
    total, normed = kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)  # the residual stream's bits exactly
    ref = torch.nn.functional.rms_norm(x + delta, (width,), w, 1e-5)
    torch.testing.assert_close(normed, ref, **_ulps(dtype))
    # rows of a wider buffer (a product's view) read in place
    wide = torch.cat([x, delta], dim=1)
    assert torch.equal(kernels.rms_norm(wide[:, :width], w, 1e-5), kernels.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("width", [1536, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul_equals_pytorch(dtype, width):
    gen = torch.Generator().manual_seed(5)
    gate_up = (4 * torch.randn(33, 2 * width, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp's overflow and 0
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = kernels.silu_mul(gate_up)
    torch.testing.assert_close(out, ref, **_ulps(dtype))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("width", [1, 15, 16, 17, 49157])
def test_argmax_rows_equals_pytorch_on_ties_infinities_and_nans(width):
    """The first index of each row's maximum, as ``torch.argmax``: ties (the first wins),
    +-inf, NaN anywhere (the first NaN wins, whatever is larger), rows that are views of
    wider rows, lane-sized and odd widths (the vector body and the scalar tail)."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randint(-3, 3, (40, width + 5), generator=gen).float()  # many ties
    x = wide[:, 2 : width + 2]
    x[1] = float("-inf")
    x[2, -1] = float("inf")
    x[3, width // 2] = float("nan")
    x[4, -1], x[4, width // 3] = float("nan"), float("nan")
    x[5, 0] = float("nan")
    x[6:20] = torch.randn(14, width, generator=gen)
    x[7, -1] = x[7].max() + 1  # the maximum in the scalar tail
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))
    assert torch.equal(kernels.argmax_rows(x[:0]), x[:0].argmax(-1))


def test_greedy_ids_equals_argmax_with_and_without_the_kernel(monkeypatch):
    """``greedy_ids`` gives ``torch.argmax``'s indices on every path: the kernel (float32
    rows, one row or several), and PyTorch's for other dtypes, layouts and shapes, or while
    the extension is not loaded."""
    from specdec.sampling import greedy_ids

    assert kernels.kernel_available()  # loads the extension (greedy_ids never does)
    calls = []
    real = kernels.argmax_rows
    monkeypatch.setattr(kernels, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    gen = torch.Generator().manual_seed(10)
    x = torch.randint(-4, 4, (6, 300), generator=gen).float()
    cases = [x, x[2], x[:, :77], x.t(), x.bfloat16(), x.double(), x.view(2, 3, 300), x[:0]]
    for case in cases:
        assert torch.equal(greedy_ids(case), case.argmax(-1))
    assert calls == [(6, 300), (1, 300), (6, 77)]  # float32 rows with unit stride only
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    assert torch.equal(greedy_ids(x), x.argmax(-1)) and len(calls) == 3


def test_argmax_rows_refuses_bad_inputs():
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="at least one column"):
        kernels.argmax_rows(torch.zeros(2, 0))


@pytest.mark.parametrize("d", [8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_kv_gives_the_reference_bits_and_fills_the_caches(dtype, d):
    """Queries and keys rotated with the bits of the PyTorch reference (``_rotate``),
    keys and values in their sequences' slots, other slots untouched; the QKV rows may be
    a view of a wider buffer."""
    from specdec.runtime.model import _rotate

    gen = torch.Generator().manual_seed(6)
    t = 5
    wide = torch.randn(t, (H + 2 * G) * d + 16, generator=gen).to(dtype)
    qkv = wide[:, 16:]
    cos = torch.randn(t, d, generator=gen).to(dtype)
    sin = torch.randn(t, d, generator=gen).to(dtype)
    caches = _caches(dtype, d, [16, 32], seed=7)
    before = [c.clone() for c in caches]
    seq, slot = [0, 0, 1, 1, 1], [3, 4, 0, 1, 30]
    q = kernels.rotary_kv(qkv, cos, sin, caches, 1, torch.tensor(seq), torch.tensor(slot), H)
    x = qkv.reshape(t, H + 2 * G, d)
    ref = _rotate(x[:, : H + G], cos.unsqueeze(1), sin.unsqueeze(1))
    assert q.shape == (t, H, d) and q.is_contiguous()
    assert torch.equal(q, ref[:, :H])
    for row, (s, p) in enumerate(zip(seq, slot, strict=True)):
        assert torch.equal(caches[s][1, 0, :, p], ref[row, H:])
        assert torch.equal(caches[s][1, 1, :, p], x[row, H + G :])
        before[s][1, :, :, p] = caches[s][1, :, :, p]
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c, b)  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_ops_give_a_row_the_same_bits_alone_and_in_a_batch(dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 576, generator=gen).to(dtype)
    delta = torch.randn(64, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    gate_up = torch.randn(64, 3072, generator=gen).to(dtype)
    batch = (kernels.rms_norm(x, w, 1e-5), *kernels.add_rms_norm(x, delta, w, 1e-5))
    act = kernels.silu_mul(gate_up)
    for row in (0, 17, 63):
        alone = (
            kernels.rms_norm(x[row : row + 1], w, 1e-5),
            *kernels.add_rms_norm(x[row : row + 1], delta[row : row + 1], w, 1e-5),
        )
        for b, a in zip(batch, alone, strict=True):
            assert torch.equal(b[row : row + 1], a)
        assert torch.equal(act[row : row + 1], kernels.silu_mul(gate_up[row : row + 1]))


@pytest.mark.parametrize("k", [576, 40, 1536])  # 40: not a multiple of the lanes
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_small_gemm_equals_the_product_and_a_row_gets_the_same_bits_in_any_batch(dtype, k):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(37, k, generator=gen).to(dtype)  # 37: not a multiple of the block
    x = torch.randn(11, k, generator=gen).to(dtype)
    y = kernels.small_gemm(x, w)
    ref = x.float() @ w.float().t()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    for m in range(11):  # alone, and at every place of smaller batches
        assert torch.equal(kernels.small_gemm(x[m : m + 1], w), y[m : m + 1])
    assert torch.equal(kernels.small_gemm(x[3:9], w), y[3:9])
    wide = torch.cat([x, x], dim=1)  # rows of a wider buffer read in place
    assert torch.equal(kernels.small_gemm(wide[:, :k], w), y)


needs_amx = pytest.mark.skipif(
    not kernels.amx_available(), reason="no AMX-BF16 here (or the tile state is refused)"
)


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(576, 576), (37, 40), (70, 1536), (16, 32)])
def test_amx_gemm_equals_the_product_and_a_row_gets_the_same_bits_for_any_row_count(n, k):
    """The AMX product: float32 accumulation of bfloat16 products (close to the float32
    product of the same values), and every row bit-identical alone, at every place of
    every row count up to 70 (several tiles of 16, odd remainders), and in a batch of 300
    (prefill-sized; N, K not multiples of the tile: zero padding adds exact zeros)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(300, k, generator=gen).bfloat16()
    packed = kernels.amx_pack(w)
    y = kernels.amx_gemm(x, packed, n)
    assert y.shape == (300, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = x.float() @ w.float().t()
    # float32 accumulation, one rounding to bfloat16: half an ulp of bfloat16 plus slack
    torch.testing.assert_close(y.float(), ref, atol=1e-3 * ref.abs().max().item(), rtol=2**-8)
    alone = torch.cat([kernels.amx_gemm(x[i : i + 1], packed, n) for i in range(80)])
    assert torch.equal(alone, y[:80])
    for m in range(2, 71):
        for start in (0, 9):
            got = kernels.amx_gemm(x[start : start + m], packed, n)
            assert torch.equal(got, y[start : start + m])
    wide = torch.cat([x, x], dim=1)  # rows of a wider buffer read in place
    assert torch.equal(kernels.amx_gemm(wide[:, :k], packed, n), y)
    assert kernels.amx_gemm(x[:0], packed, n).shape == (0, n)


@needs_amx
def test_amx_gemm_refuses_what_it_cannot_compute():
    w = torch.randn(20, 64).bfloat16()
    packed = kernels.amx_pack(w)
    with pytest.raises(ValueError, match="bfloat16 weight"):
        kernels.amx_pack(w.float())
    with pytest.raises(RuntimeError, match="bfloat16 \\[M, K\\]"):
        kernels.amx_gemm(torch.zeros(2, 64), packed, 20)
    with pytest.raises(RuntimeError, match="packed holds 64"):
        kernels.amx_gemm(torch.zeros(2, 96).bfloat16(), packed, 20)
    with pytest.raises(RuntimeError, match="matching packed's N"):
        kernels.amx_gemm(torch.zeros(2, 64).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="contiguous bfloat16 \\[N/16"):
        kernels.amx_gemm(torch.zeros(2, 64).bfloat16(), w, 20)


def test_bad_inputs_are_clear_errors():
    caches = _caches(torch.float32, 8, [64])
    one = torch.zeros(1, dtype=torch.long)
    qkv = torch.zeros(1, (H + 2 * G) * 8)
    cos = sin = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        kernels.rotary_kv(qkv, cos, sin, caches, 0, one, torch.tensor([64]), H)
    with pytest.raises(RuntimeError, match="contiguous \\[L, 2, G, C, D\\]"):
        kernels.rotary_kv(qkv.bfloat16(), cos, sin, caches, 0, one, one, H)
    with pytest.raises(RuntimeError, match="\\(H \\+ 2G\\) \\* D"):
        kernels.rotary_kv(qkv, cos, sin, caches, 0, one, one, H + 1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rms_norm(torch.zeros(2, 8), torch.zeros(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="w must be \\[D\\]"):
        kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(9), 1e-5)
    with pytest.raises(RuntimeError, match="\\[T, F\\] for gate_up \\[T, 2F\\]"):
        kernels.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="contiguous \\[N, K\\]"):
        kernels.small_gemm(torch.zeros(2, 8), torch.zeros(3, 9))
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.small_gemm(torch.zeros(2, 8), torch.zeros(3, 8).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous \\[T, H, D\\]"):
        out = torch.empty(1, H * 8)
        kernels.ragged_attention(
            torch.zeros(H, 8), caches, 0, one, one + 1, one - 1, one[:0], 1.0, out
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_kernel_gives_the_same_bits_on_one_thread_and_on_several(dtype):
    """The kernels split their work into tasks over PyTorch's threads (output blocks,
    chunks of long attention rows, rows of the fused ops); a result's bits never depend on
    how many threads ran it. (The rest of the suite may run on one thread per test worker:
    ``make test`` uses pytest-xdist, see ``conftest.pytest_configure``.)"""
    from specdec.runtime.quant import kernel_layout, q8_layout, quantize

    gen = torch.Generator().manual_seed(11)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    caches = _caches(dtype, 64, [4200, 300], seed=12)
    seq, n, off = [0, 0, 0, 1], [1, 2049, 4100, 300], [-1, -1, -1, -1]
    q = torch.randn(len(seq), H, 64, generator=gen).to(dtype)
    x = torch.randn(17, 1536, generator=gen).to(dtype)
    w = torch.randn(576, 1536, generator=gen).to(dtype)
    matrix = quantize(torch.randn(576, 1536, generator=gen) * 0.05, "q4_1")
    blocks, code = kernel_layout(matrix)
    grouped, group_code = q8_layout(matrix)
    norm_w = torch.randn(1536, generator=gen).to(dtype)
    gate_up = torch.randn(17, 2 * 1536, generator=gen).to(dtype)

    def run():
        out = torch.empty(len(seq), H * 64, dtype=dtype)
        kernels.ragged_attention(q, caches, 1, t(seq), t(n), t(off), t([]), 0.1, out)
        return [
            out, kernels.small_gemm(x, w), kernels.small_gemm(x[:1], w),
            kernels.quant_gemm(x, blocks, code), kernels.quant_gemm(x[:1], blocks, code),
            kernels.quant_gemm(x[:5], blocks, code),
            kernels.q8_gemm(x, matrix.blocks, 0), kernels.q8_gemm(x[:1], matrix.blocks, 0),
            kernels.q8_gemm(x, grouped, group_code), kernels.q8_gemm(x[:9], grouped, group_code),
            kernels.rms_norm(x, norm_w, 1e-5), *kernels.add_rms_norm(x, x, norm_w, 1e-5),
            kernels.silu_mul(gate_up),
        ]  # fmt: skip

    with torch_threads(1):
        one = run()
    for threads in (2, 3):
        with torch_threads(threads):
            for i, (a, b) in enumerate(zip(one, run(), strict=True)):
                assert torch.equal(a, b), (threads, i)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_is_named(tmp_path, monkeypatch, caplog):
    """torch's extension build waits for ever while its folder holds a ``lock`` file, which
    a killed build leaves behind: an old lock is removed, a recent one (another build may
    be running) is named in a warning and kept."""
    import logging
    import time

    import torch.utils.cpp_extension as cpp

    from specdec.runtime import kernels

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.write_text("")
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.kernels"):
        kernels._clear_stale_lock("x", now=time.time() + 60)
        assert lock.exists() and "delete that file" in caplog.text and str(lock) in caplog.text
        kernels._clear_stale_lock("x", now=time.time() + kernels.STALE_LOCK_SECONDS + 60)
    assert not lock.exists() and "removing a stale build lock" in caplog.text
    kernels._clear_stale_lock("x")  # no lock: nothing to do, no error
