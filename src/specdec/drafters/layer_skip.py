"""Layer skip: the target drafts for itself with some decoder layers skipped.

Sources:

* Draft & Verify (Zhang et al. 2024, arXiv:2309.08168): self-speculative decoding. The
  draft is the target with some layers skipped; it shares the target's weights and its KV
  cache of the verified prefix, so no second model sits in memory. The skipped set is found
  offline by Bayesian optimization, and an adaptive draft-exit threshold stops a draft when
  its top-1 probability is low.
* SWIFT (Xia et al. 2025, arXiv:2410.06916): the skipped set is chosen on the fly during
  inference, without training ("context-based layer set optimization"): an optimization
  phase proposes candidate sets (random search or Bayesian optimization) scored by how well
  their drafts match the target's already generated context, then an acceleration phase
  drafts with the best set; drafting stops when the draft's confidence falls below a
  threshold ("confidence-aware inference acceleration").

What this module implements:

* **Shared KV prefix.** At each step the sequence's own cache holds the full target's keys
  and values for every verified token (the cursor rule). Drafting runs
  ``target.forward_full([token], cache, layers=kept)`` on the pending token, then on each
  drafted token: the kept layers write the new tokens' keys and values at the next slots
  and attend over the full model's keys and values of the prefix. The cache cursor is then
  rolled back (``cache.truncate``); the verification forward rewrites those slots with
  every layer.
* **Drafting.** Greedy decoding drafts the argmax; sampling draws from
  ``logits_to_probs(draft_logits, params)`` and returns those distributions as
  ``draft_probs``, so rejection sampling keeps the output lossless. Confidence stop: the
  first draft token whose top-1 probability is below ``confidence`` is not proposed and
  ends the draft (a fixed threshold; Draft & Verify's adaptive threshold is not
  implemented). Token trees are drafted by specdec's tree builders over the same cache
  with tree attention (:class:`LayerSkipTreeSession`), not by SWIFT's confidence-based
  candidate expansion.
* **The lookup level** (``lookup=N``, also on ``quantized`` and ``sparse-kv``): a free
  second level under the draft, as the statistical bottom level of Cascade Speculative
  Drafting (Chen et al. 2024, arXiv:2312.11462) or the second level of ML-SpecQD
  (Georganas et al. 2025). Each draft forward runs the pending token followed by up to
  ``N`` tokens prompt lookup expects after it (:func:`~specdec.drafters.ngram.
  find_ngram_continuation` over the sequence and the draft so far); row i's draft token
  is picked exactly as a forward of that row alone would pick it (argmax, or a draw from
  the sequence's generator in the same order), and row i + 1 counts only while the guess
  holds row i's token; the cache is rolled back to the rows used. In exact mode every row
  of a forward has the bits it has alone (and the KV window is per row), so the chain,
  its distributions and its confidences are those drafted without the level, in fewer
  forwards (tested bit for bit). Chains only; tree sessions forward as before.
* **The skipped set.** Whole decoder layers (the papers may skip attention and MLP
  sub-layers separately; the native runtime skips layers). Either fixed (``skip=``), or
  chosen on the fly by :class:`SkipSetSearch`: start from ``skip_ratio * num_layers``
  layers spread evenly over the intermediate layers (SWIFT, Fig. 2a: uniform skipping is
  already a usable draft; the first and last layers are never skipped), score a set by its
  accepted tokens per draft forward over ``search_steps`` real verification steps, then
  for ``search_rounds`` rounds try a neighbour of the best set so far (one skipped layer
  swapped for one kept layer, drawn with a seeded ``random.Random`` among untried sets)
  and keep it if it scores higher; then draft with the best set for good. The search lives
  in the drafter, so every sequence shares it and it is learned once. It differs from SWIFT
  in scoring sets by real verification outcomes (SWIFT scores them with extra parallel
  drafting passes over the already generated context) and in using local random search
  without Bayesian optimization. Windows are short, so scores are noisy: the search finds
  a good set, not provably the best one.

Defaults (:class:`~specdec.drafters.options.LayerSkipOptions`): skip 20% of the layers,
confidence stop at 0.3, 8 steps per candidate, 12 candidates after the initial set
(~100 verification steps, shared by all requests). Chosen on the embedded 135M model,
where skipping more dropped acceptance sharply; the papers skip ~40-50% of 7B-70B models.

Losslessness never depends on the skipped set: the drafter only proposes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.config import SamplingParams
from specdec.drafters.base import (
    ChainRequest,
    DrafterBase,
    DraftProposal,
    VerificationFeedback,
    needs_isolation,
)
from specdec.drafters.draft_model import CachedTreeSession
from specdec.drafters.ngram import find_ngram_continuation
from specdec.drafters.options import LayerSkipOptions, parse_layer_set
from specdec.drafters.vocab import DraftVocabulary, SharedVocabulary
from specdec.models.base import BatchItem
from specdec.sampling import greedy_ids, logits_to_probs, sample


def skippable_layers(num_layers: int) -> tuple[int, ...]:
    """Layers the on-the-fly search may skip: all but the first and the last.

    Example:
        >>> skippable_layers(5)
        (1, 2, 3)
    """
    return tuple(range(1, num_layers - 1))


def initial_skip_set(num_layers: int, skip_ratio: float) -> tuple[int, ...]:
    """The heuristic start: ``round(skip_ratio * num_layers)`` layers (at most
    ``num_layers - 2``), spread evenly over the intermediate layers.

    Args:
        num_layers: decoder layers of the target (>= 1).
        skip_ratio: fraction of all layers to skip, in [0, 1).

    Returns:
        the skipped layer indices, increasing (empty when nothing can be skipped).

    Example:
        >>> initial_skip_set(10, 0.4)  # 4 of the layers 1..8
        (2, 4, 6, 8)
        >>> initial_skip_set(2, 0.5)  # the first and last layers stay
        ()
    """
    pool = skippable_layers(num_layers)
    count = min(int(skip_ratio * num_layers + 0.5), len(pool))
    return tuple(pool[int((i + 0.5) * len(pool) / count)] for i in range(count))


def check_skip_set(skip: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate a fixed skip set against the model's depth.

    Returns:
        the set, sorted.

    Raises:
        ValueError: an index outside ``[0, num_layers)``, an index given twice, or a set
            that skips every layer.
    """
    layers = tuple(sorted(int(i) for i in skip))
    if len(set(layers)) != len(layers):
        raise ValueError(f"skip set {list(skip)} names a layer twice")
    outside = [i for i in layers if not 0 <= i < num_layers]
    if outside:
        raise ValueError(
            f"skip set names layers {outside}, but the target has layers 0..{num_layers - 1}"
        )
    if len(layers) >= num_layers:
        raise ValueError(f"skip set skips all {num_layers} layers; at least one must run")
    return layers


@dataclass
class _Trial:
    """Counts of one candidate set's evaluation window."""

    steps: int = 0
    forwards: int = 0
    accepted: int = 0

    @property
    def score(self) -> float:
        """Accepted tokens per draft forward (0 when nothing was drafted)."""
        return self.accepted / self.forwards if self.forwards else 0.0


class SkipSetSearch:
    """On-the-fly choice of the skipped layers from measured acceptance (SWIFT-like).

    ``current`` is the set to draft with now. Each candidate is evaluated over
    ``search_steps`` calls of :meth:`record` made with that set (records for any other set
    are ignored, e.g. from a sequence that drafted before the candidate changed); its score
    is the number of accepted tokens per draft forward over the window: the acceptance
    rate, except that a forward whose token the confidence stop discarded counts as a
    rejected draft (every candidate skips as many layers, so a forward costs the same
    whatever the set, and a set that drafts cautiously is not rewarded for drafting
    little). The first candidate is ``initial``; then, for
    ``search_rounds`` rounds, a neighbour of the best set so far (one skipped layer swapped
    for one kept intermediate layer, drawn among untried sets with ``random.Random(seed)``)
    replaces the best if it scores strictly higher. Afterwards (or when no untried
    neighbour exists) ``current`` is the best set for good. The same records in the same
    order give the same sets.

    Args:
        num_layers: decoder layers of the target.
        initial: the first set (skipped layer indices; see :func:`initial_skip_set`).
        search_steps: verification steps per candidate (>= 1).
        search_rounds: candidates tried after ``initial`` (>= 0).
        seed: seed of the neighbour draws.

    Attributes:
        initial: the starting set (seeded sampled generations always draft with it).
        best, best_score: the best set so far and its score (``None`` before the first
            window ends).
        history: ``(set, score)`` of every finished window, in order.

    Example:
        >>> search = SkipSetSearch(5, (1,), search_steps=2, search_rounds=1, seed=0)
        >>> for _ in range(2):
        ...     search.record((1,), num_forwards=4, num_accepted=1)
        >>> search.current in [(2,), (3,)], search.searching  # a neighbour is evaluated
        (True, True)
        >>> candidate = search.current
        >>> for _ in range(2):
        ...     search.record(candidate, num_forwards=4, num_accepted=3)
        >>> search.best == search.current == candidate, search.best_score, search.searching
        (True, 0.75, False)
    """

    def __init__(
        self,
        num_layers: int,
        initial: Sequence[int],
        search_steps: int,
        search_rounds: int,
        seed: int = 0,
    ) -> None:
        self.pool = skippable_layers(num_layers)
        self.search_steps = search_steps
        self.rounds_left = search_rounds
        self.initial: tuple[int, ...] = tuple(initial)
        self.best: tuple[int, ...] = self.initial
        self.best_score: float | None = None
        self.current = self.best
        self.history: list[tuple[tuple[int, ...], float]] = []
        self._tried = {self.best}
        self._trial = _Trial()
        self._rng = random.Random(seed)
        self.searching = search_rounds > 0 and 0 < len(self.best) < len(self.pool)

    def record(self, skip: Sequence[int], num_forwards: int, num_accepted: int) -> None:
        """Count one verification step of a draft made with ``skip``.

        Args:
            skip: the set the draft was made with.
            num_forwards: draft forwards the step ran (the tokens drafted, plus one when
                the confidence stop discarded a token; for a tree, its number of nodes).
            num_accepted: draft tokens the target accepted.
        """
        if not self.searching or tuple(skip) != self.current:
            return
        trial = self._trial
        trial.steps += 1
        trial.forwards += num_forwards
        trial.accepted += num_accepted
        if trial.steps < self.search_steps:
            return
        self.history.append((self.current, trial.score))
        if self.best_score is None or trial.score > self.best_score:
            self.best, self.best_score = self.current, trial.score
        self._advance()

    def _advance(self) -> None:
        candidate = self._neighbour() if self.rounds_left > 0 else None
        if candidate is None:
            self.searching = False
            self.current = self.best
            return
        self.rounds_left -= 1
        self._tried.add(candidate)
        self.current = candidate
        self._trial = _Trial()

    def _neighbour(self) -> tuple[int, ...] | None:
        """An untried set one swap away from the best (``None`` if there is none)."""
        best = set(self.best)
        kept = [layer for layer in self.pool if layer not in best]
        moves = [tuple(sorted((best - {out}) | {into})) for out in sorted(best) for into in kept]
        fresh = [m for m in moves if m not in self._tried]
        return self._rng.choice(fresh) if fresh else None


#: n-gram sizes (shortest, longest) of the lookup level's prompt lookup (the ``ngram``
#: drafter's defaults)
LOOKUP_NGRAM = (2, 4)


class LayerSkipDrafter(DrafterBase):
    """Self-speculative drafting with the target minus some layers (see the module
    docstring). Holds the target, the options and the shared :class:`SkipSetSearch`.

    Args:
        target: the target on the native backend (``target.backend == "native"``); its
            ``forward_full(..., layers=...)`` runs a subset of the layers.
        options: :class:`~specdec.drafters.options.LayerSkipOptions` (default: chosen on
            the fly).

    Attributes:
        search: the on-the-fly search, or ``None`` for a fixed ``skip`` set.
        observes: whether its sequences want feedback (only while a search exists).

    Raises:
        ValueError: the target is not on the native backend, or the fixed skip set names
            layers outside the model or skips every layer.
    """

    supports_trees = True
    observes = True
    uses_target_cache = True
    confidence_stop = True

    def __init__(self, target, options: LayerSkipOptions | None = None) -> None:
        if getattr(target, "backend", None) != "native":
            raise ValueError(
                "layer-skip needs the native backend (backend='native' / --backend native, "
                "or auto on a model the runtime supports)"
            )
        self.target = target
        #: the model whose forwards draft over the target's cache: the target itself
        #: (:class:`~specdec.drafters.quantized.QuantizedDrafter` sets its quantized copy)
        self.draft_target = target
        self.options = options = options or LayerSkipOptions()
        num_layers = target.num_layers
        self.search: SkipSetSearch | None = None
        self._fixed: tuple[int, ...] = ()
        if options.skip:
            self._fixed = check_skip_set(parse_layer_set(options.skip), num_layers)
        else:
            initial = initial_skip_set(num_layers, options.skip_ratio)
            self.search = SkipSetSearch(
                num_layers, initial, options.search_steps, options.search_rounds, options.seed
            )
        self.observes = self.search is not None
        #: tokens prompt lookup guesses per draft forward (0: no lookup level)
        self.lookup = options.lookup
        self._kept: dict[tuple[int, ...], list[int] | None] = {}
        #: ``(sinks, recent, align)`` context window of draft forwards (``None``: the
        #: whole cache; :class:`~specdec.drafters.sparse_kv.SparseKVDrafter` sets it)
        self.kv_window: tuple[int, ...] | None = None
        #: tokens of the draft vocabulary's shared part (``vocab``; 0: the whole vocabulary)
        self.vocab = options.vocab
        self._shared_vocabulary: SharedVocabulary | None = None

    def shared_vocabulary(self) -> SharedVocabulary | None:
        """The draft vocabulary's part shared by this drafter's sequences, on
        :attr:`draft_target`'s LM head (``None`` without ``vocab``, or with one that
        covers the whole vocabulary: the model's own head then)."""
        if 0 < self.vocab < self.target.vocab_size and self._shared_vocabulary is None:
            self._shared_vocabulary = SharedVocabulary(
                self.draft_target, self.vocab, self.target.vocab_size
            )
        return self._shared_vocabulary

    @property
    def skip_set(self) -> tuple[int, ...]:
        """The layers skipped by the next draft."""
        return self.search.current if self.search is not None else self._fixed

    def kept_layers(self, skip: tuple[int, ...]) -> list[int] | None:
        """The layers a draft with ``skip`` runs (``None`` = all of them)."""
        if skip not in self._kept:
            run = [i for i in range(self.target.num_layers) if i not in skip]
            self._kept[skip] = run if skip else None
        return self._kept[skip]

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> LayerSkipSequence:
        """A sequence's state; it drafts once the engine attaches its cache."""
        return LayerSkipSequence(self, params)

    def propose_batch(self, requests: Sequence[ChainRequest]) -> list[DraftProposal]:
        """The chains of several sequences of this drafter at once: draft step i of every
        sequence still drafting (and drafting with the same layers) runs as one ragged
        forward of one row per sequence, so the draft's weights are read once for all of
        them instead of once per sequence (MagicDec, Chen et al. 2025, sec. 4: in a batch
        a self-draft pays where one sequence's would not).

        Each sequence's proposal is what its own :meth:`LayerSkipSequence.propose` makes
        in exact mode (the forward is batch-invariant there; each sequence draws from its
        own generator in the same order), and its cache's cursor is restored.

        Args:
            requests: one :class:`ChainRequest` per sequence (their states started by
                this drafter, each with its cache attached).

        Returns:
            one :class:`~specdec.drafters.base.DraftProposal` per request, in order.

        Raises:
            ValueError: a state without a cache, or a cache that breaks the cursor rule.
        """
        proposals = [DraftProposal([]) for _ in requests]
        chains: list[_Chain] = []
        try:
            for index, request in enumerate(requests):
                state = request.state
                state._used = None
                if request.num_tokens <= 0 or state._no_draft(request.token_ids):
                    continue
                origin = state._check_cursor(request.token_ids)
                state._used, state._forwards = state._skip_set(), 0
                state._update_vocabulary(request.token_ids)
                token, context = int(request.token_ids[-1]), state._context(request.token_ids)
                chains.append(_Chain(index, request, origin, token, context=context))
            groups: dict[tuple[int, ...], list[_Chain]] = {}
            for chain in chains:
                groups.setdefault(chain.request.state._used, []).append(chain)
            for skip, group in groups.items():
                self._draft_group(self.kept_layers(skip), group)
        finally:
            for chain in chains:
                chain.request.state.cache.truncate(chain.origin)
        for chain in chains:
            proposals[chain.index] = chain.proposal()
        return proposals

    def _draft_group(self, layers: list[int] | None, group: list[_Chain]) -> None:
        """Draft ``group``'s chains, one forward per step for all of them (see
        :meth:`propose_batch`; with a lookup level each chain's rows carry its guess)."""
        while group:
            items = []
            for chain in group:
                inputs = chain.inputs(chain.request.num_tokens, self.lookup)
                cache = chain.request.state.cache
                items.append(
                    BatchItem(
                        inputs,
                        cache,
                        num_logits=len(inputs),
                        kv_window=self.kv_window,
                        lm_head=chain.request.state.vocabulary,
                    )  # fmt: skip
                )
            outputs = self.draft_target.forward_batch_full(items, layers=layers)
            going = []
            for chain, out in zip(group, outputs, strict=True):
                request = chain.request
                request.state._forwards += 1
                if request.state._take(
                    chain, out.logits, request.generator, request.num_tokens, request.stop_drafting
                ):
                    going.append(chain)
            group = going


@dataclass
class _Chain:
    """A chain being drafted: its request (in a batch), the cache's cursor to restore,
    the token to forward next and what it drafted so far; with a lookup level, the
    sequence as an array (:class:`~specdec.drafters.options.LayerSkipOptions.lookup`)
    and the guess forwarded after the pending token."""

    index: int
    request: ChainRequest | None
    origin: int
    token: int
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    context: np.ndarray | None = None
    guess: list[int] = field(default_factory=list)

    def inputs(self, num_tokens: int, size: int) -> list[int]:
        """The next forward's tokens: the pending token, then (with a lookup level) up to
        ``size`` tokens prompt lookup expects after it, no more than the chain can still
        take."""
        self.guess = []
        room = min(size, num_tokens - len(self.tokens) - 1)
        if self.context is not None and room > 0:
            context = self.context
            if self.tokens:
                context = np.concatenate([context, np.asarray(self.tokens, dtype=np.int64)])
            self.guess = find_ngram_continuation(context, *LOOKUP_NGRAM, room).tolist()
        return [self.token, *self.guess]

    def add(self, token: int, row: torch.Tensor | None, top: float) -> None:
        """Append a drafted token (its distribution when sampled, its top probability)."""
        self.token = token
        self.tokens.append(token)
        self.confidence.append(top)
        if row is not None:
            self.rows.append(row)

    def proposal(self) -> DraftProposal:
        rows = torch.stack(self.rows) if self.rows else None
        return DraftProposal(self.tokens, rows, self.confidence)


class FixedSelfDrafter(LayerSkipDrafter):
    """A self-draft with a fixed set of skipped layers (empty: every layer runs) and no
    search: the base of :class:`~specdec.drafters.sparse_kv.SparseKVDrafter` and
    :class:`~specdec.drafters.quantized.QuantizedDrafter`.

    Args:
        target: the target on the native backend.
        name: the drafter's registry name (for the refusal).
        why: why it needs the native backend (for the refusal).
        skip: the fixed set (see :func:`~specdec.drafters.options.parse_layer_set`).
        confidence: the chain's confidence stop, in [0, 1).
        lookup: prompt lookup's guesses per draft forward (0: none).
        vocab: the draft vocabulary's shared tokens (0: the whole vocabulary; see
            :class:`~specdec.drafters.options.LayerSkipOptions`).

    Raises:
        ValueError: the target is not on the native backend, or ``skip`` names layers
            outside the model or skips every layer.
    """

    def __init__(
        self,
        target,
        name: str,
        why: str,
        skip: str,
        confidence: float,
        lookup: int = 0,
        vocab: int = 0,
    ) -> None:
        if getattr(target, "backend", None) != "native":
            raise ValueError(
                f"{name} needs the native backend (backend='native' / --backend native, "
                f"or auto on a model the runtime supports): {why}"
            )
        options = LayerSkipOptions(
            skip=skip, skip_ratio=0.0, confidence=confidence, search_rounds=0, lookup=lookup,
            vocab=vocab,
        )  # fmt: skip
        super().__init__(target, options)
        self.search = None  # nothing is searched
        self.observes = False


class LayerSkipSequence(DrafterBase):
    """One sequence's drafting over its own KV cache (attached by the engine)."""

    uses_target_cache = True

    def __init__(self, drafter: LayerSkipDrafter, params: SamplingParams) -> None:
        self.drafter = drafter
        self.target = drafter.draft_target  # runs the draft forwards
        self.params = params
        # a seeded sampled generation must not depend on earlier requests: it drafts with
        # the search's starting set and does not feed the search
        self.isolated = needs_isolation(params) and drafter.search is not None
        self.observes = drafter.observes and not self.isolated
        self.cache = None
        self._used: tuple[int, ...] | None = None  # skip set of the last draft
        self._forwards: int | None = None  # its draft forwards (None: a tree)
        shared = drafter.shared_vocabulary()
        #: the draft vocabulary (``None``: the whole vocabulary; see ``vocab``)
        self.vocabulary = DraftVocabulary(shared) if shared is not None else None

    def _update_vocabulary(self, token_ids: Sequence[int]) -> None:
        """Bring the draft vocabulary up to the sequence (its new tokens join it)."""
        if self.vocabulary is not None:
            self.vocabulary.update(token_ids)

    def attach_cache(self, cache) -> None:
        """Draft over ``cache`` (the sequence's :class:`NativeKVCache`) from now on."""
        self.cache = cache

    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        *,
        stop_drafting: Callable[[int, float], bool] | None = None,
    ) -> DraftProposal:
        """Draft up to ``num_tokens`` tokens after ``token_ids`` with the kept layers;
        ``stop_drafting(i, confidence)`` may end the draft before position i's token.

        Returns:
            the chain; ``draft_probs`` ``[k', V]`` float32 when sampling, else ``None``;
            ``confidence``: each position's top draft probability.

        Raises:
            ValueError: no cache attached, or the cache does not hold exactly every token
                but the pending one (the cursor rule).
        """
        self._used = None
        if num_tokens <= 0 or self._no_draft(token_ids):
            return DraftProposal([])
        origin = self._check_cursor(token_ids)
        skip = self._skip_set()
        self._used, self._forwards = skip, 0
        self._update_vocabulary(token_ids)
        layers = self.drafter.kept_layers(skip)
        chain = _Chain(0, None, origin, int(token_ids[-1]), context=self._context(token_ids))
        try:
            while True:
                inputs = chain.inputs(num_tokens, self.drafter.lookup)
                out = self.target.forward_full(
                    inputs, self.cache, num_logits=len(inputs), **self._draft_args(layers)
                )
                self._forwards += 1
                if not self._take(chain, out.logits, generator, num_tokens, stop_drafting):
                    break
        finally:
            self.cache.truncate(origin)
        return chain.proposal()

    def _context(self, token_ids: Sequence[int]) -> np.ndarray | None:
        """The sequence as an array for the lookup level (``None`` without one)."""
        if self.drafter.lookup <= 0:
            return None
        return np.asarray(token_ids, dtype=np.int64)

    def _take(self, chain: _Chain, logits, generator, num_tokens: int, stop) -> bool:
        """Draft from one forward's rows (the chain's pending token, then its lookup
        guess): row i's token is drafted as a forward of that row alone would draft it;
        the next row counts only while the guess holds that token. Rolls the cache back
        to the rows used. Returns whether the chain goes on drafting."""
        guess = chain.guess
        used = 0
        going = True
        for row in range(logits.shape[0]):
            used = row + 1
            picked = self._pick(logits[row : row + 1], generator, len(chain.tokens), stop)
            if picked is None:
                going = False
                break
            chain.add(*picked)
            if len(chain.tokens) >= num_tokens:
                going = False
                break
            if row >= len(guess) or guess[row] != chain.token:
                break
        self.cache.truncate(self.cache.num_tokens - logits.shape[0] + used)
        return going

    def _pick(
        self, logits: torch.Tensor, generator: torch.Generator, position: int = 0, stop=None
    ) -> tuple[int, torch.Tensor | None, float] | None:
        """The draft token from ``[1, V]`` logits, its distribution (``None`` when
        greedy) and its top probability; ``None`` when that probability is below the
        confidence threshold or ``stop(position, top)`` says so."""
        threshold = self.drafter.options.confidence
        vocabulary = self.vocabulary
        if self.params.greedy:  # over the draft vocabulary's columns, mapped back
            top = float(torch.softmax(logits[0].float(), -1).max())
            probs = None
        else:
            if vocabulary is not None:
                logits = vocabulary.spread(logits)
            probs = logits_to_probs(logits, self.params)
            top = float(probs[0].max())
        if top < threshold or (stop is not None and stop(position, top)):
            return None
        if probs is None:
            token = int(greedy_ids(logits[0]))
            if vocabulary is not None:
                token = int(vocabulary.columns[token])
            return token, None, top
        return int(sample(probs, generator)), probs[0], top

    def _skip_set(self) -> tuple[int, ...]:
        return self.drafter.search.initial if self.isolated else self.drafter.skip_set

    def _no_draft(self, token_ids: Sequence[int]) -> bool:
        """Whether this step drafts nothing (a subclass's rule, e.g. a short context)."""
        return False

    def _draft_args(self, layers: list[int] | None) -> dict:
        """Keyword arguments of a draft forward: the layers run, the KV window and the
        draft vocabulary's head."""
        args = {"layers": layers, "kv_window": self.drafter.kv_window}
        if self.vocabulary is not None:
            args["lm_head"] = self.vocabulary
        return args

    def _check_cursor(self, token_ids: Sequence[int]) -> int:
        if self.cache is None:
            raise ValueError("layer-skip drafts over the target's cache: call attach_cache first")
        if self.cache.num_tokens != len(token_ids) - 1:
            raise ValueError(
                f"the cache holds {self.cache.num_tokens} tokens; the cursor rule wants "
                f"{len(token_ids) - 1} (every token but the pending one)"
            )
        return self.cache.num_tokens

    def observe(self, feedback: VerificationFeedback) -> None:
        """Report the step's acceptance to the drafter's search."""
        search = self.drafter.search
        if search is not None and self._used is not None and not self.isolated:
            forwards = feedback.num_drafted if self._forwards is None else self._forwards
            search.record(self._used, forwards, feedback.num_accepted)
        self._used = None  # one record per draft

    def tree_session(
        self, token_ids: Sequence[int], params: SamplingParams
    ) -> LayerSkipTreeSession:
        """A :class:`~specdec.trees.builders.TreeSession` over the sequence's cache."""
        origin = self._check_cursor(token_ids)
        self.params = params
        self._used, self._forwards = self._skip_set(), None
        self._update_vocabulary(token_ids)
        args = self._draft_args(self.drafter.kept_layers(self._used))
        return LayerSkipTreeSession(self.target, self.cache, args, token_ids, params, origin)

    def close(self) -> None:
        """Forget the cache (the engine owns it)."""
        self.cache = None


class LayerSkipTreeSession(CachedTreeSession):
    """Tree drafting with the kept layers: the pending token is forwarded first, then each
    ``expand`` forwards the new nodes with tree attention after it (node at depth d sits at
    position ``len(sequence) - 1 + d`` and sees the prefix, its ancestors and itself).
    ``close`` rolls the cursor back to where the session found it.

    Candidate scores are draft probabilities: softmax of the logits when greedy, else the
    processed sampling distribution, which children are also drawn from.

    Args:
        target: the native target.
        cache: the sequence's cache, holding every token but the pending one.
        draft_args: keyword arguments of every draft forward: ``layers`` (the layers to
            run, ``None`` = all) and optionally ``kv_window``.
        token_ids: the sequence (its last token is the pending root).
        params: sampling parameters.
        origin: ``cache.num_tokens`` to restore on ``close``.
    """

    def __init__(self, target, cache, draft_args, token_ids, params, origin: int) -> None:
        self.target, self.cache, self.draft_args, self.params = target, cache, draft_args, params
        self.origin = origin
        try:
            out = target.forward_full([int(token_ids[-1])], cache, num_logits=1, **draft_args)
        except Exception:
            cache.truncate(origin)
            raise
        self.base = cache.num_tokens  # == len(token_ids)
        self._init_tree(self._spread(out.logits)[0])

    def _spread(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (a draft vocabulary's columns spread, the
        other tokens at ``-inf``)."""
        vocabulary = self.draft_args.get("lm_head")
        return logits if vocabulary is None else vocabulary.spread(logits)

    def _run_nodes(self, nodes: list[int], positions: list[int], mask: torch.Tensor):
        out = self.target.forward_full(
            [self.tokens[n] for n in nodes],
            self.cache,
            positions=positions,
            tree_mask=mask,
            **self.draft_args,
        )
        return self._spread(out.logits)

    def close(self) -> None:
        self.cache.truncate(self.origin)
