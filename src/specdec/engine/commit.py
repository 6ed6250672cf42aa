"""What one verification step of one sequence produces, and the verifier choice."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams, parse_verifier
from specdec.drafters.base import DraftProposal
from specdec.engine.stops import StopChecker
from specdec.metrics import SpecStats
from specdec.sampling import (
    TokenHistory,
    dead_rows,
    logits_to_probs,
    no_allowed_token,
    process_logits,
)
from specdec.verify.block import block_verify
from specdec.verify.greedy import verify_greedy
from specdec.verify.rejection import rejection_sample
from specdec.verify.result import VerifyResult
from specdec.verify.typical import typical_acceptance


@dataclass
class StepOutput:
    """What one verification step added.

    Attributes:
        new_token_ids: tokens appended to the output (after stop truncation).
        finish_reason: ``"stop"`` (stop token or string), ``"length"`` (max_new_tokens or
            the context limit), or ``None`` while generation goes on.
        text_end: for a stop string, where the output text ends (character offset);
            :data:`~specdec.engine.stops.WHOLE_TEXT` when a completed grammar ended it.
        stats: the generation's running :class:`SpecStats` (same object every step).
        logprobs: with ``SamplingParams.logprobs``, one
            :class:`~specdec.sampling.TokenLogprob` per new token (else ``None``).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, on the first step only:
            one entry per prompt token (``None`` for the first), else ``None``.
        error: with ``finish_reason`` ``"error"``, why the request failed (see
            :class:`~specdec.sampling.NoAllowedToken`).
    """

    new_token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
    text_end: int | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    error: str | None = None


def verify(
    proposal: DraftProposal,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    history: TokenHistory | None = None,
    verifier: str = "rejection",
) -> VerifyResult:
    """Greedy match for temperature 0, lossless rejection sampling otherwise, both on the
    processed target logits: row i gets :func:`~specdec.sampling.process_logits` with the
    committed ``history`` plus the first i draft tokens as its own history.

    Args:
        proposal: the step's draft tokens (k) and draft probabilities (or ``None``).
        target_logits: ``[k + 1, V]`` float32 raw target logits.
        history: the sequence's prompt and committed output (needed when
            ``params.needs_history``).
        verifier: ``"rejection"`` (token-wise, Leviathan et al. 2023), ``"block"``
            (Sun et al. 2024), or the lossy ``"typical[:...]"`` (Medusa-2), for sampled
            chains; greedy matches the argmax either way.

    Raises:
        NoAllowedToken: the step must emit a token at a row whose transforms allow none
            (the request is ill-posed there, as plain decoding would find at the same
            position); rows after such a row are not verified.
    """
    draft_ids = torch.tensor(proposal.token_ids, dtype=torch.long, device=target_logits.device)
    draft_probs = proposal.draft_probs
    if draft_probs is not None:  # a draft on another device (a CPU draft, a GPU target)
        draft_probs = draft_probs.to(target_logits.device)
    dead_end = None
    if params.transforms_logits:
        tokens = list(proposal.token_ids)
        prefixes = [tokens[:i] for i in range(len(tokens) + 1)]
        target_logits = process_logits(target_logits, params, history, prefixes)
        dead = dead_rows(target_logits)
        if dead:  # a row where no token is allowed: emitting there fails the request
            if dead[0] == 0:
                raise no_allowed_token(history, params)
            dead_end = dead[0]  # the drafts after it are never verified
            draft_ids = draft_ids[:dead_end]
            draft_probs = None if draft_probs is None else draft_probs[:dead_end]
            target_logits = target_logits[: dead_end + 1].clone()
            target_logits[dead_end] = 0.0  # a placeholder, never emitted from
    result = _verify_rows(draft_ids, draft_probs, target_logits, params, generator, verifier)
    if dead_end is not None and result.num_accepted == dead_end:
        raise no_allowed_token(history, params)
    return result


def _verify_rows(draft_ids, draft_probs, target_logits, params, generator, verifier):
    if params.greedy:
        return verify_greedy(draft_ids, target_logits)
    target_probs = logits_to_probs(target_logits, params)
    name, options = _verifier(verifier)
    if name == "typical":  # LOSSY, opt-in (checked by SpeculativeConfig)
        return typical_acceptance(draft_ids, target_probs, generator, options)
    sample = block_verify if name == "block" else rejection_sample
    return sample(draft_ids, draft_probs, target_probs, generator)


@functools.lru_cache(maxsize=64)
def _verifier(spec: str):
    return parse_verifier(spec)


def finish_step(
    tokens: list[int],
    num_prompt: int,
    num_new: int,
    max_total: int,
    stop_checker: StopChecker,
    stats: SpecStats,
) -> StepOutput:
    """Apply stops and the length limit to the tokens this step appended (in place)."""
    output = tokens[num_prompt:]
    match = stop_checker.check(output, num_new)
    if match is not None:
        del tokens[num_prompt + match.num_tokens :]
        new = output[len(output) - num_new : match.num_tokens]
        return StepOutput(new, "stop", stats, match.text_end)
    new = output[len(output) - num_new :]
    return StepOutput(new, "length" if len(tokens) >= max_total else None, stats)
