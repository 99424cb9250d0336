"""``TerminationPolicy``: when a session stops, and why (seed 001, "Budgets and stopping").

The policy is a pure function of an explicit ``TerminationSignals`` object, the session's
budget and its usage. It checks the stop conditions in a stable precedence order and
returns the first that holds; lower conditions that also held are kept in
``TerminationDecision.also`` so nothing is hidden:

1. user cancellation (-> CANCELLED), then non-recoverable system failure (-> FAILED);
2. objective met, then objective confidence >= threshold (-> COMPLETED);
3. maximum iterations, then another exhausted dimension in ``BudgetDimension`` order;
4. an unresolvable contradiction;
5. no candidate strictly above the minimum value threshold.

None holds -> a non-terminal decision ("continue"): valuable work remains. There is no
loop here; the caller asks once per decision point.
"""

from __future__ import annotations

from dataclasses import dataclass

from investigation.lifecycle import _records as r
from investigation.lifecycle import codes
from investigation.lifecycle._records import JSONValue
from investigation.lifecycle.budget import BudgetDimension, BudgetUsage, SessionBudget
from investigation.lifecycle.session import InvestigationSession
from investigation.lifecycle.states import SessionState, TerminationReason


@dataclass(frozen=True)
class TerminationSignals:
    """What the orchestration layer observed at a decision point.

    Args:
        best_candidate_value: value of the best remaining candidate (an investigation,
            hypothesis or action worth doing next), in the caller's value scale; ``None``
            means no candidate remains. Required: the caller must say.
        cancelled: an operator or upstream system asked to cancel.
        system_failure: a non-recoverable system failure happened (recoverable ones,
            such as a retried task, are not signalled here).
        objective_met: the objective's success criteria are satisfied.
        objective_confidence: confidence in the objective's answer, 0.0..1.0, or ``None``
            when not assessed.
        contradiction: the evidence holds a contradiction no further work can resolve.

    Raises:
        LifecycleError: ``LIFECYCLE_INVALID_VALUE`` (confidence outside 0..1, NaN, a
            non-bool flag).
    """

    best_candidate_value: float | None
    cancelled: bool = False
    system_failure: bool = False
    objective_met: bool = False
    objective_confidence: float | None = None
    contradiction: bool = False

    def __post_init__(self) -> None:
        for name in ("cancelled", "system_failure", "objective_met", "contradiction"):
            if not isinstance(getattr(self, name), bool):
                raise r.error(codes.INVALID_VALUE, f"{name} must be a bool", field=name)
        if self.objective_confidence is not None:
            value = r.finite(self.objective_confidence, "objective_confidence")
            if not 0.0 <= value <= 1.0:
                raise r.error(codes.INVALID_VALUE, "objective_confidence must be in 0..1",
                              field="objective_confidence")
        if self.best_candidate_value is not None:
            r.finite(self.best_candidate_value, "best_candidate_value")


@dataclass(frozen=True)
class TerminationDecision:
    """The policy's answer.

    Attributes:
        reason: why to stop, or ``None`` to continue.
        target_state: COMPLETED, FAILED or CANCELLED, or ``None`` to continue.
        explanation: one human-readable sentence (or a few) for operators.
        exhausted: every exhausted budget dimension at decision time.
        also: lower-precedence stop reasons that held too, highest first.
    """

    reason: TerminationReason | None
    target_state: SessionState | None
    explanation: str
    exhausted: tuple[BudgetDimension, ...] = ()
    also: tuple[TerminationReason, ...] = ()

    @property
    def is_terminal(self) -> bool:
        return self.reason is not None

    def to_dict(self) -> dict[str, JSONValue]:
        """JSON-compatible view for logs and status output."""
        return {
            "reason": self.reason.value if self.reason else None,
            "target_state": self.target_state.value if self.target_state else None,
            "explanation": self.explanation,
            "exhausted": [d.value for d in self.exhausted],
            "also": [reason.value for reason in self.also],
        }


@dataclass(frozen=True)
class TerminationPolicy:
    """Stop conditions with their thresholds. Both fields are required (no invented
    defaults: the engine's configuration chooses them).

    Args:
        confidence_threshold: objective confidence at or above which the objective is
            treated as answered; 0.0 < threshold <= 1.0.
        min_candidate_value: a candidate is worth pursuing only when its value is
            strictly above this (finite; same scale as ``best_candidate_value``).
    """

    confidence_threshold: float
    min_candidate_value: float

    def __post_init__(self) -> None:
        threshold = r.finite(self.confidence_threshold, "confidence_threshold")
        if not 0.0 < threshold <= 1.0:
            raise r.error(codes.INVALID_VALUE, "confidence_threshold must be in (0, 1]",
                          field="confidence_threshold")
        r.finite(self.min_candidate_value, "min_candidate_value")

    def decide(self, signals: TerminationSignals, budget: SessionBudget,
               usage: BudgetUsage) -> TerminationDecision:
        """Evaluate every stop condition; return the highest-precedence one that holds."""
        exhausted = budget.exhausted(usage)
        held: list[tuple[TerminationReason, str]] = []
        if signals.cancelled:
            held.append((TerminationReason.USER_CANCELLED, "the session was cancelled"))
        if signals.system_failure:
            held.append((TerminationReason.SYSTEM_FAILURE,
                         "a non-recoverable system failure occurred"))
        if signals.objective_met:
            held.append((TerminationReason.OBJECTIVE_MET,
                         "the objective's success criteria are met"))
        confidence = signals.objective_confidence
        if confidence is not None and confidence >= self.confidence_threshold:
            held.append((TerminationReason.CONFIDENCE_REACHED,
                         f"objective confidence {confidence:g} reached the threshold "
                         f"{self.confidence_threshold:g}"))
        if BudgetDimension.ITERATIONS in exhausted:
            held.append((TerminationReason.MAX_ITERATIONS,
                         f"{usage.iterations} of {budget.max_iterations} iterations used"))
        others = [d for d in exhausted if d is not BudgetDimension.ITERATIONS]
        if others:
            held.append((TerminationReason.BUDGET_EXHAUSTED, "exhausted " + ", ".join(
                f"{d.value} ({usage.used(d)} of {budget.limit(d)})" for d in others)))
        if signals.contradiction:
            held.append((TerminationReason.UNRESOLVABLE_CONTRADICTION,
                         "the evidence holds an unresolvable contradiction"))
        best = signals.best_candidate_value
        if best is None or best <= self.min_candidate_value:
            held.append((TerminationReason.NO_VALUABLE_CANDIDATE,
                         "no candidate remains" if best is None else
                         f"the best candidate's value {best:g} is not above the minimum "
                         f"{self.min_candidate_value:g}"))
        if not held:
            return TerminationDecision(
                None, None,
                f"continue: the best candidate's value {best:g} is above the minimum "
                f"{self.min_candidate_value:g} and no stop condition holds", exhausted)
        (reason, why), rest = held[0], held[1:]
        explanation = f"{reason.value}: {why}"
        if rest:
            explanation += "; also: " + "; ".join(w for _, w in rest)
        return TerminationDecision(reason, reason.target_state, explanation, exhausted,
                                   tuple(x for x, _ in rest))

    def decide_for(self, session: InvestigationSession,
                   signals: TerminationSignals) -> TerminationDecision:
        """``decide`` with the session's budget and usage.

        Raises:
            LifecycleError: ``LIFECYCLE_SESSION_TERMINAL`` when the session has ended.
        """
        if session.is_terminal:
            raise r.error(codes.SESSION_TERMINAL,
                          f"session {session.session_id} is already {session.state}")
        return self.decide(signals, session.budget, session.usage)
