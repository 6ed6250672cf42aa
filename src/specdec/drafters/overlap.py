"""Overlapped drafting: the draft for step n + 1 is made while the target verifies step n.

Source: PEARL (Liu et al. 2025, "PEARL: Parallel Speculative Decoding with Adaptive Draft
Length", arXiv:2408.11850), *post-verify*: while the target verifies a draft, the drafter
goes on drafting as if every draft token will be accepted, so when they are, the next
draft is ready without waiting. DuoDecoding (Lv et al. 2025, arXiv:2503.00784) runs the
draft on the CPU beside a GPU target the same way.

What this module implements (:class:`OverlapDrafter`, ``draft-model:overlap=true``): a
wrapper around a chain drafter's sequences. Each ``propose(token_ids, k)`` returns the
inner drafter's draft and then, in a background thread, asks the inner drafter for
``k + 1`` tokens after ``token_ids + the draft``: its first token is the drafter's guess
of the target's bonus token, the rest the next draft if that guess is right. The next
``propose`` uses the background draft when the sequence is exactly what it assumed (every
draft token accepted and the bonus token guessed); otherwise it is discarded and the
draft is made now, as without overlap; a background draft found stale is told to stop at its next
token (through ``stop_drafting``, for drafters that declare ``confidence_stop``) before it
is waited for. The inner sequence is never used by two threads at once: every call waits
for the background draft first (``close`` too).

Lossless whatever happens in the background: a proposal is used only for the context it
was drafted for, and it carries the draft distributions of that context. Sampled
background drafts draw from random streams of their own (one per background draft,
seeded from the generation's generator when the sequence starts), never from the
verifier's, so the verifier's draws stay independent of the proposal, and seeded
generations are reproducible however far a discarded background draft got.

Not implemented: PEARL's *pre-verify* (verifying the first draft token while the rest is
drafted) and its adaptive draft length.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import DrafterBase, DraftProposal


class OverlapDrafter(DrafterBase):
    """Wraps a chain drafter so that each sequence drafts its next step in the background
    while the current one is verified (see the module docstring).

    Args:
        inner: the drafter whose sequences draft (chains; its sequences must not observe
            feedback or use the target's cache, which verification is writing).
        threads: PyTorch threads the background thread's operations use (>= 1).

    Attributes:
        stats: ``{"used": n, "discarded": n}`` background drafts used / thrown away, over
            every sequence (for the benchmark).

    Raises:
        ValueError: the inner drafter observes feedback, uses the target's cache, reads
            hidden states or adds auxiliary rows.
    """

    #: why the engine refuses token trees with it (chains only)
    tree_refusal = (
        "draft-model:overlap=true cannot draft token trees: it drafts chains only (drop the "
        "tree or overlap)"
    )

    def __init__(self, inner, threads: int = 1) -> None:
        for flag in ("observes", "uses_target_cache"):
            if getattr(inner, flag, False):
                raise ValueError(
                    f"overlap cannot run {type(inner).__name__} in the background: it "
                    f"{'learns from each verification' if flag == 'observes' else 'drafts over the target KV cache that verification writes'}"  # noqa: E501
                )
        if getattr(inner, "captures", ()) or getattr(inner, "max_aux_rows", 0):
            raise ValueError(
                f"overlap cannot run {type(inner).__name__} in the background: it needs the "
                "verification forward's hidden states or rows"
            )
        self.inner = inner
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.stats = {"used": 0, "discarded": 0}

    def executor(self) -> ThreadPoolExecutor:
        """The background thread (started on first use, shared by every sequence)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    1, thread_name_prefix="specdec-draft", initializer=self._init_thread
                )
            return self._executor

    def _init_thread(self) -> None:
        torch.set_num_threads(self.threads)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> OverlapSequence:
        """A sequence of the inner drafter, drafting ahead in the background."""
        return OverlapSequence(self, self.inner.start(prompt_ids, params), params)


class OverlapSequence(DrafterBase):
    """One sequence: the inner sequence state and at most one background draft."""

    def __init__(self, drafter: OverlapDrafter, inner, params: SamplingParams) -> None:
        self.drafter = drafter
        self.inner = inner
        self.params = params
        self._future: Future | None = None
        self._cancel: threading.Event | None = None
        self._assumed: list[int] | None = None
        self._seed: int | None = None
        self._jobs = 0

    def propose(
        self, token_ids: Sequence[int], num_tokens: int, generator: torch.Generator
    ) -> DraftProposal:
        """Up to ``num_tokens`` draft tokens: the background draft when the sequence is
        what it assumed (its first token the bonus token the target emitted), else a
        draft made now; then the next draft starts in the background."""
        if self._seed is None:  # the background's own streams, from the generation's
            draw = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)
            self._seed = int(draw)
        tokens = list(token_ids)
        assumed = self._assumed is not None and tokens[:-1] == self._assumed
        if not assumed and self._cancel is not None:
            self._cancel.set()  # a draft for another history: stop it at its next token
        ahead = self._wait()
        draft = None
        if ahead is not None and assumed and len(ahead) > 1 and ahead.token_ids[0] == tokens[-1]:
            self.drafter.stats["used"] += 1
            draft = _part(ahead, 1)  # drafted after the guessed bonus token, which it was
        elif ahead is not None:
            self.drafter.stats["discarded"] += 1
        if num_tokens <= 0:
            self._assumed = None
            return DraftProposal([])
        if draft is None:
            draft = self.inner.propose(tokens, num_tokens, generator)
        out = _part(draft, 0, num_tokens)
        self._assumed = None
        if len(out):  # every token accepted: the bonus token's guess, then the next draft
            self._assumed = tokens + list(out.token_ids)
            # one stream per background draft: a stopped one leaves the next unchanged
            self._jobs += 1
            stream = torch.Generator().manual_seed((self._seed + self._jobs) % 2**63)
            args = (list(self._assumed), num_tokens + 1, stream)
            kwargs = {}
            if getattr(self.drafter.inner, "confidence_stop", False):
                cancel = self._cancel = threading.Event()
                kwargs["stop_drafting"] = lambda position, confidence: cancel.is_set()
            self._future = self.drafter.executor().submit(self.inner.propose, *args, **kwargs)
        return out

    def _wait(self) -> DraftProposal | None:
        """The background draft (``None`` when there is none); waits for it."""
        future, self._future = self._future, None
        if future is None:
            return None
        return future.result()

    def close(self) -> None:
        """Stop and wait for the background draft, then close the inner sequence."""
        if self._cancel is not None:
            self._cancel.set()
        try:
            self._wait()
        finally:
            self.inner.close()


def _part(draft: DraftProposal, start: int, stop: int | None = None) -> DraftProposal:
    """Tokens ``start:stop`` of a proposal, with their distributions and confidences."""
    probs, confidence = draft.draft_probs, draft.confidence
    return DraftProposal(
        draft.token_ids[start:stop],
        None if probs is None else probs[start:stop],
        None if confidence is None else confidence[start:stop],
    )
