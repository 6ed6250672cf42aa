"""Speculation controllers, the online cost model and the trace simulator, driven by
synthetic acceptance streams (pure Python, no models)."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Callable
from itertools import pairwise

import pytest

from specdec import registry
from specdec.config import SamplingParams
from specdec.control.base import (
    SequenceControl,
    SequenceInfo,
    SpeculationController,
    StepOutcome,
    StepView,
    check_choice,
)
from specdec.control.controllers import (
    AcceptanceEstimator,
    BanditController,
    BanditOptions,
    ConfidenceController,
    ConfidenceOptions,
    CostController,
    CostOptions,
    FixedController,
    HeuristicController,
    HeuristicOptions,
    bandit_arms,
    best_length,
)
from specdec.control.cost import CostModel, CostPrior, context_bucket
from specdec.control.simulate import (
    SimResult,
    Timing,
    Trace,
    TraceStep,
    opportunities,
    simulate,
    simulate_all,
)

MAX_K = 8

#: ``stream(step_index, k) -> accepted`` (at most ``k``).
Stream = Callable[[int, int], int]


# ---------------------------------------------------------------------- helpers


def frozen_cost(token_cost: float = 0.1, draft_token_cost: float = 0.0) -> CostModel:
    """forward_time(n) = 1 + token_cost * (n - 1); draft_time(k) = draft_token_cost * k."""
    return CostModel(CostPrior(token_cost, draft_token_cost), frozen=True)


def info(max_k: int = MAX_K, *, isolated: bool = False) -> SequenceInfo:
    return SequenceInfo("r", max_k, SamplingParams(), "d", isolated=isolated)


def outcome(k: int, accepted: int, drafted: int | None = None, **kw) -> StepOutcome:
    drafted = k if drafted is None else drafted
    return StepOutcome(
        k=k, num_drafted=drafted, num_accepted=accepted, num_emitted=accepted + 1, **kw
    )


def drive(
    controller,
    stream: Stream,
    steps: int,
    *,
    max_k: int = MAX_K,
    cost: CostModel | None = None,
    isolated: bool = False,
    control=None,
) -> list[int]:
    """Run ``steps`` steps of one sequence; returns the chosen k of every step."""
    cost = cost or frozen_cost()
    control = control or controller.start(info(max_k, isolated=isolated))
    chosen = []
    for i in range(steps):
        k = control.choose(StepView(max_k, cost))
        assert check_choice(control, k, max_k) == k
        a = stream(i, k)
        assert 0 <= a <= k
        control.observe(outcome(k, a))
        chosen.append(k)
    return chosen


def accept_all(i: int, k: int) -> int:
    return k


def accept_none(i: int, k: int) -> int:
    return 0


def alternate(i: int, k: int) -> int:
    return k if i % 2 == 0 else 0


def drift(switch: int, first: Stream, then: Stream) -> Stream:
    return lambda i, k: first(i, k) if i < switch else then(i, k)


def bernoulli(alpha: float, seed: int) -> Stream:
    """i.i.d. acceptance: accepted = the number of leading successes of k trials."""
    rng = random.Random(seed)

    def stream(i: int, k: int) -> int:
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        return a

    return stream


def first_index(values: list[int], predicate, start: int = 0) -> int:
    return next(i for i in range(start, len(values)) if predicate(values[i]))


def iid_expected(alpha: float, max_k: int) -> list[float]:
    """Leviathan et al.: a step drafting k tokens emits (1 - a^(k+1)) / (1 - a) tokens."""
    if alpha == 1.0:
        return [float(k + 1) for k in range(max_k + 1)]
    return [(1 - alpha ** (k + 1)) / (1 - alpha) for k in range(max_k + 1)]


def brute_force_best(objective: list[float]) -> int:
    best = 0
    for k, value in enumerate(objective):
        if value > objective[best]:
            best = k
    return best


# ---------------------------------------------------------------------- cost model


def test_empty_cost_model_gives_the_prior_in_plain_step_units():
    cost = CostModel(CostPrior(token_cost=0.25))
    assert cost.num_forward_samples == 0
    for n in (1, 2, 5, 16, 100):
        assert cost.forward_time(n) == pytest.approx(1 + 0.25 * (n - 1))
    assert cost.forward_time(0) == cost.forward_time(1)
    assert cost.draft_time("d", 3) == 0.0


def test_one_measured_row_count_scales_the_prior():
    cost = CostModel(CostPrior(token_cost=0.1))
    cost.observe_forward(1, 0.5)
    assert cost.forward_time(1) == pytest.approx(0.5)
    assert cost.forward_time(11) == pytest.approx(0.5 * 2.0)


def test_forward_time_is_the_median_per_row_count_once_three_samples():
    cost = CostModel()
    for _ in range(3):
        cost.observe_forward(4, 2.0)
    cost.observe_forward(1, 1.0)
    assert cost.forward_time(4) == pytest.approx(2.0)
    cost.observe_forward(4, 100.0)  # one stray slow step
    assert cost.forward_time(4) == pytest.approx(2.0)
    assert cost.num_forward_samples == 5


def test_forward_time_fits_a_line_between_and_beyond_measured_counts():
    cost = CostModel()
    for n in (2, 6):
        for _ in range(3):
            cost.observe_forward(n, 1.0 + 0.5 * n)
    assert cost.forward_time(4) == pytest.approx(3.0)
    assert cost.forward_time(1) == pytest.approx(1.5)
    assert cost.forward_time(10) == pytest.approx(6.0)
    assert cost.forward_time(200) == pytest.approx(101.0)


def test_estimates_beyond_the_table_do_not_rebuild_it():
    """A batch of many sequences asks for forwards of hundreds of rows, hundreds of times a
    step: those are extrapolated from the table, which is rebuilt only after an
    observation (it was rebuilt to n + 1 entries at every call above 64 rows)."""
    cost = CostModel()
    for n in (2, 6):
        for _ in range(3):
            cost.observe_forward(n, 1.0 + 0.5 * n)
    cost.forward_time(1)
    curve = cost._curve(0)
    table = curve._table
    for n in (65, 300, 900, 12):
        assert cost.forward_time(n) == pytest.approx(1.0 + 0.5 * n)
    assert curve._table is table and len(table) == 65
    cost.observe_forward(300, 151.0)
    assert cost.forward_time(300) == pytest.approx(151.0)
    assert len(curve._table) == 301
    assert cost.forward_time(1000) == pytest.approx(501.0)


def test_row_counts_with_fewer_than_three_samples_use_the_line():
    cost = CostModel()
    for n in (1, 9):
        for _ in range(3):
            cost.observe_forward(n, float(n))
    cost.observe_forward(5, 50.0)  # one sample only: not trusted as a median yet
    line = cost.forward_time(5)
    assert line < 50.0
    cost.observe_forward(5, 50.0)
    cost.observe_forward(5, 50.0)
    assert cost.forward_time(5) == pytest.approx(50.0)


def test_forward_time_never_decreases_with_rows():
    rng = random.Random(0)
    cost = CostModel()
    for n in range(1, 17):
        for _ in range(4):
            cost.observe_forward(n, 3.0 - 0.1 * n + rng.uniform(0, 1.0))
    times = [cost.forward_time(n) for n in range(1, 150)]
    assert all(b >= a for a, b in pairwise(times))


def test_draft_time_fits_a_line_and_is_zero_for_no_tokens():
    cost = CostModel()
    for n in range(1, 7):
        cost.observe_draft("d", n, 0.01 + 0.002 * n)
    assert cost.draft_time("d", 0) == 0.0
    assert cost.draft_time("d", 3) == pytest.approx(0.016)
    assert cost.draft_time("d", 10) == pytest.approx(0.03)
    assert cost.snapshot()["draft_s_per_token"]["d"] == pytest.approx(0.002)


def test_draft_time_with_one_draft_length_is_per_token():
    cost = CostModel()
    for _ in range(3):
        cost.observe_draft("d", 2, 0.02)
    assert cost.draft_time("d", 4) == pytest.approx(0.04)


def test_draft_time_without_samples_uses_the_prior():
    cost = CostModel(CostPrior(token_cost=0.1, draft_token_cost=0.05))
    assert cost.draft_time("other", 4) == pytest.approx(0.2)
    assert cost.step_time("other", 4, other_tokens=2) == pytest.approx(1 + 0.1 * 6 + 0.2)


def test_frozen_cost_model_ignores_observations():
    cost = frozen_cost(0.2, 0.05)
    for n in range(1, 17):
        cost.observe_forward(n, 10.0 * n)
    cost.observe_draft("d", 3, 5.0)
    assert cost.num_forward_samples == 0
    assert cost.forward_time(1) == 1.0
    assert cost.forward_time(6) == pytest.approx(2.0)
    assert cost.draft_time("d", 2) == pytest.approx(0.1)
    assert cost.step_time("d", 2) == pytest.approx(1.4 + 0.1)


def test_observations_invalidate_the_cached_estimates():
    cost = CostModel()
    for n in (1, 2):
        for _ in range(3):
            cost.observe_forward(n, float(n))
    assert cost.forward_time(2) == pytest.approx(2.0)
    for _ in range(3):
        cost.observe_forward(2, 5.0)
    assert cost.forward_time(2) == pytest.approx(3.5)  # median of three 2.0s and three 5.0s


def test_snapshot_keys():
    cost = CostModel()
    cost.observe_forward(1, 0.01)
    cost.observe_draft("d", 2, 0.004)
    snap = cost.snapshot()
    assert set(snap) == {
        "frozen", "forward_s", "forward_s_by_bucket", "samples", "draft_s_per_token",
    }  # fmt: skip
    assert set(snap["forward_s"]) == {1, 2, 4, 8, 16}
    assert set(snap["forward_s_by_bucket"]) == {0}
    assert snap["frozen"] is False and snap["samples"] == 1
    assert set(snap["draft_s_per_token"]) == {"d"}
    assert frozen_cost().snapshot()["frozen"] is True


@pytest.mark.parametrize(
    "kwargs", [{"token_cost": -0.1}, {"draft_token_cost": math.inf}, {"token_cost": math.nan}]
)
def test_cost_prior_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        CostPrior(**kwargs)


# ---------------------------------------------------------------------- acceptance estimator


def test_estimator_without_evidence_gives_the_prior_everywhere():
    est = AcceptanceEstimator(prior=0.4)
    assert est.rates(3) == pytest.approx([0.4, 0.4, 0.4])
    assert est.expected_tokens(3) == pytest.approx([1.0, 1.4, 1.56, 1.624])


def test_estimator_rates_shrink_toward_the_previous_position():
    est = AcceptanceEstimator(prior=0.3, strength=1.0, decay=1.0)
    est.update(2, 2)
    p0 = (1 + 0.3) / 2
    p1 = (1 + p0) / 2
    assert est.rates(4) == pytest.approx([p0, p1, p1, p1])  # untested positions inherit


def test_estimator_counts_the_first_rejection_and_nothing_deeper():
    est = AcceptanceEstimator(decay=1.0)
    est.update(5, 2)
    assert est.tested == [1.0, 1.0, 1.0]
    assert est.accepted == [1.0, 1.0, 0.0]
    est.update(3, 3)  # all accepted: no failed test
    assert est.tested == [2.0, 2.0, 2.0]
    assert est.accepted == [2.0, 2.0, 1.0]
    est.update(0, 0)  # nothing drafted: nothing tested
    assert est.tested == [2.0, 2.0, 2.0]


def test_estimator_decays_old_counts_every_step():
    est = AcceptanceEstimator(decay=0.5)
    est.update(1, 1)
    est.update(1, 0)
    assert est.tested == pytest.approx([1.5])
    assert est.accepted == pytest.approx([0.5])
    est.update(0, 0)  # a plain step still forgets
    assert est.tested == pytest.approx([0.75])


def test_expected_tokens_is_one_plus_the_sum_of_survival_products():
    est = AcceptanceEstimator(prior=0.5, strength=2.0, decay=0.9)
    for drafted, accepted in [(4, 4), (4, 1), (6, 3), (2, 0), (5, 5), (3, 2)]:
        est.update(drafted, accepted)
    rates = est.rates(7)
    expected = est.expected_tokens(7)
    assert len(expected) == 8
    for k in range(8):
        closed = 1 + sum(math.prod(rates[: j + 1]) for j in range(k))
        assert expected[k] == pytest.approx(closed)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_estimator_rates_approach_an_iid_rate(alpha):
    est = AcceptanceEstimator(decay=1.0)
    stream = bernoulli(alpha, seed=1)
    for i in range(3000):
        est.update(4, stream(i, 4))
    assert est.rates(4) == pytest.approx([alpha] * 4, abs=0.1)


# ---------------------------------------------------------------------- best_length


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("c", [0.02, 0.05, 0.1, 0.2, 0.4])
def test_best_length_is_leviathans_optimum_for_iid_acceptance(alpha, c):
    expected = iid_expected(alpha, MAX_K)
    cost = frozen_cost(c)
    rate = [expected[k] / (1 + c * k) for k in range(MAX_K + 1)]
    assert best_length(expected, cost, "d", StepView(MAX_K, cost)) == brute_force_best(rate)


@pytest.mark.parametrize(
    ("alpha", "c", "d"), [(0.8, 0.05, 0.05), (0.9, 0.02, 0.1), (0.6, 0.0, 0.2)]
)
def test_best_length_counts_the_draft_time(alpha, c, d):
    expected = iid_expected(alpha, MAX_K)
    cost = frozen_cost(c, d)
    rate = [expected[k] / (1 + c * k + d * k) for k in range(MAX_K + 1)]
    assert best_length(expected, cost, "d", StepView(MAX_K, cost)) == brute_force_best(rate)


def test_best_length_extremes():
    cost = frozen_cost(0.1)
    view = StepView(MAX_K, cost)
    assert best_length(iid_expected(0.0, MAX_K), cost, "d", view) == 0
    assert best_length(iid_expected(1.0, MAX_K), cost, "d", view) == MAX_K
    assert best_length([1.0], cost, "d", StepView(0, cost)) == 0


def test_best_length_ties_go_to_the_shorter_draft():
    cost = frozen_cost(0.0)  # free rows: every k ties when nothing is accepted
    assert best_length([1.0] * (MAX_K + 1), cost, "d", StepView(MAX_K, cost)) == 0


def test_best_length_charges_auxiliary_rows_only_when_speculating():
    cost = frozen_cost(0.1)
    expected = iid_expected(0.3, MAX_K)
    view = StepView(MAX_K, cost)
    assert best_length(expected, cost, "d", view) == 1
    assert best_length(expected, cost, "d", view, aux_rows=5) == 0


def flat_then_steep() -> CostModel:
    """Measured: forward time flat up to 8 rows, then +0.25 per row (a GPU's knee)."""
    cost = CostModel()
    for n in range(1, 17):
        for _ in range(3):
            cost.observe_forward(n, 1.0 if n <= 8 else 1.0 + 0.25 * (n - 8))
    return cost


def test_batch_goodput_never_drafts_longer_than_a_single_sequence():
    cost = flat_then_steep()
    expected = iid_expected(0.8, MAX_K)
    single = best_length(expected, cost, "d", StepView(MAX_K, cost))
    assert single == 7  # 8 rows still cost one plain step
    # six more sequences, one row each, each expected to emit one token
    batch = StepView(MAX_K, cost, batch_size=7, other_tokens=6, other_expected=6.0)
    assert best_length(expected, cost, "d", batch) == 1  # 8 rows: only one draft is free
    choices = [
        best_length(
            expected, cost, "d", StepView(MAX_K, cost, o + 1, other_tokens=o, other_expected=o)
        )
        for o in range(8)  # rows stay within the measured 1..16
    ]
    # measured: [7, 6, 5, 4, 3, 2, 1, 0]
    assert choices[0] == single
    assert all(k <= single for k in choices)
    assert all(b <= a for a, b in pairwise(choices))
    assert choices[-1] == 0


# ---------------------------------------------------------------------- cost controller


def test_cost_never_accepting_switches_off_and_mostly_stays_off():
    chosen = drive(CostController(), accept_none, 105)
    off = first_index(chosen, lambda k: k == 0)
    assert off < 5  # measured: step 3 (k = 1, 1, 1, then 0)
    tail = chosen[5:105]
    # it probes with k = 1 after 1, 2, 4, ... off steps (each rejected probe doubles the
    # wait); measured off share 0.95
    assert tail.count(0) / len(tail) >= 0.9
    assert max(tail) <= 1


def test_cost_always_accepting_reaches_max_k_and_stays():
    chosen = drive(CostController(), accept_all, 100)
    on = first_index(chosen, lambda k: k == MAX_K)
    assert on <= 3  # measured: k = 1, 3, then 8 at step 2
    assert all(k == MAX_K for k in chosen[on:])


def test_cost_alternating_stream_settles_on_max_k_when_rows_are_cheap():
    # position 0 is accepted half the time, deeper ones always: E(k) = 1 + k / 2 grows
    # faster than the cost 1 + 0.1 k, so the optimum is max_k. Measured: 1, 3, 2, 5, 4, 8, ...
    chosen = drive(CostController(), alternate, 100)
    assert all(k == MAX_K for k in chosen[10:])


def test_cost_switches_off_after_a_drift_to_never_accepting():
    switch = 100
    alone = CostController(CostOptions(shared=False))  # one request's own dynamics
    chosen = drive(alone, drift(switch, accept_all, accept_none), switch + 100)
    assert all(k == MAX_K for k in chosen[10:switch])
    off = first_index(chosen, lambda k: k == 0, switch) - switch
    # With the default decay 0.85 the acceptance evidence of 100 full steps fades as
    # 0.85^t, and k > 0 pays while p0 > 0.1: measured 17 steps (a cold start: 3).
    assert 10 <= off <= 25
    assert chosen[switch + 70 :].count(0) >= 25


def test_cost_with_faster_decay_switches_off_sooner():
    switch = 100
    stream = drift(switch, accept_all, accept_none)
    chosen = drive(CostController(CostOptions(decay=0.8, shared=False)), stream, switch + 60)
    assert first_index(chosen, lambda k: k == 0, switch) - switch <= 15  # measured 13


def test_cost_returns_to_max_k_after_a_drift_to_always_accepting():
    switch = 100
    chosen = drive(CostController(), drift(switch, accept_none, accept_all), switch + 100)
    assert chosen[50:switch].count(0) >= 45
    back = first_index(chosen, lambda k: k == MAX_K, switch) - switch
    # it only learns on its k = 1 probes, which after 100 rejected steps come every 32-64
    # steps; measured 41 steps
    assert back <= 70
    assert all(k == MAX_K for k in chosen[switch + back :])


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.9])
def test_cost_median_choice_is_near_leviathans_optimum_for_iid_acceptance(alpha):
    expected = iid_expected(alpha, MAX_K)
    optimum = brute_force_best([expected[k] / (1 + 0.1 * k) for k in range(MAX_K + 1)])
    chosen = drive(CostController(), bernoulli(alpha, seed=7), 1000)[100:]
    # measured medians 1, 2, 5, 8 for optima 1, 2, 6, 8 (0.8's optimum is very flat)
    assert abs(statistics.median(chosen) - optimum) <= 1


def test_cost_isolated_sequence_uses_its_own_frozen_prior():
    expensive = frozen_cost(5.0)  # the shared (measured) model says speculation never pays
    controller = CostController(CostOptions(token_cost=0.01))
    # off; a one-token probe would cost 5x a plain step, so none runs within 20 steps
    assert set(drive(controller, accept_all, 20, cost=expensive)) == {0}
    chosen = drive(controller, accept_all, 20, cost=expensive, isolated=True)
    assert chosen[-1] == MAX_K


def test_cost_respects_the_step_cap_and_tolerates_empty_drafts():
    control = CostController().start(info())
    cost = frozen_cost()
    for _ in range(10):
        k = control.choose(StepView(MAX_K, cost))
        control.observe(outcome(k, k))
    assert control.choose(StepView(3, cost)) == 3
    assert control.choose(StepView(0, cost)) == 0
    control.observe(outcome(MAX_K, 0, drafted=0))  # the drafter found nothing
    assert control.choose(StepView(MAX_K, cost)) == MAX_K


# ---------------------------------------------------------------------- heuristic


def test_heuristic_starts_at_max_k_by_default():
    assert HeuristicController().start(info()).choose(StepView(MAX_K, frozen_cost())) == MAX_K


def test_heuristic_start_option_is_capped_by_max_k():
    view = StepView(MAX_K, frozen_cost())
    assert HeuristicController(HeuristicOptions(start=3)).start(info()).choose(view) == 3
    assert HeuristicController(HeuristicOptions(start=20)).start(info()).choose(view) == MAX_K


def test_heuristic_plus_two_after_full_acceptance_minus_one_after_rejection():
    control = HeuristicController(HeuristicOptions(start=3)).start(info())
    view = StepView(MAX_K, frozen_cost())
    control.observe(outcome(3, 3))
    assert control.choose(view) == 5
    control.observe(outcome(5, 2))
    assert control.choose(view) == 4
    control.observe(outcome(4, 0))
    assert control.choose(view) == 3
    control.observe(outcome(4, 2, drafted=2))  # all of a short draft accepted: full
    assert control.choose(view) == 5


def test_heuristic_never_goes_below_min_k():
    control = HeuristicController(HeuristicOptions(start=3, min_k=2)).start(info())
    view = StepView(MAX_K, frozen_cost())
    chosen = []
    for _ in range(5):
        k = control.choose(view)
        control.observe(outcome(k, 0))
        chosen.append(k)
    assert chosen == [3, 2, 2, 2, 2]


def test_heuristic_never_chooses_above_the_step_cap():
    chosen = drive(HeuristicController(HeuristicOptions(start=7)), accept_all, 5)
    assert chosen == [7, MAX_K, MAX_K, MAX_K, MAX_K]
    control = HeuristicController().start(info())
    assert control.choose(StepView(2, frozen_cost())) == 2


def test_heuristic_state_is_clipped_to_max_k():
    stream = drift(10, accept_all, accept_none)
    chosen = drive(HeuristicController(), stream, 12)
    assert chosen[:11] == [MAX_K] * 11
    assert chosen[11] == MAX_K - 1  # one rejection after ten full acceptances


def test_heuristic_ignores_a_step_where_the_drafter_proposed_nothing():
    control = HeuristicController(HeuristicOptions(start=4)).start(info())
    view = StepView(MAX_K, frozen_cost())
    for _ in range(3):
        control.observe(outcome(4, 0, drafted=0))
    assert control.choose(view) == 4


def test_heuristic_with_min_k_zero_can_switch_speculation_off():
    chosen = drive(HeuristicController(HeuristicOptions(min_k=0)), accept_none, 12)
    assert chosen[:9] == [8, 7, 6, 5, 4, 3, 2, 1, 0]


def test_heuristic_with_min_k_zero_speculates_again():
    control = HeuristicController(HeuristicOptions(start=1, min_k=0)).start(info())
    view = StepView(MAX_K, frozen_cost())
    control.observe(outcome(1, 0))
    assert control.choose(view) == 0
    control.observe(outcome(0, 0))  # a plain step: nothing drafted, nothing rejected
    assert control.choose(view) > 0


# ---------------------------------------------------------------------- confidence


def stops(control, confidences: list[float]) -> int | None:
    """The position where ``stop_drafting`` first says stop (None: never)."""
    control.choose(StepView(MAX_K, frozen_cost()))
    for position, c in enumerate(confidences):
        if control.stop_drafting(position, c):
            return position
    return None


def test_confidence_chooses_max_k():
    control = ConfidenceController().start(info())
    assert control.choose(StepView(5, frozen_cost())) == 5


def test_confidence_without_calibration_stops_on_the_raw_product():
    control = ConfidenceController(ConfidenceOptions(threshold=0.5, calibrate=False)).start(info())
    # survival 0.75, 0.5625, 0.421875: 1 - 0.5625 = 0.4375 <= 0.5, 1 - 0.421875 > 0.5
    assert stops(control, [0.75] * 6) == 2
    assert stops(control, [1.0, 1.0, 0.5, 1.0]) is None  # 1 - 0.5 is not > 0.5
    assert stops(control, [1.0, 0.25]) == 1
    assert stops(control, [0.4]) == 0


def test_confidence_threshold_moves_the_stop():
    low = ConfidenceController(ConfidenceOptions(threshold=0.1, calibrate=False)).start(info())
    high = ConfidenceController(ConfidenceOptions(threshold=0.9, calibrate=False)).start(info())
    confidences = [0.95] * 40
    # 0.95^2 = 0.9025 (> 0.9), 0.95^3 < 0.9; 0.95^44 > 0.1 > 0.95^45
    assert stops(low, confidences) == 2
    assert stops(high, confidences) is None
    assert stops(high, [0.95] * 50) == 44


def test_confidence_position_zero_restarts_the_product():
    control = ConfidenceController(ConfidenceOptions(threshold=0.5, calibrate=False)).start(info())
    assert not control.stop_drafting(0, 0.75)
    assert not control.stop_drafting(1, 0.75)
    assert not control.stop_drafting(0, 0.75)  # a new draft (without a choose call)
    assert not control.stop_drafting(1, 0.75)


def reject_confident_tokens(control, steps: int = 50) -> None:
    view = StepView(MAX_K, frozen_cost())
    for _ in range(steps):
        control.choose(view)
        control.observe(outcome(MAX_K, 0, drafted=1, confidences=[0.95]))


def test_confidence_calibration_learns_that_confident_tokens_are_rejected():
    control = ConfidenceController(ConfidenceOptions(threshold=0.5)).start(info())
    # uncalibrated: the bin center 0.95; 0.95^13 > 0.5 > 0.95^14
    assert stops(control, [0.95] * 20) == 13
    reject_confident_tokens(control)
    assert stops(control, [0.95]) == 0


def test_confidence_calibration_is_shared_except_for_isolated_sequences():
    controller = ConfidenceController()
    a, b = controller.start(info()), controller.start(info())
    isolated = controller.start(info(isolated=True))
    reject_confident_tokens(a)
    assert stops(b, [0.95]) == 0
    assert stops(isolated, [0.95] * 3) is None


def test_confidence_unshared_calibration_stays_per_sequence():
    controller = ConfidenceController(ConfidenceOptions(shared=False))
    a, b = controller.start(info()), controller.start(info())
    reject_confident_tokens(a)
    assert stops(a, [0.95]) == 0
    assert stops(b, [0.95] * 3) is None


def test_confidence_without_calibration_ignores_outcomes():
    control = ConfidenceController(ConfidenceOptions(calibrate=False)).start(info())
    reject_confident_tokens(control)
    assert stops(control, [0.95] * 3) is None


# ---------------------------------------------------------------------- bandit


@pytest.mark.parametrize(
    ("max_k", "arms"),
    [
        (0, [0]),
        (1, [0, 1]),
        (2, [0, 1, 2]),
        (5, [0, 1, 2, 4, 5]),
        (8, [0, 1, 2, 4, 8]),
        (12, [0, 1, 2, 4, 8, 12]),
    ],
)
def test_bandit_arms(max_k, arms):
    assert bandit_arms(max_k) == arms


def test_bandit_tries_every_arm_once_before_exploiting():
    controller = BanditController(BanditOptions(counterfactual=False))
    control = controller.start(info())
    chosen = drive(controller, accept_all, 30, control=control)
    arms = bandit_arms(MAX_K)
    assert chosen[: len(arms)] == arms  # each arm once, in order, then exploitation
    assert chosen[len(arms) :].count(MAX_K) >= 20


def test_bandit_counterfactual_step_scores_every_shorter_arm():
    c = 0.1
    controller = BanditController(BanditOptions(counterfactual=True))
    control = controller.start(info())
    control.choose(StepView(MAX_K, frozen_cost(c)))
    control.observe(outcome(MAX_K, 3))
    arms = control.stats.arms
    assert control.stats.counts == [1.0] * len(arms)
    rewards = [(min(3, j) + 1) / (1 + c * j) for j in arms]
    assert control.stats.sums == pytest.approx(rewards)


def test_bandit_counterfactual_short_draft_scores_longer_arms_too():
    control = BanditController().start(info())
    control.choose(StepView(MAX_K, frozen_cost(0.1)))
    control.observe(outcome(4, 2, drafted=2))  # asked for 4, the drafter had only 2
    assert control.stats.counts == [1.0] * 5
    assert control.stats.sums[-1] == pytest.approx(3 / 1.2)  # arm 8 would also draft 2


def test_bandit_without_counterfactual_scores_only_the_chosen_arm():
    control = BanditController(BanditOptions(counterfactual=False)).start(info())
    control.choose(StepView(MAX_K, frozen_cost()))
    control.observe(outcome(4, 4))
    assert control.stats.counts == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_bandit_observe_before_choose_is_ignored():
    control = BanditController().start(info())
    control.observe(outcome(MAX_K, 3))
    assert control.stats.counts == [0.0] * 5


def test_bandit_never_chooses_above_the_step_cap():
    controller = BanditController()
    chosen = drive(controller, accept_all, 30, max_k=MAX_K)
    assert max(chosen) == MAX_K
    control = controller.start(info())
    assert control.choose(StepView(3, frozen_cost())) <= 3


@pytest.mark.parametrize("counterfactual", [True, False])
def test_bandit_settles_on_max_k_when_always_accepting(counterfactual):
    controller = BanditController(BanditOptions(counterfactual=counterfactual))
    chosen = drive(controller, accept_all, 150, cost=frozen_cost(0.02))
    # measured: 50/50 (counterfactual) and 49/50 in the last 50 steps
    assert chosen[-50:].count(MAX_K) >= 40


@pytest.mark.parametrize("counterfactual", [True, False])
def test_bandit_settles_on_zero_when_never_accepting(counterfactual):
    controller = BanditController(BanditOptions(counterfactual=counterfactual))
    tail = drive(controller, accept_none, 150, cost=frozen_cost(0.5))[-50:]
    # measured zero share 0.88 / 0.80 (with token_cost 0.1: only 0.58 / 0.46, since the
    # reward gap 1 - 1/(1 + 0.1 k) is small against exploration 0.5)
    assert Counter(tail).most_common(1)[0][0] == 0
    assert tail.count(0) >= 35


def test_bandit_isolated_sequences_do_not_touch_shared_stats():
    controller = BanditController()
    first = controller.start(info(isolated=True))
    drive(controller, accept_all, 20, control=first)
    assert sum(first.stats.counts) > 0
    assert controller.start(info()).stats.counts == [0.0] * 5  # nothing shared to warm from


def test_bandit_isolated_sequences_do_not_warm_start():
    controller = BanditController()
    drive(controller, accept_all, 20)
    assert controller.start(info(isolated=True)).stats.counts == [0.0] * 5


def test_bandit_sequences_warm_start_from_shared_stats():
    controller = BanditController()
    first = controller.start(info())
    drive(controller, accept_all, 20, control=first)
    second = controller.start(info())
    for i in range(5):
        n = first.stats.counts[i]  # the only sequence so far: its stats are the shared ones
        assert second.stats.counts[i] == pytest.approx(min(n, 2.0))
        assert second.stats.sums[i] / second.stats.counts[i] == pytest.approx(
            first.stats.sums[i] / n
        )
    assert second.choose(StepView(MAX_K, frozen_cost())) == MAX_K  # no exploration round


def test_bandit_isolated_sequence_uses_its_frozen_prior():
    controller = BanditController(BanditOptions(counterfactual=True, token_cost=0.1))
    control = controller.start(info(isolated=True))
    control.choose(StepView(MAX_K, frozen_cost(5.0)))  # ignored: isolated
    control.observe(outcome(MAX_K, MAX_K))
    assert control.stats.sums[-1] == pytest.approx((MAX_K + 1) / (1 + 0.1 * MAX_K))


# ---------------------------------------------------------------------- fixed, protocol


def test_fixed_always_chooses_the_cap():
    chosen = drive(FixedController(), bernoulli(0.5, seed=3), 20)
    assert chosen == [MAX_K] * 20
    assert FixedController().start(info()).choose(StepView(2, frozen_cost())) == 2


@pytest.mark.parametrize(
    "controller",
    [
        FixedController(),
        HeuristicController(),
        ConfidenceController(),
        CostController(),
        BanditController(),
    ],
)
def test_controllers_follow_the_protocol(controller):
    assert isinstance(controller, SpeculationController)
    assert isinstance(controller.start(info()), SequenceControl)
    assert controller.name in registry.controller_names()


# ---------------------------------------------------------------------- options, registry


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (ConfidenceOptions, {"threshold": 1.0}),
        (ConfidenceOptions, {"threshold": 0.0}),
        (ConfidenceOptions, {"threshold": math.nan}),
        (CostOptions, {"decay": 0}),
        (CostOptions, {"decay": 1.5}),
        (CostOptions, {"prior": -0.1}),
        (CostOptions, {"prior": True}),
        (CostOptions, {"strength": 0}),
        (CostOptions, {"token_cost": math.inf}),
        (BanditOptions, {"discount": 0}),
        (BanditOptions, {"exploration": -1.0}),
        (BanditOptions, {"token_cost": -0.5}),
        (HeuristicOptions, {"min_k": -1}),
        (HeuristicOptions, {"start": 1.5}),
        (HeuristicOptions, {"increase": True}),
        (HeuristicOptions, {"decrease": "1"}),
    ],
)
def test_options_reject_out_of_range_values(cls, kwargs):
    with pytest.raises(ValueError):
        cls(**kwargs)


def test_options_accept_their_boundaries():
    CostOptions(prior=0.0, decay=1.0, token_cost=0.0)
    CostOptions(prior=1.0)
    BanditOptions(exploration=0.0, discount=1.0)
    HeuristicOptions(start=0, min_k=0, increase=0, decrease=0)
    ConfidenceOptions(threshold=0.999)


def test_make_controller_options_converts_strings():
    assert registry.make_controller_options("cost", {"decay": "0.9"}) == CostOptions(decay=0.9)
    assert registry.make_controller_options(
        "bandit", {"counterfactual": "false", "discount": "1"}
    ) == BanditOptions(counterfactual=False, discount=1.0)
    assert registry.make_controller_options("heuristic", {"min_k": "0"}) == HeuristicOptions(
        min_k=0
    )
    assert registry.make_controller_options("fixed") == registry.controller_entry("fixed").options()
    options = CostOptions(prior=0.5)
    assert registry.make_controller_options("cost", options) is options


def test_make_controller_options_validates_converted_values():
    with pytest.raises(ValueError):
        registry.make_controller_options("cost", {"decay": "0"})
    with pytest.raises(ValueError, match="decay"):
        registry.make_controller_options("cost", {"decay": "fast"})


def test_unknown_controller_lists_the_names():
    with pytest.raises(ValueError, match="unknown controller") as err:
        registry.make_controller_options("nope")
    for name in ("fixed", "heuristic", "confidence", "cost", "bandit"):
        assert name in str(err.value)
    with pytest.raises(ValueError):
        registry.controller_entry("nope")


def test_unknown_option_lists_the_options():
    with pytest.raises(ValueError, match="no option 'speed'") as err:
        registry.make_controller_options("cost", {"speed": 1})
    for name in ("prior", "strength", "decay", "token_cost"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="takes no options"):
        registry.make_controller_options("fixed", {"k": 1})


def test_register_controller_refuses_a_taken_name_and_a_plus():
    names = registry.controller_names()
    taken = registry.ControllerEntry("cost", CostOptions, CostController, "again")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_controller(taken)
    plus = registry.ControllerEntry("cost+x", CostOptions, CostController, "bad name")
    with pytest.raises(ValueError, match="cannot be empty"):
        registry.register_controller(plus)
    assert registry.controller_names() == names
    assert registry.controller_entry("cost").factory is CostController


# ---------------------------------------------------------------------- check_choice


@pytest.mark.parametrize("k", [True, False, -1, 5, 2.0, "2", None])
def test_check_choice_rejects_bad_choices(k):
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        check_choice(FixedController().start(info()), k, 4)


@pytest.mark.parametrize("k", [0, 2, 4])
def test_check_choice_accepts_integers_in_range(k):
    assert check_choice(object(), k, 4) == k


# ---------------------------------------------------------------------- simulate

#: (position, drafted, accepted) of a 20-token output recorded with k = 4; the step at
#: position 7 found only 2 draft tokens.
RECORDED = [(0, 4, 4), (5, 4, 1), (7, 2, 2), (10, 4, 0), (11, 4, 3), (15, 4, 4)]
OVERHEADS = [0.003, 0.001, 0.002, 0.05, 0.002, 0.002]


def forward_s(rows: int) -> float:
    return 0.009 + 0.001 * rows


def draft_s(drafted: int) -> float:
    return 0.001 + 0.002 * drafted if drafted else 0.0


def spec_trace() -> Trace:
    steps = []
    for (p, d, a), overhead in zip(RECORDED, OVERHEADS, strict=True):
        f, ds = forward_s(1 + d), draft_s(d)
        steps.append(TraceStep(p, 4, 4, d, a, a + 1, ds, f, 1 + d, step_s=f + ds + overhead))
    return Trace(steps, 20, prefill_s=0.5)


def plain_trace(n: int = 6) -> Trace:
    f = forward_s(1)
    steps = [TraceStep(p, 0, 0, 0, 0, 1, 0.0, f, 1, step_s=f + 0.002) for p in range(n)]
    return Trace(steps, n, prefill_s=0.1)


class RecordingControl:
    def __init__(self, log: list) -> None:
        self.log = log

    def choose(self, view: StepView) -> int:
        return view.max_k

    def observe(self, outcome: StepOutcome) -> None:
        self.log.append(outcome)


class RecordingController:
    name = "recording"

    def __init__(self) -> None:
        self.log: list[StepOutcome] = []

    def start(self, info: SequenceInfo) -> RecordingControl:
        return RecordingControl(self.log)


def test_opportunities_follow_each_recorded_step():
    offered, matched = opportunities(spec_trace())
    assert offered == [4, 3, 2, 1, 0, 4, 3, 2, 1, 0, 4, 4, 3, 2, 1, 4, 3, 2, 1, 0]
    assert matched == [4, 3, 2, 1, 0, 1, 0, 2, 1, 0, 0, 3, 2, 1, 0, 4, 3, 2, 1, 0]


def test_timing_fit_recovers_forward_times_and_overhead():
    timing = Timing.fit([spec_trace(), plain_trace()])
    cost = timing.cost
    for rows in (1, 3, 5, 9):
        assert cost.forward_time(rows) == pytest.approx(forward_s(rows))
    assert cost.draft_time("drafter", 4) == pytest.approx(draft_s(4))
    assert timing.overhead_s == pytest.approx(0.002)
    assert timing.drafter == "drafter"


def test_timing_fit_without_steps_raises():
    with pytest.raises(ValueError):
        Timing.fit([Trace([], 0)])


def test_simulate_with_the_recorded_k_reproduces_the_trace():
    trace = spec_trace()
    timing = Timing.fit([trace, plain_trace()])
    recorder = RecordingController()
    simulate(trace, recorder, 4, timing)
    replayed = [(o.k, o.num_drafted, o.num_accepted) for o in recorder.log]
    assert replayed == [(s.k, s.num_drafted, s.num_accepted) for s in trace.steps]
    fixed = simulate(trace, FixedController(), 4, timing)
    assert fixed.num_steps == len(trace.steps) == 6
    assert fixed.num_output_tokens == 20
    assert fixed.num_accepted_tokens == sum(a for _, _, a in RECORDED) == 14
    assert fixed.num_draft_tokens == sum(d for _, d, _ in RECORDED) == 22
    assert fixed.chosen_k_counts == [0, 0, 0, 0, 6]
    seconds = trace.prefill_s + sum(
        timing.cost.step_time("drafter", d) + timing.overhead_s for _, d, _ in RECORDED
    )
    assert fixed.seconds == pytest.approx(seconds)
    assert fixed.tokens_per_s == pytest.approx(20 / seconds)


def test_simulate_a_shorter_k_replays_prefixes_of_the_recorded_drafts():
    result = simulate(spec_trace(), FixedController(), 2, Timing.fit([spec_trace()]))
    # positions 0, 3, 5, 7, 10, 11, 14, 15, 18 (the last step capped to 1 draft)
    assert result.num_steps == 9
    assert result.num_output_tokens == 20
    assert result.num_draft_tokens == 15
    assert result.num_accepted_tokens == 11
    assert result.chosen_k_counts == [0, 1, 8]


def test_simulate_never_offers_more_than_recorded():
    result = simulate(spec_trace(), FixedController(), 8, Timing.fit([spec_trace()]))
    assert result.num_steps == 6
    assert result.num_draft_tokens == 22
    assert result.num_accepted_tokens == 14


def test_simulate_plain_decoding_takes_one_step_per_token():
    trace = spec_trace()
    timing = Timing.fit([trace, plain_trace()])
    result = simulate(trace, FixedController(), 0, timing)
    assert result.num_steps == result.num_output_tokens == 20
    assert result.num_draft_tokens == result.num_accepted_tokens == 0
    assert result.chosen_k_counts == []
    expected = trace.prefill_s + 20 * (timing.cost.forward_time(1) + timing.overhead_s)
    assert result.seconds == pytest.approx(expected)


def test_simulate_all_sums_the_traces():
    traces = [spec_trace(), plain_trace(), spec_trace()]
    timing = Timing.fit(traces)
    total, each = simulate_all(traces, FixedController(), 4, timing)
    assert len(each) == 3
    for field in ("num_output_tokens", "num_steps", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(total, field) == sum(getattr(r, field) for r in each)
    assert total.seconds == pytest.approx(sum(r.seconds for r in each))
    assert total.num_output_tokens == 46
    counts = SimResult()
    for r in each:
        counts.add(r)
    assert total.chosen_k_counts == counts.chosen_k_counts
    assert sum(total.chosen_k_counts) == sum(sum(r.chosen_k_counts) for r in each)
    assert each[1].chosen_k_counts == [0, 1, 1, 1, 2]  # caps 4, 4, 3, 2, 1 near the end


def test_simulate_rejects_a_tree_trace():
    trace = spec_trace()
    trace.steps[2].tree = True
    with pytest.raises(ValueError, match="tree"):
        opportunities(trace)
    with pytest.raises(ValueError, match="tree"):
        simulate(trace, FixedController(), 4, Timing.fit([spec_trace()]))


def test_trace_round_trips_through_stats_dicts():
    trace = spec_trace()
    stats = {"trace": [s.to_dict() for s in trace.steps], "num_output_tokens": 20}
    again = Trace.from_stats(stats)
    assert again.steps == trace.steps
    assert again.num_output_tokens == 20 and again.prefill_s == 0.0


def test_cost_probes_back_off_after_rejected_probes_and_reset_after_an_accepted_one():
    control = CostController(CostOptions(max_backoff=4, probe_budget=1.0)).start(info())
    view = StepView(MAX_K, frozen_cost())
    for _ in range(5):  # evidence that nothing is accepted
        control.observe(outcome(1, 0))
    chosen = []
    for _ in range(20):
        k = control.choose(view)
        chosen.append(k)
        control.observe(outcome(k, 0))
    probes = [i for i, k in enumerate(chosen) if k]
    gaps = [b - a for a, b in pairwise(probes)]
    assert gaps[0] == 3 and all(g == 5 for g in gaps[1:])  # waits 2, then 4 (max_backoff)
    k = control.choose(view)
    while k == 0:
        control.observe(outcome(0, 0))
        k = control.choose(view)
    control.observe(outcome(1, 1))  # an accepted probe: the next one comes after 1 off step
    assert control.backoff == 1


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_cost_max_backoff_is_a_positive_integer(value):
    with pytest.raises(ValueError, match="max_backoff"):
        CostOptions(max_backoff=value)


def test_cost_probes_cost_at_most_the_probe_budget():
    # a probe costs 0.1 of a plain step more; at most 2% of the off time: one per 5 steps
    chosen = drive(CostController(CostOptions(shared=False)), accept_none, 200)
    probes = [i for i, k in enumerate(chosen) if k and i > 20]
    assert all(b - a >= 6 for a, b in pairwise(probes))
    lookahead_like = info()
    control = CostController(CostOptions(shared=False)).start(
        SequenceInfo("r", MAX_K, SamplingParams(), "d", aux_rows=15)
    )
    chosen = drive(None, accept_none, 200, control=control)
    assert sum(1 for k in chosen[20:] if k) <= 3  # a probe costs 1.6x: one per 80 steps
    assert lookahead_like.aux_rows == 0


def test_cost_trims_long_proposals_where_rows_cost_more_than_they_bring():
    """Whole proposals of a cheap deterministic drafter: where each verified row costs a
    lot (a 4-bit kernel: 16 rows cost 4.7x one) and later tokens are rarely accepted, the
    controller verifies a short prefix; where rows are nearly free, all of it; with
    ``trim=false``, always all of it."""

    def control_after(cost: CostModel, trim: bool = True):
        control = CostController(CostOptions(shared=False, trim=trim)).start(info(12))
        view = StepView(12, cost)
        for _ in range(40):  # measured: position 0 accepted 60%, later ones 50% each
            k = control.choose(view)
            drafted = control.trim(k) if k > 1 else k  # as the engine does
            accepted = min([0, 1, 1, 2, 3][_ % 5], drafted)
            control.observe(StepOutcome(k=k, num_drafted=drafted, num_accepted=accepted,
                                        num_emitted=accepted + 1, deterministic=True))  # fmt: skip
        control.choose(view)
        return control

    steep, flat = CostModel(), CostModel()
    for n in range(1, 20):
        for _ in range(3):
            steep.observe_forward(n, 0.010 * (1 + 0.25 * (n - 1)))
            flat.observe_forward(n, 0.010 * (1 + 0.001 * (n - 1)))
    steep_control = control_after(steep)
    assert steep_control.choose(StepView(12, steep)) == 12  # it speculates ...
    assert 1 <= steep_control.trim(12) <= 4  # ... a short prefix
    assert control_after(flat).trim(12) == 12
    assert control_after(steep, trim=False).trim(12) == 12


def test_cost_probes_in_a_batch_wait_batch_size_times_longer():
    """Every sequence's probe slows down the shared forward: in a batch of 16 each
    sequence's probes are spaced 16 times further apart by the probe budget (beyond the
    rejection backoff, which alone would allow one per 65 steps)."""
    measured = CostModel()
    for n in range(1, 40):
        for _ in range(3):
            measured.observe_forward(n, 0.010 + 0.002 * n)

    def probes(batch_size: int) -> int:
        control = CostController(CostOptions(shared=False)).start(info())
        view = StepView(MAX_K, measured, batch_size, batch_size - 1, batch_size - 1.0)
        chosen = []
        for _ in range(2000):
            k = control.choose(view)
            chosen.append(k)
            drafted = min(k, 5)  # a cheap deterministic drafter, never accepted
            control.observe(StepOutcome(k=k, num_drafted=drafted, num_accepted=0,
                                        num_emitted=1, deterministic=True))  # fmt: skip
        return sum(1 for k in chosen[200:] if k)

    alone, batched = probes(1), probes(16)
    assert alone >= 20  # the backoff's one per 65 steps
    assert batched <= alone / 2.5  # 5 rows = 24% of a 16-row step, x 16 / 2%: one per 190


def test_cost_probes_come_when_every_request_is_shorter_than_the_wait():
    """Requests that share what the drafter learned count their off steps together: after
    evidence that nothing is accepted, requests of 6 steps each, with probes spaced 40
    steps apart by the budget, still probe (one per ~40 steps over the requests), where a
    count restarted by every request never reached the wait (a server that had turned
    speculation off under load never speculated again on short requests). An isolated
    request keeps its own count (its choices never depend on other requests)."""
    measured = CostModel()
    for n in range(1, 20):
        for _ in range(3):
            measured.observe_forward(n, 0.010 * (1 + 0.08 * (n - 1)))
    controller = CostController(CostOptions(probe_budget=0.002))
    view = StepView(MAX_K, measured)

    def request(isolated: bool = False) -> list[int]:
        control = controller.start(info(isolated=isolated))
        chosen = []
        for _ in range(6):
            k = control.choose(view)
            chosen.append(k)
            control.observe(StepOutcome(k=k, num_drafted=min(k, 1), num_accepted=0,
                                        num_emitted=1, deterministic=True))  # fmt: skip
        return chosen

    for _ in range(10):  # evidence that nothing is accepted
        request()
    later = [k for _ in range(40) for k in request()]
    probes = sum(1 for k in later if k)
    assert 3 <= probes <= 12  # 240 off steps, a probe costing 8% of a step: every ~41
    shared = next(iter(controller._shared.values()))
    before = shared["off_steps"]
    request(isolated=True)
    assert shared["off_steps"] == before  # an isolated request counts on its own


def test_cost_requests_share_what_they_learned_unless_isolated():
    controller = CostController()
    drive(controller, accept_all, 50)
    assert drive(controller, accept_all, 1) == [MAX_K]  # a new request starts long
    fresh = drive(CostController(CostOptions(shared=False)), accept_all, 1)
    assert fresh[0] < MAX_K  # from the priors alone: a short draft (measured 3)
    assert drive(controller, accept_all, 1, isolated=True) == fresh


def test_cost_drafts_whole_cheap_deterministic_proposals_or_none():
    """A deterministic, free drafter: speculate with whole proposals while their measured
    goodput beats a plain step's, else switch off (probing now and then)."""
    good = CostController(CostOptions(shared=False)).start(info())
    bad = CostController(CostOptions(shared=False)).start(info())
    view = StepView(MAX_K, frozen_cost())
    for control, accepted in ((good, 3), (bad, 0)):
        for _ in range(30):
            k = control.choose(view)
            drafted = min(k, 5)  # the drafter self-limits to 5 tokens
            a = min(accepted, drafted)
            control.observe(
                StepOutcome(k=k, num_drafted=drafted, num_accepted=a, num_emitted=a + 1,
                            deterministic=True)
            )  # fmt: skip
    assert good.choose(view) == MAX_K  # 4 tokens for 1.5x a plain step's time
    assert [bad.choose(view) for _ in range(3)] == [0, 0, 0]  # 1 token for 1.5x: off


def test_cost_new_requests_know_a_shared_drafter_is_deterministic():
    """Once a request of a drafter has drafted deterministically, a new request of the
    same drafter takes the whole-proposal path from its first step: with the shared
    goodput of never-accepted drafts, it starts off (no search over lengths), and an
    isolated request still learns on its own."""
    from specdec.control import controllers

    controller = CostController()
    view = StepView(MAX_K, frozen_cost())
    first = controller.start(info())
    assert not first.deterministic
    for _ in range(30):
        k = first.choose(view)
        first.observe(StepOutcome(k=k, num_drafted=min(k, 5), num_accepted=0, num_emitted=1,
                                  deterministic=True))  # fmt: skip
    searched = []
    real = controllers.best_length
    controllers.best_length = lambda *a, **kw: searched.append(1) or real(*a, **kw)
    try:
        second = controller.start(info())
        assert second.deterministic and second.choose(view) == 0 and not searched
    finally:
        controllers.best_length = real
    assert not controller.start(info(isolated=True)).deterministic


def test_cost_whole_proposals_pay_for_their_rows_in_a_batch():
    """SmartSpec's batch goodput for whole proposals: 2 tokens per speculating step for 5
    draft rows pays alone (and beside few sequences), but not beside 31 others in a
    compute-bound forward, where its 5 rows slow down every other sequence's step."""
    measured = CostModel()
    for n in range(1, 80):
        for _ in range(3):
            measured.observe_forward(n, 0.010 + 0.0005 * n)  # weights + rows
    control = CostController(CostOptions(shared=False)).start(info())
    alone = StepView(MAX_K, measured)
    for _ in range(20):  # measured: 5 rows drafted, 1 accepted (2 tokens) per step
        k = control.choose(alone)
        drafted = min(k, 5)
        control.observe(StepOutcome(k=k, num_drafted=drafted, num_accepted=min(1, drafted),
                                    num_emitted=2, deterministic=True))  # fmt: skip
    assert control.choose(alone) == MAX_K  # 2 / 0.013 s beats 1 / 0.0105 s
    few = StepView(MAX_K, measured, batch_size=2, other_tokens=1, other_expected=1.0)
    assert control.choose(few) == MAX_K  # 3 / 0.0135 s beats 2 / 0.011 s
    crowd = StepView(MAX_K, measured, batch_size=32, other_tokens=31, other_expected=31.0)
    assert control.choose(crowd) == 0  # 33 / 0.0285 s loses to 32 / 0.026 s


def test_timing_fit_takes_plain_forwards_only_and_infers_auxiliary_rows():
    def step(position, k, drafted, rows, seconds, step_s):
        return TraceStep(position, k, k, drafted, 0, 1, 0.0, seconds, rows, step_s=step_s)

    # a Lookahead-like run: every speculating step verifies 1 + drafted + 15 rows
    looked = Trace([step(i, 4, 2, 18, 0.05, 0.06) for i in range(10)], 10)
    plain = Trace([step(i, 0, 0, 1, 0.01, 0.03) for i in range(10)], 10)
    alone = Timing.fit([looked])
    both = Timing.fit([looked], plain=[plain])
    assert both.aux_rows == alone.aux_rows == 15
    assert both.cost.forward_time(1) == pytest.approx(0.01)  # measured, not extrapolated
    assert both.overhead_s == pytest.approx(0.01) == alone.overhead_s  # from `looked` only
    off = simulate(looked, FixedController(), 0, both)  # plain decoding: 10 one-row steps
    assert off.seconds == pytest.approx(10 * (0.01 + 0.01))


def test_cost_probes_wait_longer_after_an_expensive_probe_and_tell_new_requests():
    controller = CostController()
    control = controller.start(info())
    measured = CostModel()
    for n in range(1, MAX_K + 2):
        for _ in range(3):
            measured.observe_forward(n, 0.01)  # flat: only the draft costs
            measured.observe_draft("d", n, 0.005 * n)  # half a plain step per token
    view = StepView(MAX_K, measured)
    for _ in range(5):
        control.choose(view)
        control.observe(outcome(1, 0))
    chosen = []
    for _ in range(400):
        k = control.choose(view)
        chosen.append(k)
        # the first probe's draft catches up with the whole sequence: 2 s, 200 plain steps
        control.observe(StepOutcome(k, k, 0, 1, draft_s=2.0 if k else 0.0))
    probes = [i for i, k in enumerate(chosen) if k]
    assert len(probes) == 1  # the next one would come after 200 / 0.02 off steps
    assert controller.start(info()).probe_extra == pytest.approx(200.0)
    assert controller.start(info(isolated=True)).probe_extra == 0.0


def test_cost_starts_from_the_drafters_own_acceptance_prior():
    """A costly draft (0.4 of a step per token) is not worth a first token at the default
    prior (0.3), but is at a drafter's declared acceptance_prior (0.8, a quantized
    self-draft); an explicit prior option wins over the drafter's."""
    from specdec.control.controllers import DEFAULT_PRIOR, CostOptions, start_prior

    cost = frozen_cost(token_cost=0.1, draft_token_cost=0.4)
    generic = SequenceInfo("r", MAX_K, SamplingParams(), "d")
    declared = SequenceInfo("r", MAX_K, SamplingParams(), "d", acceptance_prior=0.8)
    assert CostController().start(generic).choose(StepView(MAX_K, cost)) == 0
    assert CostController().start(declared).choose(StepView(MAX_K, cost)) >= 2
    explicit = CostController(CostOptions(prior=0.2))
    assert explicit.start(declared).choose(StepView(MAX_K, cost)) == 0
    assert start_prior(CostOptions(), declared) == 0.8
    assert start_prior(CostOptions(prior=0.5), declared) == 0.5
    assert start_prior(CostOptions(), generic) == DEFAULT_PRIOR


def test_forward_samples_are_kept_per_context_bucket():
    """A long context's forwards are priced from its own samples: a plain step at 8k
    cached tokens does not take the short-context time, and a bucket without samples
    borrows the nearest one's (the longer on a tie)."""
    assert [context_bucket(n) for n in (0, 2047, 2048, 4095, 4096, 8191, 8192)] == [
        0, 0, 1, 1, 2, 2, 3,
    ]  # fmt: skip
    cost = CostModel()
    for _ in range(3):
        cost.observe_forward(1, 0.010, context=300)
        cost.observe_forward(6, 0.012, context=300)
        cost.observe_forward(6, 0.027, context=8000)
    assert cost.forward_time(1) == pytest.approx(0.010)  # context 0: the first bucket
    assert cost.at(300).forward_time(6) == pytest.approx(0.012)
    long = cost.at(8000)
    assert long.forward_time(6) == pytest.approx(0.027)
    # one row count measured there: the prior's shape through it (token_cost 0.1)
    assert long.forward_time(1) == pytest.approx(0.027 / 1.5)
    assert long.step_time("d", 5) == pytest.approx(0.027)  # no draft samples: free drafts
    assert cost.at(6000).forward_time(6) == pytest.approx(0.027)  # nearest: bucket 2
    assert cost.at(3000).forward_time(6) == pytest.approx(0.027)  # tie 0 / 2: the longer
    assert cost.at(100_000).forward_time(1) == pytest.approx(0.027 / 1.5)
    assert cost.num_forward_samples == 9
    assert set(cost.snapshot()["forward_s_by_bucket"]) == {0, 2}


def test_a_long_context_drafts_on_its_own_forward_costs():
    """The regression the buckets fix (sparse-kv at 8k tokens, measured on a 2-core Zen 4:
    a plain step 10.6 ms at short contexts and about 17 ms at 8k, 6 verified rows 27.9 ms
    at 8k, a windowed draft 5.15 ms a token, acceptance about 0.9): one curve through both
    regimes saw a plain step at 10.6 ms and 3.5 ms per extra row and chose 1 draft token;
    the 8k bucket's own curve chooses 4, the best length for those costs."""
    rate = 0.9
    expected = [sum(rate**i for i in range(k + 1)) for k in range(9)]
    merged, bucketed = CostModel(), CostModel()
    for model in (merged, bucketed):
        for n in (1, 2, 4):
            model.observe_draft("d", n, 0.00515 * n)
    for _ in range(3):
        merged.observe_forward(1, 0.0106)
        merged.observe_forward(6, 0.0279)
        bucketed.observe_forward(1, 0.0106, context=500)
        bucketed.observe_forward(6, 0.0279, context=8000)
    assert best_length(expected, merged, "d", StepView(8, merged)) <= 1
    long = bucketed.at(8000)
    assert best_length(expected, long, "d", StepView(8, long)) == 4
    short = bucketed.at(500)  # the short context keeps its own price of a plain step
    assert short.forward_time(1) == pytest.approx(0.0106)
    assert best_length(expected, short, "d", StepView(8, short)) < 4


def test_a_rare_slow_draft_does_not_price_every_draft_token():
    """One 5-token draft at 36 ms beside one-token drafts at 5 ms (a sparse-kv draft's first
    step at 8k tokens, then the cost controller's probes) fitted a line of 7.6 ms a token;
    lengths seen at least MIN_DRAFT_SAMPLES times are fitted alone when there are some."""
    cost = CostModel()
    cost.observe_draft("d", 5, 0.0361)
    for t in (0.0050, 0.0056, 0.0067, 0.0050):
        cost.observe_draft("d", 1, t)
    cost.observe_draft("d", 2, 0.0109)
    assert cost.draft_time("d", 5) == pytest.approx(
        5 * statistics.fmean([0.005, 0.0056, 0.0067, 0.005])
    )
    for _ in range(2):  # once a length is common, it joins the fit
        cost.observe_draft("d", 2, 0.0109)
    assert cost.draft_time("d", 2) == pytest.approx(0.0109, rel=0.05)
    few = CostModel()  # no length seen three times yet: the median time per token
    few.observe_draft("d", 5, 0.0361)
    few.observe_draft("d", 1, 0.0054)
    few.observe_draft("d", 1, 0.0048)
    assert few.draft_time("d", 5) == pytest.approx(5 * 0.0054)
