"""Logits -> probabilities (temperature, top-k, top-p) and sampling with an explicit generator.

The same processing is applied to target and draft logits; rejection sampling is lossless
with respect to the processed target distribution (what plain sampling would draw from).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specdec.config import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the sampling distribution.

    Args:
        logits: ``[N, V]`` float tensor of raw logits.
        params: temperature (> 0 here), top-k and top-p settings.

    Returns:
        ``[N, V]`` float32 probabilities; each row sums to 1. Tokens removed by top-k /
        top-p get probability exactly 0.

    Raises:
        ValueError: if ``params.temperature`` is 0 (greedy has no distribution; use argmax).

    Example:
        >>> import torch
        >>> params = SamplingParams(temperature=1.0, top_k=2)
        >>> p = logits_to_probs(torch.tensor([[2.0, 1.0, 0.0]]), params)
        >>> [round(x, 4) for x in p[0].tolist()]
        [0.7311, 0.2689, 0.0]
    """
    if params.temperature == 0:
        raise ValueError("greedy decoding (temperature 0) has no distribution; use argmax")
    logits = _apply_temperature(logits.float(), params.temperature)
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _apply_top_p(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(logits - row max) / T``, safe for every finite ``T > 0``.

    Shifting by the row maximum first (softmax is shift-invariant) keeps the maximum at 0,
    so a tiny temperature sends the other logits to ``-inf`` instead of overflowing the
    maximum to ``+inf`` (``inf - inf = nan``). ``T`` is floored at float32's smallest
    normal number, below which it would round to 0 in float32 arithmetic: a temperature
    that small is greedy in effect (the distribution is uniform over the tied maxima).
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return shifted / max(temperature, torch.finfo(torch.float32).tiny)


def _apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest prefix of sorted tokens whose mass reaches ``top_p``."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    remove_sorted = mass_before >= top_p
    remove_sorted[..., 0] = False  # the most probable token always stays (top_p may be ~0)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row.

    Args:
        probs: ``[N, V]`` float probabilities (rows need not be exactly normalised).
        generator: the ``torch.Generator`` every random draw of a generation uses.

    Returns:
        ``[N]`` int64 token ids.
    """
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (a fresh seed if ``None``)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@runtime_checkable
class RandomSource(Protocol):
    """Where a verifier's random draws come from.

    Production code passes a ``torch.Generator`` (wrapped by :func:`as_random_source`);
    the exact-law oracle (:mod:`specdec.verify.exact`) passes a source that replays
    scripted values, so it can integrate the production verifier's output over every draw.
    """

    def uniform(self, n: int, device: torch.device | str) -> torch.Tensor:
        """``[n]`` floats uniform on [0, 1)."""

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64: one token per row of ``[N, V]`` (unnormalised) probabilities."""


class GeneratorSource:
    """A :class:`RandomSource` over a ``torch.Generator`` (``torch.rand`` and
    ``torch.multinomial``, exactly the draws the verifiers have always made)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def uniform(self, n: int, device: torch.device | str) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, device=device)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        return sample(probs, self.generator)


def as_random_source(generator: torch.Generator | RandomSource) -> RandomSource:
    """``generator`` as a :class:`RandomSource` (a ``torch.Generator`` is wrapped)."""
    if isinstance(generator, torch.Generator):
        return GeneratorSource(generator)
    return generator
