"""The provider-independent investigation lifecycle (seed 001, ``docs/lifecycle.md``).

Pure domain code: standard library only, no model, worker, scheduler or store.

::

    from investigation.lifecycle import (ResearchObjective, InvestigationSession,
        SessionBudget, SessionState, TerminationPolicy, TerminationSignals)

    objective = ResearchObjective.create("Why are refunds doubled?")
    session = InvestigationSession.start(objective, SessionBudget(
        max_iterations=5, max_investigations=20, max_agent_runs=50,
        max_cost_units=1_000, max_execution_ms=3_600_000))
    session.transition(SessionState.EXECUTING)          # plan submitted
    session.record_usage(investigations=2, agent_runs=4, cost_units=30, execution_ms=900)
    session.transition(SessionState.EVALUATING)         # results collected
    policy = TerminationPolicy(confidence_threshold=0.9, min_candidate_value=0.0)
    decision = policy.decide_for(session, TerminationSignals(best_candidate_value=0.4))
    session.apply(decision)                             # False: valuable work remains
    record = session.to_dict()                          # JSON-compatible
"""

from investigation.errors import LifecycleError
from investigation.lifecycle import codes
from investigation.lifecycle.budget import BudgetDimension, BudgetUsage, SessionBudget
from investigation.lifecycle.objective import OBJECTIVE_FORMAT, ResearchObjective
from investigation.lifecycle.policy import (
    TerminationDecision,
    TerminationPolicy,
    TerminationSignals,
)
from investigation.lifecycle.session import SESSION_FORMAT, InvestigationSession
from investigation.lifecycle.states import (
    ACTIVE_STATES,
    INITIAL_STATE,
    TERMINAL_STATES,
    TRANSITIONS,
    SessionState,
    TerminationReason,
)

__all__ = [
    "ACTIVE_STATES",
    "INITIAL_STATE",
    "OBJECTIVE_FORMAT",
    "SESSION_FORMAT",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "BudgetDimension",
    "BudgetUsage",
    "InvestigationSession",
    "LifecycleError",
    "ResearchObjective",
    "SessionBudget",
    "SessionState",
    "TerminationDecision",
    "TerminationPolicy",
    "TerminationReason",
    "TerminationSignals",
    "codes",
]
