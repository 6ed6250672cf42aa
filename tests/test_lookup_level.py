"""The self-drafts' lookup level (``lookup=``: Cascade Speculative Drafting's statistical
bottom level under ``layer-skip``, ``quantized`` and ``sparse-kv``).

The oracle: in exact mode every row of a draft forward is what a forward of that row
alone gives, so a chain drafted with prompt lookup's guesses in its forwards must be the
chain drafted without them, token for token and distribution for distribution (greedy and
sampled, one sequence and a batch), in fewer draft forwards where the guesses hold. The
engine-level oracles (greedy equals plain decoding, the sampled law) run the drafter
conformance suite with the level on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafter_conformance import DrafterConformance
from test_layer_skip import _NativeTargets
from test_quantized_draft import _small

from conftest import make_model, make_tokenizer
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import ChainRequest
from specdec.drafters.layer_skip import LayerSkipDrafter
from specdec.drafters.ngram import find_ngram_continuation
from specdec.drafters.quantized import QuantizedDrafter
from specdec.drafters.sparse_kv import SparseKVDrafter
from specdec.models.native import NativeModel
from specdec.registry import make_options
from specdec.runtime.kernels import kernel_available

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=40, temperature=0.8, top_k=20, seed=3)
PROMPT = [1] + [3 + (7 * i * i + 3 * i) % 29 for i in range(20)]

QUANTIZED = pytest.mark.skipif(not kernel_available(), reason="specdec's C++ quantized kernels")
SPECS = [
    "layer-skip:skip=1,confidence=0",
    "sparse-kv:sinks=2,recent=6,min_context=0",
    pytest.param("quantized", marks=QUANTIZED),
    pytest.param("sparse-kv:sinks=2,recent=6,min_context=0,quantization=auto", marks=QUANTIZED),
]


@pytest.fixture(scope="module")
def native32():
    hf = make_model(make_tokenizer(), seed=0, num_layers=3, name="tiny-3")
    return NativeModel(hf, exact=True)


@pytest.fixture(scope="module")
def repeats(native32):
    """A prompt and the target's greedy answer, which repeats itself (as the tiny random
    model's answers do), so prompt lookup has something to guess."""
    plain = LLM(native32, speculative=SpeculativeConfig(method="none"))
    out = plain.generate(PROMPT, SamplingParams(max_new_tokens=60, ignore_eos=True))
    return PROMPT + out.token_ids


def _drafter(target, spec: str, lookup: int):
    name, _, text = spec.partition(":")
    options = dict(item.split("=") for item in text.split(",") if item)
    cls = {"layer-skip": LayerSkipDrafter, "sparse-kv": SparseKVDrafter}.get(name, QuantizedDrafter)
    return cls(target, make_options(name, {**options, "lookup": lookup}))


def _chain(target, drafter, prompt, params, k, seed=0):
    """The chain ``drafter`` proposes after ``prompt``, its draft forwards, and the
    cursor left behind."""
    state = drafter.start(prompt, params)
    cache = target.new_cache(256)
    target.forward(prompt[:-1], cache)
    state.attach_cache(cache)
    draft = state.propose(prompt, k, torch.Generator().manual_seed(seed))
    assert cache.num_tokens == len(prompt) - 1  # the cursor is restored
    return draft, state._forwards


def _forwards_needed(context: list[int], chain: list[int], lookup: int, k: int) -> int:
    """Draft forwards a chain takes with the lookup level, worked out from the chain
    itself: each forward drafts one token, then one more per leading guess token that
    the chain confirms."""
    forwards, done = 0, 0
    while done < len(chain):
        forwards += 1
        room = min(lookup, k - done - 1)
        ids = np.asarray(context + chain[:done], dtype=np.int64)
        guess = find_ngram_continuation(ids, 2, 4, room).tolist() if room > 0 else []
        done += 1
        for token in guess:
            if done >= len(chain) or token != chain[done - 1]:
                break
            done += 1
    return forwards


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("spec", SPECS)
def test_the_lookup_level_changes_the_cost_not_the_draft(native32, repeats, spec, params):
    """Over several contexts of a self-repeating sequence: the same tokens and draft
    distributions (bit for bit) with and without the lookup level, in as many forwards
    as the guesses that held leave (fewer in all)."""
    plain, cascade = _drafter(native32, spec, 0), _drafter(native32, spec, 4)
    forwards = [0, 0]
    for end in range(30, len(repeats) + 1, 2):
        prompt = repeats[:end]
        want, n0 = _chain(native32, plain, prompt, params, 8, seed=end)
        got, n1 = _chain(native32, cascade, prompt, params, 8, seed=end)
        assert got.token_ids == want.token_ids
        if params.greedy:
            assert got.draft_probs is None and want.draft_probs is None
        else:
            assert torch.equal(got.draft_probs, want.draft_probs)
        assert got.confidence == want.confidence
        assert n0 == len(want.token_ids)
        assert n1 == _forwards_needed(prompt, want.token_ids, 4, 8)
        forwards[0] += n0
        forwards[1] += n1
    assert forwards[1] < forwards[0]


@pytest.mark.parametrize("spec", SPECS)
def test_a_batch_drafts_what_each_sequence_drafts_alone(native32, repeats, spec):
    """``propose_batch`` with the lookup level: each sequence's chain equals its own
    ``propose`` without it, guesses of different lengths in one ragged forward."""
    plain, cascade = _drafter(native32, spec, 0), _drafter(native32, spec, 3)
    prompts = [repeats[:60], repeats[5:70], repeats[:53], repeats[2:81]]
    want = [_chain(native32, plain, p, SAMPLED, 6, seed=i)[0] for i, p in enumerate(prompts)]
    requests, caches = [], []
    for i, prompt in enumerate(prompts):
        state = cascade.start(prompt, SAMPLED)
        cache = native32.new_cache(256)
        native32.forward(prompt[:-1], cache)
        state.attach_cache(cache)
        caches.append(cache)
        requests.append(ChainRequest(state, prompt, 6, torch.Generator().manual_seed(i)))
    got = cascade.propose_batch(requests)
    for g, w, cache, prompt in zip(got, want, caches, prompts, strict=True):
        assert g.token_ids == w.token_ids
        assert torch.equal(g.draft_probs, w.draft_probs)
        assert cache.num_tokens == len(prompt) - 1


def test_the_engine_output_is_plain_decoding_and_the_draft_forwards_fewer(native32, repeats):
    """Through ``LLM``: greedy output equals plain decoding, the same tokens are accepted
    as without the level, in fewer draft forwards (measured by the drafter's count)."""
    plain = LLM(native32, speculative=SpeculativeConfig(method="none"))
    prompt = repeats[:50]
    expected = plain.generate(prompt, GREEDY).token_ids
    accepted = []
    for lookup in (0, 4):
        config = SpeculativeConfig(
            method=f"sparse-kv:sinks=2,recent=6,min_context=0,lookup={lookup}",
            num_speculative_tokens=6,
        )
        out = LLM(native32, speculative=config).generate(prompt, GREEDY)
        assert out.token_ids == expected
        accepted.append(out.metrics.num_accepted_tokens)
    assert accepted[0] == accepted[1] > 0


def test_bad_lookup_values_are_refused():
    for name in ("layer-skip", "quantized", "sparse-kv"):
        for bad in (-1, 1.5, "x"):
            with pytest.raises(ValueError, match="lookup"):
                make_options(name, {"lookup": bad})


class TestSparseKVLookupConformance(_NativeTargets, DrafterConformance):
    """The windowed self-draft with the lookup level: guesses in its forwards."""

    spec = "sparse-kv:sinks=2,recent=4,min_context=0,lookup=3"


@QUANTIZED
class TestQuantizedLookupConformance(_NativeTargets, DrafterConformance):
    """The quantized self-draft with the lookup level."""

    spec = "quantized:lookup=4"

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        return _small(num_layers=1)
