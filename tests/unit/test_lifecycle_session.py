"""The investigation session's state machine (seed 001, "Investigation lifecycle")."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from investigation.errors import InvestigationError
from investigation.lifecycle import (
    BudgetDimension,
    InvestigationSession,
    LifecycleError,
    ResearchObjective,
    SessionBudget,
    SessionState,
    TerminationReason,
    codes,
)

PROPS = settings(max_examples=300, deadline=None, database=None)
T0 = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
S = SessionState
R = TerminationReason

#: The seed's mermaid diagram, edge by edge, written independently of ``TRANSITIONS``.
SEED_EDGES = {
    ("PLANNING", "EXECUTING"), ("EXECUTING", "EVALUATING"), ("EVALUATING", "UPDATING"),
    ("EVALUATING", "PLANNING"), ("UPDATING", "PLANNING"), ("PLANNING", "COMPLETED"),
    ("EVALUATING", "COMPLETED"), ("UPDATING", "COMPLETED"),
    ("PLANNING", "PAUSED"), ("EXECUTING", "PAUSED"), ("EVALUATING", "PAUSED"),
    ("UPDATING", "PAUSED"),
    ("PAUSED", "PLANNING"), ("PAUSED", "EXECUTING"), ("PAUSED", "EVALUATING"),
    ("PAUSED", "UPDATING"),
    ("PLANNING", "FAILED"), ("EXECUTING", "FAILED"), ("EVALUATING", "FAILED"),
    ("UPDATING", "FAILED"),
    ("PLANNING", "CANCELLED"), ("EXECUTING", "CANCELLED"), ("EVALUATING", "CANCELLED"),
    ("UPDATING", "CANCELLED"),
}
ACTIVE = {"PLANNING", "EXECUTING", "EVALUATING", "UPDATING"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}
REASON_STATE = {"USER_CANCELLED": "CANCELLED", "SYSTEM_FAILURE": "FAILED"}


def budget(**overrides: int) -> SessionBudget:
    values = {"max_iterations": 10, "max_investigations": 10, "max_agent_runs": 10,
              "max_cost_units": 100, "max_execution_ms": 10_000}
    values.update(overrides)
    return SessionBudget(**values)


def session(b: SessionBudget | None = None) -> InvestigationSession:
    objective = ResearchObjective.create("Why?", objective_id="obj-1", created_at=T0)
    return InvestigationSession.start(objective, b or budget(), session_id="ses-1",
                                      correlation_id="cor-1", now=T0)


def code_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(LifecycleError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, InvestigationError)
    return info.value.code


def walk(s: InvestigationSession, *states: str) -> None:
    for name in states:
        s.transition(S(name), at=T0)


# -- examples ----------------------------------------------------------------------------


def test_a_new_session_starts_in_planning_with_values_as_ids() -> None:
    s = session()
    assert s.state is S.PLANNING
    assert (s.session_id, s.objective_id, s.correlation_id) == ("ses-1", "obj-1", "cor-1")
    assert s.iterations == 0 and s.paused_from is None and s.termination_reason is None


def test_transitions_table_is_exactly_the_seed_diagram() -> None:
    from investigation.lifecycle import TRANSITIONS
    table = {(a.value, b.value) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == SEED_EDGES


def test_a_full_iteration_counts_only_on_updating_to_planning() -> None:
    s = session()
    walk(s, "EXECUTING", "EVALUATING", "PLANNING")      # no update: not an iteration
    assert s.iterations == 0
    walk(s, "EXECUTING", "EVALUATING", "UPDATING")
    assert s.iterations == 0
    walk(s, "PLANNING")
    assert s.iterations == 1


@pytest.mark.parametrize("path", [
    [], ["EXECUTING"], ["EXECUTING", "EVALUATING"], ["EXECUTING", "EVALUATING", "UPDATING"]])
def test_pause_records_the_exact_prior_state_and_resume_returns_to_it(path: list[str]) -> None:
    s = session()
    walk(s, *path)
    prior = s.state
    s.pause(at=T0)
    assert s.state is S.PAUSED and s.paused_from is prior
    for other in {S.PLANNING, S.EXECUTING, S.EVALUATING, S.UPDATING} - {prior}:
        assert code_of(s.transition, other) == codes.RESUME_MISMATCH
    for bad in (S.PAUSED, S.COMPLETED, S.FAILED, S.CANCELLED):
        assert code_of(s.transition, bad, reason=R.USER_CANCELLED) == codes.INVALID_TRANSITION
    assert s.state is S.PAUSED and s.paused_from is prior
    assert s.resume(at=T0) is prior
    assert s.state is prior and s.paused_from is None


def test_resume_requires_a_paused_session() -> None:
    assert code_of(session().resume) == codes.INVALID_TRANSITION


def test_executing_cannot_complete_without_evaluating() -> None:
    s = session()
    walk(s, "EXECUTING")
    assert code_of(s.terminate, R.OBJECTIVE_MET) == codes.INVALID_TRANSITION
    s.terminate(R.SYSTEM_FAILURE, at=T0)
    assert s.state is S.FAILED and s.termination_reason is R.SYSTEM_FAILURE


def test_terminal_transitions_need_a_matching_reason_and_active_ones_refuse_one() -> None:
    s = session()
    before = s.to_dict()
    assert code_of(s.transition, S.COMPLETED) == codes.REASON_REQUIRED
    assert code_of(s.transition, S.CANCELLED, reason=R.OBJECTIVE_MET) \
        == codes.REASON_STATE_MISMATCH
    assert code_of(s.transition, S.EXECUTING, reason=R.OBJECTIVE_MET) \
        == codes.REASON_FORBIDDEN
    assert code_of(s.transition, S.PAUSED, reason=R.USER_CANCELLED) == codes.REASON_FORBIDDEN
    assert s.to_dict() == before
    s.transition(S.CANCELLED, reason=R.USER_CANCELLED, at=T0)
    assert s.state is S.CANCELLED


@pytest.mark.parametrize("reason", list(TerminationReason))
def test_terminal_states_are_absorbing(reason: TerminationReason) -> None:
    s = session()
    walk(s, "EXECUTING", "EVALUATING")
    s.terminate(reason, at=T0)
    before = s.to_dict()
    for target in SessionState:
        for r in (None, reason):
            with pytest.raises(LifecycleError):
                s.transition(target, reason=r)
    assert code_of(s.record_usage, cost_units=1) == codes.SESSION_TERMINAL
    assert s.to_dict() == before


def test_planning_to_executing_is_refused_while_a_dimension_is_exhausted() -> None:
    s = session(budget(max_iterations=1))
    walk(s, "EXECUTING", "EVALUATING", "UPDATING", "PLANNING")
    assert s.exhausted() == (BudgetDimension.ITERATIONS,)
    assert code_of(s.transition, S.EXECUTING) == codes.BUDGET_EXHAUSTED
    assert s.state is S.PLANNING
    s.terminate(R.MAX_ITERATIONS, at=T0)
    assert s.state is S.COMPLETED


def test_a_naive_transition_time_is_refused_and_changes_nothing() -> None:
    s = session()
    before = s.to_dict()
    assert code_of(s.transition, S.EXECUTING, at=datetime(2025, 1, 1)) \
        == codes.NAIVE_TIMESTAMP
    assert code_of(s.record_usage, cost_units=1, at=datetime(2025, 1, 1)) \
        == codes.NAIVE_TIMESTAMP
    assert s.to_dict() == before


def test_updated_at_never_moves_back() -> None:
    s = session()
    s.transition(S.EXECUTING, at=T0 + timedelta(seconds=5))
    s.transition(S.EVALUATING, at=T0 + timedelta(seconds=1))
    assert s.updated_at == T0 + timedelta(seconds=5)


# -- random sequences --------------------------------------------------------------------

targets = st.sampled_from(list(SessionState))
reasons = st.one_of(st.none(), st.sampled_from(list(TerminationReason)))
_OP_ARGS = {
    "move": st.tuples(targets, reasons),
    # the n-th allowed target, with its own reason if terminal (valid attempts)
    "valid": st.tuples(st.integers(0, 7), st.none()),
    # the n-th allowed active target, or the resume when PAUSED: sequences get deep
    "step": st.tuples(st.integers(0, 7), st.none()),
    "pause": st.tuples(st.none(), st.none()),
    "resume": st.tuples(st.none(), st.none()),
    "use": st.tuples(st.sampled_from(["investigations", "agent_runs", "cost_units",
                                      "execution_ms"]), st.integers(-2, 5)),
}
_KINDS = ["step"] * 8 + ["move"] * 2 + ["valid", "pause", "resume", "use", "use"]
ops = st.sampled_from(_KINDS).flatmap(
    lambda kind: _OP_ARGS[kind].map(lambda args: (kind, *args)))
sequences = st.integers(0, 80).flatmap(lambda n: st.lists(ops, min_size=n, max_size=n))
small = st.integers(0, 6)


def _expect_ok(s: InvestigationSession, target: str, reason: str | None) -> bool:
    """Independent oracle from the seed text (edges, exact resume, reasons, budget guard)."""
    src = s.state.value
    if src == "PAUSED":
        if target != (s.paused_from.value if s.paused_from else None):
            return False
    elif (src, target) not in SEED_EDGES:
        return False
    if target in TERMINAL:
        return reason is not None and REASON_STATE.get(reason, "COMPLETED") == target
    if reason is not None:
        return False
    return not (src == "PLANNING" and target == "EXECUTING" and s.exhausted())


@PROPS
@given(sequences, small, st.integers(0, 30),
       st.integers(0, 30), st.integers(0, 60), st.integers(0, 60))
def test_random_sequences_keep_every_invariant_and_round_trip(
        sequence: list[tuple[str, Any, Any]], it: int, inv: int, runs: int, cost: int,
        ms: int) -> None:
    s = session(budget(max_iterations=it, max_investigations=inv, max_agent_runs=runs,
                       max_cost_units=cost, max_execution_ms=ms))
    updates_to_planning = 0
    for kind, a, b in sequence:  # bounded: at most 80 operations
        before = s.to_dict()
        src = s.state
        target: SessionState | None = None
        reason: TerminationReason | None = None
        try:
            if kind == "move":
                target, reason = a, b
                ok = _expect_ok(s, a.value, b.value if b else None)
                s.transition(a, reason=b, at=T0)
            elif kind in ("valid", "step"):
                allowed = sorted(t for t in s.allowed_targets() if kind == "valid" or (
                    not t.is_terminal and t is not S.PAUSED))
                if not allowed:
                    continue
                target = allowed[a % len(allowed)]
                reason = {S.COMPLETED: R.OBJECTIVE_MET, S.FAILED: R.SYSTEM_FAILURE,
                          S.CANCELLED: R.USER_CANCELLED}.get(target)
                ok = _expect_ok(s, target.value, reason.value if reason else None)
                s.transition(target, reason=reason, at=T0)
            elif kind == "pause":
                target = S.PAUSED
                ok = _expect_ok(s, "PAUSED", None)
                s.pause(at=T0)
            elif kind == "resume":
                target = s.paused_from
                ok = s.state is S.PAUSED
                s.resume(at=T0)
            else:
                ok = not s.is_terminal and b >= 0
                s.record_usage(**{a: b}, at=T0)
        except LifecycleError:
            assert not ok, f"{src} -> {target} ({reason}) refused but the seed allows it"
            assert s.to_dict() == before, "a refused change must change nothing"
        else:
            assert ok, f"{src} -> {target} ({reason}) accepted but the seed forbids it"
            if src is S.UPDATING and s.state is S.PLANNING:
                updates_to_planning += 1
            if src.is_terminal:
                raise AssertionError("left a terminal state")
        # invariants
        event(f"reached {s.state.value}" + (f" from {s.paused_from.value}" if s.paused_from
                                              else ""))
        assert (s.termination_reason is not None) == s.is_terminal
        if s.termination_reason is not None:
            assert s.termination_reason.target_state is s.state
        assert (s.state is S.PAUSED) == (s.paused_from is not None)
        assert s.paused_from is None or s.paused_from.is_active
        assert s.iterations == updates_to_planning
        assert s.iterations <= max(it, 0)
        record = s.to_dict()
        assert InvestigationSession.from_dict(record) == s
        assert InvestigationSession.from_dict(json.loads(json.dumps(record))).to_dict() \
            == record
    event(f"iterations={s.iterations}")


def test_the_iterations_gloss_says_the_last_round_is_not_counted_only_once_ended() -> None:
    """A 500-step reader read "the last not counted" beside 500 iterations after 500
    steps of a case still at work: only the round that ends the session is not counted."""
    from investigation.loop.lifecycle import iterations_gloss

    assert iterations_gloss({"state": "PLANNING"}) == (
        "accepted decision rounds; an account's iterations count only its queries and tests")
    for state in ("COMPLETED", "FAILED", "CANCELLED"):
        assert iterations_gloss({"state": state}).startswith(
            "accepted decision rounds, the last, which ended the session, not counted; ")
