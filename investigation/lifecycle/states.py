"""Session states, termination reasons and the seed's state diagram as data.

::

    [*] --> PLANNING
    PLANNING   --> EXECUTING | COMPLETED | PAUSED | FAILED | CANCELLED
    EXECUTING  --> EVALUATING | PAUSED | FAILED | CANCELLED
    EVALUATING --> UPDATING | PLANNING | COMPLETED | PAUSED | FAILED | CANCELLED
    UPDATING   --> PLANNING (iteration += 1) | COMPLETED | PAUSED | FAILED | CANCELLED
    PAUSED     --> the exact prior active state, nothing else
    COMPLETED, FAILED, CANCELLED: absorbing

Note that EXECUTING has no edge to COMPLETED: results are evaluated before any
objective or stop decision, and PAUSED has no edge to a terminal state: a paused
session is resumed (one recorded transition) before it is cancelled or fails.
"""

from __future__ import annotations

from enum import StrEnum


class SessionState(StrEnum):
    """The eight states of an ``InvestigationSession`` (values are the names)."""

    PLANNING = "PLANNING"
    EXECUTING = "EXECUTING"
    EVALUATING = "EVALUATING"
    UPDATING = "UPDATING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_active(self) -> bool:
        """PLANNING, EXECUTING, EVALUATING or UPDATING (PAUSED is neither active nor terminal)."""
        return self in ACTIVE_STATES

    @property
    def is_terminal(self) -> bool:
        """COMPLETED, FAILED or CANCELLED."""
        return self in TERMINAL_STATES


#: The four working states; PAUSED records which one it interrupted.
ACTIVE_STATES = frozenset({
    SessionState.PLANNING, SessionState.EXECUTING, SessionState.EVALUATING,
    SessionState.UPDATING,
})
#: Absorbing states; entering one requires a ``TerminationReason``.
TERMINAL_STATES = frozenset({
    SessionState.COMPLETED, SessionState.FAILED, SessionState.CANCELLED,
})
#: The state a new session starts in (``[*] --> PLANNING``).
INITIAL_STATE = SessionState.PLANNING

_S = SessionState
#: Allowed edges out of each non-PAUSED state (PAUSED resumes to its recorded prior state).
TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    _S.PLANNING: frozenset({_S.EXECUTING, _S.COMPLETED, _S.PAUSED, _S.FAILED, _S.CANCELLED}),
    _S.EXECUTING: frozenset({_S.EVALUATING, _S.PAUSED, _S.FAILED, _S.CANCELLED}),
    _S.EVALUATING: frozenset({_S.UPDATING, _S.PLANNING, _S.COMPLETED, _S.PAUSED, _S.FAILED,
                              _S.CANCELLED}),
    _S.UPDATING: frozenset({_S.PLANNING, _S.COMPLETED, _S.PAUSED, _S.FAILED, _S.CANCELLED}),
    _S.PAUSED: ACTIVE_STATES,
    _S.COMPLETED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class TerminationReason(StrEnum):
    """Why a session ended. Each reason belongs to exactly one terminal state
    (``target_state``); the policy's precedence level is ``level`` (1 = highest)."""

    USER_CANCELLED = "USER_CANCELLED"
    """Level 1: an operator or upstream system cancelled. -> CANCELLED."""
    SYSTEM_FAILURE = "SYSTEM_FAILURE"
    """Level 1: a non-recoverable system failure. -> FAILED."""
    OBJECTIVE_MET = "OBJECTIVE_MET"
    """Level 2: the success criteria are satisfied. -> COMPLETED."""
    CONFIDENCE_REACHED = "CONFIDENCE_REACHED"
    """Level 2: objective confidence reached the policy's threshold. -> COMPLETED."""
    MAX_ITERATIONS = "MAX_ITERATIONS"
    """Level 3: the iteration bound is exhausted. -> COMPLETED."""
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    """Level 3: another budget dimension is exhausted. -> COMPLETED."""
    UNRESOLVABLE_CONTRADICTION = "UNRESOLVABLE_CONTRADICTION"
    """Level 4: the evidence holds a contradiction no further work can resolve. -> COMPLETED."""
    NO_VALUABLE_CANDIDATE = "NO_VALUABLE_CANDIDATE"
    """Level 5: no remaining candidate is above the minimum value. -> COMPLETED."""

    @property
    def target_state(self) -> SessionState:
        """The terminal state this reason leads to."""
        return _REASON_STATE[self]

    @property
    def level(self) -> int:
        """Precedence level in ``TerminationPolicy`` (1 beats 2 beats ... 5)."""
        return _REASON_LEVEL[self]


_R = TerminationReason
_REASON_STATE = {
    _R.USER_CANCELLED: _S.CANCELLED,
    _R.SYSTEM_FAILURE: _S.FAILED,
    _R.OBJECTIVE_MET: _S.COMPLETED,
    _R.CONFIDENCE_REACHED: _S.COMPLETED,
    _R.MAX_ITERATIONS: _S.COMPLETED,
    _R.BUDGET_EXHAUSTED: _S.COMPLETED,
    _R.UNRESOLVABLE_CONTRADICTION: _S.COMPLETED,
    _R.NO_VALUABLE_CANDIDATE: _S.COMPLETED,
}
_REASON_LEVEL = {
    _R.USER_CANCELLED: 1,
    _R.SYSTEM_FAILURE: 1,
    _R.OBJECTIVE_MET: 2,
    _R.CONFIDENCE_REACHED: 2,
    _R.MAX_ITERATIONS: 3,
    _R.BUDGET_EXHAUSTED: 3,
    _R.UNRESOLVABLE_CONTRADICTION: 4,
    _R.NO_VALUABLE_CANDIDATE: 5,
}
