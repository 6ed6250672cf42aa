"""Hybrid drafting (``hybrid``: a confident suffix draft, else a model drafter's): the
conformance suite with a self-draft and with a draft model (greedy equals plain decoding,
sampled output follows the target's law with both kinds of proposals in one generation),
the choice rule, the model's share of a step, batches routed per sequence, and every
misconfiguration refused with a clear error."""

from __future__ import annotations

import pytest
import torch
from drafter_conformance import PROMPTS, DrafterConformance, hf_greedy
from test_layer_skip import _NativeTargets

from conftest import make_model, make_tokenizer, perturbed_copy
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import DraftProposal
from specdec.drafters.hybrid import SCORE_BINS, GoodputChoice, HybridDrafter
from specdec.drafters.options import HybridOptions, SuffixOptions
from specdec.drafters.suffix import SuffixDrafter
from specdec.models.native import NativeModel
from specdec.registry import make_options, needs_draft_model
from specdec.runtime.kernels import kernel_available

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
needs_kernels = pytest.mark.skipif(
    not kernel_available(), reason="the quantized self-draft runs specdec's C++ CPU kernels"
)


@needs_kernels
class TestHybridQuantizedConformance(_NativeTargets, DrafterConformance):
    """A quantized self-draft behind the suffix draft; threshold 0 takes every suffix
    match, so both kinds of proposals run in one generation."""

    spec = "hybrid:threshold=0"
    ks = (1, 4)

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        """The statistical test's target, 32 wide (a Q4_1 block holds 32 weights)."""
        tokenizer = make_tokenizer(num_words=5)
        target = make_model(tokenizer, seed=0, hidden_size=32, num_layers=1, init_std=0.2)
        return target, perturbed_copy(target, noise=0.08, seed=1)


@needs_kernels
class TestHybridGoodputConformance(TestHybridQuantizedConformance):
    """The learned choice (``choose=goodput``): which draft a step takes depends on
    timing, never on the output."""

    spec = "hybrid:threshold=0,choose=goodput"


class TestHybridDraftModelConformance(DrafterConformance):
    """A draft model (transformers) behind the suffix draft, its model drafts capped at 2."""

    spec = "hybrid:model=draft-model,threshold=0.5,model_tokens=2"
    draft_fixture = "near_draft"
    ks = (1, 4)


class _Model:
    """A chain drafter that proposes ``[7] * n`` with a distribution, and records calls."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.calls: list[int] = []
        self.batched: list[list[int]] = []

    def start(self, prompt_ids, params):
        return _ModelSequence(self)

    def propose_batch(self, requests):
        self.batched.append([r.num_tokens for r in requests])
        return [r.state.propose(r.token_ids, r.num_tokens, r.generator) for r in requests]


class _ModelSequence:
    def __init__(self, model: _Model) -> None:
        self.model = model

    def propose(self, token_ids, num_tokens, generator):
        self.model.calls.append(num_tokens)
        probs = torch.zeros(num_tokens, self.model.vocab)
        probs[:, 7] = 1.0
        return DraftProposal([7] * num_tokens, probs)

    def close(self) -> None:
        pass


def _hybrid(threshold: float, model_tokens: int = 0, vocab: int = 16, choose="threshold"):
    model = _Model(vocab)
    options = HybridOptions(threshold=threshold, model_tokens=model_tokens, choose=choose)
    suffix = SuffixDrafter(SuffixOptions(global_cache=False))
    return HybridDrafter(suffix, model, options), model


def test_the_suffix_draft_is_taken_only_when_its_score_reaches_the_threshold():
    """``1 2 3`` seen twice: after ``... 1`` the suffix path ``2 3`` scores 2 (each
    continuation certain); threshold 2 takes it, threshold 2.5 asks the model."""
    context = [1, 2, 3, 1, 2, 3, 1]
    drafter, model = _hybrid(threshold=2.0)
    state = drafter.start(context, GREEDY)
    proposal = state.propose(context, 2, torch.Generator())
    assert proposal.token_ids == [2, 3] and proposal.draft_probs is None
    assert drafter.stats == {"suffix": 1, "model": 0} and model.calls == []
    drafter, model = _hybrid(threshold=2.5)
    state = drafter.start(context, GREEDY)
    proposal = state.propose(context, 2, torch.Generator())
    assert proposal.token_ids == [7, 7] and proposal.draft_probs is not None
    assert drafter.stats == {"suffix": 0, "model": 1} and model.calls == [2]


def test_no_suffix_match_asks_the_model_and_k_zero_asks_nobody():
    drafter, model = _hybrid(threshold=0.0)
    state = drafter.start([1, 2, 3], GREEDY)
    assert state.propose([1, 2, 3], 3, torch.Generator()).token_ids == [7, 7, 7]
    assert state.propose([1, 2, 3], 0, torch.Generator()).token_ids == []
    assert model.calls == [3] and drafter.stats == {"suffix": 0, "model": 1}


def test_model_tokens_caps_only_the_model_draft():
    context = [4, 5, 6, 8, 9, 4, 5, 6, 8, 9, 4]
    drafter, model = _hybrid(threshold=0.0, model_tokens=2)
    state = drafter.start(context, GREEDY)
    assert len(state.propose(context, 4, torch.Generator())) == 4  # the suffix path: 5 6 8 9
    other = drafter.start([1, 2, 3], GREEDY)
    assert other.propose([1, 2, 3], 6, torch.Generator()).token_ids == [7, 7]
    assert model.calls == [2]


def test_a_batch_routes_each_sequence_and_batches_the_model_drafts():
    from specdec.drafters.base import ChainRequest

    drafter, model = _hybrid(threshold=1.0, model_tokens=3)
    repeat = [1, 2, 3, 1, 2, 3, 1]
    states = [drafter.start(p, GREEDY) for p in (repeat, [4, 5], [6, 8, 9])]
    gen = torch.Generator()
    prompts = (repeat, [4, 5], [6, 8, 9])
    requests = [ChainRequest(s, p, 5, gen) for s, p in zip(states, prompts, strict=True)]
    out = drafter.propose_batch(requests)
    assert out[0].token_ids[:2] == [2, 3] and out[0].draft_probs is None
    assert out[1].token_ids == out[2].token_ids == [7, 7, 7]
    assert model.batched == [[3, 3]]
    assert [p.source for p in out] == ["suffix", "model", "model"]
    one = states[1].propose([4, 5], 5, gen)  # alone, the model's proposal is tagged too
    assert one.source == "model" and one.token_ids == [7, 7, 7]


def test_a_model_without_propose_batch_leaves_the_hybrid_without_one():
    class ChainOnly:
        def start(self, prompt_ids, params):
            return _ModelSequence(_Model(16))

    drafter = HybridDrafter(SuffixDrafter(), ChainOnly())
    assert not hasattr(drafter, "propose_batch")
    assert drafter.observes is False and drafter.uses_target_cache is False


def test_greedy_output_equals_plain_decoding_with_suffix_and_model_steps(target, near_draft):
    """A repetitive prompt: the suffix drafts some steps, the draft model the others."""
    config = SpeculativeConfig(
        method="hybrid:model=draft-model,threshold=1", num_speculative_tokens=4
    )
    llm = LLM(target, draft=near_draft, speculative=config)
    prompt = PROMPTS[0] * 4
    before = dict(llm.drafter(llm.speculative).stats)
    out = llm.generate(prompt, GREEDY)
    assert out.token_ids == hf_greedy(target, prompt, 40)
    stats = llm.drafter(llm.speculative).stats
    assert stats["suffix"] > 0 and stats["model"] > 0
    # the request's own split: every step that asked the hybrid, by the source it chose
    m = out.metrics
    assert m.draft_sources == {k: stats[k] - before[k] for k in ("suffix", "model")}
    assert m.num_drafts <= sum(m.draft_sources.values()) <= m.num_steps
    assert out.metrics.to_dict()["draft_sources"] == m.draft_sources
    # in a batch, each request counts its own steps
    outs = llm.generate([prompt, PROMPTS[1]], GREEDY)
    for one in outs:
        assert one.metrics.num_drafts <= sum(one.metrics.draft_sources.values())
        assert sum(one.metrics.draft_sources.values()) <= one.metrics.num_steps
    plain = llm.generate(prompt, GREEDY, speculative=SpeculativeConfig("ngram"))
    assert plain.metrics.draft_sources == {}


@needs_kernels
def test_a_self_draft_model_drafts_over_the_target_cache(target):
    native = NativeModel(target, exact=True)
    config = SpeculativeConfig(method="hybrid:model=quantized;kernel=fma", num_speculative_tokens=4)
    llm = LLM(native, speculative=config)
    drafter = llm.drafter(llm.speculative)
    assert drafter.uses_target_cache and drafter.model.kernels["qkv"] == "fma"
    for prompt in PROMPTS:
        assert llm.generate(prompt, GREEDY).token_ids == hf_greedy(target, prompt, 40)
    batch = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batch] == [hf_greedy(target, p, 40) for p in PROMPTS]


def test_options_are_checked():
    assert make_options("hybrid", {"model": "quantized; kernel = fma "}).model_spec == (
        "quantized",
        {"kernel": "fma"},
    )
    for values, message in (
        ({"model": "hybrid"}, "cannot be hybrid"),
        ({"model": ""}, "must name a drafter"),
        ({"model": "quantized;kernel"}, "is not key=value"),
        ({"model": "quantized;kernel=fma;kernel=q8"}, "given twice"),
        ({"threshold": "-1"}, "threshold must be a number >= 0"),
        ({"model_tokens": "-1"}, "model_tokens must be an integer >= 0"),
        ({"max_depth": "1"}, "max_depth must be an integer >= 2"),
    ):
        with pytest.raises(ValueError, match=message):
            make_options("hybrid", values)


def test_bad_model_drafters_are_refused_with_the_hybrid_named(target):
    for spec, message in (
        ("hybrid:model=nope", "hybrid:model=nope: unknown drafter; choose a chain drafter"),
        ("hybrid:model=lookahead", "adds rows to verification"),
        ("hybrid:model=ngram;min_n=0", "hybrid:model=ngram;min_n=0: .*min_n"),
    ):
        with pytest.raises(ValueError, match=message):
            llm = LLM(target, speculative=SpeculativeConfig(method=spec))
            llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=2))


def test_trees_are_refused(target, near_draft):
    config = SpeculativeConfig(
        method="hybrid:model=draft-model", tree="dynamic:top_k=2,depth=3,budget=6"
    )
    with pytest.raises(ValueError, match="hybrid cannot draft token trees: it drafts chains"):
        LLM(target, draft=near_draft, speculative=config).generate(PROMPTS[0], GREEDY)


def test_needs_draft_model_follows_the_model_option():
    assert needs_draft_model("hybrid", {"model": "draft-model"})
    assert needs_draft_model("hybrid", {"model": "draft-model;tokenizers=text"})
    assert not needs_draft_model("hybrid", {"model": "quantized"})
    assert not needs_draft_model("hybrid")
    assert needs_draft_model("draft-model") and not needs_draft_model("suffix")


def test_the_model_drafters_longest_chain_caps_only_its_draft():
    """A model drafter with ``max_draft_tokens`` (Medusa's heads): the hybrid declares no
    limit (a suffix draft may be longer) and never asks the model for more."""
    model = _Model(16)
    model.max_draft_tokens = 2
    drafter = HybridDrafter(SuffixDrafter(SuffixOptions(global_cache=False)), model)
    assert drafter.max_draft_tokens is None
    state = drafter.start([1, 2, 3], GREEDY)
    assert state.propose([1, 2, 3], 6, torch.Generator()).token_ids == [7, 7]
    assert model.calls == [2]


@needs_kernels
def test_a_quantized_model_over_a_quantized_target_is_warned_about(target, caplog):
    """On a target that runs 4-bit products already, the quantized draft rarely pays."""
    q4 = NativeModel(target, exact=True, quantization="q4_1")
    config = SpeculativeConfig(method="hybrid", num_speculative_tokens=4)
    with caplog.at_level("WARNING", logger="specdec.registry"):
        LLM(q4, speculative=config).drafter(config)
    assert "--drafter suffix is faster on it" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="specdec.registry"):
        dense = NativeModel(target, exact=True)
        LLM(dense, speculative=config).drafter(config)
    assert "rarely pay" not in caplog.text


def test_the_model_drafters_options_are_checked_before_anything_loads():
    """SpeculativeConfig checks model= as it checks the hybrid's own options (the CLI
    refuses them before loading)."""
    for method, message in (
        ("hybrid:model=quantized;bogus=1", r"hybrid:model=quantized;bogus=1: .*no option 'bogus'"),
        ("hybrid:model=ngram;min_n=abc", r"hybrid:model=ngram;min_n=abc: .*min_n"),
        ("hybrid:model=retrieval", r"hybrid:model=retrieval: .*needs a datastore"),
        ("hybrid:model=nope", "choose a chain drafter: .*none"),
    ):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(method=method)
    SpeculativeConfig(method="hybrid:model=quantized;kernel=fma")  # fine: nothing loads


def test_serve_refuses_a_hybrid_tree_at_startup():
    from specdec.engine.engine import check_tree_drafter

    with pytest.raises(ValueError, match="hybrid cannot draft token trees"):
        check_tree_drafter(HybridDrafter(SuffixDrafter(), _Model(16)))
    check_tree_drafter(SuffixDrafter())  # a tree drafter passes


def _timed(choice, suffix_accepted, model_accepted, model_draft_s, verify_s=0.01, n=50):
    """``n`` steps of each source with these outcomes (score 1, bin 1; 4-token drafts),
    verification costing ``verify_s`` whatever the rows."""
    for _ in range(n):
        choice.record("suffix", 4, suffix_accepted, verify_s, score=1.0)
        choice.record("model", 4, model_accepted, verify_s, draft_s=model_draft_s)


def test_the_learned_choice_follows_the_threshold_until_both_sources_are_seen():
    choice = GoodputChoice(threshold=2.0)
    assert choice.rates(1.0, 4, 4) is None
    assert not choice.take_suffix(1.0, 4, 4) and choice.take_suffix(2.0, 4, 4)
    choice.record("suffix", 4, 3, 0.01, score=1.0)
    assert choice.rates(1.0, 4, 4) is None  # the model is not timed yet
    choice.record("model", 4, 1, 0.01, draft_s=0.005)
    assert choice.rates(1.0, 4, 4) is not None


def test_the_learned_choice_weighs_acceptance_against_draft_time():
    """A suffix draft of score 1 that the target accepts 3 tokens of, against a model
    whose drafts cost as much as verification: the suffix draft; against a free model
    accepting 4 tokens: the model, whatever the threshold says."""
    weak = GoodputChoice(threshold=100.0)
    _timed(weak, suffix_accepted=3, model_accepted=2, model_draft_s=0.01)
    suffix, model = weak.rates(1.0, 8, 4)
    assert suffix == pytest.approx(4 / 0.01, rel=0.05)
    assert model == pytest.approx(3 / 0.02, rel=0.05)
    assert weak.take_suffix(1.0, 8, 4)
    strong = GoodputChoice(threshold=0.0)
    _timed(strong, suffix_accepted=1, model_accepted=4, model_draft_s=0.0005)
    assert not strong.take_suffix(1.0, 8, 4)


def test_verification_time_is_fitted_by_rows_across_both_sources():
    """Suffix steps of 16 rows at 20 ms, model steps of 5 at 9 ms: V(rows) = 4 ms + 1 ms
    per row, so a long suffix draft pays for its rows."""
    choice = GoodputChoice(threshold=2.0, decay=0.99)
    for _ in range(40):
        choice.record("suffix", 15, 3, 0.020, score=4.0)
        choice.record("model", 4, 3, 0.009, draft_s=0.001)
    assert choice.verify_s(16) == pytest.approx(0.020)
    assert choice.verify_s(5) == pytest.approx(0.009)
    assert choice.verify_s(1) == pytest.approx(0.005)
    # 3 of 15 at 20 ms (200 tok/s) against 3 of 4 at 10 ms (400 tok/s): the model
    assert choice.rates(4.0, 15, 4) == pytest.approx((200.0, 400.0), rel=0.02)
    assert not choice.take_suffix(4.0, 15, 4)
    one = GoodputChoice(threshold=2.0)
    one.record("model", 4, 3, 0.009, draft_s=0.001)
    assert one.verify_s(1) == one.verify_s(99) == pytest.approx(0.009)  # one row count: the mean


def test_the_suffix_acceptance_is_learned_per_score_bin_with_the_score_as_prior():
    choice = GoodputChoice(threshold=2.0)
    _timed(choice, suffix_accepted=0, model_accepted=1, model_draft_s=0.001)
    # bin of score 1 learned ~0 tokens; a score of 10 (another bin) keeps its prior
    assert choice.rates(1.0, 16, 4)[0] < choice.rates(10.0, 16, 4)[0]
    assert choice.bin(1.0) != choice.bin(10.0) and choice.bin(1e9) == len(SCORE_BINS)
    assert not choice.take_suffix(1.0, 4, 4) and choice.take_suffix(10.0, 4, 4)
    # the prior is capped at the draft's length
    assert choice.rates(10.0, 2, 4)[0] < choice.rates(10.0, 4, 4)[0]
    with pytest.raises(ValueError, match="decay must be in"):
        GoodputChoice(2.0, decay=1.0)
    with pytest.raises(ValueError, match="choose must be threshold or goodput"):
        make_options("hybrid", {"choose": "bandit"})


def test_the_learned_choice_decides_greedy_and_unseeded_requests_not_seeded_sampling():
    drafter, model = _hybrid(threshold=2.0, choose="goodput")
    assert drafter.observes  # the choice reads every verification, though the model does not
    _timed(drafter.choice, suffix_accepted=0, model_accepted=4, model_draft_s=0.0001)
    context = [1, 2, 3, 1, 2, 3, 1]  # the suffix path 2 3 scores 2
    seeded = SamplingParams(temperature=1.0, seed=3, max_new_tokens=8)
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=8)
    for params, source in ((GREEDY, "model"), (unseeded, "model"), (seeded, "suffix")):
        state = drafter.start(context, params)
        assert state.learned is (params is not seeded)
        assert state.propose(context, 2, torch.Generator()).source == source


def test_the_learned_choice_records_every_verified_step(target, near_draft):
    """Through the engine: each step's outcome reaches the choice, the output is plain
    decoding's."""
    config = SpeculativeConfig(
        method="hybrid:model=draft-model,threshold=1,choose=goodput", num_speculative_tokens=4
    )
    llm = LLM(target, draft=near_draft, speculative=config)
    prompt = PROMPTS[0] * 4
    out = llm.generate(prompt, GREEDY)
    assert out.token_ids == hf_greedy(target, prompt, 40)
    choice = llm.drafter(llm.speculative).choice
    assert choice.verify_s.weight > 0 and choice.model_draft_s.weight > 0
    assert out.metrics.draft_sources and sum(out.metrics.draft_sources.values()) >= 1
