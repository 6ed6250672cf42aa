"""SpecStats: the one metrics schema shared by the Python API, the CLI and the benchmark.

Definitions (see docs in the architecture guide):

* a *step* is one target verification forward pass (prefill excluded);
* *drafted* tokens are draft tokens proposed to the verifier;
* *accepted* tokens are draft tokens the verifier kept;
* every step also emits exactly one recovered or bonus token, so output >= 1 per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters and timings of one generation.

    Attributes:
        num_steps: verification steps (target forward passes after prefill).
        num_drafts: steps in which the drafter proposed at least one token.
        num_draft_tokens: draft tokens proposed, summed over steps.
        num_accepted_tokens: draft tokens accepted and kept, summed over steps (tokens an
            accepted block held after a stop are not counted).
        num_output_tokens: tokens returned to the user (after stop truncation).
        accepted_per_position: ``[k]`` counts (k = the longest draft / deepest tree seen);
            entry i = steps whose i-th draft token (0-based; for trees, the node at depth
            i + 1 on the accepted path) was accepted.
        accepted_length_counts: histogram; entry n = steps that accepted exactly n tokens
            (for token trees: the accepted depth histogram).
        elapsed_s: wall time of the generation in seconds (prefill + all steps).
        prefill_s, draft_s, verify_s: seconds spent in the target prefill, in the drafter
            (including a draft model's prefill) and in target verification (forward +
            acceptance).
        chosen_k_counts: histogram of the speculation controller's choices; entry k =
            steps it chose to draft k tokens (tree: depth k). Steps where nothing could
            be drafted (plain decoding, or the last token) are not counted.
        num_steps_off: steps the controller switched speculation off (chose 0 although
            it could draft).
        trace: the step trace (:class:`~specdec.control.simulate.TraceStep` per step)
            when the engine records one (``EngineConfig.record_trace``), else empty.
        verifier: the chain verifier (``SpeculativeConfig.verifier``), or ``"greedy"`` for
            a greedy request: greedy verification (the longest prefix matching the
            target's argmax) checks it whatever verifier is configured.
        lossy: a lossy verifier verified sampled steps: the output does not follow the
            target's distribution.
        num_cached_tokens: prompt tokens taken from the prefix cache instead of computed
            (``EngineConfig.enable_prefix_caching``; vLLM's ``num_cached_tokens``).
        draft_sources: for a drafter that chooses a source per step (``hybrid``), the
            verification steps each source drafted, e.g. ``{"suffix": 12, "model": 30}``
            (:attr:`~specdec.drafters.base.DraftProposal.source`; a chosen model drafter
            that proposed nothing still counts); empty for other drafters.
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_output_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_length_counts: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    chosen_k_counts: list[int] = field(default_factory=list)
    num_steps_off: int = 0
    trace: list = field(default_factory=list, repr=False)
    verifier: str = "rejection"
    lossy: bool = False
    num_cached_tokens: int = 0
    draft_sources: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> SpecStats:
        """A copy that later steps do not change (counts and histograms copied; the trace
        is the steps so far, shared)."""
        return dataclasses.replace(
            self,
            accepted_per_position=list(self.accepted_per_position),
            accepted_length_counts=list(self.accepted_length_counts),
            chosen_k_counts=list(self.chosen_k_counts),
            trace=self.trace[:],
            draft_sources=dict(self.draft_sources),
        )

    def record_choice(self, k: int) -> None:
        """Count one controller choice of ``k`` draft tokens (0 = speculation off)."""
        _grow(self.chosen_k_counts, k + 1)
        self.chosen_k_counts[k] += 1
        if k == 0:
            self.num_steps_off += 1

    def record_step(
        self,
        num_drafted: int,
        num_accepted: int,
        num_emitted: int,
        max_depth: int | None = None,
    ) -> None:
        """Add one verification step.

        Args:
            num_drafted: draft tokens proposed this step (>= 0; tree nodes for a tree).
            num_accepted: of those, accepted (0 <= num_accepted <= num_drafted); for a
                tree, the depth of the accepted node.
            num_emitted: tokens this step added to the output after stop truncation.
            max_depth: deepest draft position this step (a chain: ``num_drafted``; a
                tree: its depth); sizes ``accepted_per_position``.
        """
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted tokens")
        self.num_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_output_tokens += num_emitted
        if num_drafted:
            self.num_drafts += 1
        _grow(self.accepted_per_position, num_drafted if max_depth is None else max_depth)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        _grow(self.accepted_length_counts, num_accepted + 1)
        self.accepted_length_counts[num_accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / drafted (bonus and recovered tokens excluded); 0 if nothing drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """τ = output tokens / verification steps (bonus included); 1.0 for plain decoding."""
        return self.num_output_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Entry i: fraction of drafting steps whose i-th draft token was accepted.

        Unconditional: the denominator is every step that proposed at least one draft
        token (``num_drafts``), not only the steps that reached position i (vLLM's
        convention). So the entries never increase with i.
        """
        if not self.num_drafts:
            return []
        return [n / self.num_drafts for n in self.accepted_per_position]

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per wall-clock second (the prompt's prefill included)."""
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens per second after the prompt: over ``elapsed_s - prefill_s`` (what
        speculation speeds up; on a long prompt the prefill can be most of the wall time)."""
        decode_s = self.elapsed_s - self.prefill_s
        return self.num_output_tokens / decode_s if decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready dict: the counters, timings and derived rates (``acceptance_rate``
        is ``None`` when nothing was drafted)."""
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_output_tokens": self.num_output_tokens,
            "acceptance_rate": self.acceptance_rate if self.num_draft_tokens else None,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "accepted_length_counts": list(self.accepted_length_counts),
            "elapsed_s": self.elapsed_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "chosen_k_counts": list(self.chosen_k_counts),
            "num_steps_off": self.num_steps_off,
            "verifier": self.verifier,
            "lossy": self.lossy,
            "num_cached_tokens": self.num_cached_tokens,
            "draft_sources": dict(self.draft_sources),
        }


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))
