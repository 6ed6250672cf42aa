"""Lossless speculative sampling (rejection sampling of draft tokens).

Source: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (arXiv:2211.17192, Algorithm 1); Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv:2302.01318, Algorithm 2).

Draft token x at position i is accepted with probability ``min(1, target(x) / draft(x))``;
at the first rejection a *recovered* token is drawn from the residual distribution
``norm(max(0, target - draft))``; if all k are accepted a *bonus* token is drawn from the
target's distribution at position k. The output is distributed exactly as the target's.
Deterministic drafters pass ``draft_probs=None``: their tokens are point masses
(draft = one-hot), accepted with probability ``target(x)``.
"""

from __future__ import annotations

import torch

from specdec.sampling import RandomSource, as_random_source
from specdec.verify.result import VerifyResult


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``min(1, target / draft)`` elementwise (Leviathan et al. 2023, Algorithm 1).

    Args:
        target_probs, draft_probs: same-shape float tensors of probabilities. Where
            ``draft_probs`` is 0 the token is never proposed; the result there is 1.

    Returns:
        float tensor of the same shape, in [0, 1].
    """
    ratio = target_probs / draft_probs.clamp_min(torch.finfo(draft_probs.dtype).tiny)
    return torch.where(draft_probs > 0, ratio.clamp(max=1.0), torch.ones_like(ratio))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, target - draft))`` over the last dim (Chen et al. 2023, eq. in Alg. 2).

    Args:
        target_probs, draft_probs: ``[..., V]`` float probabilities.

    Returns:
        ``[..., V]`` float32 probabilities. If the residual has no mass (target == draft,
        where a rejection has probability 0) the target distribution is returned.

    Example:
        >>> residual_distribution(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])).tolist()
        [0.0, 1.0]
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | RandomSource,
) -> VerifyResult:
    """Verify k draft tokens losslessly.

    Args:
        draft_token_ids: ``[k]`` int64 draft tokens (k >= 0).
        draft_probs: ``[k, V]`` float32 distributions the drafts were sampled from, or
            ``None`` for a deterministic drafter (point masses).
        target_probs: ``[k + 1, V]`` float32 target distributions (after temperature,
            top-k, top-p), row i following the pending token and i draft tokens.
        generator: a ``torch.Generator`` (or a :class:`~specdec.sampling.RandomSource`);
            draws, in order: k uniforms (all at once), then one categorical sample.

    Returns:
        :class:`VerifyResult` with the accepted tokens and one recovered or bonus token.
    """
    k = draft_token_ids.numel()
    rows = torch.arange(k, device=target_probs.device)
    target_at_draft = target_probs[rows, draft_token_ids]
    if draft_probs is None:
        accept_probs = target_at_draft
    else:
        accept_probs = acceptance_probability(target_at_draft, draft_probs[rows, draft_token_ids])
    source = as_random_source(generator)
    uniforms = source.uniform(k, target_probs.device)
    rejected = (uniforms >= accept_probs).nonzero()
    num_accepted = int(rejected[0, 0]) if rejected.numel() else k
    if num_accepted == k:
        last = source.categorical(target_probs[k : k + 1])  # bonus token
    else:
        draft_row = _draft_row(draft_token_ids, draft_probs, num_accepted, target_probs.shape[-1])
        residual = residual_distribution(target_probs[num_accepted], draft_row)
        last = source.categorical(residual.unsqueeze(0))  # recovered token
    accepted = draft_token_ids[:num_accepted].tolist()
    return VerifyResult(num_accepted, accepted + [int(last)])


def _draft_row(draft_token_ids, draft_probs, i: int, vocab_size: int) -> torch.Tensor:
    """Draft distribution at position i; a one-hot for deterministic drafters."""
    if draft_probs is not None:
        return draft_probs[i]
    one_hot = torch.zeros(vocab_size, device=draft_token_ids.device)
    one_hot[draft_token_ids[i]] = 1.0
    return one_hot
