"""Quantized self-speculation (``quantized``): a dense target drafting with its weights
quantized at load, a quantized target drafting with its own blocks on the 8-bit-activation
kernel; greedy equals plain decoding (chains, trees, fp32 and bf16 exact), sampled output
follows the target's law (the conformance suite), the draft shares the target's tensors
and cache, and every misconfiguration is refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import PROMPTS, TREES, DrafterConformance
from test_layer_skip import _NativeTargets

from conftest import make_model, make_tokenizer, perturbed_copy
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.options import QuantizedOptions, SparseKVOptions
from specdec.drafters.quantized import QuantizedDrafter
from specdec.drafters.sparse_kv import SparseKVDrafter
from specdec.models.native import NativeModel
from specdec.registry import make_options
from specdec.runtime.kernels import kernel_available

pytestmark = pytest.mark.skipif(
    not kernel_available(), reason="the quantized kernels are specdec's C++ CPU kernels"
)

GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def hf32():
    return make_model(make_tokenizer(), seed=0, num_layers=3, name="tiny-3")


@pytest.fixture(scope="module")
def dense(hf32):
    return NativeModel(hf32, exact=True)


@pytest.fixture(scope="module")
def q4(hf32):
    """The same model quantized to Q4_1 at load (its products on a measured kernel)."""
    return NativeModel(hf32, exact=True, quantization="q4_1")


def _small(num_layers: int):
    """The statistical test's 8-token target (and a noisy copy), 32 wide: a block holds 32
    weights (the conftest's ``small`` is 16 wide)."""
    tokenizer = make_tokenizer(num_words=5)
    target = make_model(tokenizer, seed=0, hidden_size=32, num_layers=num_layers, init_std=0.2)
    return target, perturbed_copy(target, noise=0.08, seed=1)


class TestQuantizedConformance(_NativeTargets, DrafterConformance):
    """A dense target's q4_1 copy on the q8 kernel drafts (the default)."""

    spec = "quantized"

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        return _small(num_layers=1)


class TestQuantizedSkipConformance(_NativeTargets, DrafterConformance):
    """Blocks on the fma kernel, with a layer skipped too: a draft further from the target."""

    spec = "quantized:quantization=q8_0,kernel=fma,skip=1,confidence=0.1"
    trees = TREES[:1]
    ks = (3,)

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        return _small(num_layers=2)


class TestSparseKVQuantizedConformance(_NativeTargets, DrafterConformance):
    """sparse-kv with quantized products: the window over a q4_1 copy on q8 drafts."""

    spec = "sparse-kv:sinks=2,recent=4,min_context=0,quantization=auto"
    trees = TREES[:1]

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        return _small(num_layers=1)


def _drafter(target, **options) -> QuantizedDrafter:
    return QuantizedDrafter(target, QuantizedOptions(**options))


def test_dense_target_drafts_with_its_own_tensors(dense):
    """The draft is the target's decoder on new blocks: embedding, norms and dense
    choices are the target's own tensors; the blocks are q4_1 (LM head q8_0) on q8."""
    drafter = _drafter(dense)
    draft = drafter.draft_target
    assert drafter.quantization == "q4_1"
    assert set(drafter.kernels.values()) == {"q8"}
    assert draft.decoder.weights.embed is dense.decoder.weights.embed
    assert draft.decoder.weights.norm is dense.decoder.weights.norm
    assert draft.decoder.layers[0]["down"].matrix.kind == "q4_1"
    assert draft.decoder.lm_head.matrix.kind == "q8_0"
    assert dense.decoder.weights.quantized is None  # the target stays dense
    assert draft.exact == dense.exact and draft.hf is dense.hf


def test_quantized_target_shares_its_blocks(q4):
    """On a quantized target the draft reuses the very block tensors (nothing quantized
    again) and only changes the kernel (QSpec's W4A8 draft of a W4A16 target)."""
    drafter = _drafter(q4)
    assert drafter.quantization == "target"
    ours, theirs = drafter.draft_target.decoder.weights.quantized, q4.decoder.weights.quantized
    assert ours["down"][0] is theirs["down"][0]
    assert set(drafter.kernels.values()) == {"q8"}


def test_drafts_differ_from_the_target_and_restore_the_cursor(dense):
    """The draft really is another model (some drafts rejected, most accepted) and
    drafting leaves the target's cache where it was."""
    drafter = _drafter(dense)
    state = drafter.start(PROMPTS[1], GREEDY)
    cache = dense.new_cache(64)
    dense.forward(PROMPTS[1][:-1], cache)
    state.attach_cache(cache)
    n = cache.num_tokens
    before = cache.kv[..., :n, :].clone()
    proposal = state.propose(PROMPTS[1], 6, torch.Generator().manual_seed(0))
    assert len(proposal.token_ids) == 6
    assert cache.num_tokens == n == len(PROMPTS[1]) - 1
    assert torch.equal(cache.kv[..., :n, :], before)
    llm = LLM(dense, speculative=SpeculativeConfig(method="quantized", num_speculative_tokens=4))
    metrics = [llm.generate(p, GREEDY).metrics for p in PROMPTS]
    drafted = sum(m.num_draft_tokens for m in metrics)
    accepted = sum(m.num_accepted_tokens for m in metrics)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("tree", [None, TREES[0]])
@pytest.mark.parametrize(
    "method", ["quantized", "sparse-kv:sinks=1,recent=3,min_context=0,quantization=auto"]
)
def test_quantized_target_greedy_equals_its_plain_decoding(q4, tree, method):
    """A q4_1 target drafting with its own blocks on the q8 kernel (over its whole cache,
    or over a window of it): chains and a tree give the quantized target's own plain
    output, token for token."""
    plain = LLM(q4, speculative=SpeculativeConfig(method="none"))
    config = SpeculativeConfig(method=method, num_speculative_tokens=4, tree=tree)
    llm = LLM(q4, speculative=config)
    outs = [llm.generate(p, GREEDY) for p in PROMPTS]
    assert [o.token_ids for o in outs] == [plain.generate(p, GREEDY).token_ids for p in PROMPTS]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("quantization", ["q4_1", "none"])
def test_bf16_is_bit_identical(quantization):
    """bfloat16, exact mode, a q4_1 or dense target: speculative greedy output of
    ``quantized`` and of ``sparse-kv`` with quantized products equals plain decoding."""
    hf = make_model(make_tokenizer(), seed=0, num_layers=3)
    hf.model.to(torch.bfloat16)
    target = NativeModel(hf, exact=True, quantization=quantization)
    plain = LLM(target, speculative=SpeculativeConfig(method="none"))
    for method in ("quantized", "sparse-kv:sinks=1,recent=4,min_context=0,quantization=auto"):
        llm = LLM(target, speculative=SpeculativeConfig(method=method, num_speculative_tokens=3))
        outs = [llm.generate(prompt, GREEDY) for prompt in PROMPTS]
        assert [o.token_ids for o in outs] == [
            plain.generate(prompt, GREEDY).token_ids for prompt in PROMPTS
        ]
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_refusals(hf32, dense, q4, monkeypatch):
    with pytest.raises(ValueError, match="quantized needs the native backend"):
        LLM(hf32, speculative=SpeculativeConfig(method="quantized")).generate([1, 5], GREEDY)
    with pytest.raises(ValueError, match="already runs quantized products .q4_1.: its draft"):
        _drafter(q4, quantization="q8_0")
    with pytest.raises(ValueError, match="runs dense products: quantized:quantization=target"):
        _drafter(dense, quantization="target")
    with pytest.raises(ValueError, match="needs a model loaded from a GGUF"):
        _drafter(dense, quantization="gguf")
    with pytest.raises(
        ValueError,
        match=r"quantized:kernel=dpbf16: quantized kernel 'dpbf16' does not run here for "
        r"float32 .*--dtype bfloat16, or leave kernel= out",
    ):
        _drafter(dense, kernel="dpbf16")
    # the target's own blocks asked for by name: its own blocks (the default)
    assert _drafter(q4, quantization="q4_1").quantization == "target"
    with pytest.raises(ValueError, match="skips all 3 layers"):
        _drafter(dense, skip="0-2")
    monkeypatch.setenv("SPECDEC_QUANT_KERNEL", "fma")
    on_fma = NativeModel(hf32, exact=True, quantization="q4_1")
    with pytest.raises(
        ValueError,
        match=r"is the target itself; choose another kernel "
        r"\(quantized:kernel=q8\) or load the target dense \(quantization='none'",
    ):
        _drafter(on_fma, kernel="fma")  # float32: fma and q8 run here
    assert set(_drafter(on_fma).kernels.values()) == {"q8"}  # auto: another kernel
    # sparse-kv with quantized products: the same checks, named for sparse-kv
    for target, options, message in [
        (q4, {"quantization": "q8_0"}, r"\(sparse-kv:quantization=auto\), not 'q8_0'"),
        (dense, {"quantization": "target"}, "dense products: sparse-kv:quantization=target"),
        (on_fma, {"quantization": "auto", "kernel": "fma"}, r"\(sparse-kv:kernel=q8\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            SparseKVDrafter(target, SparseKVOptions(**options))
    windowed = SparseKVDrafter(q4, SparseKVOptions(quantization="auto"))
    assert windowed.quantization == "target" and set(windowed.kernels.values()) == {"q8"}
    assert SparseKVDrafter(q4, SparseKVOptions()).kernels is None  # the target's products


def test_option_errors():
    for bad, message in [
        ({"quantization": "q2"}, "quantization must be one of auto, target"),
        ({"kernel": "avx"}, "kernel must be one of auto, fma"),
        ({"confidence": 1.0}, r"confidence must be a number in \[0, 1\)"),
        ({"skip": "x"}, "layer set item .x. is not an index"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_options("quantized", bad)


def test_sampled_drafts_carry_their_distribution(dense):
    """Sampling: each drafted token comes with the draft's processed distribution
    ([k, V] float32 rows summing to 1), which rejection sampling needs."""
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5)
    state = _drafter(dense).start(PROMPTS[0], params)
    cache = dense.new_cache(64)
    dense.forward(PROMPTS[0][:-1], cache)
    state.attach_cache(cache)
    proposal = state.propose(PROMPTS[0], 3, torch.Generator().manual_seed(1))
    probs = proposal.draft_probs
    assert probs is not None and probs.shape == (len(proposal.token_ids), dense.vocab_size)
    assert torch.allclose(probs.sum(-1), torch.ones(len(proposal.token_ids)))
    assert all(int((row > 0).sum()) <= 5 for row in probs)
