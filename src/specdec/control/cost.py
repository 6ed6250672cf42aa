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

A forward's time also depends on the KV cache its rows read. At short contexts the
weights dominate, but a long one changes both the price of a plain step and that of each
extra verified row: on SmolLM2-135M at 8k cached tokens (2-core Zen 4, bfloat16) a plain
step costs about 17 ms against 9-10 ms at a few hundred tokens, and 6 verified rows
about 27 ms (MagicDec, Sadhukhan et al. 2024, section 3: at long contexts the KV read,
not the weights, prices a verification). One line through both regimes priced the plain
step from short-context samples and the extra rows from long-context ones: at 8k it saw
10.6 ms for one row and 3.5 ms per extra row, and ``cost`` drafted 2 tokens, or none,
where 5 gave 1.3x. So forward samples are kept per *context bucket*
(:func:`context_bucket`: under :data:`CONTEXT_BUCKET_FROM` cached tokens one bucket, then
one per doubling), and a controller reads the bucket of its step's context
(:meth:`CostModel.at`); a bucket with no samples yet borrows the nearest one's. Draft
times are not bucketed (a windowed or head drafter's cost hardly depends on the context);
their line is fitted on the draft lengths seen at least :data:`MIN_DRAFT_SAMPLES` times,
or before any is on every sample if they span that many lengths; with fewer, a token
costs the median of the samples' time per token, so that one slow draft at a rare length
does not set the price of every token.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass

#: Samples kept per row count / per drafter.
WINDOW = 16
#: Draft lengths with at least this many samples are fitted alone, when there are some.
MIN_DRAFT_SAMPLES = 3
#: Contexts (KV tokens the forward's sequences hold) below this share the first bucket.
CONTEXT_BUCKET_FROM = 2048


def context_bucket(context: int) -> int:
    """The bucket of a forward whose sequences hold ``context`` cached tokens in total:
    0 below :data:`CONTEXT_BUCKET_FROM`, then 1, 2, ... per doubling (2048-4095: 1,
    4096-8191: 2, ...).

    Example:
        >>> [context_bucket(n) for n in (0, 2047, 2048, 4096, 8191, 8192)]
        [0, 0, 1, 2, 2, 3]
    """
    if context < CONTEXT_BUCKET_FROM:
        return 0
    return int(math.log2(context / CONTEXT_BUCKET_FROM)) + 1


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


class _ForwardCurve:
    """Forward time vs rows over one context bucket: per row count the last samples, and
    the table of estimates built from them (see the module docstring)."""

    def __init__(self, prior: CostPrior, window: int | None) -> None:
        self.prior = prior
        self.window = window
        self.samples: dict[int, deque[float]] = {}
        self._table: list[float] | None = None
        self._slope = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.samples.setdefault(num_tokens, deque(maxlen=self.window)).append(seconds)
        self._table = None

    def time(self, n: int) -> float:
        table = self._forward_table()
        if n < len(table):
            return table[n]
        return table[-1] + (n - len(table) + 1) * self._slope

    def _points(self) -> list[tuple[int, float, int]]:
        return [(n, statistics.median(v), len(v)) for n, v in sorted(self.samples.items())]

    def base(self) -> float:
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
        (beyond it, :meth:`time` extends the last entry by the fitted slope)."""
        if self._table is not None:
            return self._table
        size = max(65, max(self.samples, default=0) + 1)
        line, base = self._line(), self.base()
        self._slope = line[1] if line is not None else base * self.prior.token_cost
        table = [0.0] * size
        for m in range(1, size):
            if m in self.samples and len(self.samples[m]) >= 3:
                value = statistics.median(self.samples[m])
            elif line is not None:
                value = line[0] + line[1] * m
            else:
                value = base * (1 + self.prior.token_cost * (m - 1))
            table[m] = max(value, table[m - 1], 1e-9)  # never cheaper with more rows
        table[0] = table[1]
        self._table = table
        return table


class CostModel:
    """Target forward time vs rows (per context bucket), and draft time vs draft tokens
    per drafter.

    Args:
        prior: used until measurements exist (and always when ``frozen``).
        frozen: never learn: every estimate is the prior, in units of one plain step
            (``forward_time(1) == 1.0``). Controllers of seeded sampled requests use a
            frozen model so that their choices, and so the output, do not depend on timing.
        window: forward samples kept per row count and context bucket (the most recent;
            ``None``: all, for fitting a whole recorded run), and four times as many draft
            samples.

    Not thread-safe (the engine's one thread updates it).
    """

    def __init__(
        self, prior: CostPrior | None = None, *, frozen: bool = False, window: int | None = WINDOW
    ) -> None:
        self.prior = prior or CostPrior()
        self.frozen = frozen
        self.window = window
        self._curves: dict[int, _ForwardCurve] = {}
        self._empty = _ForwardCurve(self.prior, window)
        self._draft: dict[str, deque[tuple[int, float]]] = {}
        self._draft_fit: dict[str, tuple[float, float]] = {}

    # ------------------------------------------------------------------ observations

    def observe_forward(self, num_tokens: int, seconds: float, context: int = 0) -> None:
        """Record one target forward over ``num_tokens`` rows that took ``seconds``, its
        sequences holding ``context`` cached tokens in total before it (the engine passes
        them; 0: the first bucket)."""
        if self.frozen or num_tokens < 1 or not seconds > 0:
            return
        bucket = context_bucket(context)
        curve = self._curves.get(bucket)
        if curve is None:
            curve = self._curves[bucket] = _ForwardCurve(self.prior, self.window)
        curve.observe(num_tokens, seconds)

    def observe_draft(self, drafter: str, num_tokens: int, seconds: float) -> None:
        """Record that ``drafter`` proposed ``num_tokens`` tokens in ``seconds``."""
        if self.frozen or num_tokens < 1 or seconds < 0:
            return
        window = None if self.window is None else 4 * self.window
        self._draft.setdefault(drafter, deque(maxlen=window)).append((num_tokens, seconds))
        self._draft_fit.pop(drafter, None)

    @property
    def num_forward_samples(self) -> int:
        """Forward measurements held, over every context bucket (0 for a frozen model)."""
        return sum(len(v) for c in self._curves.values() for v in c.samples.values())

    # ------------------------------------------------------------------ estimates

    def at(self, context: int) -> ContextCost:
        """This model as seen by a step whose sequences hold ``context`` cached tokens in
        total: its forward times from that context's bucket (:class:`ContextCost`)."""
        return ContextCost(self, context)

    def forward_time(self, num_tokens: int, context: int = 0) -> float:
        """Estimated seconds of a forward over ``num_tokens`` >= 1 rows whose sequences
        hold ``context`` cached tokens (units of one plain step for a frozen or empty
        model): from that context's bucket, or while it has no samples the nearest
        bucket's (the longer one on a tie)."""
        return self._curve(context_bucket(context)).time(max(1, int(num_tokens)))

    def draft_time(self, drafter: str, num_tokens: int) -> float:
        """Estimated seconds for ``drafter`` to propose ``num_tokens`` tokens (0 for 0)."""
        if num_tokens <= 0:
            return 0.0
        fixed, per_token = self._draft_line(drafter)
        return max(0.0, fixed + per_token * num_tokens)

    def step_time(
        self, drafter: str, num_drafted: int, other_tokens: int = 0, context: int = 0
    ) -> float:
        """Forward over ``other_tokens + 1 + num_drafted`` rows plus the draft time."""
        return self.forward_time(other_tokens + 1 + num_drafted, context) + self.draft_time(
            drafter, num_drafted
        )

    def snapshot(self) -> dict:
        """JSON-ready estimates: forward seconds for 1..16 rows (the first context bucket;
        per bucket under ``forward_s_by_bucket``) and samples held."""
        rows = (1, 2, 4, 8, 16)
        return {
            "frozen": self.frozen,
            "forward_s": {n: self.forward_time(n) for n in rows},
            "forward_s_by_bucket": {
                b: {n: c.time(n) for n in rows} for b, c in sorted(self._curves.items())
            },
            "samples": self.num_forward_samples,
            "draft_s_per_token": {d: self._draft_line(d)[1] for d in self._draft},
        }

    # ------------------------------------------------------------------ internals

    def _curve(self, bucket: int) -> _ForwardCurve:
        if bucket in self._curves:
            return self._curves[bucket]
        if not self._curves:
            return self._empty
        nearest = min(self._curves, key=lambda b: (abs(b - bucket), -b))
        return self._curves[nearest]

    def _base(self) -> float:
        return self._curve(0).base()

    def _draft_line(self, drafter: str) -> tuple[float, float]:
        fit = self._draft_fit.get(drafter)
        if fit is not None:
            return fit
        samples = list(self._draft.get(drafter) or ())
        counts = Counter(n for n, _ in samples)
        if not samples:
            fit = (0.0, self._base() * self.prior.draft_token_cost)
        elif max(counts.values()) < MIN_DRAFT_SAMPLES and len(counts) < MIN_DRAFT_SAMPLES:
            # a few samples at one or two lengths: the median price of a token, through
            # the origin. A line through them let one slow draft at a length drafted once
            # set the slope (a 5-token draft at 36 ms beside one-token probes at 5 ms
            # priced a token at 7.6 ms, and ``cost`` then kept a sparse-kv draft off at 8k
            # tokens, where drafting 5 tokens gave 1.1-1.6x)
            fit = (0.0, statistics.median(t / n for n, t in samples))
        else:  # a line: through the lengths seen MIN_DRAFT_SAMPLES times, if any
            if max(counts.values()) >= MIN_DRAFT_SAMPLES:
                samples = [(n, t) for n, t in samples if counts[n] >= MIN_DRAFT_SAMPLES]
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


class ContextCost:
    """A :class:`CostModel` read at one context (:meth:`CostModel.at`): the same methods
    a controller calls on the model, with the forward times of that context's bucket.

    Attributes:
        model: the cost model.
        context: cached tokens the step's sequences hold in total.
    """

    def __init__(self, model: CostModel, context: int) -> None:
        self.model = model
        self.context = context

    @property
    def frozen(self) -> bool:
        """The model's :attr:`CostModel.frozen`."""
        return self.model.frozen

    @property
    def num_forward_samples(self) -> int:
        """The model's :attr:`CostModel.num_forward_samples` (every bucket)."""
        return self.model.num_forward_samples

    def forward_time(self, num_tokens: int) -> float:
        """:meth:`CostModel.forward_time` at this context."""
        return self.model.forward_time(num_tokens, self.context)

    def draft_time(self, drafter: str, num_tokens: int) -> float:
        """:meth:`CostModel.draft_time`."""
        return self.model.draft_time(drafter, num_tokens)

    def step_time(self, drafter: str, num_drafted: int, other_tokens: int = 0) -> float:
        """:meth:`CostModel.step_time` at this context."""
        return self.model.step_time(drafter, num_drafted, other_tokens, self.context)
