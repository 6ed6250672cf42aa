"""The SpeculationController protocol: before each step, how many tokens each sequence
drafts (0 = a plain decoding step); after it, what happened.

The engine asks a controller once per request (:meth:`SpeculationController.start`) for
that sequence's :class:`SequenceControl`. Before every verification step the engine calls
its ``choose(view)``, with a :class:`StepView` of the step (the cap on draft tokens, the
batch the forward already holds, the cost model), drafts at most the chosen number, and
after verification calls ``observe(outcome)`` with a :class:`StepOutcome`.

Why any controller stays lossless: it decides the draft length before the target runs,
from the past only, and verification keeps exactly the target's tokens whatever was
drafted. A confidence stop (``stop_drafting``) may also end a draft early, but only from
the draft distribution at that position, which depends on earlier draft tokens alone
(never on the token it would draw), so every drafted token is still a sample of its draft
distribution.

Reproducibility: for a seeded sampled request (:func:`specdec.drafters.base.needs_isolation`)
the engine marks the sequence ``isolated``: its view then carries a frozen cost model and
no batch, and controllers keep no state shared with other requests, so the choices -- and
the random draws they lead to -- depend on the request alone, as the seed promises.
Greedy output never depends on the choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specdec.config import SamplingParams
from specdec.control.cost import ContextCost, CostModel


@dataclass(frozen=True)
class SequenceInfo:
    """What a controller knows about a request when it starts.

    Attributes:
        request_id: the engine's id.
        max_k: the configured most draft tokens per step (for a token tree: its depth).
        params: the request's sampling parameters.
        drafter: the drafter's name (the cost model's key for its draft time; the engine
            appends ``:tree`` for token trees, whose draft time is per unit of depth).
        tree_nodes_per_depth: for a token tree, its nodes per level of depth (the rows a
            depth cap of ``k`` verifies is about ``k`` times this); 1.0 for chains.
        isolated: decide from this request alone (seeded sampling, see the module doc).
        aux_rows: rows the drafter adds to every speculating step (Lookahead's window).
        acceptance_prior: the drafter's own estimate of a first draft token's acceptance
            rate (its ``acceptance_prior`` attribute), or ``None``; ``cost`` starts from it
            instead of its ``prior`` option's default.
    """

    request_id: str
    max_k: int
    params: SamplingParams
    drafter: str = "drafter"
    tree_nodes_per_depth: float = 1.0
    isolated: bool = False
    aux_rows: int = 0
    acceptance_prior: float | None = None


@dataclass(frozen=True)
class StepView:
    """One step as a sequence's controller sees it before drafting.

    Attributes:
        max_k: most draft tokens (tree: depth) this step may take: the configured k capped
            by the tokens left to generate.
        batch_size: sequences verified in this forward (1 when isolated).
        other_tokens: rows the rest of this step verifies: the choices already made for
            earlier sequences, one row per sequence still to choose (0 when isolated).
            Prompt chunks prefilled in the same step are left out: their cost does not
            depend on the drafts.
        other_expected: tokens the rest of the batch is expected to emit this step.
        cost: the cost model (frozen when isolated), read at the step's context (the
            engine passes :meth:`CostModel.at <specdec.control.cost.CostModel.at>` of the
            tokens the verified sequences hold).
    """

    max_k: int
    cost: CostModel | ContextCost
    batch_size: int = 1
    other_tokens: int = 0
    other_expected: float = 0.0


@dataclass(frozen=True)
class StepOutcome:
    """What one verification step did, for a controller to learn from.

    Attributes:
        k: the controller's choice.
        num_drafted: draft tokens verified (tree: nodes; may be below ``k`` when the
            drafter found nothing or a confidence stop ended the draft).
        num_accepted: accepted draft tokens (tree: the accepted depth).
        num_emitted: tokens the step produced (accepted + one recovered or bonus), before
            stop truncation.
        confidences: ``[num_drafted]`` for a chain whose drafter reports them: the top
            probability of the draft distribution at each position (else ``None``).
        draft_s: seconds the drafter took this step.
        forward_s: seconds of the step's whole target forward (every sequence in it).
        forward_tokens: rows that forward ran (every sequence, prompt chunks included).
        tree: the step verified a token tree.
        deterministic: the draft carried no distribution (point masses: n-gram, suffix,
            a greedy draft model, ...).
    """

    k: int
    num_drafted: int
    num_accepted: int
    num_emitted: int
    confidences: list[float] | None = None
    draft_s: float = 0.0
    forward_s: float = 0.0
    forward_tokens: int = 1
    tree: bool = False
    deterministic: bool = False


@runtime_checkable
class SequenceControl(Protocol):
    """One sequence's controller state."""

    def choose(self, view: StepView) -> int:
        """Draft tokens for the next step, in ``[0, view.max_k]`` (0 = plain step)."""

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the step just verified."""


@runtime_checkable
class SpeculationController(Protocol):
    """Makes a :class:`SequenceControl` per request; holds what requests share (e.g. a
    bandit's arm statistics). A control may also define
    ``stop_drafting(position, confidence) -> bool``: asked before the draft token at
    ``position`` (0-based) is kept, with the top probability of its draft distribution;
    True ends the draft there (SpecDec++-style confidence stops). It may also define
    ``trim(length) -> int``: given a chain proposal of ``length`` >= 2 tokens (after any
    confidence stop), how many of its first tokens to verify, in ``[1, length]`` (a
    prefix of a draft is verified exactly as the draft would be: lossless)."""

    name: str

    def start(self, info: SequenceInfo) -> SequenceControl:
        """The controller state of a new request."""


def check_choice(control: object, k: object, max_k: int) -> int:
    """A control's choice, checked.

    Raises:
        ValueError: not an integer in ``[0, max_k]``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max_k:
        raise ValueError(
            f"{type(control).__name__}.choose returned {k!r}; it must be an integer in [0, {max_k}]"
        )
    return k
