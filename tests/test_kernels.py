"""The native runtime's compiled kernels (``specdec.runtime.kernels``) against the PyTorch
reference: ragged attention over several sequences' KV caches (prefix rows, token tree
rows, both code paths: AVX-512 for head_dim 64/128, portable otherwise), batch
invariance bit for bit, the KV store, and clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.runtime import kernels
from specdec.runtime.attention import attention_exact, key_groups

pytestmark = pytest.mark.skipif(
    os.environ.get("SPECDEC_ATTENTION", "").lower() == "reference",
    reason="SPECDEC_ATTENTION=reference turns the kernels off",
)

L, G, H = 2, 2, 6  # layers, KV heads, query heads (3 per KV head)


def test_the_kernels_build_on_this_machine():
    assert kernels.kernel_available(), "the C++ attention kernel did not build (see the log)"


def _caches(dtype, d, capacities, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(L, 2, G, c, d, generator=gen).to(dtype) for c in capacities]


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
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
            torch.testing.assert_close(out[row : row + len(vis)], ref, **tol)
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


def test_store_kv_writes_each_row_into_its_sequence_slot():
    caches = _caches(torch.bfloat16, 64, [64, 128])
    expected = [c.clone() for c in caches]
    kv_new = torch.randn(3, 2, G, 64).to(torch.bfloat16)
    seq, slot = [1, 0, 1], [100, 5, 101]
    kernels.store_kv(kv_new, caches, 1, torch.tensor(seq), torch.tensor(slot))
    for row, (s, p) in enumerate(zip(seq, slot, strict=True)):
        expected[s][1, :, :, p] = kv_new[row]
    for c, e in zip(caches, expected, strict=True):
        assert torch.equal(c, e)


def test_bad_inputs_are_clear_errors():
    caches = _caches(torch.float32, 8, [64])
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        kernels.store_kv(torch.zeros(1, 2, G, 8), caches, 0, one, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="contiguous \\[L, 2, G, C, D\\]"):
        kernels.store_kv(torch.zeros(1, 2, G, 8).bfloat16(), caches, 0, one, one)
    with pytest.raises(RuntimeError, match="contiguous \\[T, H, D\\]"):
        out = torch.empty(1, H * 8)
        kernels.ragged_attention(
            torch.zeros(H, 8), caches, 0, one, one + 1, one - 1, one[:0], 1.0, out
        )
