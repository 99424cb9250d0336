"""Every case's lifecycle (seed 001) mapped onto the loop (``docs/lifecycle.md``, "How
the engine maps onto it").

Each case has one ``ResearchObjective`` and one ``InvestigationSession``, stored as JSON
records on the case row (``objective_json``, ``session_json``) and changed only inside the
transaction that changes the case, so they can never disagree with it. The records carry
wall-clock times and are never part of a checkpoint hash.

One engine step is one lifecycle round, recorded when the step publishes:

==============================  ==========================================================
step                            session transitions (and usage)
==============================  ==========================================================
accepted query                  PLANNING -> EXECUTING -> EVALUATING -> UPDATING -> PLANNING
                                (an iteration; investigations +1, agent runs +1, cost)
accepted finish / reject        the same round, without an investigation or cost
test hand-off                   PLANNING -> EXECUTING; the session waits in EXECUTING until
                                the feedback is confirmed or the deadline passes, then
                                EXECUTING -> EVALUATING -> UPDATING -> PLANNING
rejected reply                  PLANNING -> EXECUTING -> EVALUATING -> PLANNING (no update,
                                not an iteration; agent runs +1)
blocked (provider, invalid      no transition: the session stays in PLANNING
replies)
every account terminal          ... -> UPDATING -> COMPLETED (``OBJECTIVE_MET``); a step
                                without a model call (automatic dispositions closed every
                                account): PLANNING -> COMPLETED
==============================  ==========================================================

After every round the ``TerminationPolicy`` decides with ``objective_met`` = every account
terminal; its budget (:func:`session_budget`) mirrors the engine's own limits, so a
budget stop and the engine's ``CHECKPOINT_LIMIT`` coincide. Operator ``pause`` /
``resume`` / ``cancel`` are in ``investigation.operations``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from investigation import jsonio
from investigation.config import InvestigationConfig
from investigation.lifecycle import (
    BudgetUsage,
    InvestigationSession,
    ResearchObjective,
    SessionBudget,
    SessionState,
    TerminationPolicy,
    TerminationReason,
    TerminationSignals,
)
from investigation.store.models import CaseRecord, utcnow

#: The policy's thresholds: the loop's objective is met only when every account is
#: terminal (confidence plays no part), and remaining work always has value while an
#: account is active.
POLICY = TerminationPolicy(confidence_threshold=1.0, min_candidate_value=0.0)


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def session_budget(config: InvestigationConfig, hypotheses: int) -> SessionBudget:
    """The five session bounds from the frozen policy and limits.

    They mirror the engine's own rules, so only execution time can stop a session before
    the accounts do: iterations and agent runs ``limits.max_checkpoints`` (one step, one
    checkpoint); investigations ``hypotheses * max_iterations_per_hypothesis`` (plus one
    each: a bound, never reached by the per-account caps); cost ``investigations *`` the
    largest configured action cost (reservations can exceed the credit by re-spending
    refunds, never this); execution time ``limits.max_execution_seconds`` of summed step
    durations (waiting, blocked or paused time does not count).
    """
    n = max(1, hypotheses)
    investigations = n * (config.loop.max_iterations_per_hypothesis + 1)
    largest = max([*config.budget.costs.values(), *config.budget.test_costs.values()])
    return SessionBudget(
        max_iterations=config.limits.max_checkpoints,
        max_investigations=investigations,
        max_agent_runs=config.limits.max_checkpoints,
        max_cost_units=investigations * largest,
        max_execution_ms=config.limits.max_execution_seconds * 1000)


def load(case: CaseRecord) -> InvestigationSession | None:
    """The case's session, or ``None`` before it was started."""
    if case.session_json is None:
        return None
    return InvestigationSession.from_dict(jsonio.loads(case.session_json))


def save(case: CaseRecord, session: InvestigationSession) -> None:
    """Store ``session`` on the case row (the caller's transaction commits it)."""
    case.session_json = text = json.dumps(session.to_dict(), sort_keys=True)
    _remember_checked(text, session.budget)


def ensure(case: CaseRecord, config: InvestigationConfig, hypotheses: int,
           question: str) -> InvestigationSession:
    """Load the case's session, or start it (and its objective) in PLANNING.

    Args:
        question: the objective's question (the accepted interpretation's summary).
    """
    session = load(case)
    if session is not None:
        budget = session_budget(config, hypotheses)
        if session.budget != budget and session.usage == BudgetUsage() \
                and not session.is_terminal:
            # Started before the first step (an operator pause) with provisional bounds:
            # nothing was used under them, so the frozen policy's bounds replace them.
            record = session.to_dict()
            record["budget"] = budget.to_dict()
            session = InvestigationSession.from_dict(record)
            save(case, session)
        return session
    created = _aware(case.created_at)
    objective = ResearchObjective.create(
        question or f"Investigate case {case.id}",
        scope=f"case {case.id}, package {case.package_id}, revision {case.current_revision}",
        constraints=["read-only queries against the immutable snapshot",
                     "no diagnosis, patch, source or SQL writes"],
        success_criteria=["every hypothesis account terminal",
                          "a deterministic summary.md"],
        metadata={"case_id": case.id, "package_id": case.package_id},
        objective_id=f"obj-{case.id}", created_at=created)
    session = InvestigationSession.start(
        objective, session_budget(config, hypotheses), session_id=f"ses-{case.id}",
        correlation_id=case.id, now=created)
    case.objective_json = json.dumps(objective.to_dict(), sort_keys=True)
    save(case, session)
    return session


#: Session records this process wrote or checked (:func:`ensure_started`): record text
#: -> the budget the record holds.
_CHECKED: dict[str, SessionBudget] = {}
_CHECKED_KEPT = 1024


def _remember_checked(text: str, budget: SessionBudget) -> None:
    if len(_CHECKED) >= _CHECKED_KEPT:
        _CHECKED.clear()  # a bound, not an LRU: single dict operations only
    _CHECKED[text] = budget


def ensure_started(case: CaseRecord, config: InvestigationConfig, hypotheses: int,
                   question: Callable[[], str]) -> None:
    """:func:`ensure` for a step that only needs the session to exist under its bounds:
    a record this process wrote or checked, holding these bounds, is not parsed again
    (``ensure`` leaves a started session with its own bounds unchanged).

    Args:
        question: gives the objective's question, called only if the session starts.
    """
    budget = session_budget(config, hypotheses)
    text = case.session_json
    if text is not None and _CHECKED.get(text) == budget:
        return  # a started session already under these bounds: ensure changes nothing
    session = ensure(case, config, hypotheses, question())
    if case.session_json is not None:
        _remember_checked(case.session_json, session.budget)


def _round(session: InvestigationSession, path: list[SessionState], now: datetime) -> None:
    for state in path:
        if session.state != state:
            session.transition(state, at=now)


def record_step(case: CaseRecord, session: InvestigationSession, *, accepted: bool,
                action: str | None, cost_units: int, started_at: datetime | None,
                all_terminal: bool, blocked: bool) -> TerminationReason | None:
    """Record one published step as a lifecycle round (see the module table).

    Args:
        accepted: the step's reply was accepted.
        action: the accepted next action (``query``, ``test``, ``finish``, ``reject``).
        cost_units: units reserved by the step.
        started_at: when the step's first stage was recorded (execution time).
        all_terminal: every account is terminal after the step.
        blocked: the step ended blocked for a reason other than a test hand-off.

    Returns:
        The termination reason when the policy stopped the session for something other
        than the objective (a budget bound): the engine must stop the case.
    """
    if session.is_terminal or session.state == SessionState.PAUSED:
        return None
    now = utcnow()
    elapsed = 0 if started_at is None else \
        max(0, int((now - _aware(started_at)).total_seconds() * 1000))
    if action is None and not accepted and all_terminal \
            and session.state == SessionState.PLANNING:
        # A closing step without a model call (every account became terminal by an
        # automatic disposition): the stop is decided from PLANNING.
        session.record_usage(execution_ms=elapsed, at=now)
        session.apply(POLICY.decide(
            TerminationSignals(best_candidate_value=None, objective_met=True),
            session.budget, session.usage), at=now)
        save(case, session)
        return None
    if blocked and not all_terminal:
        if elapsed:
            session.record_usage(execution_ms=elapsed, at=now)
        save(case, session)
        return None
    _round(session, [SessionState.EXECUTING], now)
    session.record_usage(investigations=1 if action in ("query", "test") else 0,
                         agent_runs=1, cost_units=cost_units, execution_ms=elapsed, at=now)
    if accepted and action == "test":
        save(case, session)  # waits in EXECUTING for the feedback
        return None
    _round(session, [SessionState.EVALUATING], now)
    if accepted:
        _round(session, [SessionState.UPDATING], now)
    return _close_or_continue(case, session, all_terminal, now)


def record_test_result(case: CaseRecord) -> None:
    """Confirmed feedback or a passed deadline: the waiting round goes on
    (EXECUTING -> EVALUATING -> UPDATING -> PLANNING). A session paused while it waited
    resumes into EXECUTING first, so no stage is skipped, and is paused again."""
    session = load(case)
    if session is None or session.is_terminal:
        return
    now = utcnow()
    paused = session.state == SessionState.PAUSED
    if paused:
        session.resume(at=now)
    if session.state == SessionState.EXECUTING:
        _round(session, [SessionState.EVALUATING, SessionState.UPDATING,
                         SessionState.PLANNING], now)
    if paused:
        session.pause(at=now)
    save(case, session)


def _close_or_continue(case: CaseRecord, session: InvestigationSession, all_terminal: bool,
                       now: datetime) -> TerminationReason | None:
    """After EVALUATING/UPDATING: complete on the objective, or return to PLANNING and ask
    the policy on the final usage. Returns the reason of a stop that is not the objective
    (a budget bound: the engine then stops the case), else ``None``."""
    if all_terminal:  # objective met outranks every budget bound (seed 001 precedence)
        session.apply(POLICY.decide(
            TerminationSignals(best_candidate_value=None, objective_met=True),
            session.budget, session.usage), at=now)  # EVALUATING/UPDATING -> COMPLETED
        save(case, session)
        return None
    _round(session, [SessionState.PLANNING], now)  # UPDATING -> PLANNING is an iteration
    decision = POLICY.decide(TerminationSignals(best_candidate_value=1.0),
                             session.budget, session.usage)
    if decision.is_terminal:
        session.apply(decision, at=now)  # PLANNING -> COMPLETED: a bounded stop
    save(case, session)
    return decision.reason


def describe(case: CaseRecord) -> dict[str, Any]:
    """The lifecycle part of ``status``: state, paused-from, reason, usage and budget."""
    session = load(case)
    if session is None:
        return {"state": SessionState.PLANNING.value, "started": False}
    return {"state": session.state.value, "started": True,
            "paused_from": session.paused_from.value if session.paused_from else None,
            "termination_reason": session.termination_reason.value
            if session.termination_reason else None,
            "iterations": session.iterations,
            "usage": BudgetUsage.to_dict(session.usage),
            "budget": session.budget.to_dict()}


def iterations_gloss(life: dict[str, Any]) -> str:
    """What a started session's ``iterations`` (:func:`describe`) count, as ``status`` and
    the report say it: every accepted decision round returns the session to PLANNING and
    counts one, but the round that ended it (``docs/lifecycle.md``: 10 after 11 steps). A
    500-step reader read "the last not counted" beside 500 for a case still at work."""
    ended = SessionState(life["state"]).is_terminal
    return ("accepted decision rounds" + (", the last, which ended the session, not counted"
                                          if ended else "")
            + "; an account's iterations count only its queries and tests")
