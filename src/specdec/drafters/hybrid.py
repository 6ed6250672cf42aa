"""Hybrid drafting: per step, a free suffix-tree draft when its match is confident, else
a model drafter's draft.

Sources:

* SAM-Decoding (Hu et al. 2024, arXiv:2411.10666): a suffix automaton over the context
  and a text corpus drafts when its match is long enough; otherwise an auxiliary drafter
  (a draft model, EAGLE) drafts. Retrieval drafts cost next to nothing, so they win
  wherever the output repeats what came before; a model's drafts cost forwards, and win
  wherever it does not.
* SuffixDecoding (Oliaro et al. 2025, arXiv:2411.04975), its hybrid with EAGLE-3 as
  Snowflake's Arctic Inference runs it: the suffix draft is taken when its score (the
  expected number of its tokens accepted, under the tree's continuation frequencies) is
  at least a threshold, else the model's.

What this module implements: :class:`HybridDrafter` (``hybrid``), which wraps a
:class:`~specdec.drafters.suffix.SuffixDrafter` and any chain drafter (``model=``,
default ``quantized``). At each step its sequence matches the context in the suffix trees
(this request's own, and the global one of earlier requests); if the greedy path's score
is at least ``threshold``, that path is the step's chain (deterministic: verified as
point masses); otherwise the model drafter's sequence drafts the step (with its own
draft distributions when sampling). The model drafter sees every verification it asks
for, whichever drafted (a head drafter keeps reading the target's hidden states), and a
self-draft keeps the target's cache attached.

Losslessness never depends on the choice: each step's proposal is verified with the
distributions of the drafter that made it, and the choice reads only the committed
tokens and the suffix trees (never the random stream), so seeded generations stay
reproducible.

Chains only (no token trees): the two drafters' trees have different shapes and budgets.
Not implemented: SAM-Decoding's static corpus automaton (the global suffix tree of earlier
requests stands in for it) and a learned choice between the two (a bandit).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import ChainRequest, DrafterBase, DraftProposal, check_drafter
from specdec.drafters.options import HybridOptions
from specdec.drafters.suffix import SuffixDrafter, SuffixSequence, greedy_path

logger = logging.getLogger(__name__)


class HybridDrafter(DrafterBase):
    """A suffix-tree draft when confident, else a model drafter's (see the module
    docstring).

    Args:
        suffix: the suffix drafter (its own options: depth, global cache, ...).
        model: the model drafter (a chain drafter: no auxiliary rows).
        options: :class:`~specdec.drafters.options.HybridOptions`.

    Attributes:
        suffix, model: the two drafters.
        options: the options (``threshold``: the suffix draft's least score to be taken).
        stats: ``{"suffix": n, "model": n}``: steps each drafted, over every sequence.

    Raises:
        ValueError: a model drafter that adds auxiliary rows to verification (Lookahead
            decoding), or is itself a hybrid.
    """

    #: why the engine refuses token trees with it (chains only)
    tree_refusal = (
        "hybrid cannot draft token trees: it drafts chains only (its two drafters' trees "
        "differ); drop the tree, or use suffix or the model drafter alone for trees"
    )

    def __init__(self, suffix: SuffixDrafter, model, options: HybridOptions | None = None):
        options = options or HybridOptions()
        check_drafter(model)
        if isinstance(model, HybridDrafter):
            raise ValueError("hybrid:model= cannot be another hybrid drafter")
        if getattr(model, "max_aux_rows", 0):
            raise ValueError(
                f"hybrid:model={options.model_name} adds rows to verification (Lookahead "
                "decoding); choose a chain drafter (quantized, layer-skip, sparse-kv, eagle, "
                "draft-model, ...)"
            )
        self.suffix, self.model, self.options = suffix, model, options
        self.observes = bool(getattr(model, "observes", False))
        self.uses_target_cache = bool(getattr(model, "uses_target_cache", False))
        self.confidence_stop = bool(getattr(model, "confidence_stop", False))
        self.captures = tuple(getattr(model, "captures", ()))
        # a suffix draft may be longer than the model's longest (Medusa's heads, a block)
        self._model_most = getattr(model, "max_draft_tokens", None)
        self.acceptance_prior = getattr(model, "acceptance_prior", None)
        if hasattr(model, "propose_batch"):  # the engine batches a self-draft's chains
            self.propose_batch = self._propose_batch
        self.stats = {"suffix": 0, "model": 0}
        logger.info(
            "hybrid: the suffix draft where its score is >= %g, else %s's",
            options.threshold,
            options.model_name,
        )

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> HybridSequence:
        """One sequence's state: a suffix sequence and a model sequence."""
        return HybridSequence(
            self, self.suffix.start(prompt_ids, params), self.model.start(prompt_ids, params)
        )

    def _propose_batch(self, requests: Sequence[ChainRequest]) -> list[DraftProposal]:
        """The chains of several sequences: suffix drafts where confident, the others in
        one batched call of the model drafter."""
        out: list[DraftProposal | None] = []
        rest: list[int] = []
        for i, request in enumerate(requests):
            state: HybridSequence = request.state
            picked = state.suffix_draft(request.token_ids, request.num_tokens)
            out.append(picked)
            if picked is None:
                rest.append(i)
        if rest:
            inner = [
                replace(
                    requests[i],
                    state=requests[i].state.model,
                    num_tokens=self.model_tokens(requests[i].num_tokens),
                )
                for i in rest
            ]
            for i, proposal in zip(rest, self.model.propose_batch(inner), strict=True):
                out[i] = replace(proposal, source="model")
        return out  # type: ignore[return-value]

    def model_tokens(self, num_tokens: int) -> int:
        """The model drafter's share of a step of ``num_tokens``: capped by
        ``model_tokens`` and by the model's own longest chain (``max_draft_tokens``)."""
        for cap in (self.options.model_tokens, self._model_most):
            if cap:
                num_tokens = min(num_tokens, cap)
        return num_tokens


class HybridSequence(DrafterBase):
    """One sequence's hybrid drafting: its suffix sequence and its model sequence."""

    def __init__(self, drafter: HybridDrafter, suffix: SuffixSequence, model) -> None:
        self.drafter = drafter
        self.suffix = suffix
        self.model = model

    def suffix_draft(self, token_ids: Sequence[int], num_tokens: int) -> DraftProposal | None:
        """The suffix trees' greedy chain of at most ``num_tokens`` tokens when its score
        is at least the threshold (counted in the drafter's stats), else ``None`` (the
        model drafts; counted too)."""
        found = self.suffix.match(token_ids, num_tokens) if num_tokens > 0 else None
        if found is not None:
            tokens, score = greedy_path(found.node, found.limit, self.suffix.options.min_token_prob)
            if tokens and score >= self.drafter.options.threshold:
                self.drafter.stats["suffix"] += 1
                return DraftProposal(tokens, source="suffix")
        self.drafter.stats["model"] += 1
        return None

    def propose(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        generator: torch.Generator,
        **kwargs,
    ) -> DraftProposal:
        """The suffix chain when confident, else the model drafter's chain (``kwargs``,
        e.g. ``stop_drafting``, go to the model drafter)."""
        if num_tokens <= 0:
            return DraftProposal([])
        picked = self.suffix_draft(token_ids, num_tokens)
        if picked is not None:
            return picked
        proposal = self.model.propose(
            token_ids, self.drafter.model_tokens(num_tokens), generator, **kwargs
        )
        return replace(proposal, source="model")

    def attach_cache(self, cache) -> None:
        """The model drafter's (a self-draft drafts over the target's cache)."""
        self.model.attach_cache(cache)

    def observe(self, feedback) -> None:
        """The model drafter learns from every verification, whichever drafted (the
        engine calls this only when the model drafter observes)."""
        self.model.observe(feedback)

    def observe_prefill(self, start: int, hidden: torch.Tensor) -> None:
        """The model drafter's (a head reads the prompt's hidden states)."""
        self.model.observe_prefill(start, hidden)

    def close(self) -> None:
        """Both sequences' (the suffix sequence adds its output to the global tree)."""
        try:
            self.suffix.close()
        finally:
            close = getattr(self.model, "close", None)
            if close is not None:
                close()
