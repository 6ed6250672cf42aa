"""TokenTree: a tree of draft tokens hanging below the pending token, verified in one pass.

Vocabulary (see the architecture guide): the *root* is the pending token (the last token
of the sequence, not yet in the KV cache); every other node is a draft token whose parent
is the root or an earlier node. One target forward runs ``[root, node_0, ..., node_{N-1}]``
with an ancestor-only attention mask ("tree attention", SpecInfer, Miao et al. 2024, §3.2;
Medusa, Cai et al. 2024, §2.1.2), so row ``i`` of the logits scores the continuation of
the root-to-node path of node ``i``.

Nodes are stored in *flattened order*: breadth-first (by depth, ties keep the input
order), so every parent precedes its children, and node ``i`` is row ``i + 1`` of the
forward pass (row 0 is the root).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: Parent index meaning "child of the root" (the pending token).
ROOT = -1


@dataclass(frozen=True)
class TokenTree:
    """An immutable tree of draft tokens in flattened (breadth-first) order.

    Build with :meth:`TokenTree.build` (any valid parents array; it sorts) or
    :meth:`TokenTree.from_sequences` (a trie of token sequences).

    Attributes:
        parents: ``[N]`` parent of each node: ``ROOT`` (-1) or the index of an earlier
            node (``parents[i] < i``).
        token_ids: ``[N]`` draft token id of each node.
        draft_probs: ``[N, V]`` float32 draft distribution each node's token was drawn
            from (the draft's distribution at the parent's context), or ``None`` for
            deterministic drafts (verified as point masses).
        order: ``[N]`` input index of each node (the permutation :meth:`build` applied).
        without_replacement: siblings were drawn without replacement from one draft
            distribution (Recursive Speculative Decoding); otherwise i.i.d. (SpecInfer).

    Example:
        A root with children 7 and 8, and 9 below 7 (input given out of order):

        >>> tree = TokenTree.build(parents=[1, ROOT, ROOT], token_ids=[9, 7, 8])
        >>> tree.token_ids, tree.parents, tree.depths
        ((7, 8, 9), (-1, -1, 0), (1, 1, 2))
        >>> tree.order
        (1, 2, 0)
        >>> tree.paths()  # root-to-leaf paths as node indices, leaves in flattened order
        [[1], [0, 2]]
        >>> tree.attention_mask().int().tolist()  # rows/cols: root, 7, 8, 9
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
        >>> tree.position_offsets().tolist()  # added to the KV cache length
        [0, 1, 1, 2]
    """

    parents: tuple[int, ...]
    token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    order: tuple[int, ...] = ()
    without_replacement: bool = False
    depths: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.parents)
        if len(self.token_ids) != n:
            raise ValueError(f"{n} parents but {len(self.token_ids)} token ids")
        depths: list[int] = []
        for i, parent in enumerate(self.parents):
            if parent != ROOT and not 0 <= parent < i:
                raise ValueError(
                    f"node {i} has parent {parent}; in flattened order a parent is ROOT (-1) "
                    "or an earlier node (use TokenTree.build for any order)"
                )
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n
        ):
            raise ValueError(f"draft_probs must be [{n}, V], got {tuple(self.draft_probs.shape)}")
        if not self.order:
            object.__setattr__(self, "order", tuple(range(n)))
        object.__setattr__(self, "depths", tuple(depths))

    # ----------------------------------------------------------------- constructors
    @classmethod
    def build(
        cls,
        parents: Sequence[int],
        token_ids: Sequence[int],
        draft_probs: torch.Tensor | None = None,
        without_replacement: bool = False,
    ) -> TokenTree:
        """A tree from a parents array in any order (``ROOT`` = child of the pending token).

        Args:
            parents: ``[N]`` ints; ``parents[i]`` is ``ROOT`` or another node's index.
            token_ids: ``[N]`` draft token ids.
            draft_probs: optional ``[N, V]`` per-node draft distributions (permuted along).
            without_replacement: see the class attributes.

        Returns:
            The tree in flattened order; ``order`` maps each node to its input index.

        Raises:
            ValueError: lengths differ, an index is out of range, a node is its own
                ancestor (cycle), or ``draft_probs`` has the wrong shape.
        """
        parents = [int(p) for p in parents]
        n = len(parents)
        if len(token_ids) != n:
            raise ValueError(f"{n} parents but {len(token_ids)} token ids")
        if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs must be [{n}, V], got {tuple(draft_probs.shape)}")
        children: list[list[int]] = [[] for _ in range(n + 1)]  # slot n = the root
        for i, parent in enumerate(parents):
            if parent == i or not (parent == ROOT or 0 <= parent < n):
                raise ValueError(f"node {i} has invalid parent {parent} (tree of {n} nodes)")
            children[n if parent == ROOT else parent].append(i)
        order: list[int] = []
        frontier = children[n]
        while frontier:  # breadth first; siblings keep their input order
            order.extend(frontier)
            frontier = [c for node in frontier for c in children[node]]
        if len(order) != n:
            raise ValueError("parents array has a cycle: some nodes never reach the root")
        new_index = {old: new for new, old in enumerate(order)}
        return cls(
            parents=tuple(ROOT if parents[o] == ROOT else new_index[parents[o]] for o in order),
            token_ids=tuple(int(token_ids[o]) for o in order),
            draft_probs=None if draft_probs is None else draft_probs[list(order)],
            order=tuple(order),
            without_replacement=without_replacement,
        )

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Sequence[int]], budget: int | None = None
    ) -> TokenTree:
        """Merge token sequences into one trie (shared prefixes become shared nodes).

        Sequences are inserted in the given order (put the most likely first) and
        insertion stops once ``budget`` nodes exist (the last sequence may be cut).

        Example:
            >>> TokenTree.from_sequences([[1, 2, 3], [1, 4], [5]]).parents
            (-1, -1, 0, 0, 2)
        """
        parents: list[int] = []
        tokens: list[int] = []
        index: dict[tuple[int, int], int] = {}
        limit = budget if budget is not None else sum(len(s) for s in sequences)
        for seq in sequences:
            node = ROOT
            for token in seq:
                key = (node, int(token))
                if key not in index:
                    if len(parents) >= limit:
                        break
                    index[key] = len(parents)
                    parents.append(node)
                    tokens.append(int(token))
                node = index[key]
        return cls.build(parents, tokens)

    @classmethod
    def chain(cls, token_ids: Sequence[int], draft_probs: torch.Tensor | None = None) -> TokenTree:
        """A single path (what chain speculative decoding verifies)."""
        parents = tuple(range(-1, len(token_ids) - 1))
        return cls(parents, tuple(int(t) for t in token_ids), draft_probs)

    # ----------------------------------------------------------------- derived
    def __len__(self) -> int:
        return len(self.parents)

    @property
    def num_nodes(self) -> int:
        """Draft nodes (the root excluded)."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for an empty tree)."""
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (``ROOT`` for the root's), in flattened order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def children_lists(self) -> list[list[int]]:
        """``[N + 1]`` lists: entry 0 = the root's children, entry i + 1 = node i's."""
        lists: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for i, parent in enumerate(self.parents):
            lists[parent + 1].append(i)
        return lists

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (node indices), leaves in flattened order."""
        has_child = {p for p in self.parents if p != ROOT}
        return [self.path_to(i) for i in range(len(self.parents)) if i not in has_child]

    def position_offsets(self) -> torch.Tensor:
        """``[N + 1]`` int64 offsets of root and nodes from the KV cache length (= depth)."""
        return torch.tensor((0, *self.depths), dtype=torch.long)

    def attention_mask(self) -> torch.Tensor:
        """``[N + 1, N + 1]`` bool: entry (i, j) is True iff j is i or an ancestor of i.

        Row/column 0 is the root; row ``i + 1`` is node ``i``.
        """
        n = len(self.parents) + 1
        mask = torch.eye(n, dtype=torch.bool)
        mask[1:, 0] = True
        for i, parent in enumerate(self.parents):
            if parent != ROOT:
                mask[i + 1] |= mask[parent + 1]
        return mask


def tree_attention_bias(
    ancestors: torch.Tensor, past_len: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Additive float attention mask for new rows appended after ``past_len`` cached tokens.

    Args:
        ancestors: ``[T, S]`` bool, which of the ``S`` tree tokens (the last ``S`` positions
            of the keys, ``S >= T``) each of the ``T`` new rows may attend to.
        past_len: cached positions before the tree tokens; every row attends to all of them.
        dtype: the attention dtype (the model's).

    Returns:
        ``[1, 1, T, past_len + S]`` with 0 where attention is allowed and the dtype's most
        negative finite value elsewhere. A float mask, not a boolean one: some attention
        kernels treat boolean masks differently.
    """
    t, s = ancestors.shape
    bias = torch.zeros((t, past_len + s), dtype=dtype, device=device)
    bias[:, past_len:].masked_fill_(~ancestors.to(device), torch.finfo(dtype).min)
    return bias.view(1, 1, t, past_len + s)
