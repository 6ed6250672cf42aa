"""Block verification: lossless verification of a draft chain as a whole.

Source: Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro & Suresh 2024, "Block Verification
Accelerates Speculative Decoding" (arXiv:2403.10444, Algorithm 2). Token-wise rejection
sampling (Leviathan et al. 2023) decides each draft token on its own and stops at the
first rejection; block verification decides how many tokens to keep from the whole block,
carrying a running weight ``w_i`` of how much target mass the accepted prefix still has
(``w_0 = 1``):

    w_i = min(1, w_{i-1} p_i(X_i) / q_i(X_i))                       (p: target, q: draft)
    h_i = r_i / (r_i + 1 - w_i),   r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x))  (i < k)
    h_k = w_k

Draw ``eta_1 .. eta_k`` uniform; keep ``tau = max {i : eta_i <= h_i}`` tokens (0 if none);
then draw the last token from the target at position k + 1 if ``tau = k`` (the bonus
token), else from the residual ``norm(max(0, w_tau p_{tau+1} - q_{tau+1}))``. The output
follows the target's law exactly (the paper's Theorem 2; tested here by the exact-law
oracle), and the expected number of kept tokens is at least token-wise rejection's for
the same draft (optimal among verifiers that read only the draft path, Theorem 3). A
``0 / 0`` in ``h_i`` (the target equals the draft at position i + 1 and ``w_i = 1``) is 0:
there is no residual mass to stop at.

Deterministic drafters pass ``draft_probs=None``; their tokens are point masses.
"""

from __future__ import annotations

import torch

from specdec.sampling import RandomSource, as_random_source
from specdec.verify.result import VerifyResult


def block_verify(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | RandomSource,
) -> VerifyResult:
    """Verify k draft tokens losslessly as one block (Sun et al. 2024, Algorithm 2).

    Args:
        draft_token_ids: ``[k]`` int64 draft tokens (k >= 0).
        draft_probs: ``[k, V]`` float distributions the drafts were sampled from, or
            ``None`` for a deterministic drafter (point masses).
        target_probs: ``[k + 1, V]`` float target distributions (after every sampling
            transform), row i following the pending token and i draft tokens.
        generator: a ``torch.Generator`` (or a :class:`~specdec.sampling.RandomSource`);
            draws, in order: k uniforms (all at once), then one categorical sample; the
            same draws as :func:`~specdec.verify.rejection.rejection_sample`.

    Returns:
        :class:`VerifyResult` with the kept tokens and one recovered or bonus token.
    """
    k = draft_token_ids.numel()
    device = target_probs.device
    source = as_random_source(generator)
    uniforms = source.uniform(k, device).double()
    p = target_probs.double()
    q = _draft_rows(draft_token_ids, draft_probs, p.shape[-1], device)
    ids = draft_token_ids.tolist()
    weights = [1.0]  # w_0 .. w_k
    keep = 0
    for i in range(1, k + 1):
        x = ids[i - 1]
        proposed = float(q[i - 1, x])
        ratio = float(p[i - 1, x]) / proposed if proposed > 0 else float("inf")
        w = min(1.0, weights[-1] * ratio)
        weights.append(w)
        h = _stop_probability(w, p[i], q[i]) if i < k else w
        if float(uniforms[i - 1]) <= h:
            keep = i
    if keep == k:
        last = source.categorical(target_probs[k : k + 1])  # bonus token
    else:
        row = _residual(weights[keep], p[keep], q[keep])
        last = source.categorical(row.to(target_probs.dtype).unsqueeze(0))  # recovered
    return VerifyResult(keep, ids[:keep] + [int(last)])


def _stop_probability(w: float, p_next: torch.Tensor, q_next: torch.Tensor) -> float:
    """``h_i = r / (r + 1 - w_i)`` with ``r = sum max(0, w_i p_{i+1} - q_{i+1})`` (``0 / 0``
    is 0: no residual mass to stop at)."""
    r = float((w * p_next - q_next).clamp_min(0.0).sum())
    denominator = r + 1.0 - w
    return r / denominator if denominator > 0 else 0.0


def _residual(w: float, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, w p - q))``; the target row where it has no mass (never drawn)."""
    residual = (w * p - q).clamp_min(0.0)
    mass = residual.sum()
    return residual / mass if mass > 0 else p


def _draft_rows(draft_token_ids, draft_probs, vocab_size: int, device) -> torch.Tensor:
    """``[k, V]`` float64 draft distributions; one-hot rows for deterministic drafters."""
    if draft_probs is not None:
        return draft_probs.double()
    rows = torch.zeros(draft_token_ids.numel(), vocab_size, dtype=torch.float64, device=device)
    if draft_token_ids.numel():
        rows[torch.arange(draft_token_ids.numel(), device=device), draft_token_ids] = 1.0
    return rows
