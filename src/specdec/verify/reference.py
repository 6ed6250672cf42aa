"""Slow, obviously-correct references for the verifiers (test oracles).

Each reference consumes the generator exactly like its fast counterpart, so both give the
same tokens under the same seed.
"""

from __future__ import annotations

import torch

from specdec.verify.result import VerifyResult


def greedy_reference(draft_token_ids: list[int], target_logits: torch.Tensor) -> VerifyResult:
    """Position-by-position greedy check: accept while the draft equals the argmax."""
    output = []
    for i, token in enumerate(draft_token_ids):
        best = int(torch.argmax(target_logits[i]))
        output.append(best)
        if best != token:
            return VerifyResult(i, output)
    output.append(int(torch.argmax(target_logits[len(draft_token_ids)])))
    return VerifyResult(len(draft_token_ids), output)


def rejection_reference(
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> VerifyResult:
    """Leviathan et al. 2023, Algorithm 1, one position at a time with Python scalars."""
    k = len(draft_token_ids)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist()
    for i, token in enumerate(draft_token_ids):
        target_p = float(target_probs[i, token])
        draft_p = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if uniforms[i] < min(1.0, target_p / draft_p):
            continue
        if draft_probs is None:
            draft_row = torch.zeros_like(target_probs[i])
            draft_row[token] = 1.0
        else:
            draft_row = draft_probs[i]
        residual = torch.where(target_probs[i] > draft_row, target_probs[i] - draft_row, 0.0)
        if float(residual.sum()) <= 0:
            residual = target_probs[i]
        recovered = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return VerifyResult(i, list(draft_token_ids[:i]) + [int(recovered)])
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    return VerifyResult(k, list(draft_token_ids) + [int(bonus)])


def first_token_marginal(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the first output token of one rejection-sampling step.

    P(x) = draft(x) * a(x) + (1 - sum_y draft(y) * a(y)) * residual(x), with
    a = ``acceptance_probability`` and residual = ``residual_distribution`` (the
    production functions). Lossless iff this equals ``target_probs``.

    Args:
        target_probs, draft_probs: ``[V]`` float64 probabilities.

    Returns:
        ``[V]`` float64 probabilities.
    """
    from specdec.verify.rejection import acceptance_probability, residual_distribution

    accept = acceptance_probability(target_probs, draft_probs)
    accepted_mass = draft_probs * accept
    return accepted_mass + (1.0 - accepted_mass.sum()) * residual_distribution(
        target_probs, draft_probs
    )
