"""Lifecycle records: to_dict/from_dict contracts, timezone-aware timestamps and stable
error codes for malformed input (seed 001, "Persistence and recovery")."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import investigation.lifecycle as lifecycle
from investigation.lifecycle import (
    BudgetUsage,
    InvestigationSession,
    LifecycleError,
    ResearchObjective,
    SessionBudget,
    SessionState,
    TerminationReason,
    codes,
)

PROPS = settings(max_examples=200, deadline=None, database=None)
T0 = datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
BUDGET = SessionBudget(max_iterations=3, max_investigations=4, max_agent_runs=5,
                       max_cost_units=6, max_execution_ms=7)


def code_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(LifecycleError) as info:
        fn(*args, **kwargs)
    return info.value.code


def objective() -> ResearchObjective:
    return ResearchObjective(
        objective_id="obj-1", question="Why are refunds doubled?", created_at=T0,
        scope="billing service", constraints=("read-only",),
        success_criteria=("root cause named",), metadata={"ticket": "B-1", "n": [1, 2.5]})


def session_dict(**changes: Any) -> dict[str, Any]:
    s = InvestigationSession.start(objective(), BUDGET, session_id="ses-1",
                                   correlation_id="cor-1", now=T0)
    record: dict[str, Any] = s.to_dict()
    record.update(changes)
    return record


# -- the public surface ------------------------------------------------------------------


def test_every_exported_name_resolves_and_the_package_is_pure() -> None:
    for name in lifecycle.__all__:
        assert hasattr(lifecycle, name)
    import ast
    from pathlib import Path
    allowed_roots = {"__future__", "collections", "dataclasses", "datetime", "enum", "math",
                     "typing", "uuid", "investigation"}
    for path in Path(lifecycle.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed_roots, f"{path.name} imports {name}"
                if name.startswith("investigation."):
                    assert name in ("investigation.errors",) or name.startswith(
                        "investigation.lifecycle"), f"{path.name} imports {name}"


def test_every_code_is_a_distinct_lifecycle_code() -> None:
    assert len(set(codes.ALL_CODES)) == len(codes.ALL_CODES)
    assert all(code.startswith("LIFECYCLE_") for code in codes.ALL_CODES)


# -- objective ---------------------------------------------------------------------------


def test_objective_round_trips_exactly() -> None:
    o = objective()
    record = o.to_dict()
    assert record == {
        "format": "research-objective/1", "objective_id": "obj-1",
        "question": "Why are refunds doubled?", "scope": "billing service",
        "constraints": ["read-only"], "success_criteria": ["root cause named"],
        "created_at": "2025-01-02T03:04:05.000006+00:00",
        "metadata": {"ticket": "B-1", "n": [1, 2.5]},
    }
    assert ResearchObjective.from_dict(json.loads(json.dumps(record))) == o


def test_objective_metadata_is_copied() -> None:
    meta: dict[str, Any] = {"a": [1]}
    o = ResearchObjective.create("q", metadata=meta, created_at=T0)
    meta["a"].append(2)
    o.to_dict()["metadata"]["a"].append(3)  # type: ignore[index, union-attr]
    assert o.metadata == {"a": [1]}


def test_other_offsets_are_stored_as_the_same_instant_in_utc() -> None:
    local = T0.astimezone(timezone(timedelta(hours=-5)))
    o = ResearchObjective.create("q", created_at=local)
    assert o.created_at == T0 and o.created_at.tzinfo is UTC


@pytest.mark.parametrize("metadata", [
    {"t": (1, 2)}, {"f": float("nan")}, {"o": object()}, {1: "x"}, {"s": {1, 2}}])
def test_objective_metadata_must_be_json_compatible(metadata: dict[Any, Any]) -> None:
    assert code_of(ResearchObjective.create, "q", metadata=metadata) \
        == codes.INVALID_METADATA


def test_objective_metadata_depth_is_bounded() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    assert code_of(ResearchObjective.create, "q", metadata={"d": deep}) \
        == codes.INVALID_METADATA


@pytest.mark.parametrize(("changes", "code"), [
    ({"objective_id": ""}, codes.INVALID_VALUE),
    ({"objective_id": "x" * 257}, codes.INVALID_VALUE),
    ({"question": "  "}, codes.INVALID_VALUE),
    ({"question": 3}, codes.MALFORMED_RECORD),
    ({"constraints": "read-only"}, codes.MALFORMED_RECORD),
    ({"success_criteria": [""]}, codes.INVALID_VALUE),
    ({"metadata": []}, codes.MALFORMED_RECORD),
    ({"metadata": {"x": float("inf")}}, codes.INVALID_METADATA),
    ({"created_at": "2025-01-02T03:04:05"}, codes.NAIVE_TIMESTAMP),
    ({"created_at": "yesterday"}, codes.INVALID_TIMESTAMP),
    ({"created_at": 1700000000}, codes.MALFORMED_RECORD),
    ({"format": "research-objective/2"}, codes.UNSUPPORTED_FORMAT),
    ({"extra": 1}, codes.MALFORMED_RECORD),
])
def test_malformed_objective_records_are_refused(changes: dict[str, Any], code: str) -> None:
    record: dict[str, Any] = objective().to_dict()
    record.update(changes)
    assert code_of(ResearchObjective.from_dict, record) == code


def test_objective_record_must_be_an_object_with_every_key() -> None:
    assert code_of(ResearchObjective.from_dict, []) == codes.MALFORMED_RECORD
    record = objective().to_dict()
    del record["scope"]
    with pytest.raises(LifecycleError) as info:
        ResearchObjective.from_dict(record)
    assert info.value.code == codes.MALFORMED_RECORD
    assert info.value.details["missing"] == ["scope"]


# -- naive timestamps, everywhere --------------------------------------------------------

NAIVE = datetime(2025, 1, 2, 3, 4, 5)


def test_naive_timestamps_are_refused_when_constructing() -> None:
    assert code_of(ResearchObjective, objective_id="o", question="q",
                   created_at=NAIVE) == codes.NAIVE_TIMESTAMP
    assert code_of(ResearchObjective.create, "q", created_at=NAIVE) == codes.NAIVE_TIMESTAMP
    assert code_of(InvestigationSession.start, objective(), BUDGET, now=NAIVE) \
        == codes.NAIVE_TIMESTAMP
    assert code_of(InvestigationSession, "s", "o", "c", BUDGET, T0, updated_at=NAIVE) \
        == codes.NAIVE_TIMESTAMP


@pytest.mark.parametrize("key", ["created_at", "updated_at"])
def test_naive_timestamps_are_refused_when_loading(key: str) -> None:
    assert code_of(InvestigationSession.from_dict, session_dict(**{key: NAIVE.isoformat()})) \
        == codes.NAIVE_TIMESTAMP


# -- budget and usage --------------------------------------------------------------------


def test_budget_and_usage_round_trip() -> None:
    assert SessionBudget.from_dict(json.loads(json.dumps(BUDGET.to_dict()))) == BUDGET
    usage = BudgetUsage(iterations=1, investigations=2, agent_runs=3, cost_units=4,
                        execution_ms=5)
    assert BudgetUsage.from_dict(json.loads(json.dumps(usage.to_dict()))) == usage


@pytest.mark.parametrize(("loader", "record", "code"), [
    (SessionBudget.from_dict, {**BUDGET.to_dict(), "max_cost_units": -1}, codes.INVALID_VALUE),
    (SessionBudget.from_dict, {**BUDGET.to_dict(), "max_cost_units": "1"},
     codes.MALFORMED_RECORD),
    (SessionBudget.from_dict, {**BUDGET.to_dict(), "max_tokens": 1}, codes.MALFORMED_RECORD),
    (BudgetUsage.from_dict, {**BudgetUsage().to_dict(), "agent_runs": False},
     codes.MALFORMED_RECORD),
    (BudgetUsage.from_dict, {"iterations": 0}, codes.MALFORMED_RECORD),
    (BudgetUsage.from_dict, None, codes.MALFORMED_RECORD),
])
def test_malformed_budget_and_usage_records_are_refused(loader: Any, record: Any,
                                                        code: str) -> None:
    assert code_of(loader, record) == code


# -- session -----------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "code"), [
    ({"state": "SLEEPING"}, codes.UNKNOWN_STATE),
    ({"state": 3}, codes.MALFORMED_RECORD),
    ({"termination_reason": "BORED", "state": "COMPLETED"}, codes.UNKNOWN_REASON),
    ({"termination_reason": "OBJECTIVE_MET"}, codes.REASON_FORBIDDEN),
    ({"state": "PAUSED", "paused_from": "EXECUTING", "termination_reason": "OBJECTIVE_MET"},
     codes.REASON_FORBIDDEN),
    ({"state": "COMPLETED"}, codes.REASON_REQUIRED),
    ({"state": "FAILED", "termination_reason": "OBJECTIVE_MET"},
     codes.REASON_STATE_MISMATCH),
    ({"state": "PAUSED"}, codes.PAUSED_WITHOUT_PRIOR),
    ({"state": "PAUSED", "paused_from": "PAUSED"}, codes.INVALID_PRIOR_STATE),
    ({"state": "PAUSED", "paused_from": "COMPLETED"}, codes.INVALID_PRIOR_STATE),
    ({"state": "PAUSED", "paused_from": "NAPPING"}, codes.UNKNOWN_STATE),
    ({"paused_from": "EXECUTING"}, codes.PRIOR_WITHOUT_PAUSE),
    ({"session_id": ""}, codes.INVALID_VALUE),
    ({"correlation_id": None}, codes.MALFORMED_RECORD),
    ({"usage": {"iterations": -1}}, codes.MALFORMED_RECORD),
    ({"usage": {**BudgetUsage().to_dict(), "iterations": -1}}, codes.INVALID_VALUE),
    ({"budget": "big"}, codes.MALFORMED_RECORD),
    ({"updated_at": "2025-01-01T00:00:00+00:00"}, codes.TIMESTAMP_ORDER),
    ({"created_at": "not a time"}, codes.INVALID_TIMESTAMP),
    ({"format": "investigation-session/0"}, codes.UNSUPPORTED_FORMAT),
    ({"history": []}, codes.MALFORMED_RECORD),
])
def test_malformed_session_records_are_refused(changes: dict[str, Any], code: str) -> None:
    assert code_of(InvestigationSession.from_dict, session_dict(**changes)) == code


def test_a_session_record_reconstructs_counter_pause_usage_and_reason() -> None:
    s = InvestigationSession.start(objective(), BUDGET, session_id="ses-1",
                                   correlation_id="cor-1", now=T0)
    for name in ("EXECUTING", "EVALUATING", "UPDATING", "PLANNING", "EXECUTING"):
        s.transition(SessionState(name), at=T0)
    s.record_usage(investigations=1, agent_runs=2, cost_units=3, execution_ms=4, at=T0)
    s.pause(at=T0 + timedelta(seconds=1))
    record = s.to_dict()
    assert record == {
        "format": "investigation-session/1", "session_id": "ses-1", "objective_id": "obj-1",
        "correlation_id": "cor-1", "state": "PAUSED", "paused_from": "EXECUTING",
        "termination_reason": None, "budget": BUDGET.to_dict(),
        "usage": {"iterations": 1, "investigations": 1, "agent_runs": 2, "cost_units": 3,
                  "execution_ms": 4},
        "created_at": "2025-01-02T03:04:05.000006+00:00",
        "updated_at": "2025-01-02T03:04:06.000006+00:00",
    }
    restored = InvestigationSession.from_dict(json.loads(json.dumps(record)))
    assert restored == s and restored.iterations == 1
    assert restored.resume() is SessionState.EXECUTING
    restored.transition(SessionState.CANCELLED, reason=TerminationReason.USER_CANCELLED)
    again = InvestigationSession.from_dict(restored.to_dict())
    assert again.termination_reason is TerminationReason.USER_CANCELLED


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**18, 10**18),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20)
# Local times a zone skips or repeats (a DST gap or fold) name no single instant: Python
# compares them unequal to every other zone's time, their UTC form included.
aware_times = st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(9999, 1, 1),
                           timezones=st.timezones()).filter(
    lambda t: t == t.astimezone(UTC))
non_blank = st.text(min_size=1, max_size=30).filter(lambda s: s.strip() != "")


@PROPS
@given(non_blank, non_blank, st.text(max_size=30), st.lists(non_blank, max_size=3),
       st.lists(non_blank, max_size=3), aware_times,
       st.dictionaries(st.text(max_size=6), json_values, max_size=4))
def test_any_objective_round_trips_through_json(oid: str, question: str, scope: str,
                                                constraints: list[str], criteria: list[str],
                                                created: datetime,
                                                metadata: dict[str, Any]) -> None:
    o = ResearchObjective(objective_id=oid, question=question, created_at=created,
                          scope=scope, constraints=tuple(constraints),
                          success_criteria=tuple(criteria), metadata=metadata)
    record = o.to_dict()
    back = ResearchObjective.from_dict(json.loads(json.dumps(record)))
    assert back == o and back.to_dict() == record
    assert back.created_at == created
