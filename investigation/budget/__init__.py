"""BudgetManager: policy, accounts, reserve/settle/refund, dispositions."""

from investigation.budget.manager import BudgetManager
from investigation.budget.rules import (
    ACTIVE,
    CLOSING_REASONS,
    EXHAUSTED,
    FINISHED,
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
    "CLOSING_REASONS",
    "EXHAUSTED",
    "FINISHED",
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
