"""Tree builders: decide which draft tokens form the step's token tree.

A builder talks to a drafter through a :class:`TreeSession` (one per step): ``expand``
asks the drafter for its ranked next-token candidates at some nodes (a draft model runs
one forward over them with tree attention; the n-gram drafter searches the text), ``add``
puts a token below a node. The builder returns a :class:`TreeProposal`: the
:class:`~specdec.trees.TokenTree` to verify plus the candidates it saw (Sequoia learns
its per-rank acceptance from them).

Builders:

* :class:`StaticTreeBuilder` -- a fixed shape given as rank paths (Medusa, Cai et al.
  2024, §2.1.2 "tree attention" choices; EAGLE-1 trees), children either the draft's
  top-ranked tokens or sampled (SpecInfer i.i.d., RSD without replacement).
* :class:`DynamicTreeBuilder` -- EAGLE-2 (Li et al. 2024, arXiv:2406.16858, §4): expand
  the ``top_k`` frontier nodes with the highest cumulative draft probability, ``top_k``
  children each, for ``depth`` levels; then keep the ``budget`` best nodes overall.
* :class:`BestFirstTreeBuilder` -- DDTree-style best-first search over per-position
  draft distributions: the ``budget`` most probable paths when each position's token is
  scored by that position's distribution alone (one drafter chain, no per-branch calls).
* :class:`SequoiaTreeBuilder` -- Sequoia (Chen et al. 2024, arXiv:2402.12374): the
  optimal static shape for the budget under the drafter's measured per-rank acceptance,
  re-solved as the measurements accumulate.

With ``adaptive=true`` the dynamic and best-first builders verify only as many of their
ranked nodes as pay for their rows this step (:func:`adaptive_size`; OPT-Tree, Wang et al.
2024, arXiv:2406.17276, which grows the tree while the expected acceptance length gained
outweighs the verification time added): ``budget`` becomes the most nodes a step may
verify, and where verification is compute-bound (a CPU, where each verified row costs
about a twentieth of a step) a tree shrinks to its confident nodes.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdec.trees.sequoia import RankAcceptance, sequoia_tree
from specdec.trees.spec import TreeSpec
from specdec.trees.tree import ROOT, TokenTree

#: Candidates requested per expanded node at least (Sequoia tracks this many ranks).
NUM_RANKS = 8


@dataclass
class Expansion:
    """A drafter's next-token candidates at one node.

    Attributes:
        tokens: up to ``width`` candidate ids, most probable first (distinct).
        scores: their draft probabilities (in (0, 1]; for n-grams, match frequencies).
        dist: ``[V]`` float32 draft distribution children would be sampled from (draft
            models at temperature > 0), else ``None``.
    """

    tokens: list[int]
    scores: list[float]
    dist: torch.Tensor | None = None


class TreeSession(Protocol):
    """One step's conversation between a builder and a drafter (root = pending token)."""

    def add(self, parent: int, token: int) -> int:
        """Register ``token`` as a child of ``parent`` (``ROOT`` or an added node); its id."""

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        """Candidates after each node's root path (every node already added, or ``ROOT``)."""

    def close(self) -> None:
        """Release per-step state (e.g. roll a draft model's cache back)."""


@dataclass
class TreeProposal:
    """The tree to verify and, per tree node (``ROOT`` included), the ranked candidates
    the drafter offered there (only nodes that were expanded)."""

    tree: TokenTree
    candidates: dict[int, list[int]] = field(default_factory=dict)
    #: adaptive builders: the draft's expected number of accepted nodes of this tree (the
    #: sum of its nodes' path probabilities, before calibration); else ``None``
    expected: float | None = None


#: ``RowCost(n)``: a forward verifying ``n`` draft nodes beside the step's other rows, as a
#: multiple of the same forward without them (``RowCost(0) == 1``).
RowCost = Callable[[int], float]


def _worth_expanding(
    probs: Sequence[float], best: float, row_cost: RowCost, factor: float, budget: int
) -> bool:
    """Whether another level can add a node :func:`adaptive_size` would keep: a child's
    path probability is at most ``best`` (its parent's, the best frontier node's), and
    adding a node of that probability to the tree chosen from ``probs`` so far must raise
    the expected tokens per unit of time. Checked before each level of an adaptive
    dynamic tree; when it fails, the levels below are not drafted (their forwards are
    most of an EAGLE tree's draft time)."""
    ranked = sorted(probs, reverse=True)[:budget]
    if len(ranked) >= budget:
        ranked = ranked[: budget - 1]  # room for one more
    n = adaptive_size(ranked, row_cost, factor) if ranked else 0
    gained = 1.0 + factor * sum(ranked[:n])
    return (gained + factor * best) / row_cost(n + 1) > gained / row_cost(n)


class Calibration:
    """How far a drafter's path probabilities overstate its acceptance: the ratio of
    nodes accepted to nodes expected (the sum of the verified nodes' path probabilities),
    both discounted by ``decay`` per step and started from ``prior`` steps at ratio 1.

    Attributes:
        factor: accepted / expected, clipped to [``low``, 2].
    """

    low = 0.05

    def __init__(self, decay: float = 0.98, prior: float = 4.0) -> None:
        self.decay = decay
        self.accepted = self.expected = prior

    @property
    def factor(self) -> float:
        return min(2.0, max(self.low, self.accepted / self.expected))

    def observe(self, expected: float, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.expected = self.decay * self.expected + expected


def adaptive_size(probs: Sequence[float], row_cost: RowCost, factor: float = 1.0) -> int:
    """How many of a tree's ranked nodes to verify (OPT-Tree's criterion, Wang et al.
    2024, arXiv:2406.17276, Eq. 6, with the verification time of the cost model): the
    ``n`` in ``1 .. len(probs)`` that maximizes the step's expected tokens per unit of
    time ``(1 + factor * sum(probs[:n])) / row_cost(n)``.

    Args:
        probs: the nodes' path probabilities (the product of draft probabilities from
            the root), in the builder's rank order: every prefix must be a tree (each
            node after its ancestors).
        row_cost: :data:`RowCost`.
        factor: :attr:`Calibration.factor`.

    Returns:
        At least 1 (when ``probs`` is not empty: the controller decided to draft, and a
        verified node keeps the calibration learning), at most ``len(probs)``.
    """
    best, best_rate, gained = min(1, len(probs)), -1.0, 1.0
    for n, p in enumerate(probs, start=1):
        gained += factor * p
        rate = gained / row_cost(n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class _Recorder:
    """Collects added nodes (session ids) and turns a subset of them into a TokenTree."""

    def __init__(self, session: TreeSession) -> None:
        self.session = session
        self.parent: dict[int, int] = {}
        self.token: dict[int, int] = {}
        self.row: dict[int, torch.Tensor] = {}
        self.candidates: dict[int, list[int]] = {}

    def add(self, parent: int, token: int, row: torch.Tensor | None = None) -> int:
        node = self.session.add(parent, token)
        self.parent[node], self.token[node] = parent, token
        if row is not None:
            self.row[node] = row
        return node

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        expansions = self.session.expand(nodes, max(width, NUM_RANKS))
        for node, exp in zip(nodes, expansions, strict=True):
            self.candidates[node] = exp.tokens
        return expansions

    def proposal(self, keep: Sequence[int], without_replacement: bool = False) -> TreeProposal:
        keep = list(keep)
        index = {node: i for i, node in enumerate(keep)}
        parents = [ROOT if self.parent[n] == ROOT else index[self.parent[n]] for n in keep]
        rows = [self.row[n] for n in keep if n in self.row]
        draft_probs = torch.stack(rows) if keep and len(rows) == len(keep) else None
        tree = TokenTree.build(
            parents, [self.token[n] for n in keep], draft_probs, without_replacement
        )
        new_index = {keep[old]: new for new, old in enumerate(tree.order)}
        new_index[ROOT] = ROOT
        candidates = {new_index[n]: c for n, c in self.candidates.items() if n in new_index}
        return TreeProposal(tree, candidates)


class TreeBuilder(ABC):
    """Base class: ``build`` one tree per step; ``observe`` the verification outcome.

    Attributes:
        max_nodes: most draft nodes a tree of this builder holds (the root excluded); the
            engine sizes KV caches with it.
    """

    max_nodes: int

    #: whether ``build`` takes the step's ``row_cost`` (:data:`RowCost`): adaptive builders
    uses_row_cost: bool = False

    @abstractmethod
    def build(
        self, session: TreeSession, max_depth: int, sampling: bool, generator: torch.Generator
    ) -> TreeProposal:
        """Build this step's tree.

        Args:
            session: the drafter's session for this step.
            max_depth: deepest level allowed (>= 1; the engine caps it by the remaining
                token budget).
            sampling: decoding samples (temperature > 0); otherwise greedy.
            generator: for builders that sample children.

        A builder whose :attr:`uses_row_cost` is true also takes ``row_cost=``
        (:data:`RowCost`, or ``None`` where no cost is known: the whole budget).
        """

    def observe(self, proposal: TreeProposal, accepted_nodes: list[int], output: list[int]):
        """The verifier kept ``accepted_nodes`` and emitted ``output``.

        The default learns nothing; adaptive builders (Sequoia) override it.
        """
        return None

    @property
    def max_depth(self) -> int:
        """Deepest level a tree of this builder reaches (its ``depth``, or its longest
        rank path)."""
        depth = getattr(self, "depth", None)
        if depth:
            return int(depth)
        return max((len(p) for p in getattr(self, "paths", ())), default=1)


class StaticTreeBuilder(TreeBuilder):
    """A fixed shape of rank paths; see the module docstring.

    Args:
        paths: rank paths, every prefix present (see :func:`specdec.trees.spec.validate_paths`).
        draw: ``top`` | ``iid`` | ``wor`` (how children are chosen).
    """

    def __init__(self, paths: Sequence[tuple[int, ...]], draw: str = "top") -> None:
        self.paths = sorted(paths, key=lambda p: (len(p), p))
        self.max_nodes = len(self.paths)
        self.draw = draw

    def build(self, session, max_depth, sampling, generator) -> TreeProposal:
        return build_static(session, self.paths, self.draw, max_depth, sampling, generator)


def build_static(session, paths, draw, max_depth, sampling, generator) -> TreeProposal:
    """Expand a rank-path shape level by level (one drafter call per level)."""
    rec = _Recorder(session)
    node_of: dict[tuple[int, ...], int] = {(): ROOT}
    depth = 1
    while True:
        level = [p for p in paths if len(p) == depth and p[:-1] in node_of]
        if not level or depth > max_depth:
            break
        prefixes = list(dict.fromkeys(p[:-1] for p in level))
        width = max(p[-1] for p in level) + 1
        expansions = rec.expand([node_of[q] for q in prefixes], width)
        for prefix, exp in zip(prefixes, expansions, strict=True):
            kids = [p for p in level if p[:-1] == prefix]
            parent = node_of[prefix]
            if draw == "top" or exp.dist is None:
                for path in kids:
                    rank = path[-1]
                    if rank < len(exp.tokens) and exp.scores[rank] > 0:
                        node_of[path] = rec.add(parent, exp.tokens[rank])
                continue
            support = int((exp.dist > 0).sum())
            count = len(kids) if draw == "iid" else min(len(kids), support)
            if count == 0:
                continue
            drawn = torch.multinomial(
                exp.dist, count, replacement=draw == "iid", generator=generator
            )
            for path, token in zip(kids, drawn.tolist(), strict=False):
                node_of[path] = rec.add(parent, int(token), exp.dist)
        depth += 1
    keep = [node_of[p] for p in paths if p in node_of and p != ()]
    sampled = draw != "top" and sampling
    return rec.proposal(keep, without_replacement=sampled and draw == "wor")


class _RankedTreeBuilder(TreeBuilder):
    """A builder whose nodes come ranked by path probability, any prefix a tree (dynamic,
    best-first): with ``adaptive`` it keeps the prefix :func:`adaptive_size` chooses for
    the step's ``row_cost``, its probabilities calibrated by what verification accepts."""

    def __init__(self, adaptive: bool) -> None:
        self.adaptive = adaptive
        self.calibration = Calibration()

    @property
    def uses_row_cost(self) -> bool:
        return self.adaptive

    def _size(self, probs: Sequence[float], row_cost: RowCost | None) -> int:
        """How many of the ranked nodes (path probabilities ``probs``) this step keeps."""
        if not self.adaptive or row_cost is None:
            return len(probs)
        return adaptive_size(probs, row_cost, self.calibration.factor)

    def observe(self, proposal: TreeProposal, accepted_nodes: list[int], output: list[int]):
        """Adaptive: calibrate the path probabilities against the nodes accepted."""
        if self.adaptive and proposal.expected is not None and len(proposal.tree):
            self.calibration.observe(proposal.expected, len(accepted_nodes))


class DynamicTreeBuilder(_RankedTreeBuilder):
    """EAGLE-2 dynamic tree (context-aware expansion, then global reranking).

    Args:
        top_k: children per expanded node and nodes expanded per level.
        depth: levels to expand.
        budget: nodes kept after reranking by cumulative draft probability (adaptive:
            the most kept).
        adaptive: keep only the ranked nodes that pay for their rows
            (:func:`adaptive_size` with the step's ``row_cost`` and the drafter's
            :class:`Calibration`).
    """

    def __init__(self, top_k: int, depth: int, budget: int, adaptive: bool = False) -> None:
        super().__init__(adaptive)
        self.top_k, self.depth, self.budget = top_k, depth, budget
        self.max_nodes = budget

    def build(self, session, max_depth, sampling, generator, row_cost=None) -> TreeProposal:
        rec = _Recorder(session)
        score = {ROOT: 0.0}
        depth_of = {ROOT: 0}
        order: list[int] = []  # every added node, in creation order
        frontier = [ROOT]
        for level in range(1, min(self.depth, max_depth) + 1):
            expansions = rec.expand(frontier, self.top_k)
            layer = []
            for parent, exp in zip(frontier, expansions, strict=True):
                for token, prob in list(zip(exp.tokens, exp.scores, strict=True))[: self.top_k]:
                    if prob <= 0:
                        continue
                    node = rec.add(parent, token)
                    score[node] = score[parent] + math.log(prob)
                    depth_of[node] = level
                    layer.append(node)
                    order.append(node)
            if not layer:
                break
            frontier = sorted(layer, key=lambda n: -score[n])[: self.top_k]
            if self.adaptive and row_cost is not None and not _worth_expanding(
                [math.exp(score[n]) for n in order], math.exp(score[frontier[0]]),
                row_cost, self.calibration.factor, self.budget,
            ):  # fmt: skip
                break  # no child could be kept: save the next levels' draft forwards
        # A child never outscores its parent, and ties go to the shallower node, so the
        # best `budget` nodes always include their ancestors.
        ranked = sorted(order, key=lambda n: (-score[n], depth_of[n], n))[: self.budget]
        probs = [math.exp(score[n]) for n in ranked]
        ranked = ranked[: self._size(probs, row_cost)]
        keep = sorted(ranked, key=lambda n: (depth_of[n], n))
        proposal = rec.proposal(keep)
        if self.adaptive:
            proposal.expected = sum(probs[: len(ranked)])
        return proposal


class BestFirstTreeBuilder(_RankedTreeBuilder):
    """DDTree-style best-first tree from per-position draft distributions.

    The drafter extends its most probable chain ``depth`` times; the ranked candidates at
    chain position i serve as the distribution of position i for *every* branch. Nodes
    are added in decreasing path probability (product of per-position probabilities)
    with a heap that, on popping a node, pushes its first child and its next sibling, so
    the result is the exact top-``budget`` set of paths.

    Args:
        budget: nodes in the tree (adaptive: the most).
        depth: positions drafted.
        adaptive: as :class:`DynamicTreeBuilder`'s.
    """

    def __init__(self, budget: int, depth: int, adaptive: bool = False) -> None:
        super().__init__(adaptive)
        self.budget, self.depth = budget, depth
        self.max_nodes = budget

    def build(self, session, max_depth, sampling, generator, row_cost=None) -> TreeProposal:
        rec = _Recorder(session)
        depth = min(self.depth, max_depth)
        positions: list[list[tuple[int, float]]] = []
        chain = [ROOT]  # the drafter's most probable chain (session ids)
        width = min(self.budget, 64)
        for _ in range(depth):
            (exp,) = rec.expand([chain[-1]], width)
            ranked = [(t, p) for t, p in zip(exp.tokens, exp.scores, strict=True) if p > 0]
            if not ranked:
                break
            positions.append(ranked)
            chain.append(rec.add(chain[-1], ranked[0][0]))
        parents: list[int] = []
        tokens: list[int] = []
        probs: list[float] = []  # path probabilities, in the (decreasing) order added
        heap: list[tuple[float, int, int, int, int]] = []  # (-logp, tie, parent, pos, rank)
        if positions:
            heap.append((-math.log(positions[0][0][1]), 0, ROOT, 0, 0))
        tie = 1
        while heap and len(tokens) < self.budget:
            neg, _, parent, pos, rank = heapq.heappop(heap)
            token = positions[pos][rank][0]
            parents.append(parent)
            tokens.append(token)
            probs.append(math.exp(-neg))
            new = len(tokens) - 1
            parent_logp = -neg - math.log(positions[pos][rank][1])
            if rank + 1 < len(positions[pos]):
                sib = parent_logp + math.log(positions[pos][rank + 1][1])
                heapq.heappush(heap, (-sib, tie, parent, pos, rank + 1))
                tie += 1
            if pos + 1 < len(positions):
                child = -neg + math.log(positions[pos + 1][0][1])
                heapq.heappush(heap, (-child, tie, new, pos + 1, 0))
                tie += 1
        n = self._size(probs, row_cost)  # nodes come after their parents: a prefix is a tree
        parents, tokens, probs = parents[:n], tokens[:n], probs[:n]
        tree = TokenTree.build(parents, tokens)
        # Candidates are known exactly only along the chain (the all-rank-0 path).
        candidates = {
            tree_node: rec.candidates[session_node]
            for tree_node, session_node in zip(_rank0_chain(tree), chain, strict=False)
            if session_node in rec.candidates
        }
        return TreeProposal(tree, candidates, sum(probs) if self.adaptive else None)


def _rank0_chain(tree: TokenTree) -> list[int]:
    """ROOT, then the first child at each level (the drafter's most probable chain)."""
    chain, node = [ROOT], ROOT
    children = tree.children_lists()
    while children[node + 1]:
        node = children[node + 1][0]
        chain.append(node)
    return chain


class SequoiaTreeBuilder(TreeBuilder):
    """Sequoia: the optimal rank-path shape for the budget, from measured acceptance.

    Per-rank acceptance is measured on every verified context whose candidates the
    drafter listed (the rank of the token the target chose, or a miss). The shape is
    re-solved whenever the observations grow by a quarter, so it is cached per drafter
    and adapts to it.

    Args:
        budget: draft nodes per step.
        depth: deepest level.
    """

    def __init__(self, budget: int, depth: int) -> None:
        self.budget, self.depth = budget, depth
        self.max_nodes = budget
        self.stats = RankAcceptance(NUM_RANKS)
        self._shape: list[tuple[int, ...]] | None = None
        self._solved_at = 0

    @property
    def shape(self) -> list[tuple[int, ...]]:
        """The current optimal rank paths (re-solved as measurements accumulate)."""
        if self._shape is None or self.stats.total >= 1.25 * self._solved_at + 8:
            _, self._shape = sequoia_tree(self.stats.estimate(), self.budget, self.depth)
            self._solved_at = self.stats.total
        return self._shape

    def build(self, session, max_depth, sampling, generator) -> TreeProposal:
        return build_static(session, self.shape, "top", max_depth, sampling, generator)

    def observe(self, proposal: TreeProposal, accepted_nodes: list[int], output: list[int]):
        for context, token in zip([ROOT, *accepted_nodes], output, strict=False):
            ranked = proposal.candidates.get(context)
            if ranked is not None:
                self.stats.observe(ranked.index(token) if token in ranked else None)


def make_tree_builder(spec: TreeSpec | str) -> TreeBuilder:
    """The builder for a :class:`TreeSpec` (or its string form)."""
    spec = TreeSpec.parse(spec)
    if spec.kind == "static":
        return StaticTreeBuilder(spec.paths, spec.draw)
    if spec.kind == "dynamic":
        return DynamicTreeBuilder(spec.top_k, spec.depth, spec.budget, spec.adaptive)
    if spec.kind == "best-first":
        return BestFirstTreeBuilder(spec.budget, spec.depth, spec.adaptive)
    return SequoiaTreeBuilder(spec.budget, spec.depth)
