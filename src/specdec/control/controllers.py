"""The built-in speculation controllers: fixed, heuristic, confidence, cost, bandit.

Each is a :class:`~specdec.control.base.SpeculationController` (shared settings and, where
requests may learn from each other, shared statistics) making one per-request control.
Options are frozen dataclasses, validated on construction (``ValueError``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.control.base import SequenceInfo, StepOutcome, StepView
from specdec.control.cost import ContextCost, CostModel, CostPrior
from specdec.option import option


def _check(name: str, value, low: float, high: float, *, low_open=False, high_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")


# ---------------------------------------------------------------------- acceptance estimate


class AcceptanceEstimator:
    """Per-position conditional acceptance probabilities, forgetting old steps.

    ``p[i]`` estimates P(draft position i accepted | positions < i accepted) as
    ``(a_i + s * p[i-1]) / (n_i + s)``: ``a_i`` acceptances of ``n_i`` tests at position
    i, shrunk toward the previous position's estimate (``p[-1]`` = the prior), so an
    unobserved deeper position inherits the shallower one's rate. Every step multiplies all
    counts by ``decay`` (drift). Expected tokens per step with ``k`` drafts is then
    ``1 + sum_{j<k} prod_{i<=j} p[i]`` (Leviathan et al. 2023, eq. 1, with a rate per
    position instead of one i.i.d. rate).

    Args:
        prior: acceptance rate before any evidence, in [0, 1].
        deep_prior: if given, positions >= 1 shrink toward this rate instead of the
            previous position's (acceptance given that the earlier tokens were accepted
            is usually much higher than at the first position).
        strength: weight of the shrinkage (pseudo-tests), > 0.
        decay: per-step forgetting factor, in (0, 1].
    """

    def __init__(
        self,
        prior: float = 0.3,
        strength: float = 1.0,
        decay: float = 0.85,
        deep_prior: float | None = None,
    ):
        self.prior, self.strength, self.decay = prior, strength, decay
        self.deep_prior = deep_prior
        self.accepted: list[float] = []
        self.tested: list[float] = []

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """One step: ``num_accepted`` of ``num_drafted`` chain positions accepted (the
        first rejected position counts as one failed test; deeper ones were not tested)."""
        self.accepted = [a * self.decay for a in self.accepted]
        self.tested = [n * self.decay for n in self.tested]
        reached = min(num_drafted, num_accepted + 1)
        while len(self.tested) < reached:
            self.accepted.append(0.0)
            self.tested.append(0.0)
        for i in range(reached):
            self.tested[i] += 1.0
            if i < num_accepted:
                self.accepted[i] += 1.0

    def rates(self, k: int, prior: list[float] | None = None) -> list[float]:
        """``[k]`` conditional acceptance probabilities of positions 0..k-1; with
        ``prior`` (``[k]`` rates, e.g. what other requests showed), position i shrinks
        toward ``prior[i]`` instead of the previous position."""
        out, previous = [], self.prior
        for i in range(k):
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            n = self.tested[i] if i < len(self.tested) else 0.0
            if prior is not None:
                target = prior[i]
            elif i and self.deep_prior is not None:
                target = self.deep_prior
            else:
                target = previous
            previous = (a + self.strength * target) / (n + self.strength)
            out.append(previous)
        return out

    def expected_tokens(self, k: int, prior: list[float] | None = None) -> list[float]:
        """``[k + 1]``: entry j = expected tokens emitted by a step drafting j tokens."""
        out, survive, total = [1.0], 1.0, 1.0
        for p in self.rates(k, prior):
            survive *= p
            total += survive
            out.append(total)
        return out


# ---------------------------------------------------------------------- fixed


@dataclass(frozen=True)
class FixedOptions:
    """``fixed`` takes no options: every step drafts the configured k (capped by the
    tokens left to generate, as for every controller)."""


class FixedControl:
    def choose(self, view: StepView) -> int:
        return view.max_k

    def observe(self, outcome: StepOutcome) -> None:
        pass


class FixedController:
    """Every step drafts the configured number of tokens (the cap ``max_k``)."""

    name = "fixed"

    def __init__(self, options: FixedOptions | None = None) -> None:
        self.options = options or FixedOptions()

    def start(self, info: SequenceInfo) -> FixedControl:
        return FixedControl()


# ---------------------------------------------------------------------- heuristic


@dataclass(frozen=True)
class HeuristicOptions:
    """Options of ``heuristic``.

    Attributes:
        start: draft tokens of the first step (0 = the configured k).
        min_k: never fewer draft tokens than this (>= 0; 0 lets it switch speculation
            off, after which a full "acceptance" of nothing raises it again).
        increase: added after a step that accepted every draft token.
        decrease: subtracted after a step that rejected one.
    """

    start: int = option(0, "draft tokens of the first step (0: the configured k)")
    min_k: int = option(1, "never fewer draft tokens than this (>= 0; 0 may switch it off)")
    increase: int = option(2, "draft tokens added after a fully accepted draft (>= 0)")
    decrease: int = option(1, "draft tokens removed after a step that rejected one (>= 0)")

    def __post_init__(self) -> None:
        for name in ("start", "min_k", "increase", "decrease"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


class HeuristicControl:
    def __init__(self, options: HeuristicOptions, max_k: int) -> None:
        self.options = options
        self.max_k = max_k
        self.k = min(options.start or max_k, max_k)

    def choose(self, view: StepView) -> int:
        return max(0, min(self.k, view.max_k))

    def observe(self, outcome: StepOutcome) -> None:
        o = self.options
        if outcome.tree:
            full = outcome.num_accepted >= outcome.k
        elif outcome.k == 0:
            full = True  # nothing drafted, nothing rejected: try again
        else:
            full = outcome.num_drafted > 0 and outcome.num_accepted == outcome.num_drafted
            if outcome.num_drafted == 0:
                return  # the drafter found nothing: no evidence either way
        k = self.k + o.increase if full else self.k - o.decrease
        self.k = max(min(o.min_k, self.max_k), min(k, self.max_k))


class HeuristicController:
    """Transformers' assisted-generation schedule (``num_assistant_tokens_schedule=
    "heuristic"``): +2 draft tokens after a step that accepted all of them, -1 after one
    that did not, within ``[min_k, k]``."""

    name = "heuristic"

    def __init__(self, options: HeuristicOptions | None = None) -> None:
        self.options = options or HeuristicOptions()

    def start(self, info: SequenceInfo) -> HeuristicControl:
        return HeuristicControl(self.options, info.max_k)


# ---------------------------------------------------------------------- confidence


@dataclass(frozen=True)
class ConfidenceOptions:
    """Options of ``confidence``.

    Attributes:
        threshold: stop drafting once the predicted probability that some draft token
            of this step is rejected exceeds this (SpecDec++'s ``h``), in (0, 1).
        calibrate: learn the acceptance probability of a draft token from its draft
            confidence online (10 bins); otherwise the confidence itself is the prediction.
        shared: requests share one calibration (never for isolated requests).
    """

    threshold: float = option(
        0.5, "stop drafting once the predicted chance of a rejection passes this, in (0, 1)"
    )
    calibrate: bool = option(
        True, "learn acceptance from draft confidence online (10 bins); false: use it as is"
    )
    shared: bool = option(True, "requests share one calibration (isolated requests never do)")

    def __post_init__(self) -> None:
        _check("threshold", self.threshold, 0.0, 1.0, low_open=True, high_open=True)


class Calibration:
    """P(accept | draft confidence) in 10 equal bins, each a Beta posterior whose prior
    mean is the bin's center (strength 2)."""

    BINS = 10

    def __init__(self) -> None:
        self.accepted = [0.0] * self.BINS
        self.tested = [0.0] * self.BINS

    def copy(self) -> Calibration:
        other = Calibration()
        other.accepted, other.tested = list(self.accepted), list(self.tested)
        return other

    def _bin(self, confidence: float) -> int:
        return min(self.BINS - 1, max(0, int(confidence * self.BINS)))

    def predict(self, confidence: float) -> float:
        b = self._bin(confidence)
        center = (b + 0.5) / self.BINS
        return (self.accepted[b] + 2 * center) / (self.tested[b] + 2)

    def update(self, confidence: float, accepted: bool) -> None:
        b = self._bin(confidence)
        self.tested[b] += 1
        self.accepted[b] += bool(accepted)


class ConfidenceControl:
    def __init__(self, options: ConfidenceOptions, calibration: Calibration | None) -> None:
        self.options = options
        self.calibration = calibration
        self._survive = 1.0

    def choose(self, view: StepView) -> int:
        self._survive = 1.0
        return view.max_k

    def stop_drafting(self, position: int, confidence: float) -> bool:
        """Before keeping draft position ``position``: stop if P(some rejection) > h."""
        if position == 0:
            self._survive = 1.0
        predicted = (
            self.calibration.predict(confidence) if self.calibration is not None else confidence
        )
        self._survive *= predicted
        return 1.0 - self._survive > self.options.threshold

    def observe(self, outcome: StepOutcome) -> None:
        if self.calibration is None or not outcome.confidences:
            return
        for i, c in enumerate(outcome.confidences[: outcome.num_accepted + 1]):
            self.calibration.update(c, i < outcome.num_accepted)


class ConfidenceController:
    """SpecDec++-style adaptive length (Huang et al. 2024, "SpecDec++: Boosting
    Speculative Decoding via Adaptive Candidate Lengths", section 3): keep drafting while
    the predicted probability that every draft token so far is accepted stays above
    ``1 - threshold``. SpecDec++ trains an acceptance-prediction head; here the prediction
    is the draft distribution's top probability, calibrated online against verified
    outcomes. Drafters without a distribution (n-gram, suffix, ...) report no confidence
    and so draft the configured k, as ``fixed`` does.
    """

    name = "confidence"

    def __init__(self, options: ConfidenceOptions | None = None) -> None:
        self.options = options or ConfidenceOptions()
        self._shared = Calibration()

    def start(self, info: SequenceInfo) -> ConfidenceControl:
        o = self.options
        if not o.calibrate:
            calibration = None
        elif o.shared and not info.isolated:
            calibration = self._shared
        else:
            calibration = Calibration()
        return ConfidenceControl(o, calibration)


# ---------------------------------------------------------------------- cost


#: ``cost``'s default first-token acceptance before evidence (the ``prior`` option).
DEFAULT_PRIOR = 0.3


@dataclass(frozen=True)
class CostOptions:
    """Options of ``cost``.

    Attributes:
        prior: acceptance rate of a first draft token assumed before evidence, in [0, 1];
            left at its default (:data:`DEFAULT_PRIOR`), a drafter that declares its own
            ``acceptance_prior`` starts from that instead (see :func:`start_prior`).
        deep_prior: acceptance rate of a later draft token whose predecessors were
            accepted, assumed before evidence, in [0, 1] (optimistic, so that long drafts
            get tried and measured).
        strength: weight of these priors (pseudo-tests), > 0.
        decay: per-step forgetting of acceptance evidence, in (0, 1]: evidence is worth
            about ``1 / (1 - decay)`` drafting steps, so a drafter that stops being
            accepted is switched off after about ``ln(token_cost) / ln(decay)`` steps.
        goodput_decay: per-step forgetting of the measured goodput of whole proposals
            (cheap deterministic drafters, see :class:`CostController`), in (0, 1].
        token_cost: cost of one more verified row relative to a plain step, used before
            the cost model has measurements and always for isolated (seeded sampled)
            requests, >= 0.
        max_backoff: while speculation is off, a one-token probe runs after 1, 2, 4, ...
            off steps (doubling after each probe that was rejected, back to 1 after one
            that was accepted), at most this many (int >= 1).
        probe_budget: probes are also spaced so that they cost at most this fraction of
            the time spent with speculation off (a probe of a drafter that adds rows,
            like Lookahead's window, or whose first draft must catch up with the whole
            sequence, like a draft model's, waits longer; the last probe's measured cost
            counts; in a batch, every sequence's probes slow down the shared forward, so
            each sequence waits batch-size times longer; with ``shared``, the off steps
            are counted over every request of the drafter, so requests shorter than the
            wait still probe), in (0, 1].
        shared: requests that are not isolated learn a per-position acceptance profile
            of the drafter together (decaying slowly), toward which each request's own
            estimate shrinks; otherwise every request starts from ``prior``.
        trim: for cheap deterministic drafters (whole proposals, see
            :class:`CostController`), verify only the prefix of the proposal that
            maximizes the step's expected tokens per second (:meth:`CostControl.trim`).
    """

    prior: float = option(
        DEFAULT_PRIOR,
        "first token's acceptance before evidence, in [0, 1]; unless changed, a drafter's "
        "own (quantized: 0.8)",
    )
    deep_prior: float = option(
        0.9, "acceptance rate of a later token after accepted ones, before evidence, in [0, 1]"
    )
    strength: float = option(1.0, "weight of the priors, in pseudo-observations (> 0)")
    decay: float = option(
        0.85, "per-step forgetting of acceptance evidence, in (0, 1]; remembers ~1/(1-decay) steps"
    )
    goodput_decay: float = option(
        0.95, "per-step forgetting of the measured goodput of whole proposals, in (0, 1]"
    )
    token_cost: float = option(
        0.1,
        "cost of a verified row relative to a plain step, before measurements and for "
        "isolated requests (>= 0)",
    )
    max_backoff: int = option(
        64,
        "most off steps between one-token probes (the wait doubles after each rejected "
        "probe; >= 1)",
    )
    probe_budget: float = option(
        0.02,
        "probes cost at most this fraction of the time spent off (in a batch: of the "
        "batch's time), in (0, 1]",
    )
    shared: bool = option(
        True, "requests (not isolated ones) learn a per-position acceptance profile together"
    )
    trim: bool = option(
        True,
        "verify the prefix of a free deterministic proposal that pays best; false: all of it",
    )

    def __post_init__(self) -> None:
        _check("prior", self.prior, 0.0, 1.0)
        _check("deep_prior", self.deep_prior, 0.0, 1.0)
        _check("goodput_decay", self.goodput_decay, 0.0, 1.0, low_open=True)
        _check("strength", self.strength, 0.0, math.inf, low_open=True, high_open=True)
        _check("decay", self.decay, 0.0, 1.0, low_open=True)
        _check("token_cost", self.token_cost, 0.0, math.inf, high_open=True)
        if isinstance(self.max_backoff, bool) or not isinstance(self.max_backoff, int):
            raise ValueError(f"max_backoff must be an integer >= 1, got {self.max_backoff!r}")
        if self.max_backoff < 1:
            raise ValueError(f"max_backoff must be an integer >= 1, got {self.max_backoff!r}")
        _check("probe_budget", self.probe_budget, 0.0, 1.0, low_open=True)


def best_length(
    expected: list[float],
    cost: CostModel | ContextCost,
    drafter: str,
    view: StepView,
    nodes_per_depth: float = 1.0,
    aux_rows: int = 0,
) -> int:
    """The draft length maximizing the step's expected tokens per second.

    Args:
        expected: ``[K + 1]`` expected tokens emitted by this sequence with 0..K drafts.
        cost: the cost model.
        drafter: the drafter's cost-model key.
        view: the step (``other_tokens`` and ``other_expected`` make it SmartSpec's batch
            goodput: every sequence's expected tokens over the one forward's time).
        nodes_per_depth: rows verified per unit of ``k`` (token trees).
        aux_rows: rows the drafter adds whenever ``k > 0``.

    Returns:
        ``k`` in ``[0, K]`` (ties go to the shorter draft; 0 = do not speculate).
    """
    best_k, best_rate = 0, -1.0
    for k, tokens in enumerate(expected):
        rows = view.other_tokens + 1 + math.ceil(k * nodes_per_depth) + (aux_rows if k else 0)
        seconds = cost.forward_time(rows) + cost.draft_time(drafter, k)
        rate = (view.other_expected + tokens) / seconds
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


class Goodput:
    """Decayed sums of tokens emitted, estimated seconds and rows drafted over
    speculating steps."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self.steps = 0.0
        self.rows = 0.0

    def add(self, tokens: float, seconds: float, decay: float, rows: float = 0.0) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.steps = self.steps * decay + 1.0
        self.rows = self.rows * decay + rows

    def rate(self) -> float | None:
        """Tokens per second (``None`` before any step)."""
        return self.tokens / self.seconds if self.seconds > 0 else None


class CostControl:
    """One request's state of :class:`CostController` (see there)."""

    def __init__(
        self,
        options: CostOptions,
        info: SequenceInfo,
        frozen: CostModel | None,
        shared: dict | None,
        shared_decay: float,
    ):
        o = self.options = options
        self.info = info
        self.frozen = frozen
        self.shared = shared
        self.shared_decay = shared_decay
        self.estimator = AcceptanceEstimator(
            start_prior(o, info), o.strength, o.decay, o.deep_prior
        )
        self.goodput = Goodput()
        if shared is not None and shared["goodput"].steps > 0:  # warm start, worth 2 steps
            g = shared["goodput"]
            scale = min(1.0, 2.0 / g.steps)
            self.goodput.tokens, self.goodput.seconds = g.tokens * scale, g.seconds * scale
            self.goodput.steps, self.goodput.rows = g.steps * scale, g.rows * scale
        # its drafts carry no distribution (known from the start when another request of
        # the same drafter has drafted: a new request then takes the whole-proposal path
        # at once, a comparison of two goodputs instead of a search over lengths)
        self.deterministic = bool(shared.get("deterministic")) if shared is not None else False
        # what the last probe cost beyond a plain step (relative; measured, so never for
        # isolated requests, whose choices must not depend on timing)
        self.probe_extra = shared.get("probe_extra", 0.0) if shared is not None else 0.0
        self._off = 0  # see off_steps
        self.backoff = 1  # off steps before the next probe
        self.probing = False
        self._view: StepView | None = None
        self._whole_step = False  # this step's choice took the whole-proposal path

    @property
    def off_steps(self) -> int:
        """Steps with speculation off since the last probe or speculating step, counted
        over every request that shares what the drafter learned (so probes keep coming
        when each request is shorter than the wait between them: a server whose traffic
        had turned speculation off, then got short requests, never probed again), else
        over this request's own steps (isolated requests)."""
        return self.shared.get("off_steps", 0) if self.shared is not None else self._off

    @off_steps.setter
    def off_steps(self, value: int) -> None:
        if self.shared is not None:
            self.shared["off_steps"] = value
        else:
            self._off = value

    def _whole(self, cost: CostModel | ContextCost, view: StepView) -> bool:
        """Draft whole proposals or nothing: drafts are deterministic and cheap."""
        plain = cost.forward_time(view.other_tokens + 1)
        cheap = cost.draft_time(self.info.drafter, view.max_k) <= 0.1 * plain
        return self.deterministic and cheap and not self.info.drafter.endswith(":tree")

    def choose(self, view: StepView) -> int:
        self._view = view
        cost = self.frozen or view.cost
        info = self.info
        plain = cost.forward_time(view.other_tokens + 1)
        self._whole_step = self._whole(cost, view)
        if self._whole_step:
            g = self.goodput
            if g.steps <= 0:
                self.off_steps = 0
                return view.max_k
            # SmartSpec's batch goodput (eq. 3) with this sequence's measured means: the
            # batch's tokens over the forward's time, with and without its draft rows
            tokens, rows = g.tokens / g.steps, g.rows / g.steps
            drafted = round(rows) + (info.aux_rows if rows else 0)
            spec_s = cost.forward_time(view.other_tokens + 1 + drafted) + cost.draft_time(
                info.drafter, round(rows)
            )
            if (view.other_expected + tokens) * plain >= (view.other_expected + 1.0) * spec_s:
                self.off_steps = 0
                return view.max_k
            extra = max(0.0, spec_s - plain) / plain
            k = view.max_k
        else:
            prior = self.shared["rates"].rates(view.max_k) if self.shared is not None else None
            expected = self.estimator.expected_tokens(view.max_k, prior)
            k = best_length(
                expected, cost, info.drafter, view, info.tree_nodes_per_depth, info.aux_rows
            )
            if k > 0 or view.max_k == 0:
                self.off_steps = 0
                return k
            extra = (
                cost.forward_time(view.other_tokens + 2 + info.aux_rows)
                + cost.draft_time(info.drafter, 1)
                - plain
            ) / plain
            k = 1
        # speculation is off; a probe tells whether it pays again. Probes back off when
        # rejected and cost at most ``probe_budget`` of the time spent off.
        self.off_steps += 1
        # a probe may cost more than a steady draft (a draft model first catches up with
        # everything generated while it was off): charge what the last probe really cost.
        # In a batch of B sequences each probing once per W steps, probes add B * extra / W
        # of a step to everyone's time: W >= B * extra / budget keeps that within budget
        extra = max(extra, self.probe_extra) * max(1, view.batch_size)
        wait = max(self.backoff, math.ceil(extra / self.options.probe_budget))
        if self.off_steps > wait:
            self.off_steps, self.probing = 0, True
            return k
        return 0

    def trim(self, length: int) -> int:
        """How many tokens of a chain proposal of ``length`` tokens to verify.

        Whole-proposal steps (cheap deterministic drafters) only, with ``trim`` on: the
        prefix length j in ``1..length`` that maximizes this step's batch goodput,
        ``(O + E_j) / (T(R + j) + draft time)``, where ``E_j`` comes from the per-position
        acceptance estimates (:meth:`AcceptanceEstimator.expected_tokens`, shrunk toward
        the shared profile) and T from the cost model, as :func:`best_length` does for
        other drafters. A prefix of a point-mass draft is verified as the draft itself
        would be, so this is lossless. Otherwise ``length``.
        """
        view = self._view
        if not (self._whole_step and self.options.trim and view is not None and length > 1):
            return length
        cost, info = self.frozen or view.cost, self.info
        prior = self.shared["rates"].rates(length) if self.shared is not None else None
        expected = self.estimator.expected_tokens(length, prior)
        best = best_length(expected, cost, info.drafter, view, 1.0, info.aux_rows)
        return max(1, best)

    def observe(self, outcome: StepOutcome) -> None:
        drafted = outcome.k if outcome.tree else outcome.num_drafted
        if self.probing:
            self.probing = False
            view = self._view
            if view is not None:
                cost = self.frozen or view.cost
                plain = cost.forward_time(view.other_tokens + 1)
                drafted_rows = view.other_tokens + 1 + outcome.num_drafted + self.info.aux_rows
                spent = cost.forward_time(drafted_rows) + outcome.draft_s - plain
                self.probe_extra = max(0.0, spent / plain) if self.frozen is None else 0.0
                if self.shared is not None:
                    self.shared["probe_extra"] = self.probe_extra
            if outcome.num_accepted:
                self.backoff = 1
            else:
                self.backoff = min(2 * self.backoff, self.options.max_backoff)
        if not drafted:  # a step without a draft says nothing about acceptance
            return
        self.deterministic = outcome.deterministic
        if self.shared is not None:
            self.shared["deterministic"] = outcome.deterministic
        self.estimator.update(drafted, outcome.num_accepted)
        view = self._view
        if self.shared is not None:
            self.shared["rates"].update(drafted, outcome.num_accepted)
        if view is not None and not outcome.tree:
            cost, info = self.frozen or view.cost, self.info
            seconds = cost.forward_time(
                view.other_tokens + 1 + drafted + info.aux_rows
            ) + cost.draft_time(info.drafter, drafted)
            tokens = outcome.num_accepted + 1
            self.goodput.add(tokens, seconds, self.options.goodput_decay, drafted)
            if self.shared is not None:
                self.shared["goodput"].add(tokens, seconds, self.shared_decay, drafted)


def start_prior(options: CostOptions, info: SequenceInfo) -> float:
    """The first-token acceptance ``cost`` starts from: ``options.prior`` when set to
    anything but its default (:data:`DEFAULT_PRIOR`), else the drafter's declared
    :attr:`~specdec.control.base.SequenceInfo.acceptance_prior` if it has one (a
    quantized self-draft expects most first tokens accepted, where the default prior
    kept it off for most of a single request), else the default."""
    if options.prior != DEFAULT_PRIOR or info.acceptance_prior is None:
        return options.prior
    return info.acceptance_prior


class CostController:
    """Choose each step's draft length to maximize expected tokens per second: the
    acceptance estimate (:class:`AcceptanceEstimator`) gives expected tokens for every k,
    the online :class:`~specdec.control.cost.CostModel` gives the forward and draft time
    of every k, and k = 0 (plain decoding) is one of the choices. In a batch the objective
    is SmartSpec's goodput (Liu et al. 2024, "Optimizing Speculative Decoding for Serving
    Large Language Models Using Goodput", eq. 3): all sequences' expected tokens over the
    shared forward's time. Leviathan et al. (2023, section 3.5) derive the same optimum
    for one sequence and an i.i.d. acceptance rate.

    Deterministic drafters whose drafts cost next to nothing (n-gram, suffix, recycling,
    retrieval) choose their own draft length (a long suffix or n-gram match is a
    confident one), so for them the choice is between their whole proposal (up to k) and
    none: speculate while the batch goodput with this sequence's measured means (tokens
    per speculating step, rows drafted per speculating step) beats the batch goodput
    without its draft: ``(O + E) / T(R + D) >= (O + 1) / T(R)``, O the other sequences'
    expected tokens, R the forward's other rows plus one, T the cost model's forward
    time. Alone (O = 0) that is "a speculating step's tokens per second beat a plain
    step's"; in a large batch a draft must pay for the rows it adds to everyone's forward.
    """

    name = "cost"

    #: per-step decay of the shared per-position profile (evidence of ~200 steps)
    SHARED_DECAY = 0.995

    def __init__(self, options: CostOptions | None = None) -> None:
        self.options = options or CostOptions()
        self._frozen = CostModel(CostPrior(self.options.token_cost), frozen=True)
        self._shared: dict[str, dict] = {}

    def start(self, info: SequenceInfo) -> CostControl:
        o = self.options
        if info.isolated:
            return CostControl(o, info, self._frozen, None, self.SHARED_DECAY)
        shared = None
        if o.shared:
            shared = self._shared.setdefault(
                info.drafter,
                {
                    "rates": AcceptanceEstimator(
                        start_prior(o, info), o.strength, self.SHARED_DECAY, o.deep_prior
                    ),
                    "goodput": Goodput(),
                },
            )
        return CostControl(o, info, None, shared, self.SHARED_DECAY)


# ---------------------------------------------------------------------- bandit


@dataclass(frozen=True)
class BanditOptions:
    """Options of ``bandit``.

    Attributes:
        exploration: UCB's exploration scale ``c`` (rewards are a step's speed relative
            to a plain step, about 0-3), >= 0.
        discount: per-step discount of arm statistics (discounted UCB), in (0, 1].
        counterfactual: after a chain step, also score every shorter arm (and, when the
            drafter proposed fewer tokens than asked, every longer one) from the same
            verification: a draft of length j is the first j tokens of the longer draft.
        token_cost: as for ``cost`` (isolated requests and before measurements).
    """

    exploration: float = option(
        0.2, "UCB exploration scale c; rewards are speed over a plain step, about 0-3 (>= 0)"
    )
    discount: float = option(0.98, "per-step discount of the arms' statistics, in (0, 1]")
    counterfactual: bool = option(
        True, "also score shorter (and unproposed longer) lengths from each verification"
    )
    token_cost: float = option(
        0.1,
        "cost of a verified row relative to a plain step, before measurements and for "
        "isolated requests (>= 0)",
    )

    def __post_init__(self) -> None:
        _check("exploration", self.exploration, 0.0, math.inf, high_open=True)
        _check("discount", self.discount, 0.0, 1.0, low_open=True)
        _check("token_cost", self.token_cost, 0.0, math.inf, high_open=True)


def bandit_arms(max_k: int) -> list[int]:
    """The arms for a cap ``max_k``: 0 (no speculation), powers of two below it, and it."""
    arms, k = {0, max_k}, 1
    while k < max_k:
        arms.add(k)
        k *= 2
    return sorted(arms)


class ArmStats:
    """Discounted reward sums and counts per arm."""

    def __init__(self, arms: list[int]) -> None:
        self.arms = arms
        self.sums = [0.0] * len(arms)
        self.counts = [0.0] * len(arms)

    def discount(self, factor: float) -> None:
        self.sums = [s * factor for s in self.sums]
        self.counts = [n * factor for n in self.counts]

    def add(self, index: int, reward: float) -> None:
        self.sums[index] += reward
        self.counts[index] += 1.0


class BanditControl:
    def __init__(self, options: BanditOptions, info: SequenceInfo, frozen, shared):
        self.options, self.info, self.frozen, self.shared = options, info, frozen, shared
        self.stats = ArmStats(bandit_arms(info.max_k))
        if shared is not None:  # warm start: the shared means, worth at most 2 pulls each
            for i in range(len(self.stats.arms)):
                n = shared.counts[i]
                if n > 0:
                    self.stats.counts[i] = min(n, 2.0)
                    self.stats.sums[i] = shared.sums[i] / n * self.stats.counts[i]
        self._cost: CostModel | ContextCost | None = None

    def choose(self, view: StepView) -> int:
        self._cost = self.frozen or view.cost
        stats, c = self.stats, self.options.exploration
        total = sum(stats.counts)
        best, best_score = 0, -math.inf
        for i, arm in enumerate(stats.arms):
            if arm > view.max_k:
                break
            n = stats.counts[i]
            if n < 1e-9:
                return arm  # every arm is tried once
            score = stats.sums[i] / n + c * math.sqrt(math.log(max(total, 1.0)) / n)
            if score > best_score:
                best, best_score = arm, score
        return best

    def _reward(self, drafted: int, accepted: int) -> float:
        cost, name = self._cost, self.info.drafter
        plain = cost.forward_time(1)
        return (accepted + 1) * plain / cost.step_time(name, drafted)

    def observe(self, outcome: StepOutcome) -> None:
        if self._cost is None:
            return
        o = self.options
        stats = self.stats
        stats.discount(o.discount)
        if self.shared is not None:
            self.shared.discount(o.discount)
        for i, arm in enumerate(stats.arms):
            if outcome.tree or not o.counterfactual:
                if arm != outcome.k:
                    continue
                drafted, accepted = outcome.num_drafted, outcome.num_accepted
            elif arm <= outcome.k or outcome.num_drafted < outcome.k:
                drafted = min(arm, outcome.num_drafted)
                accepted = min(outcome.num_accepted, drafted)
            else:
                continue
            reward = self._reward(drafted, accepted)
            stats.add(i, reward)
            if self.shared is not None:
                self.shared.add(i, reward)


class BanditController:
    """Upper-confidence-bound choice among draft lengths (BanditSpec, Hou et al. 2025,
    "BanditSpec: Adaptive Speculative Decoding via Bandit Algorithms", UCBSpec): each arm
    is a draft length (0, powers of two, k); its reward is the step's tokens per unit of
    time relative to a plain step (times from the cost model); discounted UCB (Garivier &
    Moulines 2011) follows drift. Because a shorter draft is a prefix of a longer one,
    one verification scores every shorter arm at once (``counterfactual``). Requests
    that are not isolated share arm statistics as a warm start.
    """

    name = "bandit"

    def __init__(self, options: BanditOptions | None = None) -> None:
        self.options = options or BanditOptions()
        self._frozen = CostModel(CostPrior(self.options.token_cost), frozen=True)
        self._shared: dict[int, ArmStats] = {}

    def start(self, info: SequenceInfo) -> BanditControl:
        if info.isolated:
            return BanditControl(self.options, info, self._frozen, None)
        shared = self._shared.setdefault(info.max_k, ArmStats(bandit_arms(info.max_k)))
        return BanditControl(self.options, info, None, shared)
