"""The Drafter protocol: what the engine asks of every drafter."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.config import SamplingParams


@dataclass
class DraftProposal:
    """Draft tokens for one verification step.

    Attributes:
        token_ids: ``[k']`` proposed token ids (``k'`` may be smaller than requested, even 0).
        draft_probs: ``[k', vocab_size]`` float32 distributions the tokens were sampled from,
            in the target's vocabulary; ``None`` for deterministic drafters, whose tokens are
            verified as point masses (still lossless).
        confidence: ``[k']`` optional: the top probability of the draft distribution at
            each position (a function of the earlier draft tokens only), for confidence
            stops (:mod:`specdec.control`); derived from ``draft_probs`` when absent.
        source: which of its sources a drafter that chooses one per step drafted with
            (``hybrid``: ``"suffix"`` or ``"model"``), counted per request in
            :attr:`~specdec.metrics.SpecStats.draft_sources`; ``None`` for other drafters.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    confidence: list[float] | None = None
    source: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class ChainRequest:
    """One sequence's part of a drafter's ``propose_batch(requests) ->
    list[DraftProposal]`` (optional; self-drafts such as
    :meth:`~specdec.drafters.layer_skip.LayerSkipDrafter.propose_batch` draft the chains
    of several sequences in shared forwards): the arguments of the sequence's own
    ``propose``.

    Attributes:
        state: the sequence's drafter state (started by the drafter that batches).
        token_ids: the sequence's tokens (the last one is pending).
        num_tokens: the most draft tokens (k).
        generator: the sequence's generator (sampled drafts draw from it).
        stop_drafting: ``stop(i, confidence)`` ends the chain before position i, or
            ``None``.
    """

    state: object
    token_ids: Sequence[int]
    num_tokens: int
    generator: torch.Generator
    stop_drafting: Callable[[int, float], bool] | None = None


@dataclass
class AuxRows:
    """Rows a drafter adds to the verification forward that are not drafts (Lookahead
    decoding's lookahead branch): they see the cached prefix, the pending token and the
    auxiliary rows their mask allows -- never the draft -- and no draft row sees them, so
    they cannot change what is verified. They are never kept in the KV cache; their
    logits come back in :attr:`VerificationFeedback.aux_logits`.

    Attributes:
        token_ids: ``[m]`` their tokens.
        position_offsets: ``[m]`` positions relative to the pending token's (>= 1).
        mask: ``[m, m]`` bool: row i sees auxiliary row j (``mask[i, i]`` must be True).
    """

    token_ids: list[int]
    position_offsets: list[int]
    mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class VerificationFeedback:
    """What the target said about one step's draft, for drafters that learn from it.

    Attributes:
        input_ids: ``[n]`` the tokens the target ran in this verification: the pending
            token, then the draft chain or the tree's nodes (in tree order).
        parents: for a token tree, ``[n - 1]`` each node's parent (``-1`` = the pending
            token); ``None`` for a chain (row i's parent is row i - 1).
        target_logits: ``[n, V]`` float32: row i is the target's next-token logits after
            ``input_ids[i]`` (on its root path). Read-only.
        accepted_rows: rows on the accepted path, starting with ``0`` (the pending token).
        output_token_ids: the tokens this step emitted (accepted + recovered or bonus),
            before any stop truncation.
        aux_logits: ``[m, V]`` float32 logits of the step's :class:`AuxRows` (``None``
            without them).
        hidden: ``[n, len(captures) * hidden_size]`` (the target's dtype) for drafters
            that declare ``captures``: the target's hidden states of every verified row
            (same rows as ``target_logits``; see
            :attr:`specdec.models.base.ForwardOutput.captured`); ``None`` otherwise.
    """

    input_ids: list[int]
    parents: list[int] | None
    target_logits: torch.Tensor
    accepted_rows: list[int]
    output_token_ids: list[int]
    aux_logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def num_drafted(self) -> int:
        return len(self.input_ids) - 1

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_rows) - 1


@runtime_checkable
class SequenceDrafter(Protocol):
    """One sequence's drafter: all per-sequence state (e.g. a draft model's KV cache)
    lives here, so any number of sequences can be drafted for in any interleaving.

    Optionally also ``tree_session(token_ids, params)`` for token trees (see
    :class:`specdec.trees.builders.TreeSession`).
    """

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        """Propose up to ``num_tokens`` tokens to follow ``token_ids`` (prompt + output so far)."""

    def close(self) -> None:
        """Release the sequence's state (called once, when its generation ends or stops)."""


@runtime_checkable
class Drafter(Protocol):
    """Makes a :class:`SequenceDrafter` per sequence; never decides how many tokens to
    draft (the engine passes ``num_tokens``). Holds only what sequences share (a loaded
    draft model, a cross-request cache, settings); a stateless drafter may return itself
    from ``start``.

    Capabilities are declared as class attributes (see :class:`DrafterBase`), read once
    when a request is added:

    * ``supports_trees``: its sequences offer ``tree_session(token_ids, params)`` (a
      :class:`~specdec.trees.builders.TreeSession`); the engine refuses token trees
      otherwise.
    * ``observes``: after every verification the engine calls its sequence's
      ``observe(feedback)`` with a :class:`VerificationFeedback` (the target's logits
      on every verified row); Token Recycling learns from it.
    * ``uses_target_cache``: self-speculative drafters (layer skip) draft with the target
      itself over the sequence's own KV cache. Right after ``start`` (and after every
      readmission following a preemption) the engine calls the sequence's
      ``attach_cache(cache)``. At each ``propose`` / ``tree_session`` the cache holds
      every token but the pending one (the cursor rule); the drafter may write draft
      tokens past that point but must leave ``cache.num_tokens`` as it found it (the
      verification forward overwrites those slots).
    * ``max_aux_rows`` (int, default 0): after drafting, the engine asks the sequence's
      ``aux_rows(token_ids)`` for up to this many :class:`AuxRows` to run in the same
      forward (Lookahead decoding); the scheduler counts them in the token budget.
    * ``captures`` (tuple of ints, default empty): hidden-state indices of the target
      its sequences read (draft heads such as EAGLE and Medusa; indices as in
      :attr:`specdec.models.base.ForwardOutput.captured`). The engine captures them in
      every forward of the sequence: after each prompt chunk it calls the sequence's
      ``observe_prefill(start, hidden)`` (``hidden`` ``[T, len(captures) * hidden_size]``
      for the tokens ``start .. start + T`` of the sequence; every token but the pending
      one is prefilled, again after a readmission), and every verification's rows reach
      ``observe(feedback)`` in :attr:`VerificationFeedback.hidden`.
    * ``acceptance_prior`` (float in [0, 1] or ``None``, default ``None``): the drafter's
      own estimate of a first draft token's acceptance rate, where it knows better than
      a controller's generic prior (a quantized self-draft of the target's own weights);
      the ``cost`` controller starts from it.
    * ``max_draft_tokens`` (int or ``None``, default ``None``): the most tokens one chain
      proposal can hold (Medusa: its heads; a parallel head: its block). The engine caps
      the chain length the controller chooses from (and its ``chosen k`` counts) at it.
    * ``confidence_stop``: its sequences' ``propose`` also takes ``stop_drafting=fn``
      and calls ``fn(position, confidence)`` with the top probability of the draft
      distribution before keeping each token, stopping when it returns True (so a
      confidence-stopping controller saves the draft work, not only the verification).
    """

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> SequenceDrafter:
        """Begin drafting for a new sequence (optionally prefilling its own state)."""


class DrafterBase:
    """Optional base class for drafters and their sequence states: declares no
    capabilities and gives the optional methods a default."""

    #: its sequences offer ``tree_session`` (token trees)
    supports_trees: bool = False
    #: its sequences want ``observe(feedback)`` after every verification
    observes: bool = False
    #: its sequences draft over the target's KV cache (``attach_cache(cache)``)
    uses_target_cache: bool = False
    #: most :class:`AuxRows` its sequences add to a verification (``aux_rows(token_ids)``)
    max_aux_rows: int = 0
    #: its sequences' ``propose`` takes ``stop_drafting=fn`` and asks ``fn(position,
    #: confidence)`` before keeping each draft token, ending the draft when it returns True
    confidence_stop: bool = False
    #: hidden-state indices of the target its sequences read (``observe_prefill`` and
    #: :attr:`VerificationFeedback.hidden`)
    captures: tuple[int, ...] = ()
    #: the most tokens one chain proposal can hold (``None``: no limit of its own)
    max_draft_tokens: int | None = None

    def observe(self, feedback: VerificationFeedback) -> None:
        """Learn from a verification (default: nothing)."""

    def observe_prefill(self, start: int, hidden: torch.Tensor) -> None:
        """The target's captured hidden states of prompt tokens ``start ..`` (default:
        nothing; see ``captures``)."""

    def close(self) -> None:
        """Release per-sequence state (default: nothing)."""


def needs_isolation(params: SamplingParams) -> bool:
    """Whether a generation must not see state learned from other requests: seeded
    sampling, whose output must depend only on its prompt, parameters and seed (drafts
    decide how many random draws verification takes). Greedy output never depends on the
    drafts, so greedy generations share learned state freely.
    """
    return params.seed is not None and not params.greedy


def check_drafter(drafter: object) -> None:
    """Refuse an object that cannot be a :class:`Drafter` (at configuration time).

    Raises:
        ValueError: no callable ``start``, or a declared capability (``supports_trees``,
            ``observes``, ``uses_target_cache``) that is not a bool, ``max_aux_rows``
            that is not an integer >= 0, ``max_draft_tokens`` neither ``None`` nor an
            integer >= 1, or ``acceptance_prior`` neither ``None`` nor in [0, 1].
    """
    if not callable(getattr(drafter, "start", None)):
        raise ValueError(
            f"{type(drafter).__name__} is not a drafter: it needs start(prompt_ids, params) "
            "returning a sequence drafter with propose() and close()"
        )
    for flag in ("supports_trees", "observes", "uses_target_cache", "confidence_stop"):
        if not isinstance(getattr(drafter, flag, False), bool):
            raise ValueError(f"{type(drafter).__name__}.{flag} must be a bool")
    aux = getattr(drafter, "max_aux_rows", 0)
    if isinstance(aux, bool) or not isinstance(aux, int) or aux < 0:
        raise ValueError(f"{type(drafter).__name__}.max_aux_rows must be an integer >= 0")
    most = getattr(drafter, "max_draft_tokens", None)
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 1):
        raise ValueError(
            f"{type(drafter).__name__}.max_draft_tokens must be None or an integer >= 1"
        )
    prior = getattr(drafter, "acceptance_prior", None)
    if prior is not None and (
        isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0 <= prior <= 1
    ):
        raise ValueError(f"{type(drafter).__name__}.acceptance_prior must be None or in [0, 1]")
    captures = getattr(drafter, "captures", ())
    if not isinstance(captures, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in captures
    ):
        raise ValueError(f"{type(drafter).__name__}.captures must be a tuple of integers >= 0")


class NoDrafter(DrafterBase):
    """Proposes nothing: every step is one plain autoregressive step of the target."""

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> NoDrafter:
        return self

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        return DraftProposal([])
