"""Packed KV blocks (``NativeKVCache.pack_tiles``, ``kernels.pack_kv_tiles``): the attention
kernel over a bfloat16 cache reads a long sequence's blocks packed once instead of packing
them on every forward. The oracle is bit equality: the packed bytes are what the kernel
packs itself, so every row's output, logits and KV must be the same bits with and without
them, alone and batched, for decoding, chain and tree rows and long rows split into
chunks; and a block whose slots change (truncate, compact) must never be read stale."""

from __future__ import annotations

import os

import pytest
import torch
from test_runtime import tiny_hf

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.models.native import NativeModel
from specdec.runtime import cache as cache_module
from specdec.runtime import kernels
from specdec.runtime.cache import NativeKVCache
from specdec.trees import ROOT, TokenTree

needs_packed = pytest.mark.skipif(
    os.environ.get("SPECDEC_ATTENTION", "").lower() == "reference"
    or not kernels.packed_kv_available(),
    reason="packed KV blocks need the C++ kernels with AVX512-BF16",
)

L, G, H = 2, 2, 6  # layers, KV heads, query heads (3 per KV head)


def _cache(d: int, capacity: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, G, capacity, d, generator=gen).to(torch.bfloat16)


@needs_packed
@pytest.mark.parametrize("d", [64, 128])
def test_rows_read_packed_blocks_with_the_bits_they_get_unpacked(d):
    """Decoding rows, a chain, tree rows with their own slots and long rows split into
    chunks (2,048 keys and more), over two sequences: the same bits whether the complete
    blocks below ``tiles_upto`` are packed or not; a packed block holding other bytes than
    the cache (the test's canary) changes the output, so the kernel does read them."""
    n0, n1 = 2600, 700
    caches = [_cache(d, 2688, seed=1), _cache(d, 768, seed=2)]
    tiles = [torch.empty_like(c) for c in caches]
    kernels.pack_kv_tiles(caches[0], tiles[0], 0, 2560)
    kernels.pack_kv_tiles(caches[1], tiles[1], 0, 640)
    upto = torch.tensor([2560, 640])
    tree = torch.cat([torch.arange(300), torch.tensor([310, 650, 651])])
    rows = [  # (sequence, visible keys, tree slots)
        (0, n0 + 1, None),
        *[(0, n0 + 1 + i, None) for i in range(5)],  # a chain
        (0, tree.numel(), tree),
        (1, n1 + 1, None),
        (1, 66, None),
    ]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(rows), H, d, generator=gen).to(torch.bfloat16)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    seq = t([r[0] for r in rows])
    n = t([r[1] for r in rows])
    off, slots, used = [], [], 0
    for _, count, sl in rows:
        off.append(-1 if sl is None else used)
        if sl is not None:
            slots.append(sl)
            used += count
    args = (seq, n, t(off), torch.cat(slots))
    for layer in range(L):
        plain = torch.empty(len(rows), H * d, dtype=torch.bfloat16)
        kernels.ragged_attention(q, caches, layer, *args, 0.125, plain)
        packed = torch.empty_like(plain)
        kernels.ragged_attention(q, caches, layer, *args, 0.125, packed, tiles, upto)
        assert torch.equal(packed, plain), layer
    canary = [x.clone() for x in tiles]
    canary[0][1, 0, 1, 64:128] = 0  # layer 1's keys of KV head 1, second block
    spoiled = torch.empty_like(plain)
    kernels.ragged_attention(q, caches, 1, *args, 0.125, spoiled, canary, upto)
    assert not torch.equal(spoiled, plain)


def _window_slots(length: int, sinks: int, recent: int, align: int) -> torch.Tensor:
    """The slots a KV-window row with a path of ``length`` slots sees (as ``_visibility``)."""
    first = sinks + (length - recent - 1 - sinks) // align * align
    return torch.cat([torch.arange(sinks), torch.arange(first, length)])


@needs_packed
@pytest.mark.parametrize("d", [64, 128])
def test_window_rows_read_the_packed_blocks_of_their_own_slots(d):
    """KV-window rows (their own slot lists) whose recent part starts on a block after the
    sinks read the kept packed blocks among their slots: the same bits as packing them
    again; an unaligned window packs its own; spoiling a packed block inside an aligned
    window changes that row's output, so the kernel does read it."""
    cache = _cache(d, 2688, seed=4)
    tiles = torch.empty_like(cache)
    kernels.pack_kv_tiles(cache, tiles, 0, 2560)
    windows = [(16, 496, 64), (16, 496, 64), (4, 300, 64), (16, 496, 1), (0, 700, 64)]
    lengths = [2601, 2603, 2580, 2601, 2602]
    sl = [_window_slots(n, *w) for n, w in zip(lengths, windows, strict=True)]
    assert sl[0][64] % 64 == 0 and sl[3][64] % 64 != 0  # position 64: a block start or not
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(sl), H, d, generator=gen).to(torch.bfloat16)
    off = torch.tensor([0, *torch.cumsum(torch.tensor([x.numel() for x in sl]), 0)[:-1]])
    args = (torch.zeros(len(sl), dtype=torch.long), torch.tensor([x.numel() for x in sl]), off)
    slots = torch.cat(sl)
    upto = torch.tensor([2560])
    plain = [torch.empty(len(sl), H * d, dtype=torch.bfloat16) for _ in range(L)]
    for layer in range(L):
        kernels.ragged_attention(q, [cache], layer, *args, slots, 0.125, plain[layer])
        packed = torch.empty_like(plain[layer])
        kernels.ragged_attention(q, [cache], layer, *args, slots, 0.125, packed, [tiles], upto)
        assert torch.equal(packed, plain[layer]), layer
    plain = plain[0]
    canary = tiles.clone()
    canary[0, 1, 0, 2304:2368] = 0  # layer 0's values of KV head 0, a block every window reads
    spoiled = torch.empty_like(plain)
    kernels.ragged_attention(q, [cache], 0, *args, slots, 0.125, spoiled, [canary], upto)
    head0 = slice(0, 3 * d)  # the query heads of KV head 0
    changed = [not torch.equal(a[head0], b[head0]) for a, b in zip(spoiled, plain, strict=True)]
    assert changed == [True, True, True, False, True]  # the unaligned window packs its own


@needs_packed
def test_pack_kv_tiles_refuses_what_it_cannot_pack():
    kv = _cache(64, 128, seed=0)
    with pytest.raises(RuntimeError, match="multiples of 64"):
        kernels.pack_kv_tiles(kv, torch.empty_like(kv), 0, 100)
    with pytest.raises(RuntimeError, match="multiples of 64"):
        kernels.pack_kv_tiles(kv, torch.empty_like(kv), 0, 192)
    with pytest.raises(RuntimeError, match="shape and dtype"):
        kernels.pack_kv_tiles(kv, torch.empty(L, 2, G, 64, 64, dtype=torch.bfloat16), 0, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.pack_kv_tiles(kv.float(), torch.empty_like(kv.float()), 0, 64)
    with pytest.raises(RuntimeError, match="multiple of 64 slots"):
        q = torch.zeros(1, H, 64, dtype=torch.bfloat16)
        t = torch.tensor([0])
        kernels.ragged_attention(
            q, [kv], 0, t, torch.tensor([5]), torch.tensor([-1]), torch.empty(0).long(), 0.1,
            torch.empty(1, H * 64, dtype=torch.bfloat16), [kv], torch.tensor([32]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="tiles_upto"):
        kernels.ragged_attention(
            q, [kv], 0, t, torch.tensor([5]), torch.tensor([-1]), torch.empty(0).long(), 0.1,
            torch.empty(1, H * 64, dtype=torch.bfloat16), [kv],
        )  # fmt: skip


def test_the_cache_drops_packed_blocks_whose_slots_change(monkeypatch):
    """The bookkeeping, on any CPU: truncate and compact lower ``tiles_upto`` to the block
    of the first slot they change; a forward's own writes (at the cursor) never do."""
    cache = NativeKVCache(2, 1, 64, 512, torch.bfloat16, "cpu")
    cache.num_tokens, cache.tiles_upto = 400, 384
    cache.truncate(390)
    assert cache.tiles_upto == 384
    cache.truncate(300)
    assert cache.tiles_upto == 256
    cache.compact([200, 201], start=200)  # in place: only the cursor moves back
    assert (cache.num_tokens, cache.tiles_upto) == (202, 192)
    cache.num_tokens, cache.tiles_upto = 300, 256
    cache.compact([130, 131, 140], start=130)  # slot 132 takes slot 140's keys
    assert (cache.num_tokens, cache.tiles_upto) == (133, 128)


def test_short_or_float32_caches_pack_nothing():
    small = NativeKVCache(2, 1, 64, 4096, torch.bfloat16, "cpu")
    small.num_tokens = cache_module.TILES_FROM - 1
    assert small.pack_tiles() == 0 and small.tiles is None
    wide = NativeKVCache(2, 1, 64, 4096, torch.float32, "cpu")
    wide.num_tokens = 4000
    assert wide.pack_tiles() == 0 and wide.tiles is None


def _decode(native, ids, start, packed: bool, monkeypatch):
    """Logits of decoding ``ids[start:]`` one token at a time after ``ids[:start]``, with
    packed blocks from 64 tokens on or without any; the cache."""
    monkeypatch.setattr(cache_module, "TILES_FROM", 64 if packed else 10**9)
    cache = native.new_cache(64)  # small: the cache (and its packed blocks) must grow
    native.forward(ids[:start], cache)
    rows = [native.forward([token], cache)[0] for token in ids[start:]]
    return rows, cache


@needs_packed
def test_a_long_prompt_is_packed_as_it_is_prefilled(monkeypatch):
    """The prompt's complete blocks are packed by its prefill forward, not by the first
    decoding forward (whose time the cost controller takes as a draft's or a step's), and
    decoding after it gets the bits of a cache that never packed."""
    native = NativeModel(tiny_hf("llama", dtype=torch.bfloat16, head_dim=64), exact=True)
    ids = [1, *[(5 * i + i * i) % 31 + 2 for i in range(330)]]
    monkeypatch.setattr(cache_module, "TILES_FROM", 64)
    cache = native.new_cache(512)
    native.forward(ids[:300], cache)
    assert cache.num_tokens == 300 and cache.tiles_upto == 256
    rows = [native.forward([t], cache) for t in ids[300:]]
    monkeypatch.setattr(cache_module, "TILES_FROM", 10**9)
    plain = native.new_cache(512)
    native.forward(ids[:300], plain)
    assert plain.tiles is None
    for i, token in enumerate(ids[300:]):
        assert torch.equal(rows[i], native.forward([token], plain)), i


@needs_packed
def test_a_model_decodes_the_same_bits_with_packed_blocks(monkeypatch):
    """Plain decoding, a chain verified after a rollback into a packed block, and a token
    tree compacted below them: every row the bits of decoding without packed blocks."""
    native = NativeModel(tiny_hf("llama", dtype=torch.bfloat16, head_dim=64), exact=True)
    ids = [1, *[(7 * i + i * i) % 29 + 3 for i in range(300)]]
    plain, _ = _decode(native, ids, 100, False, monkeypatch)
    rows, cache = _decode(native, ids, 100, True, monkeypatch)
    assert cache.tiles_upto == 256 and cache.capacity > 64  # packed, and grown since
    for i, (a, b) in enumerate(zip(rows, plain, strict=True)):
        assert torch.equal(a, b), i
    # roll back into a packed block and verify a chain of other tokens: as recomputed
    cache.truncate(200)
    assert cache.tiles_upto == 192
    chain = [5, 6, 7, 8]
    got = native.forward(chain, cache)
    monkeypatch.setattr(cache_module, "TILES_FROM", 10**9)
    fresh = native.new_cache(256)
    native.forward(ids[:100], fresh)
    for token in ids[100:200]:
        native.forward([token], fresh)
    assert torch.equal(got, native.forward(chain, fresh))
    # a token tree, compacted to its accepted path, then decoding on
    tree = TokenTree.build([ROOT, ROOT, 0, 1], [9, 10, 11, 12])
    after = []
    for c, packed in ((cache, True), (fresh, False)):
        monkeypatch.setattr(cache_module, "TILES_FROM", 64 if packed else 10**9)
        c.truncate(200)
        native.forward_tree(13, tree, c)
        c.compact([201, 203], start=201)
        after.append(native.forward([14, 15], c))
    assert cache.tiles_upto == 192 and fresh.tiles is None
    assert torch.equal(after[0], after[1])


@needs_packed
@pytest.mark.parametrize(
    "method, tree",
    [
        ("ngram:min_n=1", None),
        ("ngram:min_n=1", "dynamic:top_k=2,depth=4,budget=8"),
        ("sparse-kv:sinks=4,recent=28,min_context=64", None),
    ],
)
def test_greedy_speculation_with_packed_blocks_equals_plain_decoding(monkeypatch, method, tree):
    monkeypatch.setattr(cache_module, "TILES_FROM", 64)
    native = NativeModel(tiny_hf("llama", dtype=torch.bfloat16, head_dim=64), exact=True)
    llm = LLM(native, speculative=SpeculativeConfig(method="none"))
    params = SamplingParams(max_new_tokens=36, ignore_eos=True)  # 127 tokens: the model's 128
    prompt = [1, *[(5 * i + 3) % 23 + 3 for i in range(90)]]
    plain = llm.generate(prompt, params)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, tree=tree)
    out = llm.generate(prompt, params, speculative=spec)
    assert out.token_ids == plain.token_ids
    assert out.metrics.num_steps < len(out.token_ids)  # it did speculate


def test_packed_blocks_can_be_turned_off_and_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.setenv("SPECDEC_PACKED_KV", "off")
    cache = NativeKVCache(2, 1, 64, 4096, torch.bfloat16, "cpu")
    cache.num_tokens = 4000
    assert cache.pack_tiles() == 0 and cache.tiles is None
    monkeypatch.setenv("SPECDEC_PACKED_KV", "sometimes")
    with pytest.raises(ValueError, match="SPECDEC_PACKED_KV='sometimes'"):
        NativeModel(tiny_hf("llama", dtype=torch.bfloat16, head_dim=64), exact=True)
    from specdec.models.loading import check_quantization

    with pytest.raises(ValueError, match="SPECDEC_PACKED_KV"):  # before any load
        check_quantization("none", "hf")
