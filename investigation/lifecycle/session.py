"""``InvestigationSession``: the validated, bounded lifecycle of one research objective.

Every transition is checked against the seed's diagram (``states.TRANSITIONS``) before
anything changes; a refused transition raises ``LifecycleError`` and leaves the session
exactly as it was. The session holds values only (ids, state, budget, usage, times), so
``to_dict``/``from_dict`` reconstruct the iteration counter, paused state, usage and
termination reason after a restart.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from investigation.lifecycle import _records as r
from investigation.lifecycle import codes
from investigation.lifecycle._records import JSONValue
from investigation.lifecycle.budget import BudgetDimension, BudgetUsage, SessionBudget
from investigation.lifecycle.objective import ResearchObjective
from investigation.lifecycle.states import (
    ACTIVE_STATES,
    INITIAL_STATE,
    TRANSITIONS,
    SessionState,
    TerminationReason,
)

if TYPE_CHECKING:
    from investigation.lifecycle.policy import TerminationDecision

#: ``format`` of a serialised session.
SESSION_FORMAT = "investigation-session/1"
_KEYS = ("format", "session_id", "objective_id", "correlation_id", "state", "paused_from",
         "termination_reason", "budget", "usage", "created_at", "updated_at")


def _check_shape(state: SessionState, paused_from: SessionState | None,
                 reason: TerminationReason | None) -> None:
    """The record invariants: PAUSED iff a prior active state; reason iff terminal and
    matching that terminal state."""
    if state is SessionState.PAUSED:
        if paused_from is None:
            raise r.error(codes.PAUSED_WITHOUT_PRIOR,
                          "a PAUSED session must record the active state it was paused from")
        if paused_from not in ACTIVE_STATES:
            raise r.error(codes.INVALID_PRIOR_STATE,
                          f"paused_from must be an active state, not {paused_from}",
                          paused_from=str(paused_from))
    elif paused_from is not None:
        raise r.error(codes.PRIOR_WITHOUT_PAUSE,
                      f"only a PAUSED session records a prior state (state is {state})",
                      state=str(state))
    if state.is_terminal:
        if reason is None:
            raise r.error(codes.REASON_REQUIRED,
                          f"{state} requires a TerminationReason", state=str(state))
        if reason.target_state is not state:
            raise r.error(codes.REASON_STATE_MISMATCH,
                          f"reason {reason} leads to {reason.target_state}, not {state}",
                          state=str(state), reason=str(reason))
    elif reason is not None:
        raise r.error(codes.REASON_FORBIDDEN,
                      f"{state} is not terminal and cannot carry a termination reason",
                      state=str(state), reason=str(reason))


_E = TypeVar("_E", SessionState, TerminationReason)


def _enum(kind: type[_E], value: object, field: str, code: str) -> _E:
    if not isinstance(value, str):
        raise r.error(codes.MALFORMED_RECORD, f"{field} must be a string", field=field)
    try:
        return kind(value)
    except ValueError as exc:
        raise r.error(code, f"{field} {value!r} is not one of {[m.value for m in kind]}",
                      field=field) from exc


class InvestigationSession:
    """One objective's lifecycle: state machine, budget, usage and termination reason.

    Construct a new session with :meth:`start`; the constructor validates a complete
    record (it is what :meth:`from_dict` uses).

    Args:
        session_id: stable identifier of this session.
        objective_id: the ``ResearchObjective.objective_id`` it serves.
        correlation_id: identifier that ties logs, tasks and records together.
        budget: the five bounds.
        created_at: timezone-aware; stored in UTC.
        state: current state (default PLANNING).
        paused_from: the prior active state; set iff ``state`` is PAUSED.
        termination_reason: set iff ``state`` is terminal, and must lead to that state.
        usage: what has been used (default all zero).
        updated_at: time of the last change (default ``created_at``); not before it.

    Raises:
        LifecycleError: any shape violation (see ``codes``), before anything is built.
    """

    __slots__ = ("_budget", "_correlation_id", "_created_at", "_objective_id",
                 "_paused_from", "_reason", "_session_id", "_state", "_updated_at", "_usage")

    def __init__(self, session_id: str, objective_id: str, correlation_id: str,
                 budget: SessionBudget, created_at: datetime, *,
                 state: SessionState = INITIAL_STATE,
                 paused_from: SessionState | None = None,
                 termination_reason: TerminationReason | None = None,
                 usage: BudgetUsage | None = None,
                 updated_at: datetime | None = None) -> None:
        created = r.aware(created_at, "created_at")
        updated = created if updated_at is None else r.aware(updated_at, "updated_at")
        if updated < created:
            raise r.error(codes.TIMESTAMP_ORDER, "updated_at is earlier than created_at")
        if not isinstance(budget, SessionBudget):
            raise r.error(codes.MALFORMED_RECORD, "budget must be a SessionBudget")
        if usage is not None and not isinstance(usage, BudgetUsage):
            raise r.error(codes.MALFORMED_RECORD, "usage must be a BudgetUsage")
        _check_shape(state, paused_from, termination_reason)
        self._session_id = r.identifier(session_id, "session_id")
        self._objective_id = r.identifier(objective_id, "objective_id")
        self._correlation_id = r.identifier(correlation_id, "correlation_id")
        self._budget = budget
        self._usage = usage or BudgetUsage()
        self._state = state
        self._paused_from = paused_from
        self._reason = termination_reason
        self._created_at = created
        self._updated_at = updated

    @classmethod
    def start(cls, objective: ResearchObjective, budget: SessionBudget, *,
              session_id: str | None = None, correlation_id: str | None = None,
              now: datetime | None = None) -> InvestigationSession:
        """A new session in PLANNING for ``objective``, with zero usage.

        ``session_id`` defaults to ``"ses-" + uuid4 hex``, ``correlation_id`` to the
        session id, ``now`` to the current UTC time.
        """
        sid = session_id or f"ses-{uuid.uuid4().hex}"
        return cls(sid, objective.objective_id, correlation_id or sid, budget,
                   r.now_or(now, "now"))

    # -- read-only view ------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def objective_id(self) -> str:
        return self._objective_id

    @property
    def correlation_id(self) -> str:
        return self._correlation_id

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def paused_from(self) -> SessionState | None:
        """The active state a PAUSED session resumes to; ``None`` otherwise."""
        return self._paused_from

    @property
    def termination_reason(self) -> TerminationReason | None:
        """Set iff the session is terminal."""
        return self._reason

    @property
    def budget(self) -> SessionBudget:
        return self._budget

    @property
    def usage(self) -> BudgetUsage:
        return self._usage

    @property
    def iterations(self) -> int:
        """Completed iterations: the number of UPDATING -> PLANNING transitions."""
        return self._usage.iterations

    @property
    def created_at(self) -> datetime:
        return self._created_at

    @property
    def updated_at(self) -> datetime:
        return self._updated_at

    @property
    def is_terminal(self) -> bool:
        return self._state.is_terminal

    def allowed_targets(self) -> frozenset[SessionState]:
        """States reachable in one transition now (ignoring the budget guard and the
        reason a terminal target needs)."""
        if self._state is SessionState.PAUSED:
            return frozenset({self._paused_from}) if self._paused_from else frozenset()
        return TRANSITIONS[self._state]

    def exhausted(self) -> tuple[BudgetDimension, ...]:
        """Exhausted budget dimensions, in ``BudgetDimension`` order."""
        return self._budget.exhausted(self._usage)

    # -- changes -------------------------------------------------------------------------

    def transition(self, target: SessionState, *, reason: TerminationReason | None = None,
                   at: datetime | None = None) -> None:
        """Move to ``target`` if the diagram allows it; otherwise change nothing.

        Args:
            target: the next state.
            reason: required for COMPLETED/FAILED/CANCELLED (and must lead there);
                forbidden otherwise.
            at: aware time of the change (default now); ``updated_at`` never moves back.

        Raises:
            LifecycleError: ``LIFECYCLE_INVALID_TRANSITION`` (edge not in the diagram, or
                out of a terminal state), ``LIFECYCLE_RESUME_MISMATCH`` (PAUSED to another
                active state than the prior one), ``LIFECYCLE_REASON_REQUIRED``,
                ``LIFECYCLE_REASON_FORBIDDEN``, ``LIFECYCLE_REASON_STATE_MISMATCH``,
                ``LIFECYCLE_BUDGET_EXHAUSTED`` (PLANNING -> EXECUTING with an exhausted
                dimension), ``LIFECYCLE_NAIVE_TIMESTAMP``.
        """
        when = r.now_or(at)
        if not isinstance(target, SessionState):
            raise r.error(codes.UNKNOWN_STATE, f"{target!r} is not a SessionState")
        if reason is not None and not isinstance(reason, TerminationReason):
            raise r.error(codes.UNKNOWN_REASON, f"{reason!r} is not a TerminationReason")
        source = self._state
        if source is SessionState.PAUSED and target in ACTIVE_STATES \
                and target is not self._paused_from:
            raise r.error(codes.RESUME_MISMATCH,
                          f"this session was paused from {self._paused_from}; resume "
                          f"returns there, not to {target}",
                          paused_from=str(self._paused_from), target=str(target))
        if target not in self.allowed_targets():
            hint = ("terminal states are absorbing" if source.is_terminal
                    else f"allowed: {sorted(s.value for s in self.allowed_targets())}")
            raise r.error(codes.INVALID_TRANSITION, f"{source} -> {target} is not allowed "
                          f"({hint})", source=str(source), target=str(target))
        _check_shape(target, source if target is SessionState.PAUSED else None, reason)
        if source is SessionState.PLANNING and target is SessionState.EXECUTING:
            exhausted = self.exhausted()
            if exhausted:
                raise r.error(codes.BUDGET_EXHAUSTED,
                              "cannot start execution: exhausted "
                              f"{', '.join(d.value for d in exhausted)}; ask the "
                              "TerminationPolicy for a stop decision",
                              exhausted=[d.value for d in exhausted])
        if source is SessionState.UPDATING and target is SessionState.PLANNING:
            self._usage = self._usage.plus(iterations=1)
        self._paused_from = source if target is SessionState.PAUSED else None
        self._state = target
        self._reason = reason
        self._updated_at = max(self._updated_at, when)

    def pause(self, *, at: datetime | None = None) -> None:
        """Active state -> PAUSED, recording the state to resume to."""
        self.transition(SessionState.PAUSED, at=at)

    def resume(self, *, at: datetime | None = None) -> SessionState:
        """PAUSED -> the exact prior state; returns it.

        Raises:
            LifecycleError: ``LIFECYCLE_INVALID_TRANSITION`` when not PAUSED.
        """
        if self._state is not SessionState.PAUSED or self._paused_from is None:
            raise r.error(codes.INVALID_TRANSITION,
                          f"only a PAUSED session resumes (state is {self._state})",
                          source=str(self._state))
        target = self._paused_from
        self.transition(target, at=at)
        return target

    def terminate(self, reason: TerminationReason, *, at: datetime | None = None) -> None:
        """Move to ``reason.target_state`` (COMPLETED, FAILED or CANCELLED)."""
        self.transition(reason.target_state, reason=reason, at=at)

    def apply(self, decision: TerminationDecision, *, at: datetime | None = None) -> bool:
        """Apply a policy decision: terminate if it is terminal, else change nothing.

        Returns:
            ``True`` when the session terminated, ``False`` for a continue decision.
        """
        if decision.reason is None:
            return False
        self.terminate(decision.reason, at=at)
        return True

    def record_usage(self, *, investigations: int = 0, agent_runs: int = 0,
                     cost_units: int = 0, execution_ms: int = 0,
                     at: datetime | None = None) -> BudgetUsage:
        """Add non-negative usage (iterations advance only by UPDATING -> PLANNING).

        Usage may overrun a bound: it records what happened. Returns the new usage.

        Raises:
            LifecycleError: ``LIFECYCLE_SESSION_TERMINAL`` on a terminal session (its
                final accounting is frozen), ``LIFECYCLE_INVALID_VALUE`` for a negative
                amount, ``LIFECYCLE_MALFORMED_RECORD`` for a non-integer.
        """
        when = r.now_or(at)
        if self.is_terminal:
            raise r.error(codes.SESSION_TERMINAL,
                          f"session {self._session_id} is {self._state}; its usage is final")
        self._usage = self._usage.plus(investigations=investigations, agent_runs=agent_runs,
                                       cost_units=cost_units, execution_ms=execution_ms)
        self._updated_at = max(self._updated_at, when)
        return self._usage

    # -- records -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, JSONValue]:
        """JSON-compatible record (see ``docs/lifecycle.md``, "Records")."""
        return {
            "format": SESSION_FORMAT,
            "session_id": self._session_id,
            "objective_id": self._objective_id,
            "correlation_id": self._correlation_id,
            "state": self._state.value,
            "paused_from": self._paused_from.value if self._paused_from else None,
            "termination_reason": self._reason.value if self._reason else None,
            "budget": self._budget.to_dict(),
            "usage": self._usage.to_dict(),
            "created_at": r.dump_timestamp(self._created_at),
            "updated_at": r.dump_timestamp(self._updated_at),
        }

    @classmethod
    def from_dict(cls, data: object) -> InvestigationSession:
        """Rebuild from ``to_dict()`` output, validating every field and invariant.

        Raises:
            LifecycleError: ``LIFECYCLE_MALFORMED_RECORD``, ``LIFECYCLE_UNSUPPORTED_FORMAT``,
                ``LIFECYCLE_UNKNOWN_STATE``, ``LIFECYCLE_UNKNOWN_REASON``,
                ``LIFECYCLE_PAUSED_WITHOUT_PRIOR``, ``LIFECYCLE_PRIOR_WITHOUT_PAUSE``,
                ``LIFECYCLE_INVALID_PRIOR_STATE``, ``LIFECYCLE_REASON_REQUIRED``,
                ``LIFECYCLE_REASON_FORBIDDEN``, ``LIFECYCLE_REASON_STATE_MISMATCH``,
                ``LIFECYCLE_NAIVE_TIMESTAMP``, ``LIFECYCLE_TIMESTAMP_ORDER``, ...
        """
        d = r.fields(data, "session", _KEYS)
        r.check_format(d, SESSION_FORMAT)
        state = _enum(SessionState, d["state"], "state", codes.UNKNOWN_STATE)
        prior = d["paused_from"]
        paused_from = None if prior is None else _enum(SessionState, prior, "paused_from",
                                                       codes.UNKNOWN_STATE)
        raw_reason = d["termination_reason"]
        reason = None if raw_reason is None else _enum(
            TerminationReason, raw_reason, "termination_reason", codes.UNKNOWN_REASON)
        return cls(
            r.identifier(d["session_id"], "session_id"),
            r.identifier(d["objective_id"], "objective_id"),
            r.identifier(d["correlation_id"], "correlation_id"),
            SessionBudget.from_dict(d["budget"]),
            r.load_timestamp(d["created_at"], "created_at"),
            state=state,
            paused_from=paused_from,
            termination_reason=reason,
            usage=BudgetUsage.from_dict(d["usage"]),
            updated_at=r.load_timestamp(d["updated_at"], "updated_at"),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InvestigationSession):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"InvestigationSession(session_id={self._session_id!r}, "
                f"state={self._state.value}, iterations={self.iterations})")
