"""BudgetManager: policy, accounts, reserve/settle/refund, dispositions."""

from investigation.budget.manager import BudgetManager
from investigation.budget.rules import (
    ACTIVE,
    EXHAUSTED,
    FINISHED,
    LOW_INFORMATION,
    REJECTED,
    TERMINAL_STATUSES,
    Projection,
    action_cost,
    cheapest_action_cost,
    novelty_permille,
    project,
    refund_units,
)

__all__ = [
    "ACTIVE",
    "EXHAUSTED",
    "FINISHED",
    "LOW_INFORMATION",
    "REJECTED",
    "TERMINAL_STATUSES",
    "BudgetManager",
    "Projection",
    "action_cost",
    "cheapest_action_cost",
    "novelty_permille",
    "project",
    "refund_units",
]
