"""SuffixDecoding: draft from suffix trees over this request and earlier requests' outputs.

Source: Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications" (2024, arXiv:2411.04975), §3: a per-request suffix tree over the prompt and
the output so far, a global suffix tree over earlier outputs, pattern matching of the
context's suffix, frequency-scored candidates, and a speculation budget of
``max_spec_factor * match_length`` tokens (§3.3, "adaptive speculation length").

A depth-bounded suffix tree (a trie of every substring of at most ``max_depth`` tokens)
keeps, per node, how many times its path occurred. The probability of continuing a
matched path with token ``t`` is estimated as ``count(child t) / sum of the children's
counts`` (occurrences with a continuation); a draft path's score is the product of these
estimates, and paths below ``min_token_prob`` are not drafted.

The global tree is such a trie (:class:`SuffixTree`: outputs come and go, evicted by
count). A request's own tree is not stored as one: :class:`SequenceIndex` answers the
same counts from where each token occurs in the request (nodes built per match, from the
positions of the context's last tokens), so a long prompt costs a list of positions
instead of about ``max_depth`` nodes per token (a 7,454-token prompt: 178,000 nodes,
52 MB, 0.15-0.3 s at its first draft; indexed: 3 ms).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal, needs_isolation
from specdec.drafters.options import SuffixOptions
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT

# A node is a list ``[count, children]`` with ``children: dict[token, node]`` (lists, not
# objects: a tree holds up to ``max_depth`` nodes per inserted token).
_COUNT, _CHILDREN = 0, 1


def _new_node() -> list:
    return [0, {}]


@contextmanager
def _collector_paused():
    """Pause Python's cyclic garbage collector while a tree grows or shrinks.

    Inserting a 7,454-token prompt creates 175,000 nodes (depth 24); each 700 allocations
    start a collection that walks the growing tree again: 0.7-1.2 s with the collector on,
    0.08-0.13 s with it paused (measured on this project's 2-core Xeon). Nodes never form
    cycles, so nothing is left uncollected."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class SuffixTree:
    """Every substring of at most ``max_depth`` tokens of the inserted sequences, as root
    paths with occurrence counts.

    Sequences are appended to token by token (:meth:`extend`), each under a key; a key's
    sequence can be removed again (:meth:`remove`), which is how the global tree evicts
    a request.

    Args:
        max_depth: longest stored substring (>= 1).

    Example:
        >>> tree = SuffixTree(max_depth=3)
        >>> tree.extend("doc", [1, 2, 1, 2])
        >>> tree.count([1, 2]), tree.count([2, 1]), tree.count([1, 2, 1]), tree.count([2, 2])
        (2, 1, 1, 0)
        >>> tree.children([1])  # what followed token 1, with counts
        {2: 2}
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _new_node()
        self._active: dict[object, list] = {}  # key -> nodes of its last suffixes
        self._tokens: dict[object, list[int]] = {}
        self.num_nodes = 1

    def extend(self, key: object, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` to the sequence stored under ``key`` (new or not).

        ``O(max_depth)`` per token: the nodes of the sequence's current suffixes (lengths
        1 .. max_depth - 1) each gain the token as a child.
        """
        tokens = [int(t) for t in token_ids]
        self._tokens.setdefault(key, []).extend(tokens)
        active = self._active.get(key, [])
        keep = self.max_depth - 1
        root, created = self.root, 0
        with _collector_paused():
            for token in tokens:  # the hot loop of a long prompt: plain lists and dicts
                nxt = []
                for node in (root, *active[:keep]):
                    children = node[_CHILDREN]
                    child = children.get(token)
                    if child is None:
                        children[token] = child = [1, {}]
                        created += 1
                    else:
                        child[_COUNT] += 1
                    nxt.append(child)
                active = nxt
        self._active[key] = active
        self.num_nodes += created

    def remove(self, key: object) -> None:
        """Remove the sequence stored under ``key`` (its counts, and nodes left at 0)."""
        tokens = self._tokens.pop(key, None)
        self._active.pop(key, None)
        if tokens is None:
            return
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                child = node[_CHILDREN][token]
                child[_COUNT] -= 1
                if child[_COUNT] == 0:
                    self.num_nodes -= _size(child)
                    del node[_CHILDREN][token]
                    break
                node = child

    def suffix_nodes(self, key: object) -> list:
        """Nodes of the stored sequence's suffixes: element ``i`` is the path of its last
        ``i + 1`` tokens (lengths 1 .. max_depth, as far as the sequence goes)."""
        return self._active.get(key, [])

    def find(self, path: Sequence[int]) -> list | None:
        """The node at the end of ``path`` from the root, or ``None``."""
        node = self.root
        for token in path:
            node = node[_CHILDREN].get(int(token))
            if node is None:
                return None
        return node

    def count(self, path: Sequence[int]) -> int:
        """Occurrences of ``path`` in the stored sequences (0 if absent)."""
        node = self.find(path)
        return 0 if node is None else node[_COUNT]

    def children(self, path: Sequence[int]) -> dict[int, int]:
        """``{token: count}`` of what followed ``path``."""
        node = self.find(path)
        return {} if node is None else {t: c[_COUNT] for t, c in node[_CHILDREN].items()}

    def __contains__(self, key: object) -> bool:
        return key in self._tokens


def _size(node: list) -> int:
    stack, total = [node], 0
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(n[_CHILDREN].values())
    return total


class _IndexNode(list):
    """A node of :class:`SequenceIndex`: the path of ``depth`` tokens that ends at the
    positions ``ends`` of the sequence. A :class:`SuffixTree` node's list ``[count,
    children]`` whose children (``None`` until :func:`_children` first asks) are built
    from the positions, so :func:`ranked_children`, :func:`greedy_path` and the tree
    sessions walk either kind. Valid until the sequence grows (a match builds its nodes
    afresh)."""

    __slots__ = ("index", "ends", "depth")

    def __init__(self, index: SequenceIndex, ends: list[int], depth: int) -> None:
        super().__init__((len(ends), None))
        self.index = index
        self.ends = ends
        self.depth = depth

    def build(self) -> dict[int, _IndexNode]:
        """The continuations: per next token, the path one token longer (none at
        ``max_depth``, where a trie stores no longer path)."""
        children: dict[int, _IndexNode] = {}
        if self.depth < self.index.max_depth:
            tokens, last = self.index.tokens, len(self.index.tokens) - 1
            groups: dict[int, list[int]] = {}
            for end in self.ends:
                if end < last:
                    groups.setdefault(tokens[end + 1], []).append(end + 1)
            depth = self.depth + 1
            children = {t: _IndexNode(self.index, g, depth) for t, g in groups.items()}
        self[_CHILDREN] = children
        return children


def _children(node: list) -> dict:
    """``{token: child}`` of a :class:`SuffixTree` or :class:`SequenceIndex` node."""
    children = node[_CHILDREN]
    return node.build() if children is None else children


class SequenceIndex:
    """One growing sequence's substrings of at most ``max_depth`` tokens, answered from
    where each token occurs instead of stored as a trie: the same counts and continuations
    as a :class:`SuffixTree` holding the sequence alone (tested), for what a
    sequence's own drafting asks (the nodes of its last suffixes and the paths below them).

    Why: a trie stores about ``max_depth`` nodes per token. A 7,454-token prompt made
    178,000 nodes (52 MB of Python objects, 0.15-0.3 s to insert at depth 24, measured on
    this project's 2-core Xeon), paid by every request at its first draft: 16 clients'
    requests in one engine, speculation mostly off, spent 3-5% of their time on those
    first drafts. Here appending a token costs one list append, and a match walks the
    positions of the context's last token, narrowed one token further back per suffix
    length.

    Args:
        max_depth: longest substring (>= 1), as :class:`SuffixTree`'s.

    Example:
        >>> index = SequenceIndex(max_depth=3)
        >>> index.extend([1, 2, 1, 2])
        >>> index.count([1, 2]), index.count([2, 1]), index.count([1, 2, 1, 2])
        (2, 1, 0)
        >>> [(node.depth, node[0]) for node in index.suffix_nodes()]  # "2", "1 2", "2 1 2"
        [(1, 2), (2, 2), (3, 1)]
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self._where: dict[int, list[int]] = {}  # token -> its positions, increasing

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` (O(1) per token)."""
        where, tokens = self._where, self.tokens
        for token in token_ids:
            token = int(token)
            where.setdefault(token, []).append(len(tokens))
            tokens.append(token)

    def suffix_nodes(self) -> list[_IndexNode]:
        """The nodes of the sequence's last ``L`` tokens, ``L = 1, 2, ...`` up to
        ``max_depth``, stopping after the first that occurs only once: its only occurrence
        is the sequence's end, so it and every longer suffix have no continuation (a
        :class:`SuffixTree` lists those too, childless)."""
        tokens = self.tokens
        n = len(tokens)
        if n == 0:
            return []
        ends = self._where[tokens[-1]]
        out = [_IndexNode(self, ends, 1)]
        for length in range(2, min(n, self.max_depth) + 1):
            if len(ends) < 2:
                break
            back, want = length - 1, tokens[n - length]
            ends = [e for e in ends if e >= back and tokens[e - back] == want]
            out.append(_IndexNode(self, ends, length))
        return out

    def count(self, path: Sequence[int]) -> int:
        """Occurrences of ``path`` (0 if absent or longer than ``max_depth``)."""
        path = [int(t) for t in path]
        if not path or len(path) > self.max_depth:
            return 0
        tokens, k = self.tokens, len(path) - 1
        return sum(
            1 for e in self._where.get(path[-1], ()) if e >= k and tokens[e - k : e + 1] == path
        )


def ranked_children(node: list, width: int) -> tuple[list[int], list[float]]:
    """The ``width`` most frequent continuations of ``node`` and their estimated
    probabilities (count over the children's total; ties: smaller token id first)."""
    children = _children(node)
    if not children:
        return [], []
    total = sum(c[_COUNT] for c in children.values())
    ranked = sorted(children.items(), key=lambda kv: (-kv[1][_COUNT], kv[0]))[:width]
    return [t for t, _ in ranked], [c[_COUNT] / total for _, c in ranked]


def greedy_path(node: list, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent child while the path's probability stays >= ``min_prob``.

    Returns:
        ``(tokens, score)``: the drafted tokens and the expected number of them accepted
        under the frequency estimate (sum of the path prefixes' probabilities).

    Example:
        After ``1 2 3 0`` twice and ``1 2 4`` once, the path after ``1`` is ``2 3 0``
        (probabilities 1, 2/3, 2/3; the tree stores 4 tokens, so nothing after ``1 2 3 0``):

        >>> tree = SuffixTree(4)
        >>> tree.extend("a", [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4])
        >>> greedy_path(tree.find([1]), 5, 0.1)
        ([2, 3, 0], 2.333333333333333)
    """
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens:
        if type(node) is _IndexNode and len(node.ends) == 1:
            # a path that occurs once goes on as the sequence does, one child of
            # probability 1 per step, up to the depth limit or the sequence's end: the
            # steps below without building a node per token
            index, end = node.index, node.ends[0]
            steps = min(
                max_tokens - len(tokens),
                index.max_depth - node.depth,
                len(index.tokens) - 1 - end,
            )
            if steps <= 0 or prob < min_prob:
                break
            tokens.extend(index.tokens[end + 1 : end + 1 + steps])
            for _ in range(steps):
                score += prob
            break
        best, probs = ranked_children(node, 1)
        if not best or prob * probs[0] < min_prob:
            break
        prob *= probs[0]
        score += prob
        tokens.append(best[0])
        node = _children(node)[best[0]]
    return tokens, score


@dataclass
class Match:
    """Where a draft continues: a node of one tree, reached by the context's last
    ``length`` tokens; ``limit`` = most tokens drafted from it."""

    node: list
    length: int
    limit: int


def best_match(
    candidates: Sequence[tuple[list, int]], max_tokens: int, options: SuffixOptions
) -> Match | None:
    """Among ``(node, match length)`` candidates, the one whose greedy draft has the most
    expected accepted tokens (SuffixDecoding's scoring; longer matches win ties)."""
    best, best_score = None, 0.0
    for node, length in candidates:
        limit = min(max_tokens, int(options.max_spec_factor * length))
        if limit < 1 or not _children(node):
            continue
        _, score = greedy_path(node, limit, options.min_token_prob)
        if score > best_score or (
            score == best_score and best is not None and length > best.length
        ):
            best, best_score = Match(node, length, limit), score
    return best


class GlobalSuffixCache:
    """The cross-request tree: the outputs of the last ``max_requests`` finished requests
    (least recently finished evicted first)."""

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_requests = max_requests
        self._order: OrderedDict[int, None] = OrderedDict()
        self._next = 0

    def add(self, output_ids: Sequence[int]) -> None:
        """Insert one finished request's output (evicting the oldest beyond the limit)."""
        if not output_ids:
            return
        key, self._next = self._next, self._next + 1
        self.tree.extend(key, output_ids)
        self._order[key] = None
        while len(self._order) > self.max_requests:
            oldest, _ = self._order.popitem(last=False)
            self.tree.remove(oldest)

    def __len__(self) -> int:
        return len(self._order)


class SuffixDrafter(DrafterBase):
    """SuffixDecoding (see the module docstring); deterministic (``draft_probs=None``).

    Holds the global cache shared by its sequences; each sequence
    (:class:`SuffixSequence`) keeps its own tree over its prompt and output.

    Args:
        options: :class:`~specdec.drafters.options.SuffixOptions`.
    """

    supports_trees = True

    def __init__(self, options: SuffixOptions | None = None) -> None:
        self.options = options or SuffixOptions()
        self.cache = (
            GlobalSuffixCache(self.options.max_depth, self.options.max_cached_requests)
            if self.options.global_cache
            else None
        )

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> SuffixSequence:
        """A sequence's drafter; a seeded sampled generation does not read the global
        cache (its output must not depend on earlier requests), but still adds to it."""
        return SuffixSequence(self, prompt_ids, read_cache=not needs_isolation(params))


class SuffixSequence(DrafterBase):
    """One sequence: the index of its prompt + output (:class:`SequenceIndex`, the
    counts of a suffix tree over them), extended as tokens commit.

    Tokens are indexed when the sequence drafts (its first match indexes the prompt):
    what a draft sees is the same either way, every committed token is in the index before
    a match."""

    def __init__(
        self, drafter: SuffixDrafter, prompt_ids: Sequence[int], read_cache: bool = True
    ) -> None:
        self.options = drafter.options
        self.cache = drafter.cache
        self.read_cache = read_cache
        self.tree = SequenceIndex(self.options.max_depth)
        self.num_prompt = len(prompt_ids)
        self.tokens: list[int] = [int(t) for t in prompt_ids]

    def _sync(self, token_ids: Sequence[int]) -> None:
        """Record the committed tokens not seen yet (tokens only ever get added), and
        index every recorded token not yet in the index."""
        if len(token_ids) > len(self.tokens):
            self.tokens.extend(int(t) for t in token_ids[len(self.tokens) :])
        indexed = len(self.tree.tokens)
        if indexed < len(self.tokens):
            self.tree.extend(self.tokens[indexed:])

    def match(self, token_ids: Sequence[int], max_tokens: int) -> Match | None:
        """The best place to continue from, over both trees and every match length."""
        self._sync(token_ids)
        candidates = [(node, node.depth) for node in self.tree.suffix_nodes()]
        if self.read_cache and self.cache is not None and len(self.cache):
            depth = min(len(self.tokens), self.options.max_depth - 1)
            for length in range(depth, 0, -1):
                node = self.cache.tree.find(self.tokens[-length:])
                if node is not None:
                    candidates.append((node, length))
        return best_match(candidates, max_tokens, self.options)

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        if num_tokens <= 0:
            return DraftProposal([])
        found = self.match(token_ids, num_tokens)
        if found is None:
            return DraftProposal([])
        tokens, _ = greedy_path(found.node, found.limit, self.options.min_token_prob)
        return DraftProposal(tokens)

    def tree_session(self, token_ids: Sequence[int], params: SamplingParams) -> SuffixTreeSession:
        """A :class:`~specdec.trees.builders.TreeSession` over the best match's subtree."""
        return SuffixTreeSession(self.match(token_ids, self.options.max_depth), self.options)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.add(self.tokens[self.num_prompt :])
        self.tree = None


class SuffixTreeSession:
    """Tree drafting inside the matched subtree: a node's candidates are its children,
    scored by their frequency estimate; nothing deeper than the match's ``limit`` or
    below ``min_token_prob`` (path probability) is offered."""

    def __init__(self, found: Match | None, options: SuffixOptions) -> None:
        self.found = found
        self.min_prob = options.min_token_prob
        self.nodes: list[tuple[list | None, int, float]] = []  # (trie node, depth, path prob)

    def add(self, parent: int, token: int) -> int:
        if parent == ROOT:
            base, depth, prob = (self.found.node if self.found else None), 0, 1.0
        else:
            base, depth, prob = self.nodes[parent]
        node = None if base is None else _children(base).get(int(token))
        if node is not None and base is not None:
            total = sum(c[_COUNT] for c in _children(base).values())
            prob *= node[_COUNT] / total
        else:
            prob = 0.0
        self.nodes.append((node, depth + 1, prob))
        return len(self.nodes) - 1

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        out = []
        for n in nodes:
            if self.found is None:
                out.append(Expansion([], []))
                continue
            node, depth, prob = (self.found.node, 0, 1.0) if n == ROOT else self.nodes[n]
            if node is None or depth >= self.found.limit:
                out.append(Expansion([], []))
                continue
            tokens, probs = ranked_children(node, width)
            keep = [i for i, p in enumerate(probs) if prob * p >= self.min_prob]
            out.append(Expansion([tokens[i] for i in keep], [probs[i] for i in keep]))
        return out

    def close(self) -> None:
        pass
