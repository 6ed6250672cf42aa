"""Exact output law of a production verifier, integrated over its random draws (test oracle).

A verifier step is a program of its random draws: uniforms (acceptance tests) and
categorical samples (recovered and bonus tokens). Its output is piecewise constant in each
uniform (accept iff ``u < a``), so the law of the output can be computed exactly by running
the *production* code with scripted draws instead of sampling it:

* a categorical draw is enumerated: each token ``y`` with probability ``probs[y] > 0`` is
  one branch of weight ``probs[y]`` (so a wrong residual shows up directly);
* a uniform draw is split at its breakpoint ``t``: the program is run with ``u`` fixed and
  everything after it at defaults, ``t`` is located by bisection between 0 and 1 to
  ``tol``, and the two pieces ``[0, t)`` and ``[t, 1)`` become branches of weight ``t``
  and ``1 - t``. Later uniforms at their default (0.5) can hide an earlier one's effect
  (block verification keeps the *last* position whose test passes, so a later pass masks
  an earlier one); the search then runs again with the later uniforms at the top of their
  range, then at 0, and a uniform is irrelevant only if no setting shows a change.

Because the comparison itself runs in the production code, any bias in it (``u < 0.98 a``
instead of ``u < a``), in the acceptance ratio or in the residual shows up in the law,
with an error of at most ``tol`` per breakpoint (float64 uniforms; the production uniforms
are float32, i.e. the law of a continuous uniform up to 2**-24 per draw).

The program may compare each uniform against one threshold (as every rejection sampler
does); a uniform with more than one breakpoint raises ``ValueError`` rather than give a
wrong law.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import torch

#: The largest float64 below 1: the top of a uniform's range.
_BELOW_ONE = 1.0 - 2.0**-53


class ScriptedSource:
    """A :class:`~specdec.sampling.RandomSource` that replays scripted outcomes.

    Draw ``i`` (counting uniforms and categorical rows in call order) takes ``script[i]``
    (a float for a uniform, a token id for a categorical row); draws past the script take
    defaults (0.5, and the most probable token). Every draw is recorded in ``events`` as
    ``("u", None)`` or ``("c", probs)`` with float64 normalised ``probs``.
    """

    def __init__(self, script: tuple = (), later: float = 0.5) -> None:
        self.script = script
        self.later = later
        self.events: list[tuple[str, torch.Tensor | None]] = []

    def _next(self, kind: str, probs, default):
        i = len(self.events)
        self.events.append((kind, probs))
        return self.script[i] if i < len(self.script) else default

    def uniform(self, n: int, device) -> torch.Tensor:
        values = [self._next("u", None, self.later) for _ in range(n)]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        rows = probs.reshape(-1, probs.shape[-1]).double()
        tokens = [self._next("c", row / row.sum(), int(row.argmax())) for row in rows.unbind(0)]
        return torch.tensor(tokens, dtype=torch.long, device=probs.device)


def exact_output_law(
    run: Callable[[ScriptedSource], Hashable], tol: float = 1e-12
) -> dict[Hashable, float]:
    """The exact law of ``run(source)`` over every uniform and categorical draw it makes.

    Args:
        run: calls a production verifier with ``source`` as its generator and returns a
            hashable outcome (e.g. the output token ids). Must be deterministic given the
            draws.
        tol: bisection tolerance of each uniform's breakpoint (error per breakpoint).

    Returns:
        ``{outcome: probability}``; probabilities sum to 1.

    Raises:
        ValueError: a uniform whose outcome changes more than once over [0, 1).

    Example:
        >>> def coin(source):  # accept with probability 0.3, else draw from [0.5, 0.5]
        ...     if float(source.uniform(1, "cpu")) < 0.3:
        ...         return "accepted"
        ...     return int(source.categorical(torch.tensor([[0.5, 0.5]])))
        >>> sorted((str(k), round(v, 9)) for k, v in exact_output_law(coin).items())
        [('0', 0.35), ('1', 0.35), ('accepted', 0.3)]
    """
    law: dict[Hashable, float] = defaultdict(float)
    pending: list[tuple[tuple, float]] = [((), 1.0)]
    while pending:
        script, weight = pending.pop()
        outcome, events = _execute(run, script)
        if len(events) == len(script):
            law[outcome] += weight
            continue
        kind, probs = events[len(script)]
        if kind == "c":
            for token in torch.nonzero(probs > 0).flatten().tolist():
                pending.append((script + (token,), weight * float(probs[token])))
            continue
        threshold = _breakpoint(run, script, tol)
        if threshold is None:
            pending.append((script + (0.5,), weight))
        else:
            pending.append((script + (0.0,), weight * threshold))
            pending.append((script + (threshold,), weight * (1.0 - threshold)))
    return dict(law)


def _execute(run, script: tuple, later: float = 0.5):
    source = ScriptedSource(script, later)
    return run(source), source.events


def _signature(run, script: tuple, later: float = 0.5):
    """What a run does with ``script`` and defaults after it (later uniforms at
    ``later``): outcome and every draw."""
    outcome, events = _execute(run, script, later)
    draws = tuple(
        (kind, None if probs is None else tuple(probs.tolist())) for kind, probs in events
    )
    return outcome, draws


def _breakpoint(run, script: tuple, tol: float) -> float | None:
    """Where the next uniform's outcome changes (``None``: it never does, whatever the
    later uniforms are set to: their default, the top of their range, or 0)."""
    for later in (0.5, _BELOW_ONE, 0.0):
        found = _breakpoint_with(run, script, tol, later)
        if found is not None:
            return found
    return None


def _breakpoint_with(run, script: tuple, tol: float, later: float) -> float | None:
    low, high = 0.0, _BELOW_ONE
    below = _signature(run, script + (low,), later)
    above = _signature(run, script + (high,), later)
    if below == above:
        for probe in (0.25, 0.5, 0.75):
            if _signature(run, script + (probe,), later) != below:
                raise ValueError("a uniform with more than one breakpoint")
        return None
    while high - low > tol:
        mid = 0.5 * (low + high)
        if _signature(run, script + (mid,), later) == below:
            low = mid
        else:
            high = mid
    for probe in (0.5 * low, 0.5 * (high + _BELOW_ONE)):
        expected = below if probe < high else above
        if _signature(run, script + (probe,), later) != expected:
            raise ValueError("a uniform with more than one breakpoint")
    return high
