"""Scheduling outcomes and step keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class StepKey:
    """Identity of one step: its stages are idempotent by ``(case, revision, seq, stage)``."""

    case_id: str
    revision: int
    step_seq: int

    def to_dict(self) -> dict[str, Any]:
        return {"case_id": self.case_id, "revision": self.revision, "step_seq": self.step_seq}


@dataclass(frozen=True)
class Outcome:
    """A scheduling outcome (``constants.OUTCOMES``) with its reason code.

    ``retry_not_before`` is set for ``RETRY_PENDING`` (timezone-aware UTC).
    """

    outcome: str
    case_id: str
    step_seq: int
    reason: str | None = None
    retry_not_before: datetime | None = None
    hypothesis_id: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form (task results, CLI ``--json``)."""
        return {
            "outcome": self.outcome,
            "case_id": self.case_id,
            "step_seq": self.step_seq,
            "reason": self.reason,
            "retry_not_before": self.retry_not_before.isoformat()
            if self.retry_not_before else None,
            "hypothesis_id": self.hypothesis_id,
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        """Inverse of :meth:`to_dict`."""
        rnb = data.get("retry_not_before")
        return cls(outcome=data["outcome"], case_id=data["case_id"], step_seq=data["step_seq"],
                   reason=data.get("reason"),
                   retry_not_before=datetime.fromisoformat(rnb) if rnb else None,
                   hypothesis_id=data.get("hypothesis_id"), details=data.get("details") or {})


@dataclass(frozen=True)
class StageResult:
    """What a stage returns: its recorded output and, if the step ends here, the outcome.

    ``fresh`` is true when this very call ran the stage body and committed its marker
    (false for an output recorded earlier, by this process or another runner).
    """

    output: dict[str, Any]
    halt: Outcome | None = None
    fresh: bool = False


#: Outcomes whose reason is the state the case left (an operator's pause or cancel).
_FROM_STATE = ("PAUSED", "CANCELLED", "RESUMED")


def tokens_text(prompt: int | None, completion: int | None) -> str:
    """``5654 + 257`` (prompt + completion tokens of a step's calls), a count no server
    reported as ``?`` (it showed as 0, a hostile trial); ``""`` when neither was."""
    if prompt is None and completion is None:
        return ""
    return " + ".join("?" if n is None else str(n) for n in (prompt, completion))


def last_outcome_text(outcome: str | None, reason: str | None,
                      none: str = "none (no step has run)") -> str:
    """``PROGRESSED``, ``BLOCKED (PROVIDER_EXHAUSTED)``, ``PAUSED (was INVESTIGATING)``."""
    if not outcome:
        return none
    if not reason:
        return outcome
    if outcome in _FROM_STATE and reason.isupper() and reason in (
            "INVESTIGATING", "BLOCKED", "PAUSED"):
        return f"{outcome} (was {reason})"
    return f"{outcome} ({reason})"
