"""Deterministic budget arithmetic (seed 000, "Budget and stopping").

Pure functions over integers: validation simulates settlement and reservation with
exactly these functions, and execution applies them, so the two can never disagree.

Refund formula (all integers, floor division)::

    novelty_permille = 0                          if the finding is empty or a duplicate
                     = 1000 * new_items // items  otherwise (the item-based overlap cap)
    refund = cost * max_refund_percent * novelty_permille * score
             // (100 * 1000 * 100)
    refund = min(refund, cost - 1)                 strictly below cost, always

so a refund needs both deterministic novelty (new item keys) and semantic utility
(the model's 0..100 assessment score), and never reaches the action's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from investigation.config import BudgetConfig

#: Account status values. ``active`` is the only non-terminal one.
ACTIVE = "active"
FINISHED = "investigation_finished"
REJECTED = "rejected"
EXHAUSTED = "exhausted"
TERMINAL_STATUSES = (FINISHED, REJECTED, EXHAUSTED)
#: Reasons that make a turn a closing turn (only ``finish``/``reject``); they are kept in
#: the account's ``disposition_reason`` as ``"<reason>: <the model's reason>"``.
ITERATION_CAP = "iteration_cap"
LOW_INFORMATION = "low_information"
BUDGET_EXHAUSTED = "budget_exhausted"
#: Deferred by an accepted early-diagnosis review (``docs/early-diagnosis.md``).
ASSESSMENT_ONLY = "assessment_only"
CLOSING_REASONS = (ASSESSMENT_ONLY, ITERATION_CAP, LOW_INFORMATION, BUDGET_EXHAUSTED)


def novelty_permille(item_count: int, new_item_count: int, duplicate: bool) -> int:
    """Deterministic novelty of one finding in thousandths (0..1000).

    Empty and duplicate findings earn 0; an overlapping finding earns the share of its
    item keys that this hypothesis had not seen before.
    """
    if duplicate or item_count <= 0 or new_item_count <= 0:
        return 0
    return 1000 * min(new_item_count, item_count) // item_count


def refund_units(cost_units: int, score: int, novelty: int, max_refund_percent: int) -> int:
    """Refund for an assessed finding, in units; always ``0 <= refund < cost_units``.

    Args:
        cost_units: what the action was charged (positive).
        score: the model's semantic assessment, 0..100.
        novelty: :func:`novelty_permille` of the finding.
        max_refund_percent: the policy's cap (0..99).
    """
    if cost_units <= 0:
        return 0
    score = max(0, min(100, score))
    novelty = max(0, min(1000, novelty))
    raw = cost_units * max_refund_percent * novelty * score // (100 * 1000 * 100)
    return max(0, min(raw, cost_units - 1))


def action_cost(budget: BudgetConfig, action: str, operation: str | None = None,
                test_kind: str | None = None) -> int | None:
    """Configured cost of a next action in units, or ``None`` when it has no cost.

    ``finish`` and ``reject`` cost nothing (0). A query costs ``budget.costs[operation]``;
    a test costs ``budget.test_costs[kind]`` and is ``None`` when not configured.
    """
    if action in ("finish", "reject"):
        return 0
    if action == "query":
        return budget.costs.get(operation or "")
    if action == "test":
        costs: dict[str, int] = {str(k): v for k, v in budget.test_costs.items()}
        return costs.get(test_kind or "")
    return None


def cheapest_action_cost(budget: BudgetConfig) -> int:
    """The smallest configured query or test cost: below it an account cannot act."""
    return min([*budget.costs.values(), *budget.test_costs.values()])


@dataclass(frozen=True)
class Projection:
    """The simulated effect of one accepted decision on one account."""

    refund_units: int
    reserve_units: int
    balance_after_settlement: int
    balance_after: int
    status_after: str


def project(
    budget: BudgetConfig,
    balance_units: int,
    pending: tuple[int, int] | None,
    score: int | None,
    action: str,
    cost_units: int,
) -> Projection:
    """Simulate settlement of the pending finding, then the reservation of the next action.

    Args:
        budget: the frozen budget policy.
        balance_units: the account balance before this decision.
        pending: ``(cost_units, novelty_permille)`` of the pending finding, or ``None``.
        score: the assessment score (required when ``pending`` is set).
        action: ``query``, ``test``, ``finish`` or ``reject``.
        cost_units: the next action's cost (0 for finish/reject).

    Returns:
        The projection; ``balance_after`` may be negative, which callers reject as
        unaffordable before any effect.
    """
    refund = 0
    if pending is not None and score is not None:
        refund = refund_units(pending[0], score, pending[1], budget.max_refund_percent)
    settled = balance_units + refund
    reserve = cost_units if action in ("query", "test") else 0
    status = {"finish": FINISHED, "reject": REJECTED}.get(action, ACTIVE)
    return Projection(refund, reserve, settled, settled - reserve, status)
