"""Layer skip (Draft & Verify, SWIFT): skip-set parsing and the heuristic start, the
on-the-fly search on synthetic feedback, drafting over the target's own cache (cursor and
prefix restored, all layers kept = the target's own tokens, draft logits = transformers
with the layers removed), and the drafter conformance suite on native targets."""

from __future__ import annotations

import math

import pytest
import torch
from drafter_conformance import PROMPTS, DrafterConformance
from transformers import DynamicCache

from conftest import make_model, make_tokenizer, perturbed_copy
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.base import VerificationFeedback
from specdec.drafters.layer_skip import (
    LayerSkipDrafter,
    SkipSetSearch,
    check_skip_set,
    initial_skip_set,
    skippable_layers,
)
from specdec.drafters.options import LayerSkipOptions, parse_layer_set
from specdec.models.native import NativeModel
from specdec.registry import make_options
from specdec.sampling import logits_to_probs

PROMPT = [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.0, top_k=8)


@pytest.fixture(scope="module")
def deep_hf():
    """A 6-layer tiny Llama (the conformance targets have only 2 layers)."""
    return make_model(make_tokenizer(), seed=0, num_layers=6, name="tiny-6-layers")


@pytest.fixture(scope="module")
def deep(deep_hf) -> NativeModel:
    return NativeModel(deep_hf, exact=True)


def _state(target, options: LayerSkipOptions, params=GREEDY, prompt=PROMPT):
    """A sequence state over a cache that holds the prompt but its pending last token."""
    drafter = LayerSkipDrafter(target, options)
    state = drafter.start(prompt, params)
    cache = target.new_cache(64)
    target.forward(prompt[:-1], cache)
    state.attach_cache(cache)
    return drafter, state, cache


def _plain(target, prompt, n):
    return LLM(target, speculative=SpeculativeConfig(method="none")).generate(
        prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)
    )


# ---------------------------------------------------------------- skip sets


@pytest.mark.parametrize(
    "text, layers",
    [
        ("", ()),
        ("4", (4,)),
        ("4-6+9", (4, 5, 6, 9)),
        ("4-11,14", (*range(4, 12), 14)),
        (" 9 + 0-1 ", (0, 1, 9)),
        ("3-3", (3,)),
    ],
)
def test_parse_layer_set(text, layers):
    assert parse_layer_set(text) == layers


@pytest.mark.parametrize(
    "text, message",
    [
        ("a", "not an index or a range"),
        ("-1", "not an index or a range"),
        ("1-", "not an index or a range"),
        ("1-2-3", "not an index or a range"),
        ("²", "not an index or a range"),
        ("5-3", "is empty"),
        ("1+0-2", "names a layer twice"),
    ],
)
def test_parse_layer_set_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_layer_set(text)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"skip": "x"}, "not an index"),
        ({"skip_ratio": "1.0"}, r"skip_ratio must be a number in \[0, 1\)"),
        ({"confidence": "-0.1"}, r"confidence must be a number in \[0, 1\)"),
        ({"search_steps": "0"}, "search_steps must be an integer >= 1"),
        ({"search_rounds": "-1"}, "search_rounds must be an integer >= 0"),
        ({"seed": "-2"}, "seed must be an integer >= 0"),
    ],
)
def test_options_refuse_bad_values(values, message):
    with pytest.raises(ValueError, match=message):
        make_options("layer-skip", values)


def test_options_from_a_spec_string():
    config = SpeculativeConfig(method="layer-skip:skip=1-2+4,confidence=0.3")
    assert config.options == LayerSkipOptions(skip="1-2+4", confidence=0.3)


@pytest.mark.parametrize(
    "num_layers, ratio, expected",
    [(10, 0.4, (2, 4, 6, 8)), (6, 0.4, (2, 4)), (30, 0.1, (5, 15, 24)), (4, 0.99, (1, 2)),
     (2, 0.5, ()), (1, 0.9, ()), (12, 0.0, ())],
)  # fmt: skip
def test_initial_skip_set_examples(num_layers, ratio, expected):
    assert initial_skip_set(num_layers, ratio) == expected


def test_initial_skip_set_spreads_the_ratio_over_the_intermediate_layers():
    for num_layers in range(1, 41):
        for ratio in (0.0, 0.1, 0.25, 0.4, 0.5, 0.75, 0.99):
            skip = initial_skip_set(num_layers, ratio)
            assert list(skip) == sorted(set(skip))
            assert set(skip) <= set(skippable_layers(num_layers))  # never first or last
            assert len(skip) == min(math.floor(ratio * num_layers + 0.5), max(num_layers - 2, 0))


def test_check_skip_set_refuses_sets_the_model_cannot_run():
    assert check_skip_set([3, 1], 4) == (1, 3)
    with pytest.raises(ValueError, match=r"names layers \[4\].*layers 0..3"):
        check_skip_set([1, 4], 4)
    with pytest.raises(ValueError, match="skips all 4 layers"):
        check_skip_set(range(4), 4)
    with pytest.raises(ValueError, match="twice"):
        check_skip_set([1, 1], 4)


def test_factory_refuses_transformers_targets_and_bad_fixed_sets(target, deep):
    with pytest.raises(
        ValueError,
        match="layer-skip needs the native backend \\(backend='native' / --backend native",
    ):
        LLM(target, speculative=SpeculativeConfig(method="layer-skip"))
    with pytest.raises(ValueError, match=r"names layers \[6\]"):
        LLM(deep, speculative=SpeculativeConfig(method="layer-skip:skip=1+6"))
    with pytest.raises(ValueError, match="skips all 6 layers"):
        LLM(deep, speculative=SpeculativeConfig(method="layer-skip:skip=0-5"))


# ---------------------------------------------------------------- the on-the-fly search


def _rate(skip) -> float:
    """Synthetic acceptance rates over 6 layers: skipping 1 and 3 is best."""
    return 0.2 + 0.3 * (1 in skip) + 0.3 * (3 in skip)


def _feed(search: SkipSetSearch, rate, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not search.searching:
            return
        skip = search.current
        search.record(skip, num_forwards=10, num_accepted=round(10 * rate(skip)))


def test_search_picks_the_better_skip_set():
    search = SkipSetSearch(6, initial_skip_set(6, 0.4), search_steps=3, search_rounds=5, seed=0)
    assert search.current == (2, 4) and search.searching
    _feed(search, _rate)
    assert not search.searching
    assert search.best == search.current == (1, 3)
    assert search.best_score == pytest.approx(0.8)
    assert search.history[0] == ((2, 4), pytest.approx(0.2))
    assert len(search.history) <= 6  # the initial set, then at most search_rounds candidates
    # every candidate is one swap from the best set at the time it was drawn
    assert all(len(skip) == 2 for skip, _ in search.history)


def test_search_keeps_the_initial_set_when_no_candidate_beats_it():
    search = SkipSetSearch(6, (2, 4), search_steps=2, search_rounds=3, seed=1)
    _feed(search, lambda skip: 0.9 if skip == (2, 4) else 0.5)
    assert search.best == search.current == (2, 4)
    assert [score for _, score in search.history] == pytest.approx([0.9, 0.5, 0.5, 0.5])


def test_search_is_deterministic_and_counts_only_the_current_set():
    runs = []
    for _ in range(2):
        search = SkipSetSearch(12, initial_skip_set(12, 0.4), 2, 6, seed=7)
        for step in range(40):
            search.record((1, 2, 3), 4, 4)  # a stale set: ignored
            skip = search.current
            search.record(skip, 4, (sum(skip) + step) % 5)
        runs.append((search.history, search.best))
    assert runs[0] == runs[1]
    assert all(skip != (1, 2, 3) for skip, _ in runs[0][0])
    other_seed = SkipSetSearch(12, initial_skip_set(12, 0.4), 2, 6, seed=8)
    _feed(other_seed, lambda skip: 0.5)
    assert [s for s, _ in other_seed.history] != [s for s, _ in runs[0][0]][
        : len(other_seed.history)
    ]


def test_search_needs_room_to_move():
    assert not SkipSetSearch(4, (1, 2), 2, 5).searching  # every intermediate layer skipped
    assert not SkipSetSearch(6, (), 2, 5).searching  # nothing skipped
    assert not SkipSetSearch(6, (2, 4), 2, 0).searching  # no rounds
    single = SkipSetSearch(4, (2,), 1, 5)  # one neighbour only: (1,)
    _feed(single, lambda skip: 0.7 if skip == (1,) else 0.1)
    assert single.best == (1,) and len(single.history) == 2


# ---------------------------------------------------------------- drafting over the cache


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_propose_restores_the_cursor_and_the_prefix(deep, params):
    _, state, cache = _state(deep, LayerSkipOptions(skip="2-3", confidence=0.0), params)
    before = cache.kv[:, :, :, : cache.num_tokens].clone()
    draft = state.propose(PROMPT, 6, torch.Generator().manual_seed(0))
    assert len(draft) == 6
    assert cache.num_tokens == len(PROMPT) - 1
    assert torch.equal(cache.kv[:, :, :, : cache.num_tokens], before)
    if params.greedy:
        assert draft.draft_probs is None
    else:
        assert draft.draft_probs.shape == (6, deep.vocab_size)
        assert torch.allclose(draft.draft_probs.sum(-1).cpu(), torch.ones(6))
        picked = draft.draft_probs[torch.arange(6), torch.tensor(draft.token_ids)]
        assert bool((picked > 0).all())
    session = state.tree_session(PROMPT, params)
    root = session.expand([-1], 2)[0]
    session.expand([session.add(-1, root.tokens[0]), session.add(-1, root.tokens[1])], 2)
    session.close()
    assert cache.num_tokens == len(PROMPT) - 1
    assert torch.equal(cache.kv[:, :, :, : cache.num_tokens], before)


def test_propose_refuses_a_cache_off_the_cursor_rule(deep):
    drafter = LayerSkipDrafter(deep, LayerSkipOptions(skip="2"))
    state = drafter.start(PROMPT, GREEDY)
    with pytest.raises(ValueError, match="attach_cache"):
        state.propose(PROMPT, 3, torch.Generator())
    _, state, _ = _state(deep, LayerSkipOptions(skip="2"))
    with pytest.raises(ValueError, match="cursor rule"):
        state.propose(PROMPT[:-1], 3, torch.Generator())
    assert state.propose(PROMPT, 0, torch.Generator()).token_ids == []


def test_all_layers_kept_drafts_exactly_the_targets_greedy_tokens(deep):
    """The strongest check of the shared-cache drafting: with nothing skipped, the draft
    is the target itself, so it proposes plain decoding's tokens and all are accepted."""
    expected = _plain(deep, PROMPT, 12).token_ids
    drafter, state, _ = _state(deep, LayerSkipOptions(skip_ratio=0.0, confidence=0.0))
    assert drafter.skip_set == () and not drafter.search.searching
    assert state.propose(PROMPT, 8, torch.Generator()).token_ids == expected[:8]
    config = SpeculativeConfig(
        method="layer-skip:skip_ratio=0,confidence=0", num_speculative_tokens=5
    )
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    out = LLM(deep, speculative=config).generate(PROMPT, params)
    assert out.token_ids == _plain(deep, PROMPT, 30).token_ids
    assert out.metrics.num_accepted_tokens == out.metrics.num_draft_tokens > 0


def _transformers_layer_skip(hf, prompt, drafts, kept):
    """Independent oracle: transformers' modules, the prefix run by every layer into a
    cache, then ``[pending, *drafts]`` run by the kept layers only over that cache."""
    model = hf.model
    device = model.device
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([prompt[:-1]], device=device), cache=cache, use_cache=True)
        layers = model.model.layers
        try:
            model.model.layers = torch.nn.ModuleList([layers[i] for i in kept])
            n = len(prompt) - 1
            ids = torch.tensor([[prompt[-1], *drafts]], device=device)
            positions = torch.arange(n, n + ids.shape[1], device=device)[None]
            out = model(ids, cache=cache, use_cache=True, position_ids=positions)
        finally:
            model.model.layers = layers
    return out.logits[0]


def test_draft_logits_equal_transformers_with_the_skipped_layers_removed(deep, deep_hf):
    _, state, cache = _state(deep, LayerSkipOptions(skip="1+3-4", confidence=0.0))
    rows = []
    original = deep.forward_full

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        rows.append(out.logits[-1])
        return out

    deep.forward_full = spy
    try:
        drafts = state.propose(PROMPT, 5, torch.Generator()).token_ids
    finally:
        del deep.forward_full
    expected = _transformers_layer_skip(deep_hf, PROMPT, drafts, kept=[0, 2, 5])
    assert torch.allclose(torch.stack(rows), expected[:5].to(rows[0].device), atol=1e-4, rtol=1e-4)
    assert drafts == expected[:5].argmax(-1).tolist()
    full = _transformers_layer_skip(deep_hf, PROMPT, drafts, kept=range(6))
    assert not torch.allclose(full, expected, atol=1e-2)  # the skipped layers matter


def test_sampled_draft_probs_are_the_processed_draft_logits(deep):
    _, state, cache = _state(deep, LayerSkipOptions(skip="2-4", confidence=0.0), SAMPLED)
    draft = state.propose(PROMPT, 4, torch.Generator().manual_seed(3))
    logits = deep.forward_full(
        [PROMPT[-1], *draft.token_ids[:-1]], cache, layers=[0, 1, 5]
    ).logits  # one forward over the same layers: the chain's rows at once
    assert torch.allclose(draft.draft_probs, logits_to_probs(logits, SAMPLED), atol=1e-6)


def test_confidence_stop_drops_unsure_tokens(deep):
    _, probe, _ = _state(deep, LayerSkipOptions(skip="2-4", confidence=0.0), SAMPLED)
    rows = probe.propose(PROMPT, 6, torch.Generator().manual_seed(0)).draft_probs
    tops = rows.max(-1).values.tolist()
    threshold = sorted(tops)[len(tops) // 2] + 1e-6  # some rows above, some below
    expected = next(i for i, top in enumerate(tops) if top < threshold)
    options = LayerSkipOptions(skip="2-4", confidence=threshold)
    _, state, _ = _state(deep, options, SAMPLED)
    draft = state.propose(PROMPT, 6, torch.Generator().manual_seed(0))
    assert len(draft) == expected
    if expected:
        assert bool((draft.draft_probs.max(-1).values >= threshold).all())
    _, sure, _ = _state(deep, LayerSkipOptions(skip="2-4", confidence=0.999999), GREEDY)
    assert len(sure.propose(PROMPT, 6, torch.Generator())) < 6


def test_the_search_runs_inside_the_engine_and_is_shared_across_requests(deep):
    config = SpeculativeConfig(
        method="layer-skip:search_steps=2,search_rounds=4,confidence=0", num_speculative_tokens=4
    )
    llm = LLM(deep, speculative=config)
    drafter = llm.drafter(config)
    assert drafter.observes and drafter.search.current == initial_skip_set(6, 0.2) == (3,)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outs = llm.generate([PROMPT, [1, 9, 4]], params)
    assert len(drafter.search.history) >= 2  # windows of both requests were counted
    for prompt, out in zip([PROMPT, [1, 9, 4]], outs, strict=True):
        assert out.token_ids == _plain(deep, prompt, 30).token_ids
    assert not LayerSkipDrafter(deep, LayerSkipOptions(skip="2")).observes  # nothing to learn


def test_a_confidence_stop_counts_as_a_rejected_draft_forward(deep):
    options = LayerSkipOptions(skip_ratio=0.4, confidence=0.999999, search_steps=1)
    drafter, state, cache = _state(deep, options)
    draft = state.propose(PROMPT, 6, torch.Generator())
    assert len(draft) < 6  # stopped: one more forward ran than tokens were proposed
    logits = torch.zeros((1 + len(draft), deep.vocab_size))
    feedback = VerificationFeedback(
        [PROMPT[-1], *draft.token_ids], None, logits, [0], [int(logits[0].argmax())]
    )
    state.observe(feedback)
    assert drafter.search.history == [((2, 4), 0.0)]
    state.observe(feedback)  # no draft since: nothing more to count
    assert len(drafter.search.history) == 1


def test_trees_over_the_target_cache_equal_plain_decoding(deep):
    tree = "dynamic:top_k=2,depth=3,budget=6"
    config = SpeculativeConfig(method="layer-skip:skip=2-3", tree=tree)
    llm = LLM(deep, speculative=config)
    for prompt in PROMPTS:
        out = llm.generate(prompt, SamplingParams(max_new_tokens=25, ignore_eos=True))
        assert out.token_ids == _plain(deep, prompt, 25).token_ids


# ---------------------------------------------------------------- conformance

_NATIVE: dict[int, tuple[object, NativeModel]] = {}


class _NativeTargets:
    """The conformance tests' transformers targets, run on the native backend (exact)."""

    def wrap_target(self, target):
        if getattr(target, "backend", None) == "native":
            return target
        hit = _NATIVE.get(id(target))
        if hit is None or hit[0] is not target:
            hit = _NATIVE[id(target)] = (target, NativeModel(target, exact=True))
        return hit[1]


class TestFixedLayerSkipConformance(_NativeTargets, DrafterConformance):
    """A draft that really differs: layer 1 of 2 skipped (layer 0 and the LM head)."""

    spec = "layer-skip:skip=1"

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        """The statistical test's target with 2 layers (the default one has 1)."""
        tokenizer = make_tokenizer(num_words=5)
        target = make_model(tokenizer, seed=0, hidden_size=16, num_layers=2, init_std=0.2)
        return target, perturbed_copy(target, noise=0.08, seed=1)


class TestSearchingLayerSkipConformance(_NativeTargets, DrafterConformance):
    """A 6-layer target whose skip set changes every 2 steps while requests run."""

    spec = "layer-skip:skip_ratio=0.25,search_steps=2,search_rounds=8,confidence=0"
    ks = (1, 4)

    @pytest.fixture
    def target(self, deep_hf):
        return deep_hf

    @pytest.fixture(scope="class")
    @classmethod
    def small(cls):
        """The statistical test's target with 4 layers: the search swaps layer 2 and 1."""
        tokenizer = make_tokenizer(num_words=5)
        target = make_model(tokenizer, seed=0, hidden_size=16, num_layers=4, init_std=0.2)
        return target, perturbed_copy(target, noise=0.08, seed=1)


# ---------------------------------------------------------------- chains of several sequences


def _batch_case(target, drafter, params, prompts, ks, stop=None):
    """Each prompt's state over its own cache, the requests, and the solo proposals (made
    first, each from a fresh generator seeded by its index)."""
    from specdec.drafters.base import ChainRequest

    states, solos = [], []
    for i, prompt in enumerate(prompts):
        state = drafter.start(prompt, params)
        cache = target.new_cache(64)
        target.forward(prompt[:-1], cache)
        state.attach_cache(cache)
        states.append(state)
        solo = state.propose(prompt, ks[i], torch.Generator().manual_seed(i), stop_drafting=stop)
        solos.append(solo)
    requests = [
        ChainRequest(state, prompt, k, torch.Generator().manual_seed(i), stop)
        for i, (state, prompt, k) in enumerate(zip(states, prompts, ks, strict=True))
    ]
    return states, requests, solos


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_propose_batch_equals_each_sequence_alone(deep, params):
    """propose_batch drafts every sequence's chain in shared forwards (one per draft step):
    the proposals, their distributions and the caches equal each sequence drafting alone,
    with different lengths, a zero-length request and a confidence stop."""
    drafter = LayerSkipDrafter(deep, LayerSkipOptions(skip="2-3", confidence=0.0))
    prompts = [PROMPT, [1, 9, 4, 4, 7], [1, 20, 21, 22, 23, 24, 20, 21], [1, 3]]
    ks = [5, 3, 0, 6]
    stop = (lambda i, c: i >= 4) if params.greedy else None
    states, requests, solos = _batch_case(deep, drafter, params, prompts, ks, stop)
    before = [s.cache.kv[:, :, :, : s.cache.num_tokens].clone() for s in states]
    calls = []
    forward = drafter.draft_target.forward_batch_full
    drafter.draft_target.forward_batch_full = lambda items, **kw: (
        calls.append(len(items)) or forward(items, **kw)
    )
    try:
        batch = drafter.propose_batch(requests)
    finally:
        del drafter.draft_target.forward_batch_full
    # the longest chain's forwards: 6, or 5 where position 4's forward is stopped
    assert calls[0] == 3 and len(calls) == (5 if stop else 6)
    for solo, got, state, kv in zip(solos, batch, states, before, strict=True):
        assert got.token_ids == solo.token_ids
        assert got.confidence == solo.confidence
        if params.greedy:
            assert got.draft_probs is None
        elif solo.token_ids:
            assert torch.equal(got.draft_probs, solo.draft_probs)
        assert torch.equal(state.cache.kv[:, :, :, : state.cache.num_tokens], kv)


def test_the_engine_drafts_a_batch_of_self_drafts_together(deep):
    """Generating three prompts at once, a fixed layer-skip draft runs one draft forward
    per draft step for all of them (not one per sequence), and every output equals
    plain decoding."""
    config = SpeculativeConfig(method="layer-skip:skip=2-3,confidence=0", num_speculative_tokens=3)
    llm = LLM(deep, speculative=config)
    drafter = llm.drafter(llm.speculative)
    prompts = [PROMPT, [1, 9, 4, 4, 7], [1, 20, 21, 22, 23, 24, 20, 21]]
    batches = []
    forward = deep.forward_batch_full
    deep.forward_batch_full = lambda items, **kw: (
        batches.append((len(items), "layers" in kw)) or forward(items, **kw)
    )
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        del deep.forward_batch_full
    assert drafter.draft_target is deep
    drafts = [n for n, drafting in batches if drafting]  # (verifications pass no layers)
    assert drafts.count(3) >= 3 * 3 and set(drafts) <= {1, 2, 3}
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _plain(deep, prompt, 40).token_ids
