"""Token trees end to end: greedy equivalence for every builder, chain tree == chain,
cursor rule, budgets and stops, sampled output law, builders, Sequoia and spec parsing."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from test_engine import PROMPTS, hf_greedy
from test_statistical import PARAMS, chi_square_pvalue, empirical_joint, exact_joint

from conftest import perturbed_copy
from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.drafters import DraftModelDrafter
from specdec.engine.generate import generate_steps
from specdec.engine.stops import StopChecker
from specdec.models.hf import HFModel
from specdec.sampling import make_generator
from specdec.trees import ROOT
from specdec.trees.builders import (
    BestFirstTreeBuilder,
    Calibration,
    DynamicTreeBuilder,
    Expansion,
    SequoiaTreeBuilder,
    adaptive_size,
    make_tree_builder,
)
from specdec.trees.sequoia import RankAcceptance, sequoia_tree, tree_value
from specdec.trees.spec import TreeSpec

TREES = [
    "static:tree-8",
    "static:tree-16",
    "static:chain-3",
    "dynamic:top_k=3,depth=4,budget=10",
    "dynamic:top_k=2,depth=6,budget=5",
    "best-first:budget=12,depth=5",
    "sequoia:budget=12,depth=5",
    "dynamic:top_k=3,depth=4,budget=10,adaptive=true",
    "best-first:budget=12,depth=5,adaptive=true",
]
DRAFTS = [("ngram", None), ("draft-model", "near_draft"), ("draft-model", "padded_draft")]


def _greedy(n, **kwargs):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("method, draft_name", DRAFTS, ids=["ngram", "near", "padded"])
@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["p0", "p1"])
def test_greedy_tree_decoding_equals_plain(request, target, prompt, method, draft_name, tree):
    draft = request.getfixturevalue(draft_name) if draft_name else None
    llm = LLM(target, draft=draft, speculative=SpeculativeConfig(method=method, tree=tree))
    out = llm.generate(prompt, _greedy(30))
    assert out.token_ids == hf_greedy(target, prompt, 30)
    m = out.metrics
    assert m.num_output_tokens == 30 and m.num_accepted_tokens + m.num_steps == 30
    assert sum(m.accepted_length_counts) == m.num_steps


def test_trees_accept_more_than_chains_with_a_close_draft(target):
    """With a near-copy draft, a tree at the same depth accepts at least as much."""
    draft = perturbed_copy(target, noise=0.05, seed=9)
    lengths = {}
    for tree in ["static:chain-4", "dynamic:top_k=4,depth=4,budget=16"]:
        llm = LLM(target, draft=draft, speculative=SpeculativeConfig("draft-model", tree=tree))
        total = [llm.generate(p, _greedy(40)).metrics for p in PROMPTS]
        lengths[tree] = sum(m.num_output_tokens for m in total) / sum(m.num_steps for m in total)
    assert lengths["dynamic:top_k=4,depth=4,budget=16"] > lengths["static:chain-4"]


@pytest.mark.parametrize("method, draft_name", [("ngram", None), ("draft-model", "near_draft")])
def test_chain_tree_equals_chain_decoding(request, target, method, draft_name):
    """A chain-shaped tree is chain speculation: same tokens, steps and acceptance."""
    draft = request.getfixturevalue(draft_name) if draft_name else None
    for prompt in PROMPTS:
        chain = LLM(
            target, draft=draft, speculative=SpeculativeConfig(method, num_speculative_tokens=4)
        )
        tree = LLM(
            target, draft=draft, speculative=SpeculativeConfig(method, tree="static:chain-4")
        )
        if method == "ngram":  # chain ngram copies the earliest match; the tree ranks by count
            prompt = [1, 5, 6, 7, 8, 9, 10, 5, 6]  # a single earlier occurrence
        a, b = chain.generate(prompt, _greedy(30)), tree.generate(prompt, _greedy(30))
        assert a.token_ids == b.token_ids
        ma, mb = a.metrics, b.metrics
        assert (ma.num_steps, ma.num_accepted_tokens, ma.accepted_length_counts) == (
            mb.num_steps,
            mb.num_accepted_tokens,
            mb.accepted_length_counts,
        )


class RecordingModel(HFModel):
    def __init__(self, base: HFModel):
        super().__init__(base.model, base.tokenizer, base.name)
        self.calls: list[tuple[int, int]] = []

    def forward(self, token_ids, cache, num_logits=0, positions=None, tree_mask=None):
        self.calls.append((cache.num_tokens, len(token_ids)))
        return super().forward(token_ids, cache, num_logits, positions, tree_mask)


def test_cursor_rule_after_every_tree_step(target, near_draft):
    recording = RecordingModel(target)
    drafter = DraftModelDrafter(near_draft, target.vocab_size, len(target.tokenizer))
    prompt = PROMPTS[1]
    steps = generate_steps(
        recording,
        drafter,
        prompt,
        _greedy(30),
        0,
        StopChecker([]),
        make_generator(0),
        make_tree_builder("static:tree-16"),
    )
    lengths = [len(prompt)]
    for step in steps:
        lengths.append(lengths[-1] + len(step.new_token_ids))
    _, *step_calls = recording.calls
    assert [start for start, _ in step_calls] == [n - 1 for n in lengths[:-1]]
    assert max(n for _, n in step_calls) > 5  # trees were actually verified


@pytest.mark.parametrize("budget", [1, 2, 3, 7])
def test_tree_depth_capped_by_remaining_budget(target, near_draft, budget):
    llm = LLM(
        target,
        draft=near_draft,
        speculative=SpeculativeConfig("draft-model", tree="static:chain-8"),
    )
    for prompt in PROMPTS:
        out = llm.generate(prompt, _greedy(budget))
        assert out.token_ids == hf_greedy(target, prompt, budget)
        assert out.finish_reason == "length"


def test_stop_token_inside_accepted_tree_path(target, near_draft):
    truth = hf_greedy(target, PROMPTS[1], 30)
    stop = truth[7]
    llm = LLM(
        target,
        draft=near_draft,
        speculative=SpeculativeConfig("draft-model", tree="static:tree-16"),
    )
    out = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=30, stop_token_ids=[stop]))
    assert out.token_ids == truth[: truth.index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("tree", ["static:tree-16", "dynamic:top_k=3,depth=4,budget=10"])
def test_same_seed_same_sampled_output(target, near_draft, tree):
    llm = LLM(target, draft=near_draft, speculative=SpeculativeConfig("draft-model", tree=tree))
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=25)
    assert llm.generate(PROMPTS[1], params).token_ids == llm.generate(PROMPTS[1], params).token_ids


# ---------------------------------------------------------------- statistical end to end


STAT_CASES = [
    ("draft-model", "static:tree-8"),
    ("draft-model", "static:tree-8,draw=iid"),
    ("draft-model", "static:tree-8,draw=wor"),
    ("draft-model", "dynamic:top_k=3,depth=3,budget=8"),
    ("draft-model", "dynamic:top_k=3,depth=3,budget=8,adaptive=true"),
    ("ngram", "static:tree-8"),
]


@pytest.mark.parametrize("method, tree", STAT_CASES)
def test_sampled_tree_speculation_matches_target_distribution(small, method, tree):
    target, draft = small
    llm = LLM(target, draft=draft, speculative=SpeculativeConfig(method, tree=tree))
    joint = exact_joint(target, SamplingParams(**PARAMS))
    counts = empirical_joint(llm, PARAMS, 1200, 3)
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_lossy_tree_rule_is_detected(small, monkeypatch):
    """Planted bug: after a rejected child, keep sampling from the target instead of the
    residual (the tree version of the classic bug). The same test must catch it."""
    import specdec.verify.tree as tree_module

    def forgetful_reject(self, i):
        pass  # the residual stays the full target distribution

    monkeypatch.setattr(tree_module.SiblingRejection, "reject", forgetful_reject)
    target, draft = small
    llm = LLM(
        target, draft=draft, speculative=SpeculativeConfig("draft-model", tree="static:tree-8")
    )
    joint = exact_joint(target, SamplingParams(**PARAMS))
    counts = empirical_joint(llm, PARAMS, 1200, 3)
    assert chi_square_pvalue(counts, joint) < 1e-3


# ---------------------------------------------------------------- builders


class FakeSession:
    """Candidates from a fixed table: node context -> ranked (token, prob)."""

    def __init__(self, table, default=()):
        self.table, self.default = table, default
        self.paths: list[tuple] = []
        self.expanded: list[int] = []

    def add(self, parent, token):
        self.paths.append((() if parent == ROOT else self.paths[parent]) + (token,))
        return len(self.paths) - 1

    def expand(self, nodes, width):
        self.expanded.extend(nodes)
        out = []
        for node in nodes:
            ranked = self.table.get(() if node == ROOT else self.paths[node], self.default)
            ranked = list(ranked)[:width]
            out.append(Expansion([t for t, _ in ranked], [p for _, p in ranked]))
        return out

    def close(self):
        pass


def _spelled(tree):
    return {tuple(tree.token_ids[n] for n in tree.path_to(i)) for i in range(len(tree))}


def test_static_builder_follows_ranks_and_skips_missing_candidates():
    table = {(): [(10, 0.6), (11, 0.3)], (10,): [(12, 0.9)], (11,): []}
    builder = make_tree_builder("static:tree-8")
    proposal = builder.build(FakeSession(table), 5, False, make_generator(0))
    assert _spelled(proposal.tree) == {(10,), (11,), (10, 12)}
    assert proposal.candidates[ROOT] == [10, 11]
    shallow = builder.build(FakeSession(table), 1, False, make_generator(0))
    assert shallow.tree.max_depth == 1


def _uniform_table(probs, depth):
    """Every context offers tokens 0..len(probs)-1 with the given probabilities."""
    ranked = list(enumerate(probs))
    return {
        ctx: ranked
        for d in range(depth + 1)
        for ctx in itertools.product(range(len(probs)), repeat=d)
    }


def test_dynamic_builder_keeps_best_nodes_and_their_ancestors():
    table = _uniform_table([0.5, 0.3, 0.2], 4)
    proposal = DynamicTreeBuilder(top_k=2, depth=3, budget=6).build(
        FakeSession(table), 3, False, make_generator(0)
    )
    tree = proposal.tree
    assert len(tree) == 6
    spelled = _spelled(tree)
    assert all(path[:-1] in spelled or len(path) == 1 for path in spelled)
    score = {p: math.prod([0.5, 0.3, 0.2][t] for t in p) for p in spelled}
    # EAGLE-2 expands only the top-2 nodes per level, so compare with those candidates:
    candidates = {
        (0,),
        (1,),
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    }
    best = sorted((math.prod([0.5, 0.3, 0.2][t] for t in p) for p in candidates), reverse=True)[:6]
    assert sorted(score.values(), reverse=True) == pytest.approx(best)


def test_best_first_builder_returns_the_most_probable_paths():
    per_position = [[(5, 0.6), (6, 0.3), (7, 0.1)], [(8, 0.5), (9, 0.5)], [(1, 0.9), (2, 0.1)]]

    class ChainSession(FakeSession):
        def expand(self, nodes, width):
            (node,) = nodes
            depth = 0 if node == ROOT else len(self.paths[node])
            ranked = per_position[depth] if depth < len(per_position) else []
            return [Expansion([t for t, _ in ranked], [p for _, p in ranked])]

    budget = 7
    tree = BestFirstTreeBuilder(budget, 3).build(ChainSession({}), 3, False, make_generator(0)).tree
    # brute force: every prefix path scored by the product of per-position probabilities
    every = {}
    for d in range(1, 4):
        for choice in itertools.product(*[range(len(per_position[i])) for i in range(d)]):
            path = tuple(per_position[i][r][0] for i, r in enumerate(choice))
            every[path] = math.prod(per_position[i][r][1] for i, r in enumerate(choice))
    got = sorted((every[p] for p in _spelled(tree)), reverse=True)
    assert len(tree) == budget
    assert got == pytest.approx(sorted(every.values(), reverse=True)[:budget])


def test_adaptive_size_maximizes_expected_tokens_per_unit_of_time():
    probs = [0.9, 0.5, 0.3, 0.1, 0.05]

    def brute(cost, factor=1.0):
        rates = [(1 + factor * sum(probs[:n])) / cost(n) for n in range(1, len(probs) + 1)]
        return 1 + max(range(len(rates)), key=rates.__getitem__)

    for cost in (
        lambda n: 1.0,  # free rows: every node
        lambda n: 1 + 0.1 * n,
        lambda n: 1 + 0.3 * n,
        lambda n: 1 + 2.0 * n,  # dear rows: only the first (at least one)
        lambda n: 1 + 0.05 * n * n,
    ):
        for factor in (0.2, 1.0, 2.0):
            assert adaptive_size(probs, cost, factor) == brute(cost, factor)
    assert adaptive_size(probs, lambda n: 1.0) == 5
    assert adaptive_size(probs, lambda n: 1 + 2.0 * n) == 1
    assert adaptive_size(probs, lambda n: 1 + 0.1 * n) == 3  # 1.8/1.2 > 2.1/1.3 > 1.7/1.1
    assert adaptive_size([], lambda n: 1.0) == 0
    # a calibration that shrinks the probabilities keeps fewer nodes at the same cost
    assert adaptive_size(probs, lambda n: 1 + 0.1 * n, 0.2) == 1


def test_calibration_follows_accepted_over_expected():
    cal = Calibration(decay=0.9, prior=1.0)
    assert cal.factor == 1.0
    for _ in range(60):
        cal.observe(expected=2.0, accepted=1)  # the draft overstates by 2x
    assert cal.factor == pytest.approx(0.5, abs=0.01)
    for _ in range(200):
        cal.observe(expected=1.0, accepted=0)
    assert cal.factor == Calibration.low  # clipped: a step always verifies one node


@pytest.mark.parametrize("kind", ["dynamic", "best-first"])
def test_adaptive_builders_keep_the_nodes_that_pay_and_learn_their_calibration(kind):
    table = _uniform_table([0.5, 0.3, 0.2], 4)
    spec = f"{kind}:budget=6,depth=3" + (",top_k=2" if kind == "dynamic" else "")
    fixed = make_tree_builder(spec)
    adaptive = make_tree_builder(spec + ",adaptive=true")
    assert adaptive.uses_row_cost and not fixed.uses_row_cost

    def build(builder, **kwargs):
        return builder.build(FakeSession(table), 3, False, make_generator(0), **kwargs)

    whole = build(fixed)
    assert len(whole.tree) == 6 and whole.expected is None
    # no cost known: the whole budget, the same tree
    assert _spelled(build(adaptive, row_cost=None).tree) == _spelled(whole.tree)
    free = build(adaptive, row_cost=lambda n: 1.0)
    assert _spelled(free.tree) == _spelled(whole.tree)
    dear = build(adaptive, row_cost=lambda n: 1 + 0.2 * n)
    spelled = _spelled(dear.tree)
    assert 1 <= len(dear.tree) < 6 and spelled <= _spelled(whole.tree)
    assert all(len(p) == 1 or p[:-1] in spelled for p in spelled)  # still a tree
    # the kept nodes are the most probable ones, and their probabilities are reported
    kept = sorted((math.prod([0.5, 0.3, 0.2][t] for t in p) for p in spelled), reverse=True)
    every = sorted(
        (math.prod([0.5, 0.3, 0.2][t] for t in p) for p in _spelled(whole.tree)), reverse=True
    )
    assert kept == pytest.approx(every[: len(kept)])
    assert dear.expected == pytest.approx(sum(kept))
    # a drafter accepted less often than its probabilities say verifies fewer nodes
    for _ in range(100):
        adaptive.observe(dear, [], [0])
    assert adaptive.calibration.factor < 0.1
    assert len(build(adaptive, row_cost=lambda n: 1 + 0.2 * n).tree) < len(dear.tree)
    fixed.observe(whole, [], [0])  # a fixed builder learns nothing


def test_an_adaptive_dynamic_tree_stops_drafting_levels_no_node_of_which_would_be_kept():
    table = _uniform_table([0.5, 0.3, 0.2], 4)
    spec = "dynamic:top_k=2,depth=4,budget=8,adaptive=true"

    def levels(row_cost):
        session = FakeSession(table)
        tree = make_tree_builder(spec).build(session, 4, False, make_generator(0), row_cost)
        return session, tree.tree

    free_session, free_tree = levels(lambda n: 1.0)
    assert len(free_session.expanded) == 1 + 2 + 2 + 2  # every level drafted
    dear_session, dear_tree = levels(lambda n: 1 + 0.4 * n)
    assert len(dear_session.expanded) < len(free_session.expanded)
    # the same tree as drafting every level and then choosing (no kept node was lost)
    session = FakeSession(table)
    whole = make_tree_builder(spec.replace(",adaptive=true", "")).build(
        session, 4, False, make_generator(0)
    )
    probs = sorted(math.prod([0.5, 0.3, 0.2][t] for t in p) for p in _spelled(whole.tree))[::-1]
    n = adaptive_size(probs, lambda n: 1 + 0.4 * n)
    assert len(dear_tree) == n


def test_adaptive_trees_follow_the_cost_model_in_the_engine(target, near_draft):
    """Dear rows (a cost model whose forward time grows steeply with rows) keep small
    trees; free rows keep the whole budget; both give plain decoding's output."""
    from specdec.control.cost import CostModel, CostPrior

    prompt = PROMPTS[0]
    sizes = {}
    for token_cost in (0.0, 1.0):
        spec = SpeculativeConfig(
            "draft-model", tree="dynamic:top_k=3,depth=3,budget=10,adaptive=true"
        )
        llm = LLM(target, draft=near_draft, speculative=spec)
        llm.cost_model = CostModel(CostPrior(token_cost=token_cost), frozen=True)
        out = llm.generate(prompt, _greedy(24))
        assert out.token_ids == hf_greedy(target, prompt, 24)
        m = out.metrics
        sizes[token_cost] = m.num_draft_tokens / m.num_steps
    assert sizes[0.0] > 8 and sizes[1.0] < 3


# ---------------------------------------------------------------- Sequoia


def _all_trees(max_nodes, ranks, depth):
    """Every rank-path tree (contiguous ranks) with <= max_nodes nodes, by brute force."""
    candidates = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    for n in range(max_nodes + 1):
        for subset in itertools.combinations(candidates, n):
            chosen = set(subset)
            ok = all(
                (len(p) == 1 or p[:-1] in chosen)
                and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in chosen)
                for p in chosen
            )
            if ok:
                yield list(subset)


@pytest.mark.parametrize("acceptance", [[0.6, 0.2, 0.1], [0.9, 0.05, 0.04], [0.3, 0.3, 0.3]])
@pytest.mark.parametrize("budget, depth", [(3, 3), (5, 3), (6, 2)])
def test_sequoia_dp_is_optimal(acceptance, budget, depth):
    value, paths = sequoia_tree(acceptance, budget, depth)
    assert len(paths) <= budget and max(len(p) for p in paths) <= depth
    assert value == pytest.approx(tree_value(acceptance, paths))
    best = max(tree_value(acceptance, t) for t in _all_trees(budget, len(acceptance), depth))
    assert value == pytest.approx(best)


def test_sequoia_shapes_follow_the_measurements():
    _, deep = sequoia_tree([0.95, 0.01], 6, 8)
    _, wide = sequoia_tree([0.3, 0.25, 0.2, 0.15], 6, 8)
    assert max(map(len, deep)) == 6  # a confident drafter gets a chain
    assert max(map(len, wide)) < 4  # an unsure one gets a bushy tree
    with pytest.raises(ValueError, match="probabilities"):
        sequoia_tree([1.5], 3, 3)


def test_sequoia_builder_learns_rank_acceptance():
    builder = SequoiaTreeBuilder(budget=6, depth=6)
    table = _uniform_table([0.5, 0.3, 0.2], 6)
    first_shape = list(builder.shape)
    for _ in range(200):  # the target always picks the rank-0 candidate
        proposal = builder.build(FakeSession(table), 6, False, make_generator(0))
        chain = [n for n in proposal.tree.paths()[0]]
        builder.observe(proposal, chain, [0] * (len(chain) + 1))
    assert builder.stats.estimate()[0] > 0.9
    assert builder.shape != first_shape and max(map(len, builder.shape)) == 6


def test_rank_acceptance_smoothing():
    stats = RankAcceptance(num_ranks=2, prior=[0.5, 0.25], prior_weight=4)
    assert stats.estimate() == [0.5, 0.25]
    for rank in [0, 0, 1, None]:
        stats.observe(rank)
    assert stats.estimate() == pytest.approx([(2 + 2) / 8, (1 + 1) / 8])


# ---------------------------------------------------------------- spec and config


def test_spec_parsing_round_trips(tmp_path):
    for text in [
        "static:tree-16",
        "static:chain-3,draw=wor",
        "dynamic:top_k=4,depth=5,budget=16",
        "best-first:budget=9,depth=4",
        "sequoia:budget=20,depth=7",
        "dynamic:top_k=4,depth=5,budget=16,adaptive=true",
        "best-first:budget=9,depth=4,adaptive=true",
    ]:
        assert str(TreeSpec.parse(text)) == text
    assert not TreeSpec.parse("dynamic:top_k=2,adaptive=false").adaptive
    # bare presets and kinds, as a request or --tree may name them
    assert TreeSpec.parse("tree-16") == TreeSpec.parse("static:tree-16")
    assert TreeSpec.parse(" chain-4") == TreeSpec.parse("static:chain-4")
    assert TreeSpec.parse("dynamic") == TreeSpec.parse("dynamic:")
    assert TreeSpec.parse("best-first").kind == "best-first"
    paths = tmp_path / "paths.json"
    paths.write_text(json.dumps([[0], [1], [0, 0]]))
    spec = TreeSpec.parse(f"static:{paths}")
    assert spec.paths == ((0,), (1,), (0, 0)) and spec.num_nodes == 3


def test_names_a_file_tells_paths_files_from_presets_without_opening_them():
    from specdec.trees.spec import names_a_file

    for text in (
        "static:tree-16",
        "static:chain-4,draw=iid",
        "dynamic:top_k=2",
        "sequoia:",
        "tree-16",
        "chain-4",
        "paths.json",
    ):
        assert not names_a_file(text)
    for text in ("static:/etc/passwd", "static: paths.json ,draw=top", "static:chain-x"):
        assert names_a_file(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("dynmic", "KIND:OPTIONS"),
        ("static", "KIND:OPTIONS"),  # a static tree names its preset or file
        ("paths.json", "KIND:OPTIONS"),  # never read as a file without static:
        ("bushy:budget=3", "unknown tree kind"),
        ("dynamic:width=3", "unknown option"),
        ("dynamic:budget=0", "integer >= 1"),
        ("dynamic:budget=x", "integer >= 1"),
        ("static:", "preset"),
        ("static:no-such-file.json", "neither a preset"),
        ("static:tree-8,draw=maybe", "draw must be"),
        ("sequoia:budget=5000", "at most"),
        ("dynamic:top_k=100000", "top_k is at most"),
        ("dynamic:top_k=4,top_k=5", "given twice"),
        ("sequoia:budget=500", "sequoia tree has at most"),
        ("best-first:depth=1000", "levels deep"),
        ("dynamic:adaptive=yes", "adaptive must be true or false"),
        ("sequoia:budget=8,adaptive=true", "unknown option"),
        ("static:tree-8,adaptive=true", "unknown option"),
    ],
)
def test_bad_tree_specs_raise(text, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec.parse(text)


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "JSON"),
        ("[]", "non-empty"),
        ("[[0], [0, -1]]", "ranks >= 0"),
        ("[[0], [0]]", "duplicate"),
        ("[[0, 0]]", "no parent"),
    ],
)
def test_bad_paths_files_raise(tmp_path, content, message):
    path = tmp_path / "paths.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        TreeSpec.parse(f"static:{path}")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="bogus"), "unknown tree kind"),
        (dict(kind="dynamic", top_k=0), "integer >= 1"),
        (dict(kind="best-first", depth=-3), "integer >= 1"),
        (dict(kind="dynamic", budget=100000), "at most"),
        (dict(kind="static"), "non-empty"),
        (dict(kind="static", paths=((0, 0),)), "no parent"),
        (dict(kind="static", paths=((0,),), draw="x"), "draw must be"),
        (dict(kind="dynamic", paths=((0,),)), "only used by static"),
        (dict(kind="dynamic", adaptive=1), "adaptive must be true or false"),
        (dict(kind="sequoia", adaptive=True), "not sequoia trees"),
    ],
)
def test_tree_spec_objects_validate_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TreeSpec(**kwargs)


def test_tree_spec_object_with_list_paths_works(target):
    from specdec.trees import TreeSpec as Exported

    spec = Exported(kind="static", paths=[[0], [1], [0, 0]])
    assert spec.paths == ((0,), (1,), (0, 0)) and hash(spec)
    llm = LLM(target, speculative=SpeculativeConfig("ngram", tree=spec))
    assert llm.generate(PROMPTS[0], _greedy(8)).token_ids == hf_greedy(target, PROMPTS[0], 8)


def test_paths_file_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        TreeSpec.parse(f"static:{tmp_path}")


def test_config_refuses_impossible_tree_combinations():
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeConfig(method="none", tree="static:tree-8")
    with pytest.raises(ValueError, match="draw=iid"):
        SpeculativeConfig(method="ngram", tree="static:tree-8,draw=iid")
    config = SpeculativeConfig(method="ngram", tree="static:tree-8")
    assert isinstance(config.tree, TreeSpec) and hash(config)


def test_ngram_tree_merges_several_continuations():
    from specdec.drafters.ngram import NgramTreeSession

    # "a b" is followed by c twice and by d once; after "a b c", e follows.
    a, b, c, d, e = 3, 4, 5, 6, 7
    seq = [a, b, c, e, a, b, d, a, b, c, e, a, b]
    session = NgramTreeSession(seq, 2, 2)
    proposal = make_tree_builder("static:tree-8").build(session, 4, False, make_generator(0))
    spelled = _spelled(proposal.tree)
    assert {(c,), (d,), (c, e)} <= spelled
    assert proposal.tree.token_ids[0] == c  # the more frequent continuation ranks first
    assert np.isclose(sum(session.expand([ROOT], 8)[0].scores), 1.0)


@pytest.mark.parametrize("tree", TREES)
def test_cache_is_sized_for_the_largest_tree_and_never_grows(target, near_draft, tree):
    """The target cache holds prompt + max_new_tokens + the builder's node limit, every
    tree respects that limit, and the native cache is allocated once."""
    from specdec.models.native import NativeModel

    native = NativeModel(target, exact=False)
    llm = LLM(native, draft=near_draft, speculative=SpeculativeConfig("draft-model", tree=tree))
    builder = llm.tree_builder(llm.speculative, seed=None)
    caches, sizes = [], []
    new_cache, build = native.new_cache, type(builder).build

    def recording(capacity=256):
        cache = new_cache(capacity)
        caches.append((capacity, cache.capacity, cache))
        return cache

    def checked_build(self, *args, **kwargs):
        proposal = build(self, *args, **kwargs)
        sizes.append(len(proposal.tree))
        return proposal

    native.new_cache = recording
    type(builder).build = checked_build
    try:
        llm.generate(PROMPTS[0], _greedy(12))
    finally:
        type(builder).build = build
    ((requested, allocated, cache),) = caches
    assert requested == len(PROMPTS[0]) + 12 + builder.max_nodes
    assert cache.capacity == allocated >= requested  # never grew
    assert sizes and max(sizes) <= builder.max_nodes
