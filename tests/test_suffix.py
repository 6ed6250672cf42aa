"""SuffixDecoding: the suffix tree's contents on worked examples, matching and scoring,
the global cache's LRU eviction, and the drafter conformance suite."""

from __future__ import annotations

import torch
from drafter_conformance import DrafterConformance
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters.options import SuffixOptions
from specdec.drafters.suffix import (
    GlobalSuffixCache,
    SequenceIndex,
    SuffixDrafter,
    SuffixTree,
    best_match,
    greedy_path,
    ranked_children,
)
from specdec.trees.builders import make_tree_builder
from specdec.trees.spec import TreeSpec
from specdec.trees.tree import ROOT

GENERATOR = torch.Generator()


def _all_paths(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node[1].items():
            out[(*path, token)] = child[0]
            stack.append(((*path, token), child))
    return out


def test_suffix_tree_contents_after_a_given_text():
    """ "a b a b c" (1 2 1 2 3) with depth 3: every substring of <= 3 tokens, counted."""
    tree = SuffixTree(max_depth=3)
    tree.extend("s", [1, 2, 1, 2, 3])
    assert _all_paths(tree) == {
        (1,): 2, (2,): 2, (3,): 1,
        (1, 2): 2, (2, 1): 1, (2, 3): 1,
        (1, 2, 1): 1, (2, 1, 2): 1, (1, 2, 3): 1,
    }  # fmt: skip
    assert tree.num_nodes == 1 + 9
    # the nodes of the text's last suffixes: "3", "2 3", "1 2 3"
    assert [node[0] for node in tree.suffix_nodes("s")] == [1, 1, 1]


def test_inserting_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """A long prompt creates hundreds of thousands of nodes; the cyclic collector would
    walk the growing tree every 700 of them. It is paused during an insert and left as it
    was found."""
    import gc

    from specdec.drafters import suffix

    calls = []
    real = suffix.gc

    class Recorder:
        def isenabled(self):
            return real.isenabled()

        def disable(self):
            calls.append("disable")
            real.disable()

        def enable(self):
            calls.append("enable")
            real.enable()

    monkeypatch.setattr(suffix, "gc", Recorder())
    tree = SuffixTree(max_depth=4)
    tokens = list(range(50))
    tree.extend("a", tokens)
    assert calls == ["disable", "enable"] and gc.isenabled()
    calls.clear()
    gc.disable()
    try:
        tree.extend("b", tokens)
        assert calls == [] and not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
    assert tree.count([3, 4]) == 2 and tree.num_nodes == 1 + 50 + 49 + 48 + 47


def test_extending_token_by_token_equals_one_insert():
    one, many = SuffixTree(4), SuffixTree(4)
    text = [5, 6, 5, 6, 5, 7, 5, 6]
    one.extend("x", text)
    for token in text:
        many.extend("x", [token])
    assert _all_paths(one) == _all_paths(many)


@settings(max_examples=40, deadline=None)
@given(
    texts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=20), min_size=1, max_size=4),
    depth=st.integers(1, 5),
)
def test_counts_are_substring_occurrences_and_removal_undoes_insertion(texts, depth):
    tree = SuffixTree(depth)
    for i, text in enumerate(texts):
        tree.extend(i, text)
    paths = _all_paths(tree)
    for path, count in paths.items():
        n = len(path)
        expected = sum(
            1 for t in texts for s in range(len(t) - n + 1) if tuple(t[s : s + n]) == path
        )
        assert count == expected
    assert tree.num_nodes == 1 + len(paths)
    for i in range(1, len(texts)):
        tree.remove(i)
    only_first = SuffixTree(depth)
    only_first.extend(0, texts[0])
    assert _all_paths(tree) == _all_paths(only_first)
    assert tree.num_nodes == only_first.num_nodes


def test_ranked_children_are_frequency_estimates():
    tree = SuffixTree(3)
    tree.extend("s", [1, 2, 9, 1, 2, 9, 1, 3, 9, 1])  # after 1: 2 twice, 3 once
    tokens, probs = ranked_children(tree.find([1]), 4)
    assert tokens == [2, 3] and probs == [2 / 3, 1 / 3]


def test_greedy_path_stops_below_min_token_prob():
    tree = SuffixTree(6)
    tree.extend("s", [1, 2, 3, 4, 0, 1, 2, 5, 4, 0, 1, 2, 6, 4])
    node = tree.find([1])  # after 1: 2 (3 times); after 1 2: 3, 5, 6 once each
    assert greedy_path(node, 5, 0.5) == ([2], 1.0)  # 2 then 1/3 < 0.5
    tokens, score = greedy_path(node, 5, 0.3)
    assert tokens == [2, 3, 4, 0, 1] and abs(score - (1 + 4 / 3)) < 1e-12


def test_draft_length_is_capped_by_the_match_length():
    """α = max_spec_factor: a match of p tokens drafts at most α·p tokens."""
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2]  # the suffix "1 2" matches
    for factor, expected in [(1.0, [3, 4]), (2.0, [3, 4, 5, 6]), (0.5, [3])]:
        drafter = SuffixDrafter(SuffixOptions(max_spec_factor=factor, global_cache=False))
        state = drafter.start(text, SamplingParams())
        assert state.propose(text, 10, GENERATOR).token_ids == expected


def test_a_sequence_indexes_its_tokens_when_it_first_drafts():
    """The prompt goes into the sequence's index at its first match, not at start; the
    index then counts every committed token's substrings as a suffix tree built token by
    token does."""
    prompt = [5, 6, 7, 5, 6, 8, 5, 6]
    state = SuffixDrafter(SuffixOptions(global_cache=False)).start(prompt, SamplingParams())
    assert state.tree.tokens == []  # nothing indexed yet
    tokens = [*prompt, 7, 5]
    assert state.propose(tokens, 4, GENERATOR).token_ids[0] == 6  # "7 5" went on with 6
    eager = SuffixTree(SuffixOptions().max_depth)
    eager.extend("self", tokens)
    assert state.tree.tokens == state.tokens == tokens
    assert state.tree.count([5, 6]) == eager.count([5, 6]) == 3
    more = [*tokens, 6, 7]
    state.propose(more, 4, GENERATOR)
    eager.extend("self", [6, 7])
    assert state.tree.count([6, 7]) == eager.count([6, 7]) == 3
    for path in _all_paths(eager):
        assert state.tree.count(path) == eager.count(path)


def _trie_reference(tokens, max_tokens, options):
    """What the drafter proposed when each sequence kept a SuffixTree of its own: the best
    match over the trie's suffix nodes, then the greedy path from it."""
    trie = SuffixTree(options.max_depth)
    trie.extend("self", tokens)
    candidates = [(node, i + 1) for i, node in enumerate(trie.suffix_nodes("self"))]
    found = best_match(candidates, max_tokens, options)
    if found is None:
        return [], None
    return greedy_path(found.node, found.limit, options.min_token_prob)[0], found


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    depth=st.integers(2, 7),
    factor=st.sampled_from([0.5, 1.0, 3.0]),
    min_prob=st.sampled_from([0.0, 0.2, 0.5]),
)
def test_the_sequence_index_counts_and_drafts_as_a_suffix_tree(text, depth, factor, min_prob):
    """Oracle: a sequence's index (:class:`SequenceIndex`) against the suffix tree it
    replaced, on small alphabets (many repeats). Every substring's count, each suffix
    node's continuations where the trie has any, and, at every prefix of the text, the
    chain proposed and the tree session's expansions are the trie's."""
    options = SuffixOptions(
        max_depth=depth, max_spec_factor=factor, min_token_prob=min_prob, global_cache=False
    )
    index, trie = SequenceIndex(depth), SuffixTree(depth)
    index.extend(text)
    trie.extend("self", text)
    for path, count in _all_paths(trie).items():
        assert index.count(path) == count
    nodes, trie_nodes = index.suffix_nodes(), trie.suffix_nodes("self")
    for i, node in enumerate(trie_nodes):
        if i < len(nodes):
            assert nodes[i].depth == i + 1 and nodes[i][0] == node[0]
            assert ranked_children(nodes[i], 99) == ranked_children(node, 99)
        else:  # past the first suffix that occurs once: no continuation in the trie
            assert node[0] == 1 and not node[1]
    drafter = SuffixDrafter(options)
    state = drafter.start(text[:1], SamplingParams())
    for end in range(1, len(text) + 1):
        prefix = text[:end]
        expected, found = _trie_reference(prefix, 5, options)
        assert state.propose(prefix, 5, GENERATOR).token_ids == expected
        session = state.tree_session(prefix, SamplingParams())
        _, found = _trie_reference(prefix, depth, options)  # a session matches up to depth
        if found is None:
            assert session.found is None
            continue
        assert session.found.length == found.length and session.found.limit == found.limit
        got = session.expand([ROOT], 3)[0]
        want = ranked_children(found.node, 3)
        keep = [i for i, p in enumerate(want[1]) if p >= min_prob]
        assert (got.tokens, got.scores) == ([want[0][i] for i in keep], [want[1][i] for i in keep])


def test_a_long_prompt_is_indexed_without_a_node_per_substring():
    """A 6,000-token prompt: the index holds the tokens and their positions, not the
    144,000 trie nodes of its substrings; the first draft still finds the prompt's
    repeat."""
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(6000)]
    prompt[3000:3010] = prompt[100:110]  # a repeat inside the prompt
    state = SuffixDrafter(SuffixOptions(global_cache=False)).start(prompt, SamplingParams())
    context = [*prompt, *prompt[100:105]]
    assert state.propose(context, 4, GENERATOR).token_ids == prompt[105:109]
    assert len(state.tree.tokens) == len(context) and state.tree.count(prompt[100:110]) == 2


def test_global_cache_drafts_from_earlier_outputs_and_evicts_lru():
    drafter = SuffixDrafter(SuffixOptions(max_cached_requests=2))
    prompt = [1, 2]
    # a finished request whose output was "7 8 9 10 11"
    state = drafter.start(prompt, SamplingParams())
    state.propose([*prompt, 7, 8, 9, 10, 11], 4, GENERATOR)
    state.close()
    assert len(drafter.cache) == 1 and drafter.cache.tree.count([7, 8, 9]) == 1
    # a new request that has just produced "7 8": the global tree continues it
    fresh = drafter.start([3, 4], SamplingParams())
    assert fresh.propose([3, 4, 7, 8], 3, GENERATOR).token_ids == [9, 10]  # α·p = 2
    fresh.close()
    # without the global cache nothing is known
    alone = SuffixDrafter(SuffixOptions(global_cache=False)).start([3, 4], SamplingParams())
    assert alone.propose([3, 4, 7, 8], 3, GENERATOR).token_ids == []
    cache = GlobalSuffixCache(max_depth=4, max_requests=2)
    for output in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.add(output)
    assert len(cache) == 2
    assert cache.tree.count([1, 2]) == 0 and cache.tree.count([7, 8]) == 1


def test_tree_session_offers_frequent_continuations():
    text = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    state = SuffixDrafter(SuffixOptions(global_cache=False, min_token_prob=0.2)).start(
        text, SamplingParams()
    )
    builder = make_tree_builder(TreeSpec.parse("dynamic:top_k=2,depth=3,budget=6"))
    session = state.tree_session(text, SamplingParams())
    tree = builder.build(session, 3, False, GENERATOR).tree
    # the longest match "9 1 2" (p = 3, so 3 tokens deep): 3 (2/3) or 4 (1/3), then 9 1
    paths = {tuple(tree.token_ids[n] for n in path) for path in tree.paths()}
    assert paths == {(3, 9, 1), (4, 9, 1)}
    assert tree.parents[0] == ROOT


def test_suffix_with_the_global_cache_accepts_more_on_repeated_requests(target):
    llm = LLM(target, speculative=SpeculativeConfig(method="suffix", num_speculative_tokens=8))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = [1, 9, 4, 17]
    first = llm.generate(prompt, params)
    second = llm.generate(prompt, params)
    assert second.token_ids == first.token_ids
    assert second.metrics.num_accepted_tokens > first.metrics.num_accepted_tokens


class TestSuffixConformance(DrafterConformance):
    spec = "suffix"


class TestSuffixWithoutGlobalCacheConformance(DrafterConformance):
    spec = "suffix:global_cache=false,max_depth=8,max_spec_factor=2.0"
    trees = ("dynamic:top_k=2,depth=4,budget=8",)
