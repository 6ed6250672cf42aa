"""The online cost model: what a verification forward and a draft cost on this machine.

A controller that maximizes tokens per second (Leviathan et al. 2023, section 3.5: the
best speculation length from the acceptance rate and the cost ratio; SmartSpec, Liu et al.
2024: *goodput*, expected accepted tokens per unit of verification cost, which depends on
the batch) needs two functions measured where the model runs:

* ``forward_time(n)``: seconds of one target forward over ``n`` rows (all sequences of a
  batched step together: pending tokens, drafts, tree nodes, auxiliary rows);
* ``draft_time(drafter, k)``: seconds a drafter takes to propose ``k`` tokens.

Both are learned from the engine's own measurements: per row count, the median of the
last samples (robust to a stray slow step); between and beyond measured row counts, a
weighted least-squares line through those medians; with fewer than two measured row counts,
the *prior* ``t(1) * (1 + token_cost * (n - 1))``. Estimates never decrease with ``n``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

#: Samples kept per row count / per drafter.
WINDOW = 16


@dataclass(frozen=True)
class CostPrior:
    """The cost model before (or instead of) measurements, in units of one plain step.

    Attributes:
        token_cost: extra forward time per extra verified row, as a fraction of a
            one-row forward (float >= 0).
        draft_token_cost: draft time per draft token, as a fraction of a one-row forward.

    Raises:
        ValueError: a negative or non-finite value.
    """

    token_cost: float = 0.1
    draft_token_cost: float = 0.0

    def __post_init__(self) -> None:
        for name in ("token_cost", "draft_token_cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


class CostModel:
    """Target forward time vs rows, and draft time vs draft tokens per drafter.

    Args:
        prior: used until measurements exist (and always when ``frozen``).
        frozen: never learn: every estimate is the prior, in units of one plain step
            (``forward_time(1) == 1.0``). Controllers of seeded sampled requests use a
            frozen model so that their choices, and so the output, do not depend on timing.
        window: forward samples kept per row count (the most recent; ``None``: all, for
            fitting a whole recorded run), and four times as many draft samples.

    Not thread-safe (the engine's one thread updates it).
    """

    def __init__(
        self, prior: CostPrior | None = None, *, frozen: bool = False, window: int | None = WINDOW
    ) -> None:
        self.prior = prior or CostPrior()
        self.frozen = frozen
        self.window = window
        self._forward: dict[int, deque[float]] = {}
        self._draft: dict[str, deque[tuple[int, float]]] = {}
        self._table: list[float] | None = None
        self._table_slope = 0.0
        self._draft_fit: dict[str, tuple[float, float]] = {}

    # ------------------------------------------------------------------ observations

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        """Record one target forward over ``num_tokens`` rows that took ``seconds``."""
        if self.frozen or num_tokens < 1 or not seconds > 0:
            return
        self._forward.setdefault(num_tokens, deque(maxlen=self.window)).append(seconds)
        self._table = None

    def observe_draft(self, drafter: str, num_tokens: int, seconds: float) -> None:
        """Record that ``drafter`` proposed ``num_tokens`` tokens in ``seconds``."""
        if self.frozen or num_tokens < 1 or seconds < 0:
            return
        window = None if self.window is None else 4 * self.window
        self._draft.setdefault(drafter, deque(maxlen=window)).append((num_tokens, seconds))
        self._draft_fit.pop(drafter, None)

    @property
    def num_forward_samples(self) -> int:
        """Forward measurements held (0 for a frozen model)."""
        return sum(len(v) for v in self._forward.values())

    # ------------------------------------------------------------------ estimates

    def forward_time(self, num_tokens: int) -> float:
        """Estimated seconds of a forward over ``num_tokens`` >= 1 rows (units of one plain
        step for a frozen or empty model)."""
        n = max(1, int(num_tokens))
        table = self._forward_table()
        if n < len(table):
            return table[n]
        return table[-1] + (n - len(table) + 1) * self._table_slope

    def draft_time(self, drafter: str, num_tokens: int) -> float:
        """Estimated seconds for ``drafter`` to propose ``num_tokens`` tokens (0 for 0)."""
        if num_tokens <= 0:
            return 0.0
        fixed, per_token = self._draft_line(drafter)
        return max(0.0, fixed + per_token * num_tokens)

    def step_time(self, drafter: str, num_drafted: int, other_tokens: int = 0) -> float:
        """Forward over ``other_tokens + 1 + num_drafted`` rows plus the draft time."""
        return self.forward_time(other_tokens + 1 + num_drafted) + self.draft_time(
            drafter, num_drafted
        )

    def snapshot(self) -> dict:
        """JSON-ready estimates: forward seconds for 1..16 rows and samples held."""
        return {
            "frozen": self.frozen,
            "forward_s": {n: self.forward_time(n) for n in (1, 2, 4, 8, 16)},
            "samples": self.num_forward_samples,
            "draft_s_per_token": {d: self._draft_line(d)[1] for d in self._draft},
        }

    # ------------------------------------------------------------------ internals

    def _points(self) -> list[tuple[int, float, int]]:
        return [(n, statistics.median(v), len(v)) for n, v in sorted(self._forward.items())]

    def _base(self) -> float:
        points = self._points()
        return points[0][1] / (1 + self.prior.token_cost * (points[0][0] - 1)) if points else 1.0

    def _line(self) -> tuple[float, float] | None:
        """Weighted least squares ``t = a + b n`` over the per-row-count medians."""
        points = self._points()
        if len(points) < 2:
            return None
        w = sum(c for _, _, c in points)
        mn = sum(c * n for n, _, c in points) / w
        mt = sum(c * t for _, t, c in points) / w
        var = sum(c * (n - mn) ** 2 for n, _, c in points)
        slope = sum(c * (n - mn) * (t - mt) for n, t, c in points) / var
        slope = max(slope, 0.0)
        return mt - slope * mn, slope

    def _forward_table(self) -> list[float]:
        """Estimates for 0 .. max(64, the most rows measured), rebuilt after an observation
        (beyond it, :meth:`forward_time` extends the last entry by the fitted slope)."""
        if self._table is not None:
            return self._table
        size = max(65, max(self._forward, default=0) + 1)
        line, base = self._line(), self._base()
        self._table_slope = line[1] if line is not None else base * self.prior.token_cost
        table = [0.0] * size
        for m in range(1, size):
            if m in self._forward and len(self._forward[m]) >= 3:
                value = statistics.median(self._forward[m])
            elif line is not None:
                value = line[0] + line[1] * m
            else:
                value = base * (1 + self.prior.token_cost * (m - 1))
            table[m] = max(value, table[m - 1], 1e-9)  # never cheaper with more rows
        table[0] = table[1]
        self._table = table
        return table

    def _draft_line(self, drafter: str) -> tuple[float, float]:
        fit = self._draft_fit.get(drafter)
        if fit is not None:
            return fit
        samples = self._draft.get(drafter)
        if not samples:
            fit = (0.0, self._base() * self.prior.draft_token_cost)
        else:
            ns = [n for n, _ in samples]
            ts = [t for _, t in samples]
            mn, mt = statistics.fmean(ns), statistics.fmean(ts)
            var = sum((n - mn) ** 2 for n in ns)
            if var == 0:
                fit = (0.0, mt / mn)
            else:
                slope = max(0.0, sum((n - mn) * (t - mt) for n, t in samples) / var)
                fit = (max(0.0, mt - slope * mn), slope)
        self._draft_fit[drafter] = fit
        return fit
