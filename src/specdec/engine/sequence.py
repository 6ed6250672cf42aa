"""A request inside the engine: its tokens, KV cache, drafter state, settings and stats."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.control.base import SequenceControl, SequenceInfo
from specdec.drafters.base import Drafter, SequenceDrafter
from specdec.engine.stops import StopChecker
from specdec.metrics import SpecStats
from specdec.models.base import KVCacheLike
from specdec.structured import GrammarState
from specdec.trees.builders import TreeBuilder


class SequenceStatus(enum.Enum):
    """Where a sequence is: ``WAITING`` (queued, or preempted and queued again),
    ``PREFILL`` (admitted; prompt chunks still to run), ``RUNNING`` (one verification step
    per engine step), ``FINISHED`` (stop or length) or ``ABORTED``."""

    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Sequence:
    """One request as the engine runs it (nano-vllm's ``Sequence``, with speculation).

    Attributes:
        request_id: the caller's id (unique among live requests).
        prompt_ids: ``[L]`` the prompt.
        tokens: prompt + output so far; once prefilled, the last one is *pending* (not
            cached), per the cursor rule.
        params: sampling parameters.
        drafter: the shared drafter; ``drafter_state`` is this sequence's
            :class:`SequenceDrafter` while it holds a cache.
        num_speculative_tokens: most draft tokens per step (0 = plain decoding).
        tree_builder: drafts a token tree per step instead of a chain (or ``None``).
        stop_checker: stop tokens and strings.
        generator: the source of every random draw of this sequence (so a seeded request
            gives the same output whatever else runs in the batch).
        max_total: most tokens the sequence may reach (prompt + max_new_tokens, capped by
            the context).
        stats: this sequence's :class:`SpecStats`.
        cache: its KV cache while admitted (``None`` while waiting).
        num_prefilled: tokens of ``tokens[:-1]`` already in ``cache`` (prefill progress).
        num_kv_reserved: cache slots the scheduler accounts to this sequence.
        status, finish_reason: see :class:`SequenceStatus`; ``finish_reason`` is
            ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (then ``error`` says
            why) once done.
        text_end: for a stop string, where the output text ends (character offset).
        arrival: admission order key (earlier requests are admitted first, preempted last).
        observes: the drafter declared ``observes`` (its state gets every verification's
            :class:`~specdec.drafters.base.VerificationFeedback`).
        max_aux_rows: most auxiliary rows its drafter adds to a verification.
        captures: hidden-state indices its drafter reads (a draft head): the engine
            captures them in every forward of this sequence, hands the prompt's to the
            drafter state's ``observe_prefill`` and each verification's in the feedback.
        num_preemptions: times its cache was dropped to make room (then recomputed).
        hidden_carry: with a prefix cache, ``(position, [n, D])``: the captured hidden
            states of its last prompt chunk's rows after the chunk's last full block (the
            start of a block the next chunk completes).
        control: its speculation controller state (see :mod:`specdec.control`), made from
            ``control_info``.
        last_cap, last_draft_s: the step's cap on draft tokens and its draft seconds.
        verifier: how its sampled chains are verified (``"rejection"`` or ``"block"``).
        logprobs: with ``params.logprobs``, one :class:`~specdec.sampling.TokenLogprob`
            per output token so far.
        prompt_logprobs: with ``params.prompt_logprobs``, one entry per prompt token: ``None``
            for the first (nothing predicts it), then each token's
            :class:`~specdec.sampling.TokenLogprob` given the tokens before it, filled in as
            the prompt's chunks run (row j of a chunk scores the token after it, so the
            last chunk's last row scores the prompt's last, pending, token).
        grammar: with ``params.structured_outputs``, its
            :class:`~specdec.structured.GrammarState` at the committed output (kept
            through preemption: it follows the tokens, not the cache).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drafter: Drafter
    num_speculative_tokens: int
    tree_builder: TreeBuilder | None
    stop_checker: StopChecker
    generator: torch.Generator
    max_total: int
    arrival: int
    observes: bool = False
    max_aux_rows: int = 0
    captures: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    drafter_state: SequenceDrafter | None = None
    cache: KVCacheLike | None = None
    num_prefilled: int = 0
    num_kv_reserved: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text_end: int | None = None
    num_preemptions: int = 0
    hidden_carry: tuple[int, torch.Tensor] | None = None
    control: SequenceControl | None = None
    control_info: SequenceInfo | None = None
    last_cap: int = 0
    last_draft_s: float = 0.0
    #: an adaptive tree builder's row cost this step (set by the engine's plan)
    row_cost: Callable[[int], float] | None = None
    verifier: str = "rejection"
    logprobs: list = field(default_factory=list)
    grammar: GrammarState | None = None
    prompt_logprobs: list = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        """Generated tokens so far."""
        return self.tokens[len(self.prompt_ids) :]

    @property
    def num_to_prefill(self) -> int:
        """Tokens still to run before the first verification (all but the pending one)."""
        return len(self.tokens) - 1 - self.num_prefilled

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    @property
    def max_step_tokens(self) -> int:
        """Most tokens one verification step of this sequence runs: the pending token, the
        largest draft (chain, capped by the remaining budget) or tree, and the auxiliary
        rows."""
        budget = self.max_total - len(self.tokens)
        if self.tree_builder is not None:
            return 1 + self.tree_builder.max_nodes + self.max_aux_rows
        return 1 + max(0, min(self.num_speculative_tokens, budget - 1)) + self.max_aux_rows
