"""Hypothesis scheduling (seed 000, "Deterministic cycle", step 1).

Among active accounts: every hypothesis first gets one initial turn, in numeric-id
order; after that the one with the highest confidence goes next, ties broken by the
lowest numeric id. "Higher confidence" follows ``constants.CONFIDENCE_ORDER``:
weakened < unassessed < weak < plausible < supported < strongly_supported.

:func:`next_turn` also says which of those rules chose the hypothesis (a
:class:`Selection`); ``build_context`` records it with the step so that a reader of the
report sees why each step went to its hypothesis (decision 166).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from investigation.budget.rules import ACTIVE
from investigation.constants import CONFIDENCE_ORDER

#: :attr:`Selection.rule` values.
FIRST_TURN = "first_turn"
HIGHEST_CONFIDENCE = "highest_confidence"

_RANK = {label: i for i, label in enumerate(CONFIDENCE_ORDER)}


class _Account(Protocol):
    hypothesis_id: int
    status: str
    confidence: str
    turns: int


@dataclass(frozen=True)
class Selection:
    """Whose turn it is and by which rule.

    ``rule`` is :data:`FIRST_TURN` (``hypothesis_id`` is the lowest id among the active
    hypotheses that have had no turn; ``tied`` lists them all, ascending) or
    :data:`HIGHEST_CONFIDENCE` (every active hypothesis has had its turn;
    ``confidence`` is the highest among them and ``tied`` every active hypothesis at
    that confidence, ascending: more than one means the lowest id broke the tie).
    ``active`` is the number of active accounts the rule chose among.
    """

    hypothesis_id: int
    rule: str
    tied: tuple[int, ...]
    active: int
    confidence: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in ``build_context``'s stage output (``selection``)."""
        out: dict[str, Any] = {"rule": self.rule, "tied": list(self.tied),
                               "active": self.active}
        if self.confidence is not None:
            out["confidence"] = self.confidence
        return out


def next_turn(accounts: Sequence[_Account]) -> Selection | None:
    """Whose turn it is, with the rule that chose it; ``None`` when all are terminal."""
    active = [a for a in accounts if a.status == ACTIVE]
    if not active:
        return None
    fresh = sorted(a.hypothesis_id for a in active if a.turns == 0)
    if fresh:
        return Selection(fresh[0], FIRST_TURN, tuple(fresh), len(active))
    top = max(_RANK[a.confidence] for a in active)
    tied = sorted(a.hypothesis_id for a in active if _RANK[a.confidence] == top)
    return Selection(tied[0], HIGHEST_CONFIDENCE, tuple(tied), len(active),
                     CONFIDENCE_ORDER[top])


def select_hypothesis(accounts: Sequence[_Account]) -> int | None:
    """Return the hypothesis id whose turn it is, or ``None`` when all are terminal."""
    chosen = next_turn(accounts)
    return chosen.hypothesis_id if chosen is not None else None
