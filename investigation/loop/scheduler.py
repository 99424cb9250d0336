"""Hypothesis scheduling (seed 000, "Deterministic cycle", step 1).

Among active accounts: every hypothesis first gets one initial turn, in numeric-id
order; after that the one with the highest confidence goes next, ties broken by the
lowest numeric id. "Higher confidence" follows ``constants.CONFIDENCE_ORDER``:
weakened < unassessed < weak < plausible < supported < strongly_supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from investigation.budget.rules import ACTIVE
from investigation.constants import CONFIDENCE_ORDER


class _Account(Protocol):
    hypothesis_id: int
    status: str
    confidence: str
    turns: int


def select_hypothesis(accounts: Sequence[_Account]) -> int | None:
    """Return the hypothesis id whose turn it is, or ``None`` when all are terminal."""
    active = [a for a in accounts if a.status == ACTIVE]
    if not active:
        return None
    fresh = sorted(a.hypothesis_id for a in active if a.turns == 0)
    if fresh:
        return fresh[0]
    rank = {label: i for i, label in enumerate(CONFIDENCE_ORDER)}
    best = min(active, key=lambda a: (-rank[a.confidence], a.hypothesis_id))
    return best.hypothesis_id
