"""TerminationPolicy precedence and the five budget dimensions (seed 001, "Budgets and
stopping")."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from investigation.lifecycle import (
    BudgetDimension,
    BudgetUsage,
    InvestigationSession,
    LifecycleError,
    ResearchObjective,
    SessionBudget,
    SessionState,
    TerminationPolicy,
    TerminationReason,
    TerminationSignals,
    codes,
)

PROPS = settings(max_examples=300, deadline=None, database=None)
T0 = datetime(2025, 1, 2, tzinfo=UTC)
R = TerminationReason
POLICY = TerminationPolicy(confidence_threshold=0.9, min_candidate_value=0.2)
ROOMY = SessionBudget(max_iterations=5, max_investigations=5, max_agent_runs=5,
                      max_cost_units=5, max_execution_ms=5)
FRESH = BudgetUsage()
SPENT_ITER = BudgetUsage(iterations=5)
SPENT_COST = BudgetUsage(cost_units=9)

#: One way to make each condition hold, highest precedence first.
CONDITIONS: list[tuple[R, dict[str, Any], BudgetUsage]] = [
    (R.USER_CANCELLED, {"cancelled": True}, FRESH),
    (R.SYSTEM_FAILURE, {"system_failure": True}, FRESH),
    (R.OBJECTIVE_MET, {"objective_met": True}, FRESH),
    (R.CONFIDENCE_REACHED, {"objective_confidence": 0.9}, FRESH),
    (R.MAX_ITERATIONS, {}, SPENT_ITER),
    (R.BUDGET_EXHAUSTED, {}, SPENT_COST),
    (R.UNRESOLVABLE_CONTRADICTION, {"contradiction": True}, FRESH),
    (R.NO_VALUABLE_CANDIDATE, {"best_candidate_value": 0.2}, FRESH),
]


def _combine(indices: list[int]) -> tuple[TerminationSignals, BudgetUsage]:
    fields: dict[str, Any] = {"best_candidate_value": 1.0}
    usage = FRESH
    for i in indices:
        _, extra, u = CONDITIONS[i]
        fields.update(extra)
        usage = BudgetUsage(**{k: max(getattr(usage, k), getattr(u, k))
                               for k in usage.to_dict()})
    return TerminationSignals(**fields), usage


def test_nothing_holds_means_continue() -> None:
    signals, usage = _combine([])
    decision = POLICY.decide(signals, ROOMY, usage)
    assert decision.reason is None and decision.target_state is None
    assert not decision.is_terminal and decision.also == ()
    assert decision.explanation.startswith("continue")


@pytest.mark.parametrize("index", range(len(CONDITIONS)))
def test_each_condition_alone_stops_with_its_reason_and_state(index: int) -> None:
    reason = CONDITIONS[index][0]
    signals, usage = _combine([index])
    decision = POLICY.decide(signals, ROOMY, usage)
    assert decision.reason is reason
    assert decision.target_state is reason.target_state
    assert decision.also == ()
    assert decision.explanation.startswith(reason.value)


@pytest.mark.parametrize(("high", "low"), [
    (h, lo) for h in range(len(CONDITIONS)) for lo in range(h + 1, len(CONDITIONS))])
def test_each_level_beats_every_lower_one(high: int, low: int) -> None:
    signals, usage = _combine([high, low])
    decision = POLICY.decide(signals, ROOMY, usage)
    assert decision.reason is CONDITIONS[high][0]
    assert decision.also == (CONDITIONS[low][0],)


def test_precedence_levels_follow_the_seed() -> None:
    assert [c[0].level for c in CONDITIONS] == [1, 1, 2, 2, 3, 3, 4, 5]
    assert R.USER_CANCELLED.target_state is SessionState.CANCELLED
    assert R.SYSTEM_FAILURE.target_state is SessionState.FAILED
    assert {c[0].target_state for c in CONDITIONS[2:]} == {SessionState.COMPLETED}


@PROPS
@given(st.sets(st.integers(0, len(CONDITIONS) - 1)))
def test_any_combination_picks_the_first_in_order_and_lists_the_rest(
        held: set[int]) -> None:
    signals, usage = _combine(sorted(held))
    decision = POLICY.decide(signals, ROOMY, usage)
    expected = [CONDITIONS[i][0] for i in sorted(held)]
    if not expected:
        assert decision.reason is None
    else:
        assert decision.reason is expected[0]
        assert decision.also == tuple(expected[1:])


def test_confidence_below_threshold_and_value_above_minimum_continue() -> None:
    signals = TerminationSignals(best_candidate_value=0.21, objective_confidence=0.89)
    assert POLICY.decide(signals, ROOMY, FRESH).reason is None


def test_no_candidate_at_all_stops_for_low_value() -> None:
    signals = TerminationSignals(best_candidate_value=None)
    decision = POLICY.decide(signals, ROOMY, FRESH)
    assert decision.reason is R.NO_VALUABLE_CANDIDATE
    assert "no candidate remains" in decision.explanation


def test_cancellation_beats_failure_within_level_one() -> None:
    signals = TerminationSignals(best_candidate_value=1.0, cancelled=True,
                                 system_failure=True)
    decision = POLICY.decide(signals, ROOMY, FRESH)
    assert decision.reason is R.USER_CANCELLED and decision.also == (R.SYSTEM_FAILURE,)


def test_max_iterations_beats_other_exhausted_dimensions() -> None:
    usage = BudgetUsage(iterations=5, agent_runs=5, execution_ms=7)
    decision = POLICY.decide(TerminationSignals(best_candidate_value=1.0), ROOMY, usage)
    assert decision.reason is R.MAX_ITERATIONS
    assert decision.also == (R.BUDGET_EXHAUSTED,)
    assert decision.exhausted == (BudgetDimension.ITERATIONS, BudgetDimension.AGENT_RUNS,
                                  BudgetDimension.EXECUTION_MS)
    assert "agent_runs (5 of 5)" in decision.explanation
    assert decision.to_dict()["exhausted"] == ["iterations", "agent_runs", "execution_ms"]


# -- budget dimensions -------------------------------------------------------------------


@pytest.mark.parametrize("dimension", list(BudgetDimension))
def test_every_dimension_exhausts_independently(dimension: BudgetDimension) -> None:
    budget = SessionBudget(max_iterations=3, max_investigations=3, max_agent_runs=3,
                           max_cost_units=3, max_execution_ms=3)
    below = BudgetUsage(**{dimension.value: 2})
    at = BudgetUsage(**{dimension.value: 3})
    others_full = BudgetUsage(**{d.value: 2 for d in BudgetDimension})
    assert budget.exhausted(below) == ()
    assert budget.exhausted(at) == (dimension,)
    assert budget.is_exhausted(at, dimension)
    assert budget.remaining(at)[dimension] == 0
    assert budget.exhausted(BudgetUsage(**{**others_full.to_dict(),
                                           dimension.value: 3})) == (dimension,)
    expected = R.MAX_ITERATIONS if dimension is BudgetDimension.ITERATIONS \
        else R.BUDGET_EXHAUSTED
    decision = POLICY.decide(TerminationSignals(best_candidate_value=1.0), budget, at)
    assert decision.reason is expected and decision.exhausted == (dimension,)


@pytest.mark.parametrize("dimension", [d for d in BudgetDimension
                                       if d is not BudgetDimension.ITERATIONS])
def test_recorded_usage_exhausts_a_session_dimension(dimension: BudgetDimension) -> None:
    budget = SessionBudget(max_iterations=9, max_investigations=4, max_agent_runs=4,
                           max_cost_units=4, max_execution_ms=4)
    objective = ResearchObjective.create("Why?", created_at=T0)
    s = InvestigationSession.start(objective, budget, now=T0)
    s.record_usage(**{dimension.value: 3}, at=T0)
    assert s.exhausted() == ()
    s.record_usage(**{dimension.value: 2}, at=T0)       # overrun is recorded, not refused
    assert s.usage.used(dimension) == 5
    assert s.exhausted() == (dimension,)
    assert s.budget.remaining(s.usage)[dimension] == 0
    with pytest.raises(LifecycleError) as info:
        s.transition(SessionState.EXECUTING)
    assert info.value.code == codes.BUDGET_EXHAUSTED
    decision = POLICY.decide_for(s, TerminationSignals(best_candidate_value=1.0))
    assert decision.reason is R.BUDGET_EXHAUSTED
    assert s.apply(decision, at=T0) and s.state is SessionState.COMPLETED
    with pytest.raises(LifecycleError) as info:
        POLICY.decide_for(s, TerminationSignals(best_candidate_value=1.0))
    assert info.value.code == codes.SESSION_TERMINAL


def test_a_zero_bound_starts_exhausted() -> None:
    budget = SessionBudget(max_iterations=1, max_investigations=1, max_agent_runs=0,
                           max_cost_units=1, max_execution_ms=1)
    assert budget.exhausted(BudgetUsage()) == (BudgetDimension.AGENT_RUNS,)


def test_a_continue_decision_changes_nothing() -> None:
    s = InvestigationSession.start(ResearchObjective.create("Why?", created_at=T0), ROOMY,
                                   now=T0)
    before = s.to_dict()
    decision = POLICY.decide_for(s, TerminationSignals(best_candidate_value=0.5))
    assert s.apply(decision) is False and s.to_dict() == before


@pytest.mark.parametrize("kwargs", [
    {"max_iterations": -1}, {"max_cost_units": 1.5}, {"max_agent_runs": True}])
def test_budget_bounds_are_non_negative_integers(kwargs: dict[str, Any]) -> None:
    values: dict[str, Any] = ROOMY.to_dict()
    values.update(kwargs)
    with pytest.raises(LifecycleError) as info:
        SessionBudget(**values)
    assert info.value.code in (codes.INVALID_VALUE, codes.MALFORMED_RECORD)


def test_negative_usage_is_refused_and_changes_nothing() -> None:
    s = InvestigationSession.start(ResearchObjective.create("Why?", created_at=T0), ROOMY,
                                   now=T0)
    before = s.to_dict()
    with pytest.raises(LifecycleError) as info:
        s.record_usage(cost_units=2, agent_runs=-1)
    assert info.value.code == codes.INVALID_VALUE
    assert s.to_dict() == before


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"objective_confidence": 1.5}, "objective_confidence"),
    ({"objective_confidence": float("nan")}, "objective_confidence"),
    ({"best_candidate_value": float("inf")}, "best_candidate_value"),
    ({"cancelled": 1}, "cancelled"),
])
def test_malformed_signals_are_refused(kwargs: dict[str, Any], field: str) -> None:
    values: dict[str, Any] = {"best_candidate_value": 1.0, **kwargs}
    with pytest.raises(LifecycleError) as info:
        TerminationSignals(**values)
    assert info.value.code == codes.INVALID_VALUE and info.value.details["field"] == field


@pytest.mark.parametrize("threshold", [0.0, 1.01, float("nan")])
def test_policy_thresholds_are_validated(threshold: float) -> None:
    with pytest.raises(LifecycleError) as info:
        TerminationPolicy(confidence_threshold=threshold, min_candidate_value=0.0)
    assert info.value.code == codes.INVALID_VALUE
