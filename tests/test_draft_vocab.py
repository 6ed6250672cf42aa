"""A self-draft's vocabulary (``vocab=``, FR-Spec): the runtime's head over a subset of
the rows against the full head's columns (dense and quantized), the sequence's vocabulary
(low ids + its own tokens, grown as tokens appear, rolled back), drafts equal to the
argmax over the subset, refusals, and the conformance suite (greedy identity in chains
and trees, bf16 exactness, the exact target law of sampled output with a draft that puts
probability 0 on most tokens)."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import DrafterConformance
from test_layer_skip import _NativeTargets
from test_quantized_draft import _small

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.sparse_kv import SparseKVDrafter
from specdec.drafters.vocab import DraftVocabulary, SharedVocabulary
from specdec.models.native import NativeModel
from specdec.registry import make_options
from specdec.runtime.kernels import kernel_available

QUANTIZED = pytest.mark.skipif(not kernel_available(), reason="specdec's C++ quantized kernels")
PROMPT = [1] + [3 + (7 * i * i + 3 * i) % 29 for i in range(20)]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def native32():
    hf = make_model(make_tokenizer(), seed=0, num_layers=3, name="tiny-3")
    return NativeModel(hf, exact=True)


@pytest.fixture(scope="module")
def quantized32(native32):
    if not kernel_available():
        pytest.skip("specdec's C++ quantized kernels")
    hf = make_model(make_tokenizer(), seed=0, num_layers=2, hidden_size=32, name="tiny-q")
    return NativeModel(hf, exact=True).quantized_copy("q4_1")


@pytest.mark.parametrize("which", ["dense", "quantized"])
def test_a_vocab_head_gives_the_full_heads_columns(native32, quantized32, which):
    """The head over rows ``ids`` computes the full head's logits of those tokens (the
    same kernel on the same rows), in the order of ``ids``: bit for bit in exact mode
    (each output's arithmetic depends on its row only), within rounding otherwise (a
    library product may block another N differently)."""
    model = native32 if which == "dense" else quantized32
    hidden = torch.randn(5, model.decoder.config.hidden_size).to(model.dtype)
    for exact in (True, False):
        full = model.decoder.lm_head(hidden, exact)
        for ids in ([0], [7, 3, 31, 12], list(range(0, 32, 2)), list(range(32))):
            got = model.vocab_head(torch.tensor(ids))(hidden, exact)
            if exact:
                assert torch.equal(got, full[:, ids])
            else:
                torch.testing.assert_close(got, full[:, ids], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ids", [[], [3, 3], [-1, 2], [0, 32], [[1, 2]]])
def test_a_bad_vocab_head_is_refused(native32, ids):
    with pytest.raises(ValueError, match="ids must"):
        native32.vocab_head(torch.tensor(ids, dtype=torch.long))


def test_a_forward_with_a_vocab_head_returns_its_columns(native32):
    """``forward_full(..., lm_head=)``: the logits are the head's columns of the logits
    the forward gives without it; the hidden states are the same."""
    ids = torch.tensor([2, 9, 4, 17])
    head = native32.vocab_head(ids)
    runs = []
    for lm_head in (None, head):
        cache = native32.new_cache(64)
        native32.forward(PROMPT[:-1], cache)
        runs.append(native32.forward_full(PROMPT[-1:] + [5, 6], cache, lm_head=lm_head))
    assert runs[1].logits.shape == (3, 4)
    assert torch.equal(runs[1].logits, runs[0].logits[:, ids])
    assert torch.equal(runs[1].hidden, runs[0].hidden)


def test_the_sequence_vocabulary_is_the_low_ids_and_its_own_tokens(native32):
    shared = SharedVocabulary(native32, 6, native32.vocab_size)
    vocabulary = DraftVocabulary(shared)
    assert vocabulary.columns.tolist() == list(range(6))
    vocabulary.update([1, 20, 4, 20, 9])
    assert vocabulary.columns.tolist() == [0, 1, 2, 3, 4, 5, 9, 20]
    vocabulary.update([1, 20, 4, 20, 9, 30, 2])  # only the new part is read
    assert vocabulary.columns.tolist() == [0, 1, 2, 3, 4, 5, 9, 20, 30]
    vocabulary.update([1, 20, 11])  # rolled back and regrown: what it held stays
    assert vocabulary.columns.tolist() == [0, 1, 2, 3, 4, 5, 9, 20, 30, 11]
    hidden = torch.randn(2, native32.decoder.config.hidden_size)
    full = native32.decoder.lm_head(hidden, True)
    assert torch.equal(vocabulary(hidden, True), full[:, vocabulary.columns])
    spread = vocabulary.spread(vocabulary(hidden, True))
    assert spread.shape == (2, native32.vocab_size)
    inside = torch.zeros(native32.vocab_size, dtype=torch.bool)
    inside[vocabulary.columns] = True
    assert torch.equal(spread[:, inside], full[:, inside].float())
    assert torch.isneginf(spread[:, ~inside]).all()


def test_a_larger_size_than_the_vocabulary_is_the_whole_vocabulary(native32):
    shared = SharedVocabulary(native32, 10_000, native32.vocab_size)
    vocabulary = DraftVocabulary(shared)
    vocabulary.update(PROMPT)
    assert vocabulary.columns.tolist() == list(range(native32.vocab_size))
    options = {"min_context": "0", "vocab": native32.vocab_size}
    drafter = SparseKVDrafter(native32, make_options("sparse-kv", options))
    assert drafter.shared_vocabulary() is None  # the model's own head drafts
    assert drafter.start(PROMPT, GREEDY).vocabulary is None


@pytest.mark.parametrize("size", [1, 4, 12])
def test_greedy_drafts_are_the_argmax_over_the_subset(native32, size):
    """Each drafted token is the windowed draft's argmax over the low ids and the
    sequence's tokens (its earlier drafts included), computed here from the full logits."""
    options = {"sinks": "2", "recent": "6", "min_context": "0"}
    full = SparseKVDrafter(native32, make_options("sparse-kv", options))
    trimmed = SparseKVDrafter(native32, make_options("sparse-kv", {**options, "vocab": size}))
    window = full.kv_window
    params = SamplingParams(max_new_tokens=8)
    state = trimmed.start(PROMPT, params)
    cache = native32.new_cache(64)
    native32.forward(PROMPT[:-1], cache)
    state.attach_cache(cache)
    draft = state.propose(PROMPT, 6, torch.Generator().manual_seed(0))
    assert len(draft.token_ids) == 6 and cache.num_tokens == len(PROMPT) - 1
    sequence, check = list(PROMPT), native32.new_cache(64)
    native32.forward(PROMPT[:-1], check)
    for token in draft.token_ids:
        logits = native32.forward_full(sequence[-1:], check, kv_window=window).logits[0]
        allowed = torch.full_like(logits, float("-inf"))
        subset = sorted(set(range(size)) | set(sequence))
        allowed[subset] = logits[subset]
        assert token == int(torch.argmax(allowed))
        sequence.append(token)


def test_the_engine_output_is_plain_decoding(native32):
    plain = LLM(native32, speculative=SpeculativeConfig(method="none"))
    expected = plain.generate(PROMPT, GREEDY).token_ids
    for spec in ("sparse-kv:sinks=2,recent=6,min_context=0,vocab=3", "layer-skip:skip=1,vocab=5"):
        llm = LLM(native32, speculative=SpeculativeConfig(method=spec, num_speculative_tokens=4))
        out = llm.generate(PROMPT, GREEDY)
        assert out.token_ids == expected, spec
        assert out.metrics.num_accepted_tokens > 0


def test_bad_vocab_values_are_refused():
    for name in ("layer-skip", "quantized", "sparse-kv"):
        for bad in (-1, 1.5, "x"):
            with pytest.raises(ValueError, match="vocab"):
                make_options(name, {"vocab": bad})


class TestSparseKVVocabConformance(_NativeTargets, DrafterConformance):
    """The windowed self-draft over 3 low ids and the sequence's tokens."""

    spec = "sparse-kv:sinks=2,recent=4,min_context=0,vocab=3"


class TestLayerSkipVocabConformance(_NativeTargets, DrafterConformance):
    """A layer-skipped draft over 2 low ids and the sequence's tokens."""

    spec = "layer-skip:skip=1,vocab=2"

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        return _small(num_layers=2)


@QUANTIZED
class TestQuantizedVocabConformance(_NativeTargets, DrafterConformance):
    """The quantized self-draft over 4 low ids and the sequence's tokens."""

    spec = "quantized:vocab=4"

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        return _small(num_layers=1)
