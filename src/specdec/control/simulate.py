"""What-if simulation: replay recorded step traces under another controller or length.

A run with ``EngineConfig(record_trace=True)`` (``specdec bench`` records one) keeps a
:class:`TraceStep` per verification step. For a greedy run with a chain drafter, the trace
says, at every step's position, how many tokens the drafter offered and how many the target
accepted; the output tokens themselves do not depend on the drafts. :func:`simulate`
walks the same output again, lets a controller choose each step's length, and charges
each simulated step what the trace's own measurements say such a step costs (a
:class:`~specdec.control.cost.CostModel` fitted on the trace's forward and draft times, plus
the engine's measured per-step overhead).

The replay model (an approximation, validated against measured runs in the benchmark):

* at a recorded step's position ``p`` the drafter offers ``d`` tokens of which ``a`` match
  the output (both exact, for prefix-consistent drafters: a shorter draft is the first
  tokens of the longer one);
* at a position ``p + j`` inside that step's accepted block, it offers ``d - j`` tokens of
  which ``a - j`` match (the same draft, shifted);
* it never offers more than the recorded run asked for: record with the largest k;
* a step costs what the same turn's recorded steps of that many rows cost (forward time
  grows with the context, so each turn is fitted on its own steps), plus the engine's
  per-step overhead.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from specdec.config import SamplingParams
from specdec.control.base import SequenceInfo, SpeculationController, StepOutcome, StepView
from specdec.control.cost import CostModel


@dataclass
class TraceStep:
    """One verification step of one sequence, as recorded.

    Attributes:
        position: output tokens before the step.
        k: the controller's choice; ``cap``: the most it could choose.
        num_drafted, num_accepted, num_emitted: as in
            :class:`~specdec.control.base.StepOutcome`.
        draft_s, forward_s, step_s: seconds drafting, in the step's forward, and of
            the whole engine step.
        forward_tokens: rows of the step's forward (all sequences).
        tree: a token tree was verified.
    """

    position: int
    k: int
    cap: int
    num_drafted: int
    num_accepted: int
    num_emitted: int
    draft_s: float
    forward_s: float
    forward_tokens: int
    tree: bool = False
    step_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TraceStep:
        return cls(**data)


@dataclass
class Trace:
    """One generation's trace: its steps, output length and prefill seconds."""

    steps: list[TraceStep]
    num_output_tokens: int
    prefill_s: float = 0.0

    @classmethod
    def from_stats(cls, stats: dict) -> Trace:
        """From a :class:`~specdec.metrics.SpecStats` dict that holds a ``trace``."""
        return cls(
            [TraceStep.from_dict(s) for s in stats["trace"]],
            stats["num_output_tokens"],
            stats.get("prefill_s", 0.0),
        )


@dataclass
class Timing:
    """Costs fitted on traces: the cost model, the per-step engine overhead (s) and the
    auxiliary rows a speculating step adds (Lookahead's window)."""

    cost: CostModel
    overhead_s: float
    drafter: str = "drafter"
    aux_rows: int = 0

    @classmethod
    def fit(
        cls, traces: Iterable[Trace], drafter: str = "drafter", plain: Iterable[Trace] = ()
    ) -> Timing:
        """Fit on every step of ``traces`` (forward time per row count, draft time per
        draft token, median overhead = step time minus forward and draft); the steps of
        ``plain`` (e.g. the baseline's, on the same prompt) add forward times only.

        Raises:
            ValueError: the traces hold no step.
        """
        cost, overheads, aux = CostModel(window=None), [], []
        for trace in plain:
            for s in trace.steps:
                cost.observe_forward(s.forward_tokens, s.forward_s)
        for trace in traces:
            for s in trace.steps:
                if s.k and s.num_drafted:
                    aux.append(max(0, s.forward_tokens - 1 - s.num_drafted))
                cost.observe_forward(s.forward_tokens, s.forward_s)
                cost.observe_draft(drafter, s.num_drafted, s.draft_s)
                if s.step_s:
                    overheads.append(max(0.0, s.step_s - s.forward_s - s.draft_s))
        if not cost.num_forward_samples:
            raise ValueError("the traces hold no verification step to fit costs on")
        overhead = statistics.median(overheads) if overheads else 0.0
        return cls(cost, overhead, drafter, int(statistics.median(aux)) if aux else 0)


@dataclass
class SimResult:
    """A simulated generation (or a sum of them).

    Attributes:
        num_output_tokens, num_steps, num_draft_tokens, num_accepted_tokens: counts.
        seconds: predicted wall seconds (prefill + steps).
        chosen_k_counts: histogram of the controller's choices.
    """

    num_output_tokens: int = 0
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    seconds: float = 0.0
    chosen_k_counts: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: SimResult) -> None:
        self.num_output_tokens += other.num_output_tokens
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.seconds += other.seconds
        for k, n in enumerate(other.chosen_k_counts):
            _bump(self.chosen_k_counts, k, n)


def opportunities(trace: Trace) -> tuple[list[int], list[int]]:
    """Per output position: tokens the drafter offers there and how many match.

    Returns:
        ``(offered, matched)``, each ``[num_output_tokens]`` (see the module doc).

    Raises:
        ValueError: a token-tree trace (trees are not replayable as chains).
    """
    n = trace.num_output_tokens
    offered, matched = [0] * n, [0] * n
    for s in trace.steps:
        if s.tree:
            raise ValueError("a token-tree trace cannot be replayed (record a chain run)")
        for j in range(s.num_accepted + 1):
            p = s.position + j
            if p < n:
                offered[p] = s.num_drafted - j
                matched[p] = s.num_accepted - j
    return offered, matched


def simulate(
    trace: Trace,
    controller: SpeculationController,
    max_k: int,
    timing: Timing,
) -> SimResult:
    """Replay one greedy chain trace with ``controller`` choosing up to ``max_k`` tokens
    per step (``max_k = 0``: plain decoding).

    Returns:
        the predicted counts and seconds (prefill as recorded).
    """
    offered, matched = opportunities(trace)
    n = trace.num_output_tokens
    info = SequenceInfo(
        "sim", max(max_k, 1), SamplingParams(), timing.drafter, aux_rows=timing.aux_rows
    )
    control = controller.start(info)
    cost = timing.cost
    result = SimResult(seconds=trace.prefill_s)
    p = 0
    while p < n:
        cap = min(max_k, n - 1 - p)
        k = control.choose(StepView(cap, cost)) if cap > 0 else 0
        if cap > 0:
            _bump(result.chosen_k_counts, k, 1)
        drafted = min(k, offered[p])
        accepted = min(matched[p], drafted)
        rows = 1 + drafted + (timing.aux_rows if k else 0)
        seconds = (
            cost.forward_time(rows) + cost.draft_time(timing.drafter, drafted) + timing.overhead_s
        )
        if cap > 0:  # a greedy replay: every draft is a point mass (deterministic)
            control.observe(
                StepOutcome(
                    k, drafted, accepted, accepted + 1, forward_s=seconds, deterministic=True
                )
            )
        emitted = min(accepted + 1, n - p)
        result.num_steps += 1
        result.num_draft_tokens += drafted
        result.num_accepted_tokens += accepted
        result.num_output_tokens += emitted
        result.seconds += seconds
        p += emitted
    return result


def simulate_all(
    traces: Sequence[Trace], controller: SpeculationController, max_k: int, timing: Timing
) -> tuple[SimResult, list[SimResult]]:
    """:func:`simulate` every trace in order with one controller (so shared statistics
    carry over, as in a real run); returns the total and the per-trace results."""
    total, each = SimResult(), []
    for trace in traces:
        one = simulate(trace, controller, max_k, timing)
        each.append(one)
        total.add(one)
    return total, each


def _bump(counts: list[int], k: int, n: int) -> None:
    if len(counts) <= k:
        counts.extend([0] * (k + 1 - len(counts)))
    counts[k] += n
