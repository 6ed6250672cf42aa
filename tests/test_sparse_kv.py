"""Sparse-KV self-speculation: the runtime's KV window (``BatchItem.kv_window``) against
transformers with an explicit attention mask, windowed tree rows against windowed chains,
the drafter's behaviour (cursor restored, ``min_context``, refusals) and the drafter
conformance suite on native targets."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import PROMPTS, DrafterConformance
from test_layer_skip import _NativeTargets

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.options import SparseKVOptions
from specdec.drafters.sparse_kv import SparseKVDrafter
from specdec.models.native import NativeModel
from specdec.registry import make_options
from specdec.runtime.kernels import kernel_available

GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)
LONG = [1] + [3 + (7 * i * i + 3 * i) % 29 for i in range(40)]  # 41 tokens, few repeats


@pytest.fixture(scope="module")
def hf32():
    return make_model(make_tokenizer(), seed=0, num_layers=3, name="tiny-3")


@pytest.fixture(scope="module")
def native32(hf32):
    return NativeModel(hf32, exact=True)


def _window_mask(n: int, sinks: int, recent: int, context: int, align: int = 1) -> torch.Tensor:
    """[1, 1, n, n] float mask: rows < context causal; a later row p sees the first
    ``sinks`` tokens and the last ``recent`` before it, and itself (StreamingLLM's rolling
    window), the recent part extended back to start ``sinks + m * align`` tokens in."""
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for row in range(context, n):
        first = max(row - recent, 0)
        if first > sinks:
            first = sinks + (first - sinks) // align * align
        allowed[row, :] = False
        allowed[row, :sinks] = True
        allowed[row, first : row + 1] = True
    mask = torch.zeros(n, n)
    mask[~allowed] = float("-inf")
    return mask[None, None]


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
@pytest.mark.parametrize("window", [(2, 5), (0, 1), (4, 16), (2, 5, 4), (3, 6, 8), (0, 9, 4)])
def test_window_equals_transformers_with_the_same_mask(hf32, window, fast):
    """Three new tokens after a 30-token context, each seeing the sinks and the ``recent``
    tokens before it (extended back to a multiple of ``align`` after the sinks): logits
    equal transformers' with that 4D mask."""
    sinks, recent, align = (*window, 1)[:3]
    native = NativeModel(hf32, exact=not fast)
    context, new = LONG[:30], LONG[30:33]
    cache = native.new_cache(64)
    native.forward(context, cache)
    got = native.forward_full(new, cache, kv_window=window).logits
    mask = _window_mask(33, sinks, recent, 30, align)
    with torch.no_grad():
        ids = torch.tensor([context + new], device=hf32.model.device)
        ref = hf32.model(ids, attention_mask=mask.to(ids.device)).logits[0, 30:]
    torch.testing.assert_close(got, ref.float(), atol=2e-4, rtol=2e-4)
    full = native.forward_full(new, _filled(native, context)).logits
    assert not torch.allclose(got, full, atol=1e-3)  # the window really hides tokens


@pytest.mark.parametrize("window", [(2, 0), (-1, 5), (2, 5, 0), (2,), (2, 5, 4, 1), (2.0, 5)])
def test_a_malformed_window_is_refused(native32, window):
    with pytest.raises(ValueError, match="kv_window must be"):
        native32.forward_full(LONG[20:23], _filled(native32, LONG[:20]), kv_window=window)


def _filled(native, tokens):
    cache = native.new_cache(64)
    native.forward(tokens, cache)
    return cache


def test_window_covering_the_context_is_the_full_forward(native32):
    """A window as large as the context and the new rows changes nothing, bit for bit."""
    context = LONG[:20]
    full = native32.forward_full(LONG[20:23], _filled(native32, context)).logits
    for window in [(10, 12), (0, 22), (20, 64)]:
        got = native32.forward_full(LONG[20:23], _filled(native32, context), kv_window=window)
        assert torch.equal(got.logits, full)


def test_windowed_tree_rows_equal_windowed_chains(native32):
    """Two branches forwarded as one tree with a window: each node's logits equal its
    root path forwarded as a chain with the same window (a row's window is taken over
    its path, context then ancestors, so both see the same slots)."""
    context = LONG[:30]
    a, b, c = LONG[30], LONG[31], LONG[32]
    # tree: a -> b, a -> c  (rows: a, b, c)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    positions = [30, 31, 31]
    tree = native32.forward_full(
        [a, b, c], _filled(native32, context), positions=positions, tree_mask=mask,
        kv_window=(3, 6),
    ).logits  # fmt: skip
    ab = native32.forward_full([a, b], _filled(native32, context), kv_window=(3, 6)).logits
    ac = native32.forward_full([a, c], _filled(native32, context), kv_window=(3, 6)).logits
    torch.testing.assert_close(tree[0], ab[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[1], ab[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[2], ac[1], atol=1e-5, rtol=1e-5)


def _state(target, options: SparseKVOptions, prompt, params=GREEDY):
    drafter = SparseKVDrafter(target, options)
    state = drafter.start(prompt, params)
    cache = target.new_cache(128)
    target.forward(prompt[:-1], cache)
    state.attach_cache(cache)
    return state, cache


QUANTIZED = pytest.param(
    "q4_1",
    marks=pytest.mark.skipif(not kernel_available(), reason="specdec's C++ quantized kernels"),
)


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("quantization", ["none", QUANTIZED])
def test_drafts_are_the_windowed_targets_greedy_tokens(native32, quantization, align):
    """A greedy draft is what the target (with ``quantization``: its quantized copy)
    attending over the window would decode, and drafting leaves the cursor where it was."""
    prompt = LONG[:35]
    options = SparseKVOptions(
        sinks=2, recent=6, align=align, min_context=0, quantization=quantization
    )
    state, cache = _state(native32, options, prompt)
    assert state.drafter.kv_window == (2, 6, align)
    draft = state.propose(prompt, 4, torch.Generator())
    assert cache.num_tokens == len(prompt) - 1
    assert len(draft.token_ids) == 4 and draft.draft_probs is None
    # reference: decode step by step with the same window over a copy
    runs = state.drafter.draft_target
    assert (runs is native32) == (quantization == "none")
    ref = _filled(native32, prompt[:-1])
    token, expected = prompt[-1], []
    for _ in range(4):
        logits = runs.forward_full([token], ref, num_logits=1, kv_window=(2, 6, align)).logits
        token = int(logits[-1].argmax())
        expected.append(token)
    assert draft.token_ids == expected


def test_sampled_drafts_carry_their_distributions(native32):
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=5)
    prompt = LONG[:35]
    state, cache = _state(
        native32, SparseKVOptions(sinks=2, recent=6, min_context=0), prompt, params
    )
    draft = state.propose(prompt, 3, torch.Generator().manual_seed(0))
    assert draft.draft_probs.shape == (3, native32.vocab_size)
    assert torch.allclose(draft.draft_probs.sum(-1).cpu(), torch.ones(3))
    for token, row in zip(draft.token_ids, draft.draft_probs, strict=True):
        assert row[token] > 0 and int((row > 0).sum()) <= 5


def test_no_draft_below_min_context(native32, caplog):
    """Below min_context: no draft, chains and trees alike, and output unchanged; a
    warning says why, once per drafter."""
    plain = LLM(native32, speculative=SpeculativeConfig(method="none"))
    for tree in (None, "dynamic:top_k=2,depth=3,budget=6"):
        config = SpeculativeConfig(
            method="sparse-kv:min_context=200", num_speculative_tokens=4, tree=tree
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="specdec.drafters.sparse_kv"):
            out = LLM(native32, speculative=config).generate(PROMPTS[0], GREEDY)
        assert out.token_ids == plain.generate(PROMPTS[0], GREEDY).token_ids
        assert out.metrics.num_draft_tokens == 0
        told = [r for r in caplog.records if "min_context=200" in r.getMessage()]
        assert len(told) == 1
        assert "hybrid:model=sparse-kv;min_context=N" in told[0].getMessage()  # nested too
    # at min_context 20 the drafts start once the sequence is 20 tokens long
    config = SpeculativeConfig(method="sparse-kv:min_context=20,recent=4", num_speculative_tokens=4)
    out = LLM(native32, speculative=config).generate(PROMPTS[0], GREEDY)
    assert out.token_ids == plain.generate(PROMPTS[0], GREEDY).token_ids
    assert out.metrics.num_draft_tokens > 0


def test_refusals(hf32, native32):
    with pytest.raises(ValueError, match="sparse-kv needs the native backend"):
        LLM(hf32, speculative=SpeculativeConfig(method="sparse-kv")).generate([1, 5], GREEDY)
    with pytest.raises(ValueError, match="skips all 3 layers"):
        SparseKVDrafter(native32, SparseKVOptions(skip="0-2"))
    for bad, message in [
        ({"recent": 0}, "recent must be an integer >= 1"),
        ({"sinks": -1}, "sinks must be an integer >= 0"),
        ({"align": 0}, "align must be an integer >= 1"),
        ({"min_context": 1.5}, "min_context.*needs an integer"),
        ({"confidence": 1.0}, r"confidence must be a number in \[0, 1\)"),
        ({"skip": "x"}, "layer set item .x. is not an index"),
        ({"quantization": "q2"}, "quantization must be one of none, auto, target"),
        ({"quantization": "auto", "kernel": "avx"}, "kernel must be one of auto, fma"),
        ({"kernel": "q8"}, "kernel='q8' chooses a quantized draft's kernel: give quantization"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_options("sparse-kv", bad)


class TestSparseKVConformance(_NativeTargets, DrafterConformance):
    """A window much smaller than the test prompts' contexts, drafting from the start."""

    spec = "sparse-kv:sinks=2,recent=4,min_context=0"


def test_window_plus_skipped_layers_is_lossless(native32):
    """The window and a skipped layer together (a cheaper draft): chains and a tree equal
    plain decoding, and the drafts are accepted sometimes."""
    plain = LLM(native32, speculative=SpeculativeConfig(method="none"))
    spec = "sparse-kv:sinks=1,recent=3,min_context=0,skip=1,confidence=0.1"
    for tree in (None, "dynamic:top_k=2,depth=4,budget=8"):
        config = SpeculativeConfig(method=spec, num_speculative_tokens=4, tree=tree)
        outs = [LLM(native32, speculative=config).generate(p, GREEDY) for p in PROMPTS]
        expected = [plain.generate(p, GREEDY).token_ids for p in PROMPTS]
        assert [o.token_ids for o in outs] == expected
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
