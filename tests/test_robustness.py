"""Inputs at the edges: extreme sampling values, sizes that would allocate memory, text cut
inside a character, interleaved generations, and seeds with learning tree builders."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.config import MAX_STOP_STRINGS
from specdec.sampling import logits_to_probs
from specdec.text import complete_text

PROMPT = [1, 5, 6, 7, 8, 5, 6, 7]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-30])
def test_tiny_temperature_is_greedy_in_effect(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=0.5))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


@pytest.mark.parametrize("temperature", [1e30, 1e308])
def test_huge_temperature_is_uniform(temperature):
    probs = logits_to_probs(torch.randn(2, 8), SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.full((2, 8), 1 / 8))


@pytest.mark.parametrize("temperature", [1e30, 3.5e38, 1e308])
def test_huge_temperature_is_uniform_over_the_unmasked_tokens(temperature):
    """A new user's trial: every head drafter (draft vocabulary: -inf outside it) crashed
    in multinomial at temperatures above float32's largest number (-inf / inf = nan)."""
    logits = torch.randn(2, 8)
    logits[:, 5:] = float("-inf")  # tokens outside a draft vocabulary
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert (probs[:, 5:] == 0).all()
    torch.testing.assert_close(probs[:, :5], torch.full((2, 5), 1 / 5))
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=3))
    assert (probs[:, 5:] == 0).all() and ((probs == 0) | (probs >= 1 / 5 - 1e-6)).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("method", ["none", "ngram", "draft-model"])
def test_tiny_temperature_generation_equals_greedy(target, near_draft, method):
    llm = LLM(target, draft=near_draft, speculative=SpeculativeConfig(method=method))
    greedy = llm.generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
    tiny = llm.generate(
        PROMPT, SamplingParams(temperature=1e-40, seed=0, max_new_tokens=12, ignore_eos=True)
    )
    assert tiny.token_ids == greedy.token_ids


def _record_capacities(model, monkeypatch) -> list[int]:
    sizes: list[int] = []
    new_cache = model.new_cache

    def recording(capacity=256):
        sizes.append(capacity)
        return new_cache(capacity)

    monkeypatch.setattr(model, "new_cache", recording)
    return sizes


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_huge_speculation_length_allocates_only_what_it_can_use(
    target, near_draft, monkeypatch, method
):
    llm = LLM(target, draft=near_draft, speculative=SpeculativeConfig(method=method))
    target_sizes = _record_capacities(target, monkeypatch)
    draft_sizes = _record_capacities(near_draft, monkeypatch)
    with pytest.raises(ValueError, match="from 1 to 64"):
        SpeculativeConfig(method=method, num_speculative_tokens=10**12)
    huge = SpeculativeConfig(method=method, num_speculative_tokens=64)
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True), speculative=huge)
    assert len(out.token_ids) == 8
    assert target_sizes == [len(PROMPT) + 8]
    assert all(size <= len(PROMPT) + 8 + 16 for size in draft_sizes)


def test_huge_max_new_tokens_allocates_at_most_the_context(target, near_draft, monkeypatch):
    llm = LLM(target, draft=near_draft, speculative=SpeculativeConfig(method="draft-model"))
    target_sizes = _record_capacities(target, monkeypatch)
    draft_sizes = _record_capacities(near_draft, monkeypatch)
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=10**15, ignore_eos=True))
    assert len(PROMPT) + len(out.token_ids) == target.max_context
    assert out.finish_reason == "length"
    assert target_sizes == [target.max_context]
    assert draft_sizes and max(draft_sizes) <= near_draft.max_context + 16


def test_stop_limits_are_clear_errors(target):
    with pytest.raises(ValueError, match="at most 64 stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match="at most 1024 characters"):
        SamplingParams(stop=["x" * 1025])
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop=[3])
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LLM(target).generate(PROMPT, SamplingParams(stop_token_ids=[10**6]))


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=True), dict(max_new_tokens=True), dict(temperature=True), dict(seed=False)],
    ids=str,
)
def test_booleans_are_not_numbers(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_complete_text_drops_only_a_trailing_replacement_character():
    assert complete_text("abc\ufffd\ufffd") == "abc"
    assert complete_text("a\ufffdb") == "a\ufffdb"
    assert complete_text("") == ""


# ------------------------------------------------------------ interleaved generations


def _interleave(streams) -> list[list[int]]:
    """Advance every stream one chunk at a time, round-robin, until all are done."""
    outputs: list = [None] * len(streams)
    live = dict(enumerate(streams))
    while live:
        for i, stream in list(live.items()):
            chunk = next(stream, None)
            if chunk is None or chunk.output is not None:
                outputs[i] = chunk.output.token_ids if chunk else outputs[i]
                del live[i]
    return outputs


@pytest.mark.parametrize("tree", [None, "dynamic:top_k=2,depth=3,budget=6"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interleaved_draft_model_streams_equal_sequential_runs(
    target, near_draft, tree, temperature
):
    """All drafter state is per sequence: interleaving generations on one LLM changes
    nothing (this crashed with 'cannot reshape tensor of 0 elements')."""
    spec = SpeculativeConfig(method="draft-model", num_speculative_tokens=3, tree=tree)
    llm = LLM(target, draft=near_draft, speculative=spec)
    prompts = [PROMPT, [1, 9, 10, 11], [1, 20, 21, 22, 23, 20, 21]]
    params = [
        SamplingParams(temperature=temperature, seed=s, max_new_tokens=n, ignore_eos=True)
        for s, n in zip(range(3), (20, 7, 14), strict=True)
    ]
    sequential = [llm.generate(p, sp).token_ids for p, sp in zip(prompts, params, strict=True)]
    streams = [llm.stream(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert _interleave(streams) == sequential


def test_abandoned_stream_releases_its_draft_state(target, near_draft):
    llm = LLM(target, draft=near_draft)
    stream = llm.stream(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()  # the sequence's draft cache is freed (the generator's finally runs)
    again = llm.generate(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert len(again.token_ids) == 30


# ------------------------------------------------------------ seeds and learned state


def test_seeded_sampling_with_sequoia_is_reproducible(target):
    spec = SpeculativeConfig(method="ngram:min_n=1", tree="sequoia:budget=8,depth=6")
    llm = LLM(target, speculative=spec)
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=32, ignore_eos=True)
    outputs = {tuple(llm.generate(PROMPT, params).token_ids) for _ in range(4)}
    assert len(outputs) == 1
    # Unseeded generations share (and keep teaching) one builder per config.
    shared = llm.tree_builder(spec)
    before = shared.stats.total
    llm.generate(PROMPT, SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True))
    assert shared.stats.total > before
    assert llm.tree_builder(spec, seed=3) is not shared


def test_every_interleaving_of_seeded_runs_gives_the_same_outputs(target):
    spec = SpeculativeConfig(method="ngram:min_n=1", tree="sequoia:budget=8,depth=4")
    llm = LLM(target, speculative=spec)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_new_tokens=10, ignore_eos=True)
        for s in range(3)
    ]
    expected = [llm.generate(PROMPT, p).token_ids for p in params]
    for order in itertools.permutations(range(3)):
        got = {i: llm.generate(PROMPT, params[i]).token_ids for i in order}
        assert [got[i] for i in range(3)] == expected


def test_drafters_and_tree_builders_kept_per_config_stay_bounded(target):
    """A new user's trial: a server's clients varying num_speculative_tokens or the tree
    made the LLM keep a drafter (and a head drafter its head) per distinct config."""
    from specdec import llm as llm_module

    own = SpeculativeConfig(method="ngram")
    llm = LLM(target, speculative=own)
    mine = llm.drafter(own)
    configs = [SpeculativeConfig(method="ngram", num_speculative_tokens=k) for k in range(1, 65)]
    built = [llm.drafter(c) for c in configs]
    assert len({id(d) for d in built}) == 64  # one per config: what each learns is its own
    assert len(llm._drafters) == llm_module.DRAFTERS
    assert llm.drafter(own) is mine and llm.drafter(configs[-1]) is built[-1]
    builders = [
        llm.tree_builder(SpeculativeConfig("ngram", tree=f"static:chain-{n}"), None)
        for n in range(1, 2 * llm_module.TREE_BUILDERS)
    ]
    assert len(llm._tree_builders) == llm_module.TREE_BUILDERS
    again = SpeculativeConfig("ngram", tree=f"static:chain-{2 * llm_module.TREE_BUILDERS - 1}")
    assert llm.tree_builder(again, None) is builders[-1]  # the recent ones are kept
