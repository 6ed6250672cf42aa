"""An independent draft model: a smaller causal LM sharing the target's tokenizer (a
draft with another tokenizer: :mod:`specdec.drafters.cross_tokenizer`).

Source: Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318): the
draft samples γ tokens autoregressively; the target verifies them in one forward pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal
from specdec.models.base import Backend
from specdec.sampling import greedy_ids, logits_to_probs, sample
from specdec.trees.builders import Expansion
from specdec.trees.tree import ROOT


def check_vocab_compatible(target: Backend, draft: Backend) -> None:
    """Refuse a draft whose tokenizer maps tokens to ids differently from the target's.

    Padded embedding matrices (``vocab_size`` larger than the tokenizer) are fine; the
    token -> id mappings themselves must be identical.

    Raises:
        ValueError: the vocabularies differ (the message names the sizes and an example), or
            a model has fewer logits than its tokenizer has tokens.
    """
    for model in (target, draft):
        if model.vocab_size < len(model.tokenizer):
            raise ValueError(
                f"{model.name!r} scores {model.vocab_size} tokens but its tokenizer has "
                f"{len(model.tokenizer)}; it cannot be used for speculative decoding"
            )
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
    example = differing[0] if differing else None
    raise ValueError(
        f"draft model {draft.name!r} and target {target.name!r} have different vocabularies "
        f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. {example!r} is not shared). "
        "draft-model:tokenizers=shared needs the target's tokenizer; tokenizers=auto (the "
        "default) or text translates this draft's tokens through text."
    )


def align_draft_logits(
    logits: torch.Tensor, num_real_tokens: int, target_vocab_size: int
) -> torch.Tensor:
    """Map draft logits onto the target's logit width.

    Draft columns >= ``num_real_tokens`` (embedding padding, no token behind them) are set
    to -inf so the draft never proposes them; the result is cut or -inf-padded to
    ``target_vocab_size`` columns.

    Args:
        logits: ``[N, V_draft]`` float draft logits.
        num_real_tokens: tokens the shared tokenizer knows (``len(tokenizer)``).
        target_vocab_size: width of the target's logits.

    Returns:
        ``[N, target_vocab_size]`` float logits.
    """
    width = logits.shape[-1]
    if width > num_real_tokens:
        logits = logits.clone()
        logits[..., num_real_tokens:] = float("-inf")
    if width > target_vocab_size:
        return logits[..., :target_vocab_size]
    if width < target_vocab_size:
        pad = logits.new_full((*logits.shape[:-1], target_vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


def expansions_from_logits(
    rows: torch.Tensor, params: SamplingParams, width: int
) -> list[Expansion]:
    """Each node's ``width`` most probable next tokens from its draft logits.

    Scores are probabilities: softmax of the logits for greedy decoding, the processed
    sampling distribution (temperature, top-k, top-p) otherwise, which is then also the
    distribution sampled children are drawn from (``Expansion.dist``).

    Args:
        rows: ``[n, V]`` float32 draft logits, one row per expanded node.
    """
    if params.greedy:
        probs, dists = torch.softmax(rows, dim=-1), None
    else:
        probs = dists = logits_to_probs(rows, params)
    top = torch.topk(probs, min(width, probs.shape[-1]), dim=-1)
    out = []
    for i in range(rows.shape[0]):
        keep = top.values[i] > 0
        tokens, scores = top.indices[i][keep].tolist(), top.values[i][keep].tolist()
        out.append(Expansion(tokens, scores, None if dists is None else dists[i]))
    return out


def new_nodes_mask(new: list[int], parents: list[int], slot: dict[int, int]) -> torch.Tensor:
    """Tree attention of nodes forwarded together after earlier forwarded nodes.

    Args:
        new: the nodes to forward now (in this order).
        parents: every node's parent (``ROOT`` or a node).
        slot: node -> its index among the tree tokens already forwarded (their ancestors
            must all be there).

    Returns:
        ``[len(new), len(slot) + len(new)]`` bool: each new row sees its forwarded
        ancestors and itself.
    """
    num_cached = len(slot)
    mask = torch.zeros((len(new), num_cached + len(new)), dtype=torch.bool)
    for row, node in enumerate(new):
        mask[row, num_cached + row] = True
        ancestor = parents[node]
        while ancestor != ROOT:
            mask[row, slot[ancestor]] = True  # KeyError: ancestor not expanded
            ancestor = parents[ancestor]
    return mask


class DraftModelDrafter(DrafterBase):
    """Drafts with a separate causal LM; each sequence keeps its own draft KV cache
    (:class:`DraftModelSequence`).

    Args:
        draft: the draft model (shared by every sequence).
        target_vocab_size: width of the target's logits (draft probabilities use it).
        num_real_tokens: size of the shared tokenizer vocabulary.
    """

    #: Its sequences offer ``tree_session`` (token trees).
    supports_trees = True
    #: ``propose`` takes ``stop_drafting`` and reports each position's confidence.
    confidence_stop = True

    def __init__(self, draft: Backend, target_vocab_size: int, num_real_tokens: int) -> None:
        self.draft = draft
        self.target_vocab_size = target_vocab_size
        self.num_real_tokens = num_real_tokens

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> DraftModelSequence:
        """A new sequence's drafter; its draft cache is filled by its first draft (one
        forward over the prompt), so a sequence that never drafts never runs the draft."""
        return DraftModelSequence(self, prompt_ids, params)


class DraftModelSequence(DrafterBase):
    """One sequence's draft state: its draft KV cache and the tokens in it.

    The draft cache is synchronised lazily: at each ``propose`` the longest prefix shared by
    the cached tokens and the current sequence is kept (rollback is moving the cursor) and
    the rest is fed in one forward (the whole prompt at the first draft; everything
    generated meanwhile after steps a controller ran without drafting). The cache starts
    sized for the prompt plus ``max_new_tokens`` (at most the draft's context) and grows if
    a tree needs more.
    """

    def __init__(
        self, drafter: DraftModelDrafter, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.draft = drafter.draft
        self.target_vocab_size = drafter.target_vocab_size
        self.num_real_tokens = drafter.num_real_tokens
        self._params = params
        capacity = min(len(prompt_ids) + params.max_new_tokens, self.draft.max_context) + 16
        self._cache = self.draft.new_cache(capacity)
        self._cached_ids: list[int] = []  # filled by the first draft: no draft forward
        self._synced = 0  # runs while a controller keeps speculation off

    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        *,
        stop_drafting: Callable[[int, float], bool] | None = None,
    ) -> DraftProposal:
        """Up to ``num_tokens`` draft tokens, one draft forward each; ``confidence`` holds
        each position's top draft probability (temperature 1 for greedy), and
        ``stop_drafting(i, confidence)`` may end the draft before position i's token is
        drawn."""
        if num_tokens <= 0:
            return DraftProposal([])
        pending = self._sync(token_ids)
        proposed: list[int] = []
        probs: list[torch.Tensor] = []
        confidence: list[float] = []
        for i in range(num_tokens):
            logits = self.draft.forward(pending, self._cache, num_logits=1)
            self._cached_ids.extend(pending)
            logits = align_draft_logits(logits, self.num_real_tokens, self.target_vocab_size)
            if self._params.greedy:
                top = float(torch.softmax(logits[-1].float(), -1).max())
            else:
                step_probs = logits_to_probs(logits[-1:], self._params)
                top = float(step_probs[0].max())
            if stop_drafting is not None and stop_drafting(i, top):
                break
            if self._params.greedy:
                token = int(greedy_ids(logits[-1]))
            else:
                token = int(sample(step_probs, generator))
                probs.append(step_probs[0])
            proposed.append(token)
            confidence.append(top)
            pending = [token]
            if i == num_tokens - 1:
                break
        self._synced = len(token_ids)
        draft_probs = torch.stack(probs) if probs else None
        return DraftProposal(proposed, draft_probs, confidence)

    def tree_session(
        self, token_ids: Sequence[int], params: SamplingParams
    ) -> DraftModelTreeSession:
        """A :class:`~specdec.trees.builders.TreeSession` over this sequence's draft cache."""
        self._params = params
        return DraftModelTreeSession(self, token_ids)

    def close(self) -> None:
        """Free the draft cache."""
        self._cache = None
        self._cached_ids = []

    def _sync(self, token_ids: Sequence[int]) -> list[int]:
        """Roll the draft cache back to the prefix it shares with ``token_ids``; return the rest."""
        limit = min(len(self._cached_ids), len(token_ids) - 1)
        n = min(self._synced, limit)
        if self._cached_ids[:n] != list(token_ids[:n]):  # drafted for another history
            n = 0  # (overlapped drafting assumes one: specdec.drafters.overlap)
        while n < limit and self._cached_ids[n] == token_ids[n]:
            n += 1
        self._cache.truncate(n)
        del self._cached_ids[n:]
        return list(token_ids[n:])


class CachedTreeSession(ABC):
    """Base of tree sessions that run a model over the tree's nodes in a KV cache (a draft
    model, or the target minus some layers): each ``expand`` forwards the nodes not yet
    forwarded, with tree attention, after the cached sequence (a node at depth d sits at
    position ``base - 1 + d`` and sees the sequence, its forwarded ancestors and itself).

    Subclasses set ``base`` (cached tokens, the root included) and ``params``, put the
    root's logits in ``logits[ROOT]``, and implement :meth:`_run_nodes`.
    """

    base: int
    params: SamplingParams

    def _init_tree(self, root_logits: torch.Tensor) -> None:
        self.parents: list[int] = []
        self.tokens: list[int] = []
        self.depths: list[int] = []
        self.slot: dict[int, int] = {}  # node -> index among forwarded tree tokens
        self.logits: dict[int, torch.Tensor] = {ROOT: root_logits}

    @abstractmethod
    def _run_nodes(self, nodes: list[int], positions: list[int], mask: torch.Tensor):
        """``[len(nodes), V]`` logits of the new nodes (ids; their tokens are
        ``self.tokens[n]``) forwarded with ``mask`` at ``positions``."""

    def add(self, parent: int, token: int) -> int:
        self.parents.append(parent)
        self.tokens.append(int(token))
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def expand(self, nodes: Sequence[int], width: int) -> list[Expansion]:
        new = [n for n in dict.fromkeys(nodes) if n not in self.logits]
        if new:
            num_cached = len(self.slot)
            mask = new_nodes_mask(new, self.parents, self.slot)
            positions = [self.base - 1 + self.depths[n] for n in new]
            logits = self._run_nodes(new, positions, mask)
            for row, node in enumerate(new):
                self.slot[node] = num_cached + row
                self.logits[node] = logits[row]
        rows = torch.stack([self.logits[n] for n in nodes])
        return expansions_from_logits(rows, self.params, width)


class DraftModelTreeSession(CachedTreeSession):
    """Tree drafting with a draft model: each ``expand`` is one draft forward over the new
    nodes with tree attention, appended after the draft's cached sequence.

    The draft cache first catches up with the whole sequence (root included); tree nodes
    then occupy the positions after it, each seeing the sequence, its forwarded ancestors
    and itself, at position ``len(sequence) - 1 + depth``. ``close`` truncates the cache
    back to the sequence, so the next step's prefix sync is unchanged.

    Candidate scores are the draft's probabilities: softmax of the logits for greedy
    decoding, the processed sampling distribution (temperature, top-k, top-p) otherwise,
    which is also the distribution sampled children are drawn from.
    """

    def __init__(self, sequence: DraftModelSequence, token_ids: Sequence[int]) -> None:
        self.sequence = sequence
        self.draft = sequence.draft
        self.cache = sequence._cache
        pending = sequence._sync(token_ids)
        logits = self.draft.forward(pending, self.cache, num_logits=1)
        sequence._cached_ids.extend(pending)
        self.base = self.cache.num_tokens  # == len(token_ids)
        self.params = sequence._params
        self._init_tree(self._align(logits[-1:])[0])

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        d = self.sequence
        return align_draft_logits(logits, d.num_real_tokens, d.target_vocab_size)

    def _run_nodes(self, nodes: list[int], positions: list[int], mask: torch.Tensor):
        tokens = [self.tokens[n] for n in nodes]
        logits = self.draft.forward(tokens, self.cache, positions=positions, tree_mask=mask)
        return self._align(logits)

    def close(self) -> None:
        self.cache.truncate(self.base)
        self.sequence._synced = self.base
