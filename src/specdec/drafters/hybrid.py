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

The choice (``choose=``): ``threshold`` (default) is the fixed rule above. ``goodput``
learns it (:class:`GoodputChoice`): per step, the draft with the higher expected tokens
per second, ``(1 + E[accepted]) / (draft time + verification time)``, as BanditSpec
(Hou et al. 2025, arXiv:2505.15141) chooses among drafting configurations by their
measured reward, and as OPT-Tree (Wang et al. 2024) sizes a tree by tokens per time; the
suffix draft's expected acceptance is learned per bin of its score (SuffixDecoding's
score as the prior), the model's as one discounted mean, the times measured on the
steps each made. Seeded sampled requests keep the fixed rule: their output must not
depend on timing.

Chains only (no token trees): the two drafters' trees have different shapes and budgets.
Not implemented: SAM-Decoding's static corpus automaton (the global suffix tree of earlier
requests stands in for it).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import ChainRequest, DrafterBase, DraftProposal, check_drafter
from specdec.drafters.options import HybridOptions
from specdec.drafters.suffix import SuffixDrafter, SuffixSequence, greedy_path

logger = logging.getLogger(__name__)


#: Upper edges of the bins of the suffix draft's score (its expected accepted tokens under
#: the tree's continuation frequencies) in which :class:`GoodputChoice` learns the
#: acceptance the suffix draft really gets; scores above the last share the last bin.
SCORE_BINS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


@dataclass
class _Mean:
    """A discounted running mean: ``total`` and ``weight`` both decay by ``decay`` per
    observation."""

    total: float = 0.0
    weight: float = 0.0

    def add(self, value: float, decay: float) -> None:
        self.total = decay * self.total + value
        self.weight = decay * self.weight + 1.0

    def mean(self, prior: float, prior_weight: float = 1.0) -> float:
        """The mean with ``prior`` counted as ``prior_weight`` observations."""
        return (self.total + prior * prior_weight) / (self.weight + prior_weight)


class _RowCost:
    """Seconds of a verification of ``rows`` rows, ``a + b * rows``, fitted by discounted
    least squares to the steps seen (``b`` kept >= 0: with one row count seen, or noise
    suggesting a negative slope, the mean)."""

    def __init__(self) -> None:
        self.sums = [0.0] * 5  # weight, rows, rows^2, seconds, rows * seconds

    def add(self, rows: int, seconds: float, decay: float) -> None:
        values = (1.0, rows, rows * rows, seconds, rows * seconds)
        self.sums = [decay * s + v for s, v in zip(self.sums, values, strict=True)]

    @property
    def weight(self) -> float:
        return self.sums[0]

    def __call__(self, rows: int) -> float:
        w, r, r2, y, ry = self.sums
        if w <= 0:
            return 0.0
        det = w * r2 - r * r
        slope = (w * ry - r * y) / det if det > 1e-9 * w * w else 0.0
        if slope <= 0:
            return y / w
        return (y - slope * r) / w + slope * rows


class GoodputChoice:
    """The learned rule of ``hybrid:choose=goodput``: which draft a step takes.

    Per step the hybrid compares the two drafts' expected tokens per second (BanditSpec,
    Hou et al. 2025, arXiv:2505.15141: choose the drafting configuration by its measured
    reward; the rate is OPT-Tree's objective, Wang et al. 2024, arXiv:2406.17276):

        suffix:  (1 + A_s(bin(score))) / V(1 + n_s)
        model:   (1 + A_m) / (D_m + V(1 + n_m))

    ``n_s``, ``n_m``: the two drafts' lengths; ``A_s(b)``: the tokens the target accepted
    of the suffix drafts whose score fell in bin ``b`` of :data:`SCORE_BINS` (prior: the
    score itself, capped at the draft's length, as one observation); ``A_m``: of the
    model's drafts (prior 1 token); ``D_m``: the model drafter's seconds per step;
    ``V(rows)``: seconds from a draft to its verification's feedback (the target's forward
    and the verification), ``a + b * rows`` fitted to every step of either source. All are
    discounted over the steps of every sequence of the drafter (``decay`` per
    observation), so the rule follows a change of workload. The suffix draft is free to
    make, so only its verification counts. Until both sources have been seen the fixed
    rule decides (``score >= threshold``), which drafts with both at the start.

    Args:
        threshold: the fixed rule's least score.
        decay: weight kept by the past per observation, in (0, 1).

    Raises:
        ValueError: a decay outside (0, 1).
    """

    def __init__(self, threshold: float, decay: float = 0.98) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.threshold, self.decay = float(threshold), decay
        self.suffix_accepted = [_Mean() for _ in range(len(SCORE_BINS) + 1)]
        self.model_accepted = _Mean()
        self.model_draft_s = _Mean()
        self.verify_s = _RowCost()

    @staticmethod
    def bin(score: float) -> int:
        """The bin of a suffix draft's score (an index into :data:`SCORE_BINS`, or its
        length for scores above the last edge)."""
        return bisect.bisect_left(SCORE_BINS, score)

    def rates(self, score: float, suffix_tokens: int, model_tokens: int):
        """``(suffix, model)`` expected tokens per second of a suffix draft of
        ``suffix_tokens`` tokens with this ``score`` and of a model draft of
        ``model_tokens``, or ``None`` before both sources have been seen."""
        suffix_seen = any(m.weight for m in self.suffix_accepted)
        if not (suffix_seen and self.model_draft_s.weight):
            return None
        prior = min(score, float(suffix_tokens))
        accepted = self.suffix_accepted[self.bin(score)].mean(prior)
        suffix = (1.0 + accepted) / max(self.verify_s(1 + suffix_tokens), 1e-9)
        model_s = self.model_draft_s.mean(0.0, 0.0) + self.verify_s(1 + model_tokens)
        model = (1.0 + self.model_accepted.mean(1.0)) / max(model_s, 1e-9)
        return suffix, model

    def take_suffix(self, score: float, suffix_tokens: int, model_tokens: int) -> bool:
        """Whether the step takes the suffix draft (see the class docstring)."""
        rates = self.rates(score, suffix_tokens, model_tokens)
        if rates is None:
            return score >= self.threshold
        return rates[0] >= rates[1]

    def record(
        self,
        source: str,
        drafted: int,
        accepted: int,
        verify_s: float,
        score: float | None = None,
        draft_s: float | None = None,
    ) -> None:
        """One verified step of ``source`` (``"suffix"``, with its draft's ``score``, or
        ``"model"``, with its ``draft_s``): ``drafted`` tokens, ``accepted`` of them kept,
        ``verify_s`` seconds from the draft to the feedback."""
        decay = self.decay
        self.verify_s.add(1 + drafted, verify_s, decay)
        if source == "suffix":
            self.suffix_accepted[self.bin(score or 0.0)].add(accepted, decay)
        else:
            self.model_accepted.add(accepted, decay)
            if draft_s is not None:
                self.model_draft_s.add(draft_s, decay)


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
        self.model_observes = bool(getattr(model, "observes", False))
        # the learned choice reads every verification, whether the model drafter does or not
        self.choice = GoodputChoice(options.threshold) if options.choose == "goodput" else None
        self.observes = self.model_observes or self.choice is not None
        self.uses_target_cache = bool(getattr(model, "uses_target_cache", False))
        self.confidence_stop = bool(getattr(model, "confidence_stop", False))
        self.captures = tuple(getattr(model, "captures", ()))
        # a suffix draft may be longer than the model's longest (Medusa's heads, a block)
        self._model_most = getattr(model, "max_draft_tokens", None)
        self.acceptance_prior = getattr(model, "acceptance_prior", None)
        if hasattr(model, "propose_batch"):  # the engine batches a self-draft's chains
            self.propose_batch = self._propose_batch
        self.stats = {"suffix": 0, "model": 0}
        if self.choice is None:
            logger.info(
                "hybrid: the suffix draft where its score is >= %g, else %s's",
                options.threshold,
                options.model_name,
            )
        else:
            logger.info(
                "hybrid: the suffix draft or %s's, whichever is expected to give more "
                "tokens per second (learned; score >= %g until both are timed)",
                options.model_name,
                options.threshold,
            )

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> HybridSequence:
        """One sequence's state: a suffix sequence and a model sequence."""
        return HybridSequence(
            self,
            self.suffix.start(prompt_ids, params),
            self.model.start(prompt_ids, params),
            learned=self.choice is not None and (params.greedy or params.seed is None),
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
            t0 = time.perf_counter()
            proposals = self.model.propose_batch(inner)
            draft_s = time.perf_counter() - t0  # the step waits for the whole batch
            for i, proposal in zip(rest, proposals, strict=True):
                out[i] = replace(proposal, source="model")
                requests[i].state.drafted("model", draft_s=draft_s)
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

    def __init__(
        self, drafter: HybridDrafter, suffix: SuffixSequence, model, learned: bool = False
    ) -> None:
        self.drafter = drafter
        self.suffix = suffix
        self.model = model
        #: the learned choice decides this sequence's steps (else the fixed threshold)
        self.learned = learned
        # the last draft, until its feedback: (source, score, draft seconds, end time)
        self._pending: tuple[str, float | None, float | None, float] | None = None

    def suffix_draft(self, token_ids: Sequence[int], num_tokens: int) -> DraftProposal | None:
        """The suffix trees' greedy chain of at most ``num_tokens`` tokens when the rule
        takes it (fixed: its score is at least the threshold; learned:
        :meth:`GoodputChoice.take_suffix`), counted in the drafter's stats, else ``None``
        (the model drafts; counted too)."""
        self._pending = None
        found = self.suffix.match(token_ids, num_tokens) if num_tokens > 0 else None
        if found is not None:
            tokens, score = greedy_path(found.node, found.limit, self.suffix.options.min_token_prob)
            choice = self.drafter.choice
            if tokens and (
                choice.take_suffix(score, len(tokens), self.drafter.model_tokens(num_tokens))
                if self.learned
                else score >= self.drafter.options.threshold
            ):
                self.drafter.stats["suffix"] += 1
                self.drafted("suffix", score=score)
                return DraftProposal(tokens, source="suffix")
        self.drafter.stats["model"] += 1
        return None

    def drafted(self, source: str, score: float | None = None, draft_s: float | None = None):
        """Note this step's draft for the learned choice (timed from now to its feedback)."""
        if self.learned:
            self._pending = (source, score, draft_s, time.perf_counter())

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
        t0 = time.perf_counter()
        proposal = self.model.propose(
            token_ids, self.drafter.model_tokens(num_tokens), generator, **kwargs
        )
        self.drafted("model", draft_s=time.perf_counter() - t0)
        return replace(proposal, source="model")

    def attach_cache(self, cache) -> None:
        """The model drafter's (a self-draft drafts over the target's cache)."""
        self.model.attach_cache(cache)

    def observe(self, feedback) -> None:
        """The learned choice records the step (its draft's accepted tokens and times);
        the model drafter, if it observes, learns from every verification, whichever
        drafted (the engine calls this only when one of them observes)."""
        pending, self._pending = self._pending, None
        if pending is not None and self.drafter.choice is not None:
            source, score, draft_s, t_end = pending
            self.drafter.choice.record(
                source,
                feedback.num_drafted,
                feedback.num_accepted,
                time.perf_counter() - t_end,
                score,
                draft_s,
            )
        if self.drafter.model_observes:
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
