"""Typical acceptance: a LOSSY verifier, opt-in only.

Source: Cai, Li, Geng, Peng, Lee, Chen & Dao 2024, "Medusa: Simple LLM Inference
Acceleration Framework with Multiple Decoding Heads" (arXiv:2401.10774), section 2.3.1
("typical acceptance"). A draft token ``x_i`` is accepted when the target gives it enough
probability relative to how uncertain the target is at that position:

    p_i(x_i) > min(epsilon, delta * exp(-H(p_i)))        H: entropy of p_i (nats)

The longest accepted prefix is kept and the next token is drawn from the target's
distribution at the first unaccepted position (or the bonus position). Unlike rejection
sampling this does not reproduce the target's distribution: it favours the draft's
choices wherever the target would accept them, raising the acceptance length at the cost
of a changed output law (Medusa argues the outputs stay "typical"; the exact-law tests of
this project measure the change). It is therefore labelled lossy everywhere it appears and
runs only when a request opts in (``SpeculativeConfig(allow_lossy=True)``).

Medusa's defaults: ``epsilon`` (its ``posterior_threshold``) 0.09, ``delta`` (its
``posterior_alpha``) 0.3.
"""

from __future__ import annotations

import torch

from specdec.config import TypicalOptions
from specdec.sampling import RandomSource, as_random_source
from specdec.verify.result import VerifyResult


def typical_thresholds(target_probs: torch.Tensor, options: TypicalOptions) -> torch.Tensor:
    """``min(epsilon, delta * exp(-H(p_i)))`` per row of ``[n, V]`` probabilities (float64)."""
    p = target_probs.double()
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return torch.clamp(options.delta * torch.exp(-entropy), max=options.epsilon)


def typical_acceptance(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | RandomSource,
    options: TypicalOptions,
) -> VerifyResult:
    """Keep the longest draft prefix whose tokens pass the typical criterion, then draw
    one token from the target (LOSSY; see the module docstring).

    Args:
        draft_token_ids: ``[k]`` int64 draft tokens.
        target_probs: ``[k + 1, V]`` target distributions after every sampling transform.
        generator: the source of the one categorical draw.
        options: epsilon and delta.

    Returns:
        :class:`VerifyResult`: the accepted tokens, then one token drawn from
        ``target_probs[num_accepted]``.
    """
    k = draft_token_ids.numel()
    source = as_random_source(generator)
    accepted = 0
    if k:
        thresholds = typical_thresholds(target_probs[:k], options)
        chosen = target_probs[:k].double().gather(1, draft_token_ids.view(-1, 1)).squeeze(1)
        passed = (chosen > thresholds).tolist()
        accepted = next((i for i, ok in enumerate(passed) if not ok), k)
    token = source.categorical(target_probs[accepted])
    return VerifyResult(
        output_token_ids=[*draft_token_ids[:accepted].tolist(), int(token)],
        num_accepted=accepted,
    )
